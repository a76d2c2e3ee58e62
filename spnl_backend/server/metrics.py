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

    def watch(self, stats: Callable[[], EngineStats | None]) -> None:
        """Report the engine's state, read by ``stats`` (None: no model yet) at scrapes."""
        self.registry.register(_EngineCollector(stats))


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        yield _gauge("spnl_running_sequences", "Sequences in the running batch", stats.running)
        yield _gauge("spnl_waiting_sequences", "Sequences waiting to run", stats.waiting)
        yield _gauge("spnl_paused_sequences", "Sequences whose readers are behind", stats.paused)
        if stats.pool is not None:
            yield _gauge("spnl_kv_blocks_used", "KV blocks held by sequences", stats.pool.in_use)
            free = stats.pool.blocks - stats.pool.in_use
            yield _gauge("spnl_kv_blocks_free", "KV blocks free or cached", free)
            yield _gauge(
                "spnl_kv_blocks_cached",
                "Free KV blocks holding a reusable prefix",
                stats.pool.cached,
            )
        yield _counter("spnl_preemptions", "Sequences preempted for room", stats.preemptions)
        yield _counter(
            "spnl_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            stats.prefix_cache_queries,
        )
        yield _counter(
            "spnl_prefix_cache_hits",
            "Prompt tokens served by the prefix cache",
            stats.prefix_cache_hits,
        )
        yield _counter(
            "spnl_pic_hit_tokens",
            "Plus-block tokens of PIC prompts whose KV the pool had",
            stats.pic_hit_tokens,
        )
        yield _counter(
            "spnl_pic_miss_tokens",
            "Plus-block tokens of PIC prompts that were computed",
            stats.pic_miss_tokens,
        )


def _gauge(name: str, doc: str, value: float) -> Metric:
    metric = GaugeMetricFamily(name, doc)
    metric.add_metric([], value)
    return metric


def _counter(name: str, doc: str, value: float) -> Metric:
    metric = CounterMetricFamily(name, doc)
    metric.add_metric([], value)
    return metric
