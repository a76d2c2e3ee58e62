"""The server's Prometheus metrics: what it served (counted as it happens) and what the
engine holds (read from `Backend.stats()` at each scrape). Each server has its own
registry, so several may run in one process (the tests do)."""

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..engine.engine import EngineStats

# Seconds: from a few milliseconds (a cached short prompt) to a long queue.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "spnl_requests",
            "Requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=reg,
        )
        self.model_requests = Counter(
            "spnl_model_requests",
            "Requests by model and outcome (a server of several models)",
            ["model", "outcome"],
            registry=reg,
        )
        self.prompt_tokens = Counter("spnl_prompt_tokens", "Prompt tokens", registry=reg)
        self.completion_tokens = Counter("spnl_completion_tokens", "Generated tokens", registry=reg)
        self.ttft = Histogram(
            "spnl_time_to_first_token_seconds",
            "From arrival to the first token",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "spnl_inter_token_latency_seconds",
            "Between a completion's tokens (mean per completion)",
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.draft_tokens = Counter(
            "spnl_spec_draft_tokens", "Tokens proposed by the speculative draft", registry=reg
        )
        self.accepted_tokens = Counter(
            "spnl_spec_accepted_tokens", "Draft tokens the target accepted", registry=reg
        )
        # vLLM's name for the same histogram, for dashboards and endpoint pickers built
        # for vLLM; labelled with the served model's name, as vLLM labels it.
        self.model_name = ""
        self.vllm_ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "From arrival to the first token (vLLM's name)",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=reg,
        )

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.vllm_ttft.labels(self.model_name).observe(seconds)

    def watch(self, stats: Callable[[], list[tuple[str | None, EngineStats]]]) -> None:
        """Report the engines' state, read by ``stats`` at scrapes: one unnamed engine
        (a one-model server: no label), or each loaded model's, labelled ``model``; and
        the load under vLLM's names, labelled ``model_name``."""
        self.registry.register(_EngineCollector(stats))
        self.registry.register(_VllmCollector(stats, lambda: self.model_name))


_Read = Callable[[EngineStats], float | None]


def _suffix(field: str) -> _Read:
    """A field of the suffix store's stats; None where the engine has none."""
    return lambda s: None if s.suffix is None else getattr(s.suffix, field)


def _tier(name: str) -> _Read:
    """A KV tier counter's reader (None where there is no tier)."""
    return lambda s: None if s.tier is None else float(getattr(s.tier, name))


def _window_used(s: EngineStats) -> float | None:
    """The sliding-window layers' own pool's blocks held (None where there is none)."""
    return None if s.pool is None else s.pool.window_in_use


def _window_free(s: EngineStats) -> float | None:
    pool = s.pool
    if pool is None or pool.window_blocks is None or pool.window_in_use is None:
        return None
    return pool.window_blocks - pool.window_in_use


def _window_cached(s: EngineStats) -> float | None:
    return None if s.pool is None else s.pool.window_cached


def _usage(s: EngineStats) -> float | None:
    """The fraction of the fuller KV pool held (`PoolUsage.usage`)."""
    return None if s.pool is None else s.pool.usage


# (kind, name, help, value) of each engine metric; a value of None is left out.
_ENGINE_METRICS: tuple[tuple[str, str, str, _Read], ...] = (
    ("gauge", "spnl_running_sequences", "Sequences in the running batch", lambda s: s.running),
    ("gauge", "spnl_waiting_sequences", "Sequences waiting to run", lambda s: s.waiting),
    ("gauge", "spnl_paused_sequences", "Sequences whose readers are behind", lambda s: s.paused),
    (
        "gauge",
        "spnl_kv_blocks_used",
        "KV blocks held by sequences",
        lambda s: s.pool.in_use if s.pool else None,
    ),
    (
        "gauge",
        "spnl_kv_blocks_free",
        "KV blocks free or cached",
        lambda s: s.pool.blocks - s.pool.in_use if s.pool else None,
    ),
    (
        "gauge",
        "spnl_kv_blocks_cached",
        "Free KV blocks holding a reusable prefix",
        lambda s: s.pool.cached if s.pool else None,
    ),
    *(
        ("gauge", f"spnl_kv_window_blocks_{name}", doc, read)
        for name, doc, read in (
            ("used", "Windowed KV pool blocks held by sequences' windows", _window_used),
            ("free", "Windowed KV pool blocks free or kept for prefix hits", _window_free),
            ("cached", "Windowed KV pool blocks kept for prefix hits", _window_cached),
        )
    ),
    (
        "gauge",
        "spnl_state_slots",
        "State slots (sequences a model with state layers runs at once)",
        lambda s: s.states.slots if s.states else None,
    ),
    (
        "gauge",
        "spnl_state_slots_used",
        "State slots held by sequences",
        lambda s: s.states.in_use if s.states else None,
    ),
    (
        "gauge",
        "spnl_state_snapshots",
        "State snapshots kept for prefix hits",
        lambda s: s.states.snapshots if s.states else None,
    ),
    (
        "gauge",
        "spnl_state_bytes",
        "Bytes of the states held: live, step copies and snapshots",
        lambda s: s.states.bytes if s.states else None,
    ),
    (
        "gauge",
        "spnl_lora_adapters",
        "LoRA adapters known (loaded at start or since, not unloaded)",
        lambda s: s.adapters.known if s.adapters else None,
    ),
    (
        "gauge",
        "spnl_lora_adapters_held",
        "LoRA adapters held in memory (at most MISTRALRS_LORA_MAX_LOADED)",
        lambda s: s.adapters.loaded if s.adapters else None,
    ),
    (
        "gauge",
        "spnl_lora_adapter_bytes",
        "Bytes of the LoRA adapters held in memory",
        lambda s: s.adapters.nbytes if s.adapters else None,
    ),
    ("counter", "spnl_preemptions", "Sequences preempted for room", lambda s: s.preemptions),
    (
        "counter",
        "spnl_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache",
        lambda s: s.prefix_cache_queries,
    ),
    (
        "counter",
        "spnl_prefix_cache_hits",
        "Prompt tokens served by the prefix cache",
        lambda s: s.prefix_cache_hits,
    ),
    (
        "counter",
        "spnl_pic_hit_tokens",
        "Plus-block tokens of PIC prompts whose KV the pool had",
        lambda s: s.pic_hit_tokens,
    ),
    (
        "counter",
        "spnl_pic_miss_tokens",
        "Plus-block tokens of PIC prompts that were computed",
        lambda s: s.pic_miss_tokens,
    ),
    (
        "counter",
        "spnl_pic_recomputed_tokens",
        "Plus-block tokens of PIC prompts computed again with full attention",
        lambda s: s.pic_recomputed_tokens,
    ),
    (
        "counter",
        "spnl_kv_tier_hit_tokens",
        "Reused prompt tokens whose KV the KV tier read back",
        lambda s: s.tier_hit_tokens if s.tier else None,
    ),
    *(
        ("counter", f"spnl_kv_tier_{name}", doc, _tier(name))
        for name, doc in (
            ("hits", "KV tier entries read back into the pool"),
            ("misses", "KV tier lookups with no entry"),
            ("bytes_read", "Bytes the KV tier read"),
            ("bytes_written", "Bytes the KV tier wrote"),
            ("evictions", "KV tier entries removed to stay within its budget"),
            ("dropped", "Blocks the KV tier did not write: its writer was behind"),
        )
    ),
    (
        "gauge",
        "spnl_kv_tier_write_queue",
        "Blocks waiting for the KV tier's writer",
        _tier("write_queue"),
    ),
    ("gauge", "spnl_kv_tier_enabled", "1 while the KV tier is on", _tier("enabled")),
    *(
        (kind, f"spnl_spec_suffix_{name}", doc, _suffix(name))
        for kind, name, doc in (
            ("gauge", "entries", "Documents and outputs held by the suffix store"),
            ("gauge", "tokens", "Tokens held by the suffix store"),
            ("counter", "dropped_entries", "Suffix store entries dropped for its budget"),
            ("counter", "proposed_from_documents", "Tokens proposed from prompts' documents"),
            ("counter", "accepted_from_documents", "Of those, accepted by the target"),
            ("counter", "proposed_from_outputs", "Tokens proposed from finished outputs"),
            ("counter", "accepted_from_outputs", "Of those, accepted by the target"),
        )
    ),
)


class _EngineCollector:
    def __init__(self, stats: Callable[[], list[tuple[str | None, EngineStats]]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        engines = self._stats()
        if not engines:
            return
        labels = ["model"] if engines[0][0] is not None else []
        for kind, name, doc, read in _ENGINE_METRICS:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            metric = family(name, doc, labels=labels)
            samples = [(model, read(stats)) for model, stats in engines]
            for model, value in samples:
                if value is not None:
                    metric.add_metric([model] if labels else [], value)
            if any(value is not None for _, value in samples):
                yield metric
        yield from _tier_rejections(engines, labels)


# vLLM's names for the load a router or endpoint picker reads (kind, name, help, value).
_VLLM_METRICS: tuple[tuple[str, str, str, _Read], ...] = (
    ("gauge", "vllm:num_requests_running", "Requests in the running batch", lambda s: s.running),
    ("gauge", "vllm:num_requests_waiting", "Requests waiting to run", lambda s: s.waiting),
    (
        "gauge",
        "vllm:kv_cache_usage_perc",
        "Fraction of the KV block pool held by requests (1 is full; the fuller pool "
        "where sliding-window layers keep their own)",
        _usage,
    ),
    (
        "gauge",
        "vllm:gpu_cache_usage_perc",
        "The same fraction under vLLM's former name",
        _usage,
    ),
    (
        "counter",
        "vllm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache",
        lambda s: s.prefix_cache_queries,
    ),
    (
        "counter",
        "vllm:prefix_cache_hits",
        "Prompt tokens served by the prefix cache",
        lambda s: s.prefix_cache_hits,
    ),
    ("counter", "vllm:num_preemptions", "Requests preempted for room", lambda s: s.preemptions),
)


class _VllmCollector:
    def __init__(
        self,
        stats: Callable[[], list[tuple[str | None, EngineStats]]],
        served: Callable[[], str],
    ) -> None:
        self._stats, self._served = stats, served

    def collect(self) -> Iterator[Metric]:
        engines = [(model or self._served(), stats) for model, stats in self._stats()]
        for kind, name, doc, read in _VLLM_METRICS:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            metric = family(name, doc, labels=["model_name"])
            for model, stats in engines:
                value = read(stats)
                if value is not None:
                    metric.add_metric([model], value)
            if metric.samples:
                yield metric


def _tier_rejections(engines: list[tuple[str | None, EngineStats]], labels: list[str]):
    """KV tier entries refused, by reason (an entry that was not the block asked for)."""
    tiers = [(model, stats.tier) for model, stats in engines if stats.tier is not None]
    if not tiers:
        return
    metric = CounterMetricFamily(
        "spnl_kv_tier_rejected", "KV tier entries refused, by reason", labels=[*labels, "reason"]
    )
    for model, tier in tiers:
        for reason, count in sorted(tier.rejected.items()):  # type: ignore[union-attr]
            metric.add_metric([*([model] if labels else []), reason], count)
    yield metric
