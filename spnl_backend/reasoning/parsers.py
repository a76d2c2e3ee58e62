"""Reasoning separated from the answer as the output streams.

A parser is fed the output's text deltas (`feed`) and told when it ends (`finish`); each
call returns what the delta added to the reasoning, to the answer and, for harmony, to
tool calls. Text that may still be the start of a marker (``</thi`` of ``</think>``) is
held back until the next delta says which, so no partial marker ever reaches the answer;
reading the output whole is feeding it at once, so whole and streamed results are equal.
"""

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Protocol

from ..tools.calls import ToolCall
from .formats import (
    CALL,
    CHANNEL,
    END,
    HARMONY_TAGS,
    MESSAGE,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    RETURN,
    START,
    THINK_CLOSE,
    THINK_OPEN,
)


@dataclass
class ReasoningDelta:
    """What a piece of output adds: reasoning text, answer text, and (harmony) tool calls
    begun and their arguments extended (``(index, fragment)``)."""

    reasoning: str = ""
    content: str = ""
    started: list[ToolCall] = field(default_factory=list)
    arguments: list[tuple[int, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.started or self.arguments)

    def add(self, other: "ReasoningDelta") -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.started += other.started
        self.arguments += other.arguments


class ReasoningParser(Protocol):
    calls: list[ToolCall]

    def feed(self, text: str) -> ReasoningDelta: ...
    def finish(self) -> ReasoningDelta: ...


def held(text: str, tags: tuple[str, ...]) -> int:
    """How many of ``text``'s last characters could begin one of ``tags``."""
    longest = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:size]):
                longest = size
                break
    return longest


class ThinkParser:
    """``<think>reasoning</think>answer``: the block may only open the output (after
    whitespace), or the output starts inside it (``inside``). The reasoning and the answer
    lose the whitespace around the markers. ``wrapped``: Granite's answer, between
    ``<response>`` and ``</response>``, given without those tags."""

    def __init__(self, inside: bool = False, wrapped: bool = False) -> None:
        self.state = "reasoning" if inside else "start"
        self.wrapped = wrapped
        self.buffer = ""  # read, not yet given out
        self.calls: list[ToolCall] = []
        self._trim = True  # the next reasoning or answer text loses its leading whitespace

    def feed(self, text: str) -> ReasoningDelta:
        self.buffer += text
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        return self._drain(final=True)

    def _drain(self, final: bool) -> ReasoningDelta:
        delta = ReasoningDelta()
        while self._step(delta, final):
            pass
        return delta

    def _step(self, delta: ReasoningDelta, final: bool) -> bool:
        """One move of the state machine; False once it waits for more text."""
        if self.state == "start":
            return self._opening(final)
        if self.state == "reasoning":
            return self._reasoning(delta, final)
        if self.state == "answer_start":
            return self._answer_start(final)
        delta.content += self._answer(final)
        return False

    def _opening(self, final: bool) -> bool:
        rest = self.buffer.lstrip()
        if rest.startswith(THINK_OPEN):
            self.buffer, self.state = rest[len(THINK_OPEN) :], "reasoning"
            return True
        if THINK_OPEN.startswith(rest) and not final:
            return False  # whitespace, or the opening still arriving
        self.state, self._trim = "answer", False  # no reasoning: the answer as written
        return True

    def _reasoning(self, delta: ReasoningDelta, final: bool) -> bool:
        at = self.buffer.find(THINK_CLOSE)
        if at >= 0:
            delta.reasoning += self._trimmed(self.buffer[:at].rstrip())
            self.buffer, self.state = self.buffer[at + len(THINK_CLOSE) :], "answer_start"
            self._trim = True
            return True
        keep = len(self.buffer) if final else len(self.buffer) - held(self.buffer, (THINK_CLOSE,))
        piece = self.buffer[:keep] if final else self.buffer[:keep].rstrip()
        delta.reasoning += self._trimmed(piece)
        self.buffer = self.buffer[len(piece) :] if not final else ""
        return False

    def _answer_start(self, final: bool) -> bool:
        rest = self.buffer.lstrip()
        if self.wrapped and rest.startswith(RESPONSE_OPEN):
            self.buffer, self.state = rest[len(RESPONSE_OPEN) :], "answer"
            return True
        if (not rest or (self.wrapped and RESPONSE_OPEN.startswith(rest))) and not final:
            return False
        self.buffer, self.state = rest, "answer"
        return True

    def _answer(self, final: bool) -> str:
        text = self.buffer
        if self.wrapped:
            text = text.replace(RESPONSE_CLOSE, "")
            keep = len(text) if final else len(text) - held(text, (RESPONSE_CLOSE,))
        else:
            keep = len(text)
        self.buffer = text[keep:]
        return self._trimmed(text[:keep])

    def _trimmed(self, text: str) -> str:
        if self._trim:
            text = text.lstrip()
            self._trim = not text
        return text


def _json_whole(call: ToolCall) -> bool:
    try:
        json.loads(call.arguments)
    except ValueError:
        return False
    return True


_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_ENDS = (END, RETURN, CALL)


class HarmonyParser:
    """gpt-oss's messages: ``analysis`` → reasoning; ``final`` and ``commentary`` without a
    recipient (a preamble) → the answer; ``commentary to=functions.NAME`` → a call of
    NAME, its message the arguments. The output starts in a message's header (the
    generation prompt ends with ``<|start|>assistant``). ``calls=False`` (no tools were
    offered, or ``tool_choice`` is ``none``): a call is not dropped but kept in the answer
    as the model wrote it, tags and all."""

    def __init__(self, calls: bool = True) -> None:
        self.state = "header"
        self.buffer = ""
        self.channel: str | None = None
        self.recipient: str | None = None
        self.calls: list[ToolCall] = []
        self.reads_calls = calls
        self._unread = ""  # an unread call's header, not yet given out
        self._opened = ""  # the tag that opened the message being read

    def feed(self, text: str) -> ReasoningDelta:
        self.buffer += text
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        delta = self._drain(final=True)
        if self.state == "body":
            # <|call|> is an end-of-sequence token, left out of the text: a call ending
            # the output is whole where its arguments are (max_tokens may have cut it).
            if self.recipient is not None and self.calls and not _json_whole(self.calls[-1]):
                self.recipient = None
            self._close_call()
        return delta

    def _drain(self, final: bool) -> ReasoningDelta:
        delta = ReasoningDelta()
        while self._header(final) if self.state == "header" else self._step(delta, final):
            pass
        return delta

    def _step(self, delta: ReasoningDelta, final: bool) -> bool:
        if self.state == "between":
            return self._between(delta, final)
        return self._body(delta, final)

    def _header(self, final: bool) -> bool:
        at = self.buffer.find(MESSAGE)
        if at < 0:
            if final:
                self.buffer = ""  # a header cut short: no message began
            return False
        header, self.buffer = self.buffer[:at], self.buffer[at + len(MESSAGE) :]
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        self.channel = channel.group(1) if channel else None
        self.recipient = recipient.group(1) if recipient else None
        self.state = "body"
        if self.recipient is not None and not self.reads_calls:
            self._unread = self._opened + header + MESSAGE  # given out with the body
        return True

    def _between(self, delta: ReasoningDelta, final: bool) -> bool:
        """After a message's end: the next message's header, opened by ``<|start|>`` (or
        by ``<|channel|>`` where the model leaves the start out)."""
        starts = [(i, t) for t in (START, CHANNEL) if (i := self.buffer.find(t)) >= 0]
        if starts:
            at, tag = min(starts)
            delta.content += self.buffer[:at].strip()  # stray text: kept, not dropped
            self.buffer = self.buffer[at + (len(tag) if tag == START else 0) :]
            self._opened = START if tag == START else ""
            self.state = "header"
            return True
        keep = len(self.buffer) if final else len(self.buffer) - held(self.buffer, (START, CHANNEL))
        delta.content += self.buffer[:keep].strip()
        self.buffer = self.buffer[keep:]
        return False

    def _body(self, delta: ReasoningDelta, final: bool) -> bool:
        ends = [(i, t) for t in _ENDS if (i := self.buffer.find(t)) >= 0]
        if ends:
            at, tag = min(ends)
            self._emit(self.buffer[:at] + (tag if self._unread_call() else ""), delta)
            self.buffer = self.buffer[at + len(tag) :]
            self._close_call()
            self.state = "between"
            return True
        keep = len(self.buffer) if final else len(self.buffer) - held(self.buffer, HARMONY_TAGS)
        self._emit(self.buffer[:keep], delta)
        self.buffer = self.buffer[keep:]
        return False

    def _unread_call(self) -> bool:
        return self.recipient is not None and not self.reads_calls

    def _emit(self, text: str, delta: ReasoningDelta) -> None:
        if self._unread_call():
            delta.content += self._unread + text
            self._unread = ""
        elif self.recipient is not None:
            self._call_text(text, delta)
        elif self.channel == "analysis":
            delta.reasoning += text
        elif text:
            delta.content += text

    def _call_text(self, text: str, delta: ReasoningDelta) -> None:
        if not self.calls or self.calls[-1].whole:
            name = self.recipient.removeprefix("functions.")  # type: ignore[union-attr]
            call = ToolCall(len(self.calls), "call_" + secrets.token_hex(12), name)
            self.calls.append(call)
            delta.started.append(call)
        if text:
            call = self.calls[-1]
            call.arguments += text
            delta.arguments.append((call.index, text))

    def _close_call(self) -> None:
        if self.recipient is not None and self.calls and not self.calls[-1].whole:
            self.calls[-1].whole = True
        self.recipient = None
