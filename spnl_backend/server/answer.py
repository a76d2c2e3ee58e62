"""A chat answer read into its parts, for the APIs that give each part its own shape
(Anthropic's content blocks, the Responses API's output items): reasoning, text and tool
calls, whole or piece by piece as it streams.

Reasoning is read first, then the rest for calls, as the chat route reads them.
`reasoning_reader` is the one place that decides how a model's reasoning is told from its
answer: the request's `Reasoning` (``<think>`` blocks, harmony channels: `reasoning`),
or, where it has none, everything is the answer (`NoReasoning`). Both APIs emit the
reasoning as Anthropic ``thinking`` blocks and Responses ``reasoning`` items.
"""

from dataclasses import dataclass, field
from typing import Literal, Protocol

from ..reasoning import Reasoning, ReasoningDelta, ReasoningParser
from ..tools.calls import CallReader, ToolCall, call_reader
from ..tools.formats import ToolFormat


class ReasoningReader(Protocol):
    """Splits an output, as it grows, into reasoning and answer."""

    def feed(self, piece: str) -> tuple[str, str]:
        """What ``piece`` adds to the reasoning and to the answer."""
        ...

    def finish(self) -> tuple[str, str]:
        """What is left of each at the output's end."""
        ...


class NoReasoning:
    """A model read as answering alone: everything is the answer."""

    def feed(self, piece: str) -> tuple[str, str]:
        return "", piece

    def finish(self) -> tuple[str, str]:
        return "", ""


class Parsed:
    """A model's reasoning told apart by its format's parser."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser

    def feed(self, piece: str) -> tuple[str, str]:
        delta = self.parser.feed(piece)
        return delta.reasoning, delta.content

    def finish(self) -> tuple[str, str]:
        delta = self.parser.finish()
        return delta.reasoning, delta.content


def reasoning_reader(reasoning: Reasoning | None) -> ReasoningReader:
    """How an answer's reasoning is told apart: by the request's format, if any."""
    parser = reasoning.parser() if reasoning is not None else None
    return NoReasoning() if parser is None else Parsed(parser)


PieceKind = Literal["reasoning", "text", "call", "arguments"]


@dataclass(frozen=True)
class Piece:
    """What a stretch of output adds: reasoning or answer text, a call begun (``call``),
    or a fragment of a call's arguments (``text``, for call ``index``)."""

    kind: PieceKind
    text: str = ""
    call: ToolCall | None = None
    index: int = 0


@dataclass
class Answer:
    """A finished answer: its reasoning, its text, the whole calls it made."""

    reasoning: str = ""
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class AnswerReader:
    """An output read as it streams: reasoning, then text or calls (where ``tools`` gives
    the format the output was held to)."""

    def __init__(self, tools: ToolFormat | None, reasoning: Reasoning | None = None) -> None:
        self.reasoning = reasoning_reader(reasoning)
        self.calls: CallReader | None = None
        self.harmony: ReasoningParser | None = None  # harmony's calls: its parser reads them
        if tools is not None and tools.syntax == "harmony":
            self.harmony = reasoning.parser() if reasoning is not None else None
            if self.harmony is None:
                raise ValueError("harmony's calls are read by the harmony reasoning parser")
        elif tools is not None:
            self.calls = call_reader(tools)
        self.answer = Answer()

    def feed(self, text: str) -> list[Piece]:
        if self.harmony is not None:
            return self._harmony_pieces(self.harmony.feed(text), end=False)
        return self._pieces(*self.reasoning.feed(text), end=False)

    def finish(self) -> list[Piece]:
        if self.harmony is not None:
            return self._harmony_pieces(self.harmony.finish(), end=True)
        return self._pieces(*self.reasoning.finish(), end=True)

    def _harmony_pieces(self, delta: ReasoningDelta, end: bool) -> list[Piece]:
        pieces = self._pieces(delta.reasoning, delta.content, end=False)
        pieces += [Piece("call", call=call, index=call.index) for call in delta.started]
        pieces += [Piece("arguments", text, index=i) for i, text in delta.arguments]
        if end:
            self.answer.calls = [call for call in self.harmony.calls if call.whole]  # type: ignore[union-attr]
        return pieces

    def _pieces(self, reasoning: str, content: str, end: bool) -> list[Piece]:
        pieces = [Piece("reasoning", reasoning)] if reasoning else []
        self.answer.reasoning += reasoning
        if self.calls is None:
            if content:
                pieces.append(Piece("text", content))
                self.answer.text += content
            return pieces
        delta = self.calls.feed(content) if content else None
        for read in (delta, self.calls.finish() if end else None):
            if read is None:
                continue
            if read.content:
                pieces.append(Piece("text", read.content))
                self.answer.text += read.content
            pieces += [Piece("call", call=call, index=call.index) for call in read.started]
            pieces += [Piece("arguments", text, index=i) for i, text in read.arguments]
        if end:
            self.answer.calls = self.calls.whole_calls() or []
        return pieces


def read_answer(tools: ToolFormat | None, text: str, reasoning: Reasoning | None = None) -> Answer:
    """A finished output's parts, read at once."""
    reader = AnswerReader(tools, reasoning)
    reader.feed(text)
    reader.finish()
    return reader.answer
