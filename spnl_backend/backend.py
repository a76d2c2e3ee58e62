"""`Backend`: the one interface host applications call — generate, stream, chat."""

import atexit
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .engine.build import build_engine
from .engine.cache import CacheInfo
from .engine.engine import Engine, EngineStats
from .engine.sequence import SamplingParams, StepOutput
from .engine.sequence import Sequence as EngineSequence
from .errors import RequestAbortedError, RequestError, SettingsError
from .loader.build import LoadedModel, load_model
from .loader.default_model import default_model_path
from .loader.draft import load_draft
from .loader.progress import LogProgress, Progress
from .loader.resolve import ModelSource, resolve_model
from .log import get_logger, set_verbose
from .memory import release_freed_memory
from .models.config import ModelConfig
from .models.transformer import CausalLM
from .request import check_messages, check_prompt, prompt_list, reject_unknown, sampling_params
from .settings import BackendSettings, PlatformDecisions, detect_platform, load_settings

log = get_logger()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens reused from the prefix cache
    ttft_s: float  # from the request to its first token
    decode_tok_s: float  # completion tokens after the first, per second
    draft_tokens: int = 0  # proposed by the speculative draft (0 without one)
    accepted_tokens: int = 0  # of those, accepted by the target


@dataclass(frozen=True)
class GenerateResult:
    text: str
    token_ids: list[int]  # the completion's tokens (an EOS that ended it included)
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    usage: Usage


# Backends not closed yet: closed at interpreter exit, so that no thread of the host is
# still inside a step while the interpreter tears torch down.
_OPEN: "weakref.WeakSet[Backend]" = weakref.WeakSet()


@atexit.register
def _close_open_backends() -> None:
    for backend in list(_OPEN):
        backend.close()


# A stream runs at most this many pieces ahead of its reader, then pauses.
STREAM_BUFFER = 64
# A paused stream whose reader has taken nothing for this long is aborted.
STREAM_IDLE_TIMEOUT_S = 60.0


class Backend:
    """A loaded model behind `generate`, `stream` and `chat`; safe to share between threads.

    Also a context manager: leaving the ``with`` block (or `close`) frees everything.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        engine: Engine,
        settings: BackendSettings,
        platform: PlatformDecisions,
    ) -> None:
        self.settings, self.platform = settings, platform
        self.tokenizer = loaded.tokenizer
        self.model_config: ModelConfig = loaded.config
        self.source: ModelSource = loaded.source
        self.max_model_len = engine.config.max_model_len
        self._cache_holds_context = engine.cache.capacity_tokens == self.max_model_len
        self._engine: Engine | None = engine
        self._lock = threading.Lock()
        self._abandoned: deque[EngineSequence] = deque()  # left by readers; aborted next
        _OPEN.add(self)

    def generate(
        self,
        prompt: str | Sequence[str],
        *,
        max_tokens: int | None = None,
        temperature: float = 0.6,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        **unknown: object,
    ) -> GenerateResult | list[GenerateResult]:
        """Complete one prompt, or a list of prompts run together as one batch.

        ``max_tokens`` of 0 or None runs until EOS or the end of the context;
        ``temperature`` 0 is greedy. Returns a list exactly when given a list; if one of
        its prompts fails, the call raises that error and the others are aborted.
        """
        reject_unknown(unknown)
        self._open_engine()
        params = sampling_params(max_tokens, temperature, top_p, top_k, seed, stop)
        prompts = [check_prompt(prompt)] if isinstance(prompt, str) else prompt_list(prompt)
        results = self._generate_ids([self._encode(p) for p in prompts], params)
        return results[0] if isinstance(prompt, str) else results

    def stream(
        self,
        prompt: str,
        *,
        max_tokens: int | None = None,
        temperature: float = 0.6,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        **unknown: object,
    ) -> "Stream":
        """Yield the completion's text in pieces as it is decoded.

        The request starts with the first ``next()``. Closing the iterator, letting it be
        garbage-collected or leaving the loop aborts it; one left unread pauses after
        `STREAM_BUFFER` pieces and is aborted after `STREAM_IDLE_TIMEOUT_S` seconds.
        """
        reject_unknown(unknown)
        self._open_engine()
        params = sampling_params(max_tokens, temperature, top_p, top_k, seed, stop)
        if not isinstance(prompt, str):
            raise RequestError(f"stream() takes one prompt string, not {type(prompt).__name__}")
        return Stream(self, self._encode(check_prompt(prompt)), params)

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int | None = None,
        temperature: float = 0.6,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        **unknown: object,
    ) -> GenerateResult:
        """Apply the model's chat template to ``messages`` and complete the assistant turn."""
        reject_unknown(unknown)
        self._open_engine()
        params = sampling_params(max_tokens, temperature, top_p, top_k, seed, stop)
        ids = self.tokenizer.apply_chat_template(check_messages(messages))
        return self._generate_ids([self._check_length(ids)], params)[0]

    def run_steps(self, prompts: list[str], params: SamplingParams) -> Iterator[StepOutput]:
        """Every step's outputs for a batch (what the CLI's progress display follows)."""
        seqs = self._add([self._encode(p) for p in prompt_list(prompts)], params)
        yield from self._run(seqs)

    def close(self) -> None:
        """Abort every unfinished request (its caller gets `RequestAbortedError`) and free the
        model and its KV cache. Later calls raise `RequestAbortedError`; closing twice is fine."""
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is None:
                return
            for seq in engine.unfinished():
                engine.abort(seq, RequestAbortedError("the backend was closed"))
            self._abandoned.clear()
        del engine
        release_freed_memory()
        log.info("backend.closed", model=self.source.name)

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._engine is None

    def stats(self) -> EngineStats:
        """Requests running, waiting and paused, sequences holding cache, block-pool usage
        in paged mode; preemptions and prefix-cache queries and hits (in prompt tokens)
        since the model was loaded."""
        with self._lock:
            return self._open_engine().stats()

    def cache_info(self) -> CacheInfo:
        """The KV cache: paged or contiguous, its capacity, blocks, storage dtype, bytes per
        token, compression method and attention kernels (the target's, with a draft)."""
        with self._lock:
            return self._open_engine().cache_info

    @property
    def model(self) -> CausalLM:
        """The loaded torch module, for inspection (its modules, parameters and config);
        changing it while the backend serves requests is not supported."""
        return self._open_engine().runner.model

    def _generate_ids(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> list[GenerateResult]:
        seqs = self._add(prompts, params)
        for _ in self._run(seqs):
            pass
        return [_result(seq) for seq in seqs]

    def _stream_pieces(
        self, ids: list[int], params: SamplingParams
    ) -> Iterator["EngineSequence | str"]:
        """The request's sequence first (the `Stream` keeps it), then its text pieces."""
        (seq,) = self._add([ids], params)
        yield seq
        for output in self._run([seq]):
            if output.text_delta:
                yield output.text_delta

    def _add(self, prompts: list[list[int]], params: SamplingParams) -> list[EngineSequence]:
        with self._lock:
            engine = self._open_engine()
            return [engine.add(ids, params) for ids in prompts]

    def _run(self, seqs: list[EngineSequence]) -> Iterator[StepOutput]:
        """Step the engine until ``seqs`` finish, yielding their outputs.

        Every caller's thread steps the one engine for all running sequences
        (continuous batching across threads); outputs are sorted per sequence so
        each caller sees its own. A sequence that failed raises its error here, after
        the outputs it produced. Sequences are aborted if the caller stops early.
        """
        try:
            while True:
                with self._lock:
                    self._abort_abandoned()
                    outputs = _take(seqs)
                    if not outputs and not _all_finished(seqs):
                        self._step()
                        outputs = _take(seqs)
                    done = _all_finished(seqs)
                yield from outputs
                _raise_failure(seqs)
                if done:
                    return
        finally:
            self._abandon(seqs)

    def _abandon(self, seqs: list[EngineSequence]) -> None:
        """The reader is gone: abort its unfinished sequences and drop their outputs. Queued
        first, because a generator collected by the garbage collector may run this on a
        thread that holds the lock mid-step; done at once where the lock is free, else by
        the lock's holder before its next step."""
        self._abandoned.extend(seqs)
        if self._lock.acquire(blocking=False):
            try:
                self._abort_abandoned()
            finally:
                self._lock.release()

    def _step(self) -> None:
        """One engine step; its outputs wait in each sequence's outbox for its reader, and a
        sequence whose reader is `STREAM_BUFFER` outputs behind pauses."""
        engine = self._open_engine()
        self._abort_idle(engine)
        engine.step()
        for seq in engine.unfinished():
            if len(seq.outbox) >= STREAM_BUFFER:
                seq.paused = True

    def _abort_idle(self, engine: Engine) -> None:
        """Abort paused requests whose readers have taken nothing for too long."""
        deadline = time.monotonic() - STREAM_IDLE_TIMEOUT_S
        for seq in engine.unfinished():
            if seq.paused and seq.read_at < deadline:
                message = f"the stream was not read for {STREAM_IDLE_TIMEOUT_S:g} s"
                log.warning("request.aborted", seq_id=seq.seq_id, reason=message)
                engine.abort(seq, RequestAbortedError(message + "; it was aborted"))

    def _abort_abandoned(self) -> None:
        """Abort the sequences whose readers left (called with the lock held)."""
        while self._abandoned:
            seq = self._abandoned.popleft()
            seq.outbox.clear()
            if self._engine is not None and not seq.is_finished:
                self._engine.abort(seq)

    def _open_engine(self) -> Engine:
        if self._engine is None:
            raise RequestAbortedError("the backend is closed; load a new one")
        return self._engine

    def _encode(self, prompt: str) -> list[int]:
        return self._check_length(self.tokenizer.encode(prompt))

    def _check_length(self, ids: list[int]) -> list[int]:
        if len(ids) >= self.max_model_len:
            if self._cache_holds_context:
                holder = "the whole paged KV cache (the MISTRALRS_PAGED_ATTN_* budget)"
                remedy = "raise MISTRALRS_PAGED_ATTN_CONTEXT_LEN or shorten it"
            else:
                holder, remedy = "the model's context", "shorten it"
            raise RequestError(
                f"the prompt has {len(ids)} tokens, but {holder} holds "
                f"{self.max_model_len} (prompt and completion together); {remedy}"
            )
        return ids


class Stream(Iterator[str]):
    """The text pieces of one completion as it is decoded (what `Backend.stream` returns).

    Read from one thread at a time; `close` (from any thread), garbage collection or
    leaving the loop aborts the request."""

    def __init__(self, backend: Backend, ids: list[int], params: SamplingParams) -> None:
        self.seq: EngineSequence | None = None  # once the first piece is asked for
        self._backend = backend
        self._pieces = backend._stream_pieces(ids, params)
        self._reading = threading.Lock()

    def __next__(self) -> str:
        if not self._reading.acquire(blocking=False):
            raise RequestError("this stream is being read by another thread; read it from one")
        try:
            if self.seq is None:
                self.seq = next(self._pieces)  # type: ignore[assignment]
            return next(self._pieces)  # type: ignore[return-value]
        finally:
            self._reading.release()

    def close(self) -> None:
        """Abort the request; a thread reading the stream meanwhile sees it end."""
        if self._reading.acquire(blocking=False):
            try:
                self._pieces.close()
            finally:
                self._reading.release()
        elif self.seq is not None:
            self._backend._abandon([self.seq])


def _take(seqs: list[EngineSequence]) -> list[StepOutput]:
    """The outputs waiting for this reader (called with the lock held)."""
    now = time.monotonic()
    taken: list[StepOutput] = []
    for seq in seqs:
        taken += seq.outbox
        seq.outbox.clear()
        seq.paused, seq.read_at = False, now
    return taken


def _all_finished(seqs: list[EngineSequence]) -> bool:
    return all(seq.is_finished for seq in seqs)


def _raise_failure(seqs: list[EngineSequence]) -> None:
    for seq in seqs:
        if seq.error is not None:
            raise seq.error


def _result(seq: EngineSequence) -> GenerateResult:
    completion = len(seq.output_token_ids)
    ttft = (seq.first_token_time or seq.arrival_time) - seq.arrival_time
    decode_time = (seq.finish_time or 0.0) - (seq.first_token_time or 0.0)
    decode_rate = (completion - 1) / decode_time if completion > 1 and decode_time > 0 else 0.0
    usage = Usage(
        len(seq.prompt_token_ids),
        completion,
        seq.num_cached_tokens,
        ttft,
        decode_rate,
        seq.num_draft_tokens,
        seq.num_accepted_tokens,
    )
    return GenerateResult(seq.text, list(seq.output_token_ids), seq.finish_reason or "stop", usage)


def load_backend(
    model: str | os.PathLike[str] | None = None,
    settings: BackendSettings | None = None,
    *,
    progress: Progress | None = None,
) -> Backend:
    """Load a model (the argument, else ``MISTRALRS_MODEL``, else the embedded default).

    ``settings`` default to the MISTRALRS_* environment; ``progress`` receives loading
    progress (by default ``load.progress`` log events).
    """
    _check_load_arguments(model, settings, progress)
    if settings is None:
        settings = load_settings()
    else:
        set_verbose(settings.verbose)
    decisions = detect_platform(settings)
    name = os.fspath(model) if model is not None else settings.model
    source = (
        resolve_model(name)
        if name
        else ModelSource("gguf", default_model_path(), "embedded default")
    )
    log.info("model.resolved", name=source.name, kind=source.kind, path=str(source.path))
    progress = progress or LogProgress()
    loaded = load_model(source, settings.isq, decisions, progress)
    draft = load_draft(loaded, settings, decisions, progress)
    engine = build_engine(loaded, settings, decisions, draft)
    backend = Backend(loaded, engine, settings, decisions)
    release_freed_memory()
    return backend


def _check_load_arguments(model: object, settings: object, progress: object) -> None:
    if (model is not None and not isinstance(model, str | os.PathLike)) or (
        isinstance(model, os.PathLike) and not isinstance(os.fspath(model), str)
    ):
        raise SettingsError(
            f"model={type(model).__name__}: expected a model name or path (str or os.PathLike)"
        )
    if settings is not None and not isinstance(settings, BackendSettings):
        raise SettingsError(
            f"settings={type(settings).__name__}: expected a BackendSettings "
            "(build one with BackendSettings(field=value, ...))"
        )
    if progress is not None and not callable(progress):
        raise SettingsError(
            f"progress={type(progress).__name__}: expected a callable (stage, done, total)"
        )
