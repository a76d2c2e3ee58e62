"""What a request gives back: its results (text, token ids, finish reason, usage) read
whole, or its text as a stream of pieces; and embeddings."""

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from .engine.loop import Finished, Item, LoopRequest
from .engine.sampler import TokenLogprobs
from .engine.sequence import Sequence as EngineSequence
from .engine.sequence import StepOutput
from .errors import RequestError
from .reasoning import Reasoning
from .tools.calls import ToolCall, read_whole
from .tools.chat import ToolChat


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens reused from the prefix cache
    ttft_s: float  # from the request to its first token
    decode_tok_s: float  # completion tokens after the first, per second
    draft_tokens: int = 0  # proposed by the speculative draft (0 without one)
    accepted_tokens: int = 0  # of those, accepted by the target
    # Of a PIC prompt's plus tokens, those whose K/V the pool had (reused) and those
    # computed (0 and 0 for a plain prompt).
    pic_hit_tokens: int = 0
    pic_miss_tokens: int = 0
    # Of a PIC prompt's plus tokens, those computed again with full attention
    # (``MISTRALRS_PIC_RECOMPUTE``), on top of the ones above.
    pic_recomputed_tokens: int = 0
    # Of the reused prompt tokens (cached ones and PIC hits), those whose K/V the KV tier
    # read back from disk (0 without a tier).
    tier_hit_tokens: int = 0


@dataclass(frozen=True)
class GenerateResult:
    text: str
    token_ids: list[int]  # the completion's tokens (an EOS that ended it included)
    finish_reason: str  # "stop" (EOS, a stop string or a stop token) or "length"
    usage: Usage
    # With ``logprobs=True``: each token's log-probability and its ``top_logprobs``
    # likeliest alternatives (`TokenLogprobs`), one per entry of ``token_ids``.
    logprobs: list[TokenLogprobs] | None = None
    # A chat with tools whose answer called them: the calls (its ``text`` is then the
    # calls as the model wrote them, and ``finish_reason`` "tool_calls"; cut short by
    # max_tokens, the calls made whole before the cut, and "length").
    tool_calls: list[ToolCall] | None = None
    # A chat whose model reasons (`reasoning`): its reasoning, told from the answer that
    # ``text`` then holds alone; None where the model's output is not read for reasoning.
    reasoning: str | None = None


@dataclass(frozen=True)
class Embeddings:
    vectors: "torch.Tensor"  # [texts, hidden] float32, each row of unit length
    token_counts: list[int]  # each text's tokens

    @property
    def prompt_tokens(self) -> int:
        return sum(self.token_counts)


class Stream(Iterator[str]):
    """The text pieces of one completion as it is decoded (what `Backend.stream` returns).

    Read from one thread at a time; `close` (from any thread), garbage collection or
    leaving the loop aborts the request."""

    def __init__(self, start: Callable[[], LoopRequest]) -> None:
        """``start``: submits the request (with every step's pieces), on the first piece
        asked for."""
        self.request: LoopRequest | None = None  # once the first piece is asked for
        self._start = start
        self._items: Iterator[Item] | None = None
        self._reading = threading.Lock()

    @property
    def seq(self) -> EngineSequence | None:
        return None if self.request is None else self.request.seqs[0]

    def __next__(self) -> str:
        if not self._reading.acquire(blocking=False):
            raise RequestError("this stream is being read by another thread; read it from one")
        try:
            if self._items is None:
                self.request = self._start()
                self._items = self.request.items()
            for item in self._items:
                raise_failure(item)
                if isinstance(item, StepOutput) and item.text_delta:
                    return item.text_delta
            raise StopIteration
        finally:
            self._reading.release()

    def close(self) -> None:
        """Abort the request, and return once its cache is free; a thread reading the
        stream meanwhile sees it end."""
        if self.request is None:
            return
        if self._reading.acquire(blocking=False):
            try:
                if self._items is not None:
                    self._items.close()
            finally:
                self._reading.release()
        else:
            self.request.abort()
        self.request.loop.barrier()


def read_results(request: LoopRequest, single: bool) -> Any:
    """Wait for ``request`` on this thread: its results (one, or a list)."""
    for item in request.items():
        raise_failure(item)
    results = [result_of(seq) for seq in request.seqs]
    return results[0] if single else results


async def aread_results(request: LoopRequest, single: bool) -> Any:
    """`read_results` on the event loop."""
    async for item in request.aitems():
        raise_failure(item)
    results = [result_of(seq) for seq in request.seqs]
    return results[0] if single else results


def with_calls(result: GenerateResult, chat: ToolChat) -> GenerateResult:
    """``result`` with the calls its text makes, where it was read for them."""
    if chat.format is None or chat.format.syntax == "harmony":  # read with the reasoning
        return result
    calls = read_whole(chat.format, result.text)
    if calls is None:
        return result
    if result.finish_reason == "length":  # cut short: the calls made whole before the cut
        return replace(result, tool_calls=calls)
    return replace(result, tool_calls=calls, finish_reason="tool_calls")


def with_reasoning(result: GenerateResult, reasoning: Reasoning) -> GenerateResult:
    """A chat ``result``'s reasoning told from its answer, where the model's is read."""
    if reasoning.format == "none":
        return result
    split = reasoning.split(result.text)
    result = replace(result, text=split.content, reasoning=split.reasoning)
    if not split.started:  # harmony's calls, where they are read
        return result
    calls = [call for call in split.started if call.whole]
    if result.finish_reason == "length":  # cut short: the calls made whole before the cut
        return replace(result, tool_calls=calls)
    return replace(result, tool_calls=calls, finish_reason="tool_calls")


def raise_failure(item: Item) -> None:
    if isinstance(item, Finished) and item.seq.error is not None:
        raise item.seq.error


def result_of(seq: EngineSequence) -> GenerateResult:
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
        seq.num_pic_hit_tokens,
        seq.num_pic_miss_tokens,
        seq.num_pic_recomputed_tokens,
        seq.num_tier_hit_tokens,
    )
    return GenerateResult(
        seq.text,
        list(seq.output_token_ids),
        seq.finish_reason or "stop",
        usage,
        list(seq.logprobs) if seq.params.logprobs else None,
    )
