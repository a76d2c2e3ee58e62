"""The engine: requests in, one scheduled model step at a time, finished sequences out."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import DistributedError, EngineError, RequestError
from ..log import get_logger
from ..models.lora import AdapterInfo, LoraAdapter, scaled_root, set_root
from ..pic.layout import PicLayout
from ..sampling import SamplingParams
from ..settings.speculation import SpeculationMethod
from .adapters import AdapterRegistry, AdapterUsage
from .block_manager import BlockEvents
from .cache import CacheInfo, PoolUsage, StateUsage
from .detokenizer import Decoder, IncrementalDetokenizer, KeptTokens
from .embed import embed
from .kv_tier import TierStats, tier_stats
from .ngram import NgramRunner
from .runner import Runner
from .sampler import TokenLogprobs, row_error
from .scheduler import Scheduler
from .sequence import ScheduledSeq, Sequence, StepOutput
from .speculative import SpeculativeRunner
from .state_cache import state_usage
from .suffix import SuffixRunner, SuffixStats

if TYPE_CHECKING:
    import torch

log = get_logger()

MAX_NUM_SEQS = 64  # sequences one step runs at most (and the most state slots a model gets)


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int  # tokens per sequence: the model's context, or the whole KV cache
    eos_token_ids: frozenset[int]
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = 2048
    # A prompt's chunk while other sequences decode: bounds how long one step holds up
    # their next tokens (bench/serve.py: inter-token latency p99).
    prefill_chunk_while_decoding: int = 256
    prefix_caching: bool = True  # MISTRALRS_PREFIX_CACHE_N > 0


@dataclass(frozen=True)
class EngineStats:
    """What the engine holds now: its requests and, in paged mode, its block pool; and
    counters since it was built."""

    running: int
    waiting: int
    paused: int  # running or waiting, but their readers are behind
    preemptions: int  # since the engine was built
    cache_holders: int  # sequences that hold KV cache
    pool: PoolUsage | None  # None in non-paged mode
    # Prompt tokens of the requests that reached their first token, and of those, the
    # ones a prefix cache served (the sum of their `usage.cached_tokens`; 0 with it off).
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Plus tokens of the PIC prompts that reached their first token: reused from the pool,
    # and computed.
    pic_hit_tokens: int = 0
    pic_miss_tokens: int = 0
    pic_recomputed_tokens: int = 0  # computed again (``MISTRALRS_PIC_RECOMPUTE``)
    # Prompt tokens of those requests whose K/V the KV tier read back (within the cached
    # ones above), and the tier's own counters; None where there is no tier.
    tier_hit_tokens: int = 0
    tier: "TierStats | None" = None
    # A model with state layers: its state slots held, snapshots and bytes; else None.
    states: StateUsage | None = None
    # LoRA adapters: known, held in memory and their bytes, the bound; None where the
    # model takes none (tensor parallelism, a speculative draft).
    adapters: AdapterUsage | None = None
    # Suffix speculation: its shared store and the tokens it proposed; else None.
    suffix: SuffixStats | None = None


class Engine:
    def __init__(
        self, runner: Runner, decoder: Decoder, config: EngineConfig, cache_info: CacheInfo
    ) -> None:
        self.config = config
        self.cache_info = cache_info  # what `build` made; the target's, with a draft
        self.decoder = decoder
        self.runner = runner
        self.cache = runner.cache
        # How MISTRALRS_SPECULATIVE_METHOD was resolved (`settings.speculation`); `build`
        # sets it, with the method its runner runs.
        self.speculation_why = "no speculation was asked for"
        self.scheduler = Scheduler(
            self.cache,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.prefill_chunk_while_decoding,
        )
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        # Set when a failed step could not release its sequences' caches: the cache's
        # bookkeeping can no longer be trusted, so every later call says so.
        self.broken: EngineError | None = None
        self.prefix_cache_queries = 0  # see `EngineStats`
        self.prefix_cache_hits = 0
        self.pic_hit_tokens = 0
        self.pic_miss_tokens = 0
        self.pic_recomputed_tokens = 0
        self.tier_hit_tokens = 0
        self.last_batch_size = 0  # sequences the last step ran (0: nothing was schedulable)
        # LoRA adapters (`build` sets them); where the model takes none, why not.
        self.adapters: AdapterRegistry | None = None
        self.no_adapters: str | None = None
        # Called by the loop while it waits for work, and when it stops (a tensor-parallel
        # model's heartbeat to its other ranks, and their stop).
        self.on_idle: list[Callable[[], None]] = []
        self.on_close: list[Callable[[], None]] = []

    def idle(self) -> None:
        try:
            for hook in self.on_idle:
                hook()
        except DistributedError as exc:  # the other ranks are gone: nothing can run
            self.broken = exc
            log.error("engine.broken", error=str(exc))

    def close(self) -> None:
        """Run the close hooks (each once; one that fails does not stop the others)."""
        hooks, self.on_close = self.on_close, []
        for hook in hooks:
            try:
                hook()
            except Exception as exc:  # closing: log it, let the rest close
                log.warning("engine.close_hook_failed", error=f"{type(exc).__name__}: {exc}")

    def add(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        seq = self.new_sequence(prompt_ids, params)
        self.add_sequence(seq)
        return seq

    def new_sequence(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        leader: Sequence | None = None,
        pic: PicLayout | None = None,
    ) -> Sequence:
        """A sequence for this engine, not yet added (safe from any thread). A PIC one's
        context is less the padding its spans' block alignment takes."""
        max_len = self.config.max_model_len
        if pic is not None and self.cache_info.block_size:
            size = self.cache_info.block_size
            max_len = self.pic_context() - (pic.padded_slots(size) - pic.num_prompt_tokens + size)
        seq = Sequence(prompt_ids, params, max_len=max_len, leader=leader, pic=pic)
        for name, _ in params.adapters:
            self.check_adapter(name)
        return seq

    def check_adapter(self, name: str) -> None:
        """A `RequestError` naming those loaded where no LoRA adapter is known as ``name``
        (its slot is taken when the sequence is added: `add_sequence`)."""
        if self.adapters is None:
            raise RequestError(
                f"adapter={name!r}: no LoRA adapter of that name is loaded (loaded: none; "
                "MISTRALRS_LORA_ADAPTERS names them)"
            )
        self.adapters.check_known(name)

    def adapters_in_use(self) -> list[str]:
        """The adapters of each unfinished sequence (each once per sequence)."""
        return [name for s in self.unfinished() for name, _ in s.params.adapters]

    def load_adapter(self, adapter: LoraAdapter) -> AdapterInfo:
        """Know ``adapter`` (read off this thread) from now on; held if room can be made."""
        if self.adapters is None:
            raise RequestError(self.no_adapters or "this model takes no LoRA adapters")
        return self.adapters.add(adapter, self.adapters_in_use())

    def unload_adapter(self, name: str) -> None:
        """Forget adapter ``name``; an `AdapterInUseError` while requests run with it."""
        if self.adapters is None:
            raise RequestError(self.no_adapters or "this model takes no LoRA adapters")
        self.adapters.remove(name, self.adapters_in_use())

    def add_sequence(self, seq: Sequence) -> None:
        self._check_usable()
        if seq.params.adapters:
            self._acquire_adapters(seq)
        constraint = seq.params.constraint
        kept = (constraint.kept_token_ids if constraint is not None else ()) + (
            seq.params.kept_token_ids
        )
        decoder = KeptTokens(self.decoder, kept) if kept else self.decoder
        self.detokenizers[seq.seq_id] = IncrementalDetokenizer(
            decoder,
            seq.prompt_token_ids,
            seq.params.stop,
            seq.healed_text,
            keep_stop=seq.params.keep_stop,
        )
        self.cache.arriving(seq)
        self.scheduler.add(seq)

    def _acquire_adapters(self, seq: Sequence) -> None:
        """Hold ``seq``'s adapters (read again if evicted) while it runs: their slots, and
        the hash root of the whole set at its scales."""
        adapters = seq.params.adapters
        for name, _ in adapters:
            self.check_adapter(name)
        assert self.adapters is not None
        bound = self.adapters.max_loaded
        if bound and len(adapters) > bound:
            raise RequestError(
                f"adapters: {len(adapters)} LoRA adapters in one request, more than the "
                f"{bound} held in memory at once (MISTRALRS_LORA_MAX_LOADED)"
            )
        in_use = self.adapters_in_use() + [name for name, _ in adapters]  # none evicts another
        lora, roots = [], []
        for name, factor in adapters:
            slot, root = self.adapters.acquire(name, in_use)
            lora.append((slot, factor))
            roots.append(scaled_root(root, factor))
        seq.lora, seq.hash_root = tuple(lora), set_root(roots)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def unfinished(self) -> list[Sequence]:
        return [*self.scheduler.running, *self.scheduler.waiting]

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            paused=sum(seq.paused for seq in self.unfinished()),
            preemptions=scheduler.num_preemptions,
            cache_holders=self.cache.num_holders,
            pool=self.cache.pool_usage(),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            pic_hit_tokens=self.pic_hit_tokens,
            pic_miss_tokens=self.pic_miss_tokens,
            pic_recomputed_tokens=self.pic_recomputed_tokens,
            tier_hit_tokens=self.tier_hit_tokens,
            tier=tier_stats(getattr(self.cache, "tier", None)),
            states=state_usage(self.cache),
            adapters=None if self.adapters is None else self.adapters.usage(),
            suffix=self.runner.store.stats() if isinstance(self.runner, SuffixRunner) else None,
        )

    def reset_prefix_cache(self) -> int:
        """Empty the prefix and PIC caches; running requests keep what they hold."""
        dropped = self.cache.reset_prefix_cache()
        log.info("prefix_cache.reset", dropped=dropped)
        return dropped

    def watch_blocks(self, events: BlockEvents | None) -> int:
        """Tell ``events`` of every block the prefix cache (and the KV tier, where there is
        one) registers and forgets from now on (None: stop); the pool's block size.
        Refused without a paged prefix cache."""
        blocks = getattr(self.cache, "blocks", None)
        if blocks is None or not blocks.enable_prefix_caching:
            raise EngineError(
                "KV events need the paged KV cache with prefix caching on (MISTRALRS_PAGED_ATTN "
                "and MISTRALRS_PREFIX_CACHE_N not 0); this model's cache has no blocks to announce"
            )
        blocks.events = events
        pool_tier = getattr(self.cache, "tier", None)
        if pool_tier is not None:  # what the KV tier writes and removes is held here too
            pool_tier.tier.events = events
        return blocks.block_size

    def embed(self, texts: list[list[int]]) -> "torch.Tensor":
        """The texts' embeddings (`embed.embed`), pooled as the model's config says; one
        chunk of an embedding request, run between two steps, beside the cache."""
        self._check_usable()
        runner = self.runner
        return embed(runner.model, runner.device, texts, runner.model.config.pooling)

    def embedding_chunk_tokens(self) -> int:
        """How many tokens one embedding chunk between two steps packs at most: while
        sequences are unfinished, what a step gives prompts while others decode (so that
        a stream's next token waits for a chunk no longer than for a prompt's), else a
        whole step's budget."""
        if self.scheduler.has_unfinished():
            return self.config.prefill_chunk_while_decoding
        return self.config.max_num_batched_tokens

    def step(self) -> list[StepOutput]:
        """One scheduled step. A request whose sampling or detokenization fails finishes
        with its error alone; an error of the step itself fails every sequence the step
        touched (their caches are released, so the next step starts clean), and an
        interruption (KeyboardInterrupt, SystemExit) does the same and propagates."""
        self._check_usable()
        batch: list[ScheduledSeq] = []
        self.last_batch_size = 0
        try:
            batch = self.scheduler.schedule()
            self.last_batch_size = len(batch)
            if not batch:
                return []
            return self._run(batch)
        except Exception as exc:
            self._fail_step(batch, exc)
            return []
        except BaseException as exc:
            self._fail_step(batch, exc)
            raise

    def abort(self, seq: Sequence, error: Exception | None = None) -> None:
        """End ``seq`` now and free its cache (what it computed stays reusable by the prefix
        cache); ``error`` is what its caller is told."""
        if not seq.is_finished:
            seq.finish("abort" if error is None else "error", error)
        self._release(seq)

    def _run(self, batch: list[ScheduledSeq]) -> list[StepOutput]:
        sampled = self.runner.run(batch)
        outputs, finished = [], []
        for item in batch:
            result = sampled.get(item.seq.seq_id)
            if isinstance(result, Exception):
                self.abort(item.seq, result)
                continue
            if result is None:  # a prefill chunk that did not reach the prompt's end
                continue
            logprobs = result.logprobs or [None] * len(result.tokens)
            for token_id, token_logprobs in zip(result.tokens, logprobs, strict=True):
                output = self._accept_safely(item.seq, token_id, token_logprobs)
                if output is not None:
                    outputs.append(output)
                if item.seq.is_finished:
                    finished.append(item.seq)
                    break  # accepted drafts after a stop are dropped
        self.cache.after_step(batch)  # register full blocks now that their tokens are known
        for seq in finished:
            if isinstance(self.runner, SuffixRunner):  # its output joins the shared store
                self.runner.finished(seq)
            self._release(seq)
        return outputs

    def _accept_safely(
        self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None
    ) -> StepOutput | None:
        try:
            return self._accept(seq, token_id, logprobs)
        except Exception as exc:  # a detokenizer or stop-string failure is this request's
            self.abort(seq, row_error(exc))
            return None

    def _fail_step(self, batch: list[ScheduledSeq], exc: BaseException) -> None:
        """Fail every sequence the step may have left half-updated (its batch, or every
        running one when scheduling itself failed)."""
        seqs = [item.seq for item in batch] or list(self.scheduler.running)
        if isinstance(exc, DistributedError):  # the other ranks are gone: nothing can run
            self.broken = exc
        if isinstance(exc, Exception):
            log.error(
                "engine.step_failed",
                error=f"{type(exc).__name__}: {exc}",
                failed_requests=len(seqs),
                exc_info=exc,
            )
        else:  # the host is being interrupted: its caller sees that, not an error event
            log.info("engine.step_interrupted", cause=type(exc).__name__, requests=len(seqs))
        try:
            for seq in seqs:
                error = _step_error(exc)
                if not seq.is_finished:
                    seq.finish("error", error)
                self._discard(seq)
            for seq in self.scheduler.waiting:  # one being admitted when it failed holds cache
                self.cache.release(seq)
                seq.num_computed_tokens = 0
        except Exception as cleanup:
            self._break(exc, cleanup)

    def _break(self, cause: BaseException, cleanup: Exception) -> None:
        """The failed step's caches could not be released: fail every request, refuse work."""
        self.broken = EngineError(
            f"the engine is unusable: after a failed step ({type(cause).__name__}: {cause}) "
            f"its KV cache could not be released ({type(cleanup).__name__}: {cleanup}); "
            "load a new backend"
        )
        log.error("engine.broken", error=str(self.broken))
        for seq in self.unfinished():
            if not seq.is_finished:
                seq.finish("error", self.broken)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()

    @property
    def speculation(self) -> SpeculationMethod | None:
        """What proposes tokens for the target to verify: "draft", "ngram", "suffix", or
        None."""
        if isinstance(self.runner, SpeculativeRunner):
            return "draft"
        if isinstance(self.runner, SuffixRunner):
            return "suffix"
        if isinstance(self.runner, NgramRunner):
            return "ngram"
        return None

    def pic_context(self) -> int:
        """The tokens a PIC sequence holds: the context, or where the sliding-window layers
        keep a pool of their own, at most what it holds (a PIC sequence's queries read any
        of its blocks there, so it keeps them all)."""
        info = self.cache_info
        if info.window_blocks is None or info.block_size is None:
            return self.config.max_model_len
        return min(self.config.max_model_len, info.window_blocks * info.block_size)

    def pic_refusal(self) -> str | None:
        """Why PIC prompts cannot run on this engine's cache, or None where they can."""
        info = self.cache_info
        if info.kind != "paged":
            return (
                "it runs without paged attention (MISTRALRS_PAGED_ATTN=false, or the "
                "platform's default); PIC lives in the paged pool"
            )
        if self.runner.model.config.implementation == "transformers":
            return (
                "its model runs on transformers' modeling code (MISTRALRS_MODEL_IMPL), "
                "whose rotary embedding PIC's moved keys cannot follow"
            )
        if info.compression is not None:
            return f"its KV cache is compressed (MISTRALRS_KV_CACHE_COMPRESSION={info.compression})"
        if info.latent_kv:
            return (
                "its model's attention keeps one latent per token (DeepSeek's multi-head "
                "latent attention): PIC moves and probes K and V per head, and a latent "
                "computed at other positions is not moved yet"
            )
        if not info.uniform_kv:
            return (
                "its model's KV layers differ in shape or are read by other layers "
                "(Gemma 4): PIC's moves and probes take one shape and a layer each"
            )
        if info.chunked_attention:
            return (
                "its model attends within chunks of absolute positions (Llama 4): a block "
                "computed at other positions would see other keys"
            )
        if info.state_bytes_per_seq is not None:
            return (
                "its model has state layers (Gated DeltaNet, Mamba-2, Mamba-1), whose state holds "
                "the whole context in order: a block computed elsewhere cannot be placed into it"
            )
        if isinstance(self.runner, SpeculativeRunner):
            return (
                "it decodes with a speculative draft (MISTRALRS_SPECULATIVE_DRAFT_MODEL or "
                "MISTRALRS_SPECULATIVE_DRAFT_ISQ)"
            )
        return None

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise type(self.broken)(str(self.broken))  # a DistributedError stays one

    def _accept(
        self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None = None
    ) -> StepOutput:
        if seq.constraint is not None and seq.constraint.active:
            seq.constraint.accept(token_id)  # before the append: a refused token is not kept
        seq.append(token_id)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        if len(seq.output_token_ids) == 1:  # its prompt is computed: count its lookup once
            self.prefix_cache_queries += len(seq.prompt_token_ids)
            self.prefix_cache_hits += seq.num_cached_tokens
            self.pic_hit_tokens += seq.num_pic_hit_tokens
            self.pic_miss_tokens += seq.num_pic_miss_tokens
            self.pic_recomputed_tokens += seq.num_pic_recomputed_tokens
            self.tier_hit_tokens += seq.num_tier_hit_tokens
        detok = self.detokenizers[seq.seq_id]
        delta = detok.add(token_id)
        reason = self._finish_reason(seq, token_id, detok.stopped)
        if reason:
            delta += detok.flush()
            seq.text, seq.stop_string = detok.text, detok.matched
            seq.finish(reason)
        output = StepOutput(seq, token_id, delta, logprobs)
        seq.outbox.append(output)  # within the step: a failure after it loses nothing
        return output

    def _finish_reason(self, seq: Sequence, token_id: int, stopped: bool) -> str | None:
        params = seq.params
        if stopped or token_id in params.stop_token_ids:
            return "stop"
        if token_id in self.config.eos_token_ids and not params.ignore_eos:
            return "stop"
        max_tokens = params.max_tokens
        if (max_tokens and len(seq.output_token_ids) >= max_tokens) or (
            seq.num_tokens >= seq.max_len
        ):
            return "length"
        return None

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.detokenizers.pop(seq.seq_id, None)

    def _discard(self, seq: Sequence) -> None:
        """Release ``seq`` without offering its cache for reuse: a failed step may have
        left it half-written."""
        seq.num_computed_tokens = 0
        self._release(seq)


def _step_error(exc: BaseException) -> EngineError:
    """What a request of a failed step is told: the group's own error where the other
    ranks of a tensor-parallel model are gone (it names them), else the step's failure."""
    if isinstance(exc, DistributedError):
        return exc
    error = EngineError(f"the engine step failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error
