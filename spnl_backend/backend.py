"""`Backend`: the one interface host applications call — generate, stream, chat."""

import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .engine.engine import Engine, StepOutput
from .engine.sequence import SamplingParams
from .engine.sequence import Sequence as EngineSequence
from .errors import RequestError
from .loader.build import LoadedModel, load_model
from .loader.default_model import default_model_path
from .loader.draft import load_draft
from .loader.engine import build_engine
from .loader.memory import release_freed_memory
from .loader.progress import LogProgress, Progress
from .loader.resolve import ModelSource, resolve_model
from .log import get_logger, set_verbose
from .models.config import ModelConfig
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


class Backend:
    """A loaded model behind `generate`, `stream` and `chat`; safe to share between threads."""

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
        self._engine = engine
        self._lock = threading.Lock()
        self._pending: dict[int, list[StepOutput]] = {}

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
    ) -> GenerateResult | list[GenerateResult]:
        """Complete one prompt, or a list of prompts run together as one batch.

        ``max_tokens`` of 0 or None runs until EOS or the end of the context;
        ``temperature`` 0 is greedy. Returns a list exactly when given a list.
        """
        params = sampling_params(max_tokens, temperature, top_p, top_k, seed, stop)
        prompts = [prompt] if isinstance(prompt, str) else _prompt_list(prompt)
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
    ) -> Iterator[str]:
        """Yield the completion's text in pieces as it is decoded."""
        params = sampling_params(max_tokens, temperature, top_p, top_k, seed, stop)
        if not isinstance(prompt, str):
            raise RequestError(f"stream() takes one prompt string, not {type(prompt).__name__}")
        ids = self._encode(prompt)
        return self._stream_ids(ids, params)

    def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> GenerateResult:
        """Apply the model's chat template to ``messages`` and complete the assistant turn."""
        params = sampling_params(**sampling)
        ids = self.tokenizer.apply_chat_template(_check_messages(messages))
        return self._generate_ids([self._check_length(ids)], params)[0]

    def run_steps(self, prompts: list[str], params: SamplingParams) -> Iterator[StepOutput]:
        """Every step's outputs for a batch (what the CLI's progress display follows)."""
        seqs = self._add([self._encode(p) for p in prompts], params)
        yield from self._run(seqs)

    def _generate_ids(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> list[GenerateResult]:
        seqs = self._add(prompts, params)
        for _ in self._run(seqs):
            pass
        return [_result(seq) for seq in seqs]

    def _stream_ids(self, ids: list[int], params: SamplingParams) -> Iterator[str]:
        (seq,) = self._add([ids], params)
        for output in self._run([seq]):
            if output.text_delta:
                yield output.text_delta

    def _add(self, prompts: list[list[int]], params: SamplingParams) -> list[EngineSequence]:
        return [self._engine_add(ids, params) for ids in prompts]

    def _engine_add(self, ids: list[int], params: SamplingParams) -> EngineSequence:
        with self._lock:
            return self._engine.add(ids, params)

    def _run(self, seqs: list[EngineSequence]) -> Iterator[StepOutput]:
        """Step the engine until ``seqs`` finish, yielding their outputs.

        Every caller's thread steps the one engine for all running sequences
        (continuous batching across threads); outputs are sorted per sequence so
        each caller sees its own. Sequences are aborted if the caller stops early.
        """
        ids = {seq.seq_id for seq in seqs}
        try:
            while True:
                with self._lock:
                    outputs = self._take(ids)
                    if not outputs and not all(seq.is_finished for seq in seqs):
                        self._step()
                        outputs = self._take(ids)
                    done = all(seq.is_finished for seq in seqs)
                yield from outputs
                if done:
                    return
        finally:
            with self._lock:
                for seq in seqs:
                    self._pending.pop(seq.seq_id, None)
                    if not seq.is_finished:
                        self._engine.abort(seq)

    def _step(self) -> None:
        for output in self._engine.step():
            self._pending.setdefault(output.seq.seq_id, []).append(output)

    def _take(self, ids: set[int]) -> list[StepOutput]:
        return [o for seq_id in ids for o in self._pending.pop(seq_id, [])]

    def _encode(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise RequestError(f"a prompt must be a string, not {type(prompt).__name__}")
        if not prompt:
            raise RequestError("the prompt is empty")
        return self._check_length(self.tokenizer.encode(prompt))

    def _check_length(self, ids: list[int]) -> list[int]:
        if len(ids) >= self.max_model_len:
            if self._engine.cache.capacity_tokens == self.max_model_len:
                holder = "the whole paged KV cache (the MISTRALRS_PAGED_ATTN_* budget)"
                remedy = "raise MISTRALRS_PAGED_ATTN_CONTEXT_LEN or shorten it"
            else:
                holder, remedy = "the model's context", "shorten it"
            raise RequestError(
                f"the prompt has {len(ids)} tokens, but {holder} holds "
                f"{self.max_model_len} (prompt and completion together); {remedy}"
            )
        return ids


def sampling_params(
    max_tokens: int | None = None,
    temperature: float = 0.6,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
) -> SamplingParams:
    """Validated sampling parameters (a bad one is a `RequestError` naming it)."""
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 0):
        raise RequestError(
            f"max_tokens={max_tokens!r}: expected an integer >= 0 "
            "(0 or None: until EOS or the end of the context)"
        )
    if not _is_number(temperature) or temperature < 0:
        raise RequestError(f"temperature={temperature!r}: expected a number >= 0 (0 is greedy)")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise RequestError(f"top_p={top_p!r}: expected a number in (0, 1]")
    if not _is_int(top_k) or top_k < 0:
        raise RequestError(f"top_k={top_k!r}: expected an integer >= 0 (0 disables it)")
    if seed is not None and not _is_int(seed):
        raise RequestError(f"seed={seed!r}: expected an integer or None")
    return SamplingParams(
        max_tokens=max_tokens or None,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        seed=seed,
        stop=_stop_strings(stop),
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop={stop!r}: expected a non-empty string or a list of them")
    return stops


def _prompt_list(prompts: Sequence[str]) -> list[str]:
    if not isinstance(prompts, Sequence) or not prompts:
        raise RequestError("expected a prompt string or a non-empty list of prompt strings")
    return list(prompts)


def _check_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise RequestError(
                f"messages[{i}] = {message!r}: expected a dict with string 'role' and 'content'"
            )
    return messages


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
    model: str | None = None,
    settings: BackendSettings | None = None,
    *,
    progress: Progress | None = None,
) -> Backend:
    """Load a model (the argument, else ``MISTRALRS_MODEL``, else the embedded default).

    ``settings`` default to the MISTRALRS_* environment; ``progress`` receives loading
    progress (by default ``load.progress`` log events).
    """
    if settings is None:
        settings = load_settings()
    else:
        set_verbose(settings.verbose)
    decisions = detect_platform(settings)
    name = model or settings.model
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
