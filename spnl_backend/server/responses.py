"""OpenAI's response bodies and stream chunks for completions and chat, built from the
engine's sequences. A request's choices are its sequences in order: for a list of
prompts with ``n`` completions each, choice ``p * n + i`` is prompt ``p``'s ``i``-th."""

import base64
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..engine.sampler import TokenLogprobs
from ..engine.sequence import Sequence
from ..reasoning import Reasoning, ReasoningDelta, ReasoningParser
from ..results import Embeddings
from ..tools.calls import CallReader, Delta, ToolCall, call_reader, read_whole
from ..tools.formats import ToolFormat
from .protocol import EmbeddingRequest

Endpoint = Literal["completions", "chat"]


@dataclass
class Reply:
    """One response's identity and the sequences behind its choices."""

    endpoint: Endpoint
    model: str
    seqs: list[Sequence]
    n: int
    # Token ids → their bytes, for the log-probabilities' token names.
    token_bytes: Callable[[list[int]], list[bytes]] = lambda ids: [b"" for _ in ids]
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolFormat | None = None  # a chat answer read for tool calls in this format
    reasoning: Reasoning | None = None  # a chat answer's reasoning told from its answer
    keep_alive: float | None = None  # Ollama's, for the model once the answer is done
    finished: bool = False  # its request let go (model, in-flight count, metrics)

    def __post_init__(self) -> None:
        prefix = "cmpl" if self.endpoint == "completions" else "chatcmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex}"
        self.index = {seq.seq_id: i for i, seq in enumerate(self.seqs)}
        self._pending: dict[int, list[TokenLogprobs]] = {}
        self._started: set[int] = set()  # streams that sent their first chunk
        self._readers: dict[int, CallReader] = {}  # a stream's calls read so far
        self._thinking: dict[int, ReasoningParser] = {}  # a stream's reasoning read so far

    def pending(self, seq: Sequence) -> list[TokenLogprobs]:
        """A stream's log-probabilities not yet sent: they go with its next chunk."""
        return self._pending.setdefault(seq.seq_id, [])

    # ---- whole responses --------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        return {
            **self._head(""),
            "choices": [self._choice(s) for s in self.seqs],
            "usage": self.usage(),
        }

    def _choice(self, seq: Sequence) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index[seq.seq_id]}
        calls = self.calls(seq)
        if self.endpoint == "completions":
            choice["text"] = seq.text
        elif calls is None:
            answer = self.answer(seq)
            message = {"role": "assistant", "content": answer.content}
            choice["message"] = self._with_reasoning(message, answer.reasoning or None)
        else:
            # Cut short by max_tokens: the calls made whole before the cut (a stream has
            # sent the cut one's fragments too), and no call markup as content.
            bodies = [call.body() for call in calls]
            message = {"role": "assistant", "content": None, "tool_calls": bodies}
            choice["message"] = self._with_reasoning(message, self.answer(seq).reasoning or None)
        entries = seq.logprobs if seq.params.logprobs else None
        reason = _finish_reason(seq, calls)
        return {**choice, "logprobs": self._logprobs(entries), "finish_reason": reason}

    def answer(self, seq: Sequence) -> ReasoningDelta:
        """A finished chat sequence's reasoning and answer (all answer where its reasoning
        is not told apart)."""
        if self.reasoning is None:
            return ReasoningDelta(content=seq.text)
        return self.reasoning.split(seq.text)

    def _with_reasoning(self, message: dict[str, Any], reasoning: str | None) -> dict[str, Any]:
        """A message or delta with its reasoning under both names clients read: vLLM's
        ``reasoning`` and llama.cpp's (and vLLM's former) ``reasoning_content``. Left out
        where the model's reasoning is not told apart."""
        if self.reasoning is None or self.reasoning.format == "none":
            return message
        return {**message, "reasoning_content": reasoning, "reasoning": reasoning}

    def calls(self, seq: Sequence) -> list[ToolCall] | None:
        """The whole calls the sequence's answer made (its stream's reader where it
        streamed); None where it answered in text or was not read for calls."""
        if self.tools is None:
            return None
        if self.tools.syntax == "harmony":  # read by the reasoning parser, with the channels
            parser = self._thinking.get(seq.seq_id)
            made = parser.calls if parser is not None else self.answer(seq).started
            return [call for call in made if call.whole] if made else None
        reader = self._readers.get(seq.seq_id)
        if reader is None:
            return read_whole(self.tools, self.answer(seq).content)
        return reader.whole_calls()

    def usage(self) -> dict[str, Any]:
        """Each prompt counted once (its first completion's), every completion's tokens."""
        leaders = self.seqs[:: self.n]
        prompt = sum(len(seq.prompt_token_ids) for seq in leaders)
        completion = sum(len(seq.output_token_ids) for seq in self.seqs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {
                "cached_tokens": sum(seq.num_cached_tokens for seq in leaders),
                "pic_hit_tokens": sum(seq.num_pic_hit_tokens for seq in leaders),
                "pic_miss_tokens": sum(seq.num_pic_miss_tokens for seq in leaders),
                "pic_recomputed_tokens": sum(seq.num_pic_recomputed_tokens for seq in leaders),
                "tier_hit_tokens": sum(seq.num_tier_hit_tokens for seq in leaders),
            },
            "completion_tokens_details": _speculated(self.seqs),
        }

    # ---- stream chunks ----------------------------------------------------------------

    def text_chunk(self, seq: Sequence, text: str) -> dict[str, Any] | None:
        """A stream's chunk for ``text``; None where it adds nothing to send yet (a tool
        call's opening or a reasoning marker still being read)."""
        if self.endpoint != "chat":
            return self._chunk(seq, text, None)
        parser = self._parser(seq)
        thought, split = "", None
        if parser is not None:
            split = parser.feed(text)
            thought, text = split.reasoning, split.content
        if self.tools is not None:
            calls = self._read(seq, split, text)
            chunk = self._chunk(seq, "", None, calls) if calls or thought else None
        else:
            chunk = self._chunk(seq, text, None) if text or thought else None
        return self._thought(chunk, thought)

    def end_chunk(self, seq: Sequence) -> dict[str, Any]:
        """The stream's last chunk: what its parsers held back, and its finish reason."""
        parser = self._thinking.get(seq.seq_id)
        rest = parser.finish() if parser is not None else ReasoningDelta()
        calls = None
        if self.tools is not None and self.tools.syntax == "harmony":
            calls = Delta(rest.content, rest.started, rest.arguments)
        elif self.tools is not None and (rest.content or seq.seq_id in self._readers):
            reader = self._reader(seq)
            fed, last = reader.feed(rest.content), reader.finish()
            calls = Delta(
                fed.content + last.content,
                fed.started + last.started,
                fed.arguments + last.arguments,
            )
        reason = _finish_reason(seq, self.calls(seq))
        chunk = self._chunk(seq, "" if calls is not None else rest.content, reason, calls)
        return self._thought(chunk, rest.reasoning)  # type: ignore[return-value]

    def _parser(self, seq: Sequence) -> ReasoningParser | None:
        """The stream's reasoning parser, made on its first piece."""
        if self.reasoning is None:
            return None
        if seq.seq_id not in self._thinking:
            parser = self.reasoning.parser()
            if parser is None:
                return None
            self._thinking[seq.seq_id] = parser
        return self._thinking[seq.seq_id]

    def _read(self, seq: Sequence, split: ReasoningDelta | None, text: str) -> Delta:
        """What a piece of a tool-calling answer adds: harmony's calls as its reasoning
        parser read them, the other formats' as their call reader reads the answer."""
        if self.tools is not None and self.tools.syntax == "harmony" and split is not None:
            return Delta(split.content, split.started, split.arguments)
        return self._reader(seq).feed(text)

    def _reader(self, seq: Sequence) -> CallReader:
        reader = self._readers.get(seq.seq_id)
        if reader is None:  # once per stream: setdefault would build one per chunk
            reader = self._readers[seq.seq_id] = call_reader(self.tools)  # type: ignore[arg-type]
        return reader

    def _thought(self, chunk: dict[str, Any] | None, thought: str) -> dict[str, Any] | None:
        """``chunk`` with the reasoning its piece added."""
        if chunk is not None and thought:
            choice = chunk["choices"][0]
            choice["delta"] = {
                **choice["delta"],
                "reasoning_content": thought,
                "reasoning": thought,
            }
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._head(".chunk"), "choices": [], "usage": self.usage()}

    def _chunk(
        self, seq: Sequence, text: str, reason: str | None, calls: Delta | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index[seq.seq_id]}
        first = seq.seq_id not in self._started
        self._started.add(seq.seq_id)
        if self.endpoint == "completions":
            choice["text"] = text
        elif calls is not None:
            choice["delta"] = _calls_delta(calls, first)
        else:
            choice["delta"] = (
                {"role": "assistant", "content": text}
                if first
                else {"content": text}
                if text or reason is None
                else {}
            )
        entries = self._pending.pop(seq.seq_id, None) if seq.params.logprobs else None
        if seq.params.logprobs and entries is None:
            entries = []
        return {
            **self._head(".chunk"),
            "choices": [{**choice, "logprobs": self._logprobs(entries), "finish_reason": reason}],
        }

    def _logprobs(self, entries: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        """OpenAI's shape: chat's ``{"content": [...]}`` of token objects; the completions
        endpoint's parallel lists (``text_offset`` counts from the completion's start)."""
        if entries is None:
            return None
        ids = [e.token_id for e in entries] + [t for e in entries for t, _ in e.top]
        names = dict(zip(ids, self.token_bytes(ids), strict=True))
        if self.endpoint == "chat":
            return {
                "content": [
                    {
                        **_token(names[e.token_id], e.logprob),
                        "top_logprobs": [_token(names[t], lp) for t, lp in e.top],
                    }
                    for e in entries
                ]
            }
        tokens = [_text(names[e.token_id]) for e in entries]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_text(names[t]): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _head(self, suffix: str) -> dict[str, Any]:
        kind = "text_completion" if self.endpoint == "completions" else "chat.completion" + suffix
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def _finish_reason(seq: Sequence, calls: list[ToolCall] | None) -> str:
    if calls is not None and seq.finish_reason != "length":
        return "tool_calls"
    return finish_reason(seq)


def _calls_delta(calls: Delta, first: bool) -> dict[str, Any]:
    """A chat chunk's delta for what a tool-calling answer added: its text, or its calls'
    openings (id and name) and argument fragments, by call index."""
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if calls.content or (first and not calls.started):
        delta["content"] = calls.content
    entries: dict[int, dict[str, Any]] = {}
    for call in calls.started:
        function = {"name": call.name, "arguments": ""}
        entries[call.index] = {"index": call.index, "id": call.id, "type": "function"}
        entries[call.index]["function"] = function
    for index, fragment in calls.arguments:
        entry = entries.setdefault(index, {"index": index, "function": {"arguments": ""}})
        entry["function"]["arguments"] += fragment
    if entries:
        delta["tool_calls"] = list(entries.values())
    return delta


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _token(raw: bytes, logprob: float) -> dict[str, Any]:
    return {"token": _text(raw), "logprob": logprob, "bytes": list(raw)}


def finish_reason(seq: Sequence) -> str:
    """OpenAI's reasons: "stop" (EOS or a stop string) or "length"."""
    return "length" if seq.finish_reason == "length" else "stop"


def embedding_body(result: Embeddings, asked: EmbeddingRequest, model: str) -> dict[str, Any]:
    """OpenAI's embeddings list for `Backend.embed`'s ``result`` (an `EmbeddingRequest`'s
    ``dimensions`` taken first and normalized again)."""
    vectors = result.vectors
    if asked.dimensions is not None:
        vectors = torch.nn.functional.normalize(vectors[:, : asked.dimensions], dim=-1)
    data = []
    for index, vector in enumerate(vectors):
        if asked.base64:
            raw = vector.numpy().astype("<f4").tobytes()
            embedding: Any = base64.b64encode(raw).decode("ascii")
        else:
            embedding = vector.tolist()
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = result.prompt_tokens
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def json_piecewise(body: dict[str, Any], key: str) -> bytes:
    """``body`` as Starlette's `JSONResponse` writes it, the list at ``key`` an item at a
    time. One call into the C encoder holds the GIL until it returns (some 0.75 s for
    2,048 vectors of 640), however off the event loop it runs; between short calls the
    event loop's thread gets its turn."""
    fields = []
    for name, value in body.items():
        text = "[" + ",".join(map(_json, value)) + "]" if name == key else _json(value)
        fields.append(_json(name) + ":" + text)
    return ("{" + ",".join(fields) + "}").encode()


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def _speculated(seqs: list[Sequence]) -> dict[str, int]:
    """Speculation's proposed tokens the target kept and refused, under the names OpenAI
    gives a prediction's (both 0 without speculation)."""
    proposed = sum(seq.num_draft_tokens for seq in seqs)
    accepted = sum(seq.num_accepted_tokens for seq in seqs)
    return {
        "accepted_prediction_tokens": accepted,
        "rejected_prediction_tokens": proposed - accepted,
    }
