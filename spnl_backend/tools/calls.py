"""A tool-calling output read as it streams: a text answer, or calls, each call's name
as soon as it is whole and its arguments fragment by fragment.

The output was held to `grammar.tool_grammar`, so its layout is fixed: a text answer
never opens as the calls do, and each call is ``{"name": "<name>", "<key>": {...}}``
written compactly. Reading goes on from where the last delta stopped, so a long answer
costs time in proportion to its length, not its square.
"""

import json
import re
import secrets
from dataclasses import dataclass, field

from .formats import ToolFormat
from .gemma import call_end, read_value


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
        self._at = 0  # where reading the calls goes on
        self._expect = "opening"  # what the calls' layout has next
        self._scan = _ObjectScan(0)  # the arguments being read
        self._close = "}" + fmt.call_close  # after a call's arguments: its object's end
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

    def whole_calls(self) -> list[ToolCall] | None:
        """The calls made whole so far; None where the answer is text."""
        return None if self.content is not None else [c for c in self.calls if c.whole]

    def _content(self) -> Delta:
        delta = Delta(content=self.text[self._sent :])
        self._sent = len(self.text)
        return delta

    def _read_calls(self) -> Delta:
        """Read on from where the last delta stopped: each character is scanned once."""
        delta = Delta()
        while self._advance(delta):
            pass
        return delta

    def _advance(self, delta: Delta) -> bool:
        """One step of the calls' layout; False where the text read so far ends first."""
        fmt, text, at = self.fmt, self.text, self._at
        if self._expect in ("opening", "call_open", "separator", "close"):
            fixed = {
                "opening": fmt.opening,
                "call_open": fmt.call_open,
                "separator": fmt.separator,
                "close": self._close,
            }[self._expect]
            if not text.startswith(fixed, at):
                return False  # not yet there (the grammar allows nothing else)
            self._at += len(fixed)
            following = {"opening": "call_open", "call_open": "head", "close": "separator"}
            self._expect = following.get(self._expect, "call_open")
            return True
        if self._expect == "head":
            return self._read_head(delta)
        return self._read_arguments(delta)

    def _read_head(self, delta: Delta) -> bool:
        head = self._head.match(self.text, self._at)
        if head is None:
            return False
        self._start(head.group(1), delta)
        self._at, self._expect, self._scan = head.end(), "arguments", _ObjectScan(head.end())
        return True

    def _start(self, name: str, delta: Delta) -> None:
        call = ToolCall(len(self.calls), "call_" + secrets.token_hex(12), name)
        self.calls.append(call)
        delta.started.append(call)

    def _read_arguments(self, delta: Delta) -> bool:
        call, scan = self.calls[-1], self._scan
        end = scan.feed(self.text)
        fragment = self.text[self._at : end if end is not None else len(self.text)]
        if fragment:
            delta.arguments.append((call.index, fragment))
            call.arguments += fragment
            self._at += len(fragment)
        if end is None:
            return False
        call.whole, self._expect = True, "close"
        return True


class GemmaReader(CallReader):
    """Gemma's calls (`tools.gemma`): a call's name as soon as it is whole, its arguments
    as one JSON fragment once their object closes (Gemma's layout is no JSON to pass on
    piece by piece)."""

    _name = re.compile(r"([A-Za-z0-9_-]+)\{")

    def __init__(self, fmt: ToolFormat) -> None:
        super().__init__(fmt)
        self._close = fmt.call_close  # the arguments' closing brace is theirs

    def _read_head(self, delta: Delta) -> bool:
        head = self._name.match(self.text, self._at)
        if head is None:
            return False
        self._start(head.group(1), delta)
        self._at, self._expect = head.end() - 1, "arguments"
        return True

    def _read_arguments(self, delta: Delta) -> bool:
        text, at = self.text, self._at
        end = call_end(text, at)  # scanned again as it grows: arguments are short
        if end is None:
            return False
        call = self.calls[-1]
        value, _ = read_value(text[at:end])
        call.arguments, call.whole = json.dumps(value, ensure_ascii=False), True
        delta.arguments.append((call.index, call.arguments))
        self._at, self._expect = end, "close"
        return True


def call_reader(fmt: ToolFormat) -> CallReader:
    """A reader for ``fmt``'s calls."""
    return GemmaReader(fmt) if fmt.syntax == "gemma" else CallReader(fmt)


def read_whole(fmt: ToolFormat, text: str) -> list[ToolCall] | None:
    """A finished answer's whole calls, read at once; None where it answered in text."""
    reader = call_reader(fmt)
    reader.feed(text)
    reader.finish()
    return reader.whole_calls()


class _ObjectScan:
    """Finds where a JSON object ends, reading each character once across calls."""

    def __init__(self, start: int) -> None:
        self.pos, self.depth, self.in_string, self.escaped = start, 0, False, False

    def feed(self, text: str) -> int | None:
        """Just past the object's closing brace, once ``text`` has it; else None."""
        while self.pos < len(text):
            char = text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return self.pos
        return None
