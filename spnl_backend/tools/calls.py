"""A tool-calling output read as it streams: a text answer, or calls, each call's name
as soon as it is whole and its arguments fragment by fragment.

The output was held to `grammar.tool_grammar`, so its layout is fixed: a text answer
never opens as the calls do, and each call is ``{"name": "<name>", "<key>": {...}}``
written compactly. What is read so far is read again on each delta (outputs are short);
what was already reported is not reported again.
"""

import json
import re
import secrets
from dataclasses import dataclass, field

from .formats import ToolFormat


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""  # JSON text, so far
    whole: bool = False  # the arguments' object closed

    def body(self) -> dict:
        """OpenAI's shape for a whole call."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass
class Delta:
    """What one piece of output adds: text, or calls begun and arguments extended
    (``(index, fragment)``)."""

    content: str = ""
    started: list[ToolCall] = field(default_factory=list)
    arguments: list[tuple[int, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.started or self.arguments)


class CallReader:
    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.mode: str | None = None  # "text" or "calls", once the output says which
        self.calls: list[ToolCall] = []
        self._sent = 0  # characters of a text answer reported
        self._head = re.compile(
            r'\{"name": "([A-Za-z0-9_-]*)", ' + re.escape(json.dumps(fmt.arguments_key)) + ": "
        )

    def feed(self, piece: str) -> Delta:
        self.text += piece
        if self.mode is None:
            trigger = self.fmt.trigger
            if self.text.startswith(trigger):
                self.mode = "calls"
            elif not trigger.startswith(self.text):
                self.mode = "text"
        if self.mode == "text":
            return self._content()
        if self.mode == "calls":
            return self._read_calls()
        return Delta()

    def finish(self) -> Delta:
        """The rest, at the output's end: text still undecided is a text answer."""
        if self.mode is None:
            self.mode = "text"
            return self._content()
        return Delta()

    @property
    def content(self) -> str | None:
        return self.text if self.mode != "calls" else None

    def _content(self) -> Delta:
        delta = Delta(content=self.text[self._sent :])
        self._sent = len(self.text)
        return delta

    def _read_calls(self) -> Delta:
        delta = Delta()
        fmt, text = self.fmt, self.text
        at = len(fmt.opening)
        for index in range(len(text)):  # bounded: each round reads one call onwards
            if index > 0:
                if not text.startswith(fmt.separator, at):
                    break
                at += len(fmt.separator)
            if not text.startswith(fmt.call_open, at):
                break
            at += len(fmt.call_open)
            head = self._head.match(text, at)
            if head is None:
                break
            if index == len(self.calls):
                call = ToolCall(index, "call_" + secrets.token_hex(12), head.group(1))
                self.calls.append(call)
                delta.started.append(call)
            end = _value_end(text, head.end())
            arguments = text[head.end() : end]
            call = self.calls[index]
            if len(arguments) > len(call.arguments):
                delta.arguments.append((index, arguments[len(call.arguments) :]))
                call.arguments = arguments
            if end is None:
                break
            call.whole = True
            at = end + 1 + len(fmt.call_close)  # the object's closing brace, then the call's
        return delta


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON object at ``start`` ends (just past its closing brace); None where
    it is not whole yet."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
