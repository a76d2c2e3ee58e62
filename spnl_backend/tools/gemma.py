"""Gemma's call syntax (FunctionGemma): its grammar from each tool's schema, and its values
read back as JSON.

A call is ``<start_function_call>call:NAME{key:value,...}<end_function_call>``: keys are
bare, a string is written between two ``<escape>`` delimiters with nothing escaped inside,
numbers, booleans and null as JSON writes them, objects ``{key:value,...}`` and arrays
``[value,...]``. No JSON sub-grammar fits that, so the schema is translated here, keyword
by keyword; a keyword the translation does not hold the output to is refused (a call
that did not validate would be worse than a 400).
"""

import json
import re
from typing import Any

from ..errors import RequestError
from .formats import GEMMA_CALL, GEMMA_END, GEMMA_ESCAPE, ToolFormat
from .spec import Tool, ToolRequest

# Keywords that say nothing about which values are valid.
_ANNOTATIONS = {"description", "title", "default", "examples", "$comment", "$schema"}
_NUMBER_WORDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
_HELD = {
    "type", "enum", "const", "anyOf", "properties", "required", "additionalProperties",
    "items", "minItems", "maxItems", "minLength", "maxLength", *_NUMBER_WORDS,
}  # fmt: skip
_KEY = re.compile(r"[A-Za-z0-9_.-]+")  # a key Gemma's layout can write bare and read back
_NUMBER_LAYOUT = {"whitespace_flexible": False}
MAX_DEPTH = 64  # schema levels translated (each a rule; Python's recursion is the bound)


def gemma_grammar(fmt: ToolFormat, request: ToolRequest) -> str:
    """The output's grammar (llguidance's Lark dialect): a text answer under ``auto``, or
    the calls, each naming a callable tool with arguments its schema allows."""
    rules = _Rules(dict(fmt.kept))
    tools = request.callable()
    names = " | ".join(rules.add(_call(rules, tool)) for tool in tools)
    more = "+" if request.parallel else ""
    call = f'{rules.piece(GEMMA_CALL)} "call:" ({names}) {rules.piece(GEMMA_END)}'
    head = ["start: TEXT | calls" if request.choice == "auto" else "start: calls"]
    head.append(f"calls: ({call}){more}")
    if request.choice == "auto":  # a text answer never opens as a call does
        head.append("TEXT: /(?s:.+)/ & ~/(?s:[ \\t\\r\\n]*<start_function_call>.*)/")
    return "%llguidance {}\n" + "\n".join(head + rules.lines) + "\n"


def _call(rules: "_Rules", tool: Tool) -> str:
    schema = json.loads(tool.parameters)
    try:
        return f"{json.dumps(tool.name)} {rules.value(schema, 'parameters')}"
    except _UnheldError as exc:
        raise RequestError(
            f"tool {tool.name!r}: {exc} is not held by Gemma's call syntax here; its schemas "
            f"may use {', '.join(sorted(_HELD))} (and annotations such as description)"
        ) from None


class _UnheldError(Exception):
    """A schema part the grammar cannot hold the output to (its text says where)."""


class _Rules:
    """The grammar's rules as they are made, one per schema part."""

    def __init__(self, special: dict[str, int]) -> None:
        self.special = special
        self.lines: list[str] = []

    def add(self, body: str) -> str:
        return self.line(f"g{len(self.lines)}", body)

    def piece(self, text: str) -> str:
        """A fixed text: its special token where it is one, else the text."""
        token = self.special.get(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    def value(self, schema: object, where: str) -> str:
        if where.count(".") + where.count("[") > MAX_DEPTH:
            raise _UnheldError(f"{where}: nesting deeper than {MAX_DEPTH} levels")
        if schema is True or schema == {}:
            raise _UnheldError(f"{where}: a schema that allows any value")
        if not isinstance(schema, dict):
            raise _UnheldError(f"{where}: {json.dumps(schema)[:40]}")
        unheld = set(schema) - _HELD - _ANNOTATIONS
        if unheld:
            raise _UnheldError(f"{where}: the keyword {sorted(unheld)[0]!r}")
        if "const" in schema:
            return self.literal(schema["const"])
        if "enum" in schema:
            return "(" + " | ".join(self.literal(v) for v in schema["enum"]) + ")"
        if "anyOf" in schema:
            options = schema["anyOf"]
            rest = {k: v for k, v in schema.items() if k != "anyOf"}
            parts = [
                self.value({**rest, **option}, f"{where}.anyOf[{i}]")
                for i, option in enumerate(options)
            ]
            return self.add(" | ".join(parts))
        kinds = schema.get("type")
        if isinstance(kinds, list):
            parts = [self.value({**schema, "type": k}, where) for k in kinds]
            return self.add(" | ".join(parts))
        return self.add(self._typed(schema, kinds, where))

    def _typed(self, schema: dict[str, Any], kind: object, where: str) -> str:
        if kind == "string":
            return self._string(schema)
        if kind in ("integer", "number"):
            bounds = {k: schema[k] for k in _NUMBER_WORDS if k in schema}
            number = {"type": kind, **bounds, "x-guidance": _NUMBER_LAYOUT}
            return f"%json {json.dumps(number)}"  # bare numbers are written as JSON's
        if kind == "boolean":
            return '"true" | "false"'
        if kind == "null":
            return '"null"'
        if kind == "object":
            return self._object(schema, where)
        if kind == "array":
            return self._array(schema, where)
        raise _UnheldError(f"{where}: type {json.dumps(kind)}")

    def _string(self, schema: dict[str, Any]) -> str:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        count = f"{{{low},{'' if high is None else high}}}"
        escape = self.piece(GEMMA_ESCAPE)
        if GEMMA_ESCAPE in self.special:  # a token the text cannot hold: the string ends there
            if high == 0:
                return f"{escape} {escape}"
            text = self.line(f"S{len(self.lines)}", f"/(?s:.{{{max(low, 1)},{high or ''}}})/")
            return f"{escape} {text}{'?' if low == 0 else ''} {escape}"
        # Written as text: the string ends at the first delimiter (lazily, so that the
        # lexer need not take back the delimiter's first characters).
        return f"{escape} " + self.line(f"g{len(self.lines)}[stop={escape}]", f"/(?s:.{count})/")

    def line(self, head: str, body: str) -> str:
        self.lines.append(f"{head}: {body}")
        return head.split("[")[0]

    def _object(self, schema: dict[str, Any], where: str) -> str:
        if schema.get("additionalProperties", False) not in (False, True):
            raise _UnheldError(f"{where}: additionalProperties as a schema")
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        if not isinstance(properties, dict) or not required <= set(properties):
            raise _UnheldError(f"{where}: required names a property it does not define")
        fields = []
        for key, sub in properties.items():
            if not _KEY.fullmatch(key):
                raise _UnheldError(f"{where}: the property name {key!r}")
            fields.append((f'"{key}:" {self.value(sub, f"{where}.{key}")}', key in required))
        return f'"{{" {self._fields(fields)} "}}"'

    def _fields(self, fields: list[tuple[str, bool]]) -> str:
        """Fields in order, each required one present, joined by commas. Built from the
        last: for each field, a rule for the rest after a field came before (a comma
        first) and one for the rest where none did; a rest that may be empty is a
        ``(name, True)``, one that can only be empty a ``(None, True)``."""
        after: tuple[str | None, bool] = (None, True)  # a field came before
        first: tuple[str | None, bool] = (None, True)  # none did
        for text, needed in reversed(fields):
            after, first = (
                self._rest(f'"," {text} {_ref(after)}', needed, after),
                self._rest(f"{text} {_ref(after)}", needed, first),
            )
        return _ref(first)

    def _rest(self, present: str, needed: bool, skipped: tuple[str | None, bool]):
        options = [present.strip()]
        if not needed and skipped[0] is not None:
            options.append(skipped[0])
        return self.add(" | ".join(options)), not needed and skipped[1]

    def _array(self, schema: dict[str, Any], where: str) -> str:
        item = self.value(schema.get("items", True), f"{where}.items")
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if high == 0:
            return '"[" "]"'
        more = f'("," {item}){{{max(low - 1, 0)},{"" if high is None else high - 1}}}'
        listed = f"{item} {more}"
        return f'"[" {listed if low else f"({listed})?"} "]"'

    def literal(self, value: object) -> str:
        if isinstance(value, str):
            if GEMMA_ESCAPE in value:
                raise _UnheldError(f"the value {value!r}")
            inner = f" {json.dumps(value)} " if value else " "
            return f"{self.piece(GEMMA_ESCAPE)}{inner}{self.piece(GEMMA_ESCAPE)}"
        if isinstance(value, bool) or value is None or isinstance(value, int | float):
            return json.dumps(json.dumps(value))
        raise _UnheldError(f"the value {json.dumps(value)[:40]}")


def _ref(rest: tuple[str | None, bool]) -> str:
    name, nullable = rest
    return "" if name is None else name + ("?" if nullable else "")


def read_value(text: str, at: int = 0) -> tuple[Any, int]:
    """The value written at ``text[at:]`` in Gemma's layout, and where it ends (a
    `ValueError` where it is not whole)."""
    if text.startswith(GEMMA_ESCAPE, at):
        end = text.find(GEMMA_ESCAPE, at + len(GEMMA_ESCAPE))
        if end < 0:
            raise ValueError("an unclosed string")
        return text[at + len(GEMMA_ESCAPE) : end], end + len(GEMMA_ESCAPE)
    if text.startswith("{", at):
        found: dict[str, Any] = {}
        at += 1
        while not text.startswith("}", at):
            if found:
                at = _expect(text, ",", at)
            colon = text.find(":", at)
            if colon < 0:
                raise ValueError("an unclosed object")
            found[text[at:colon]], at = read_value(text, colon + 1)
        return found, at + 1
    if text.startswith("[", at):
        items: list[Any] = []
        at += 1
        while not text.startswith("]", at):
            if items:
                at = _expect(text, ",", at)
            item, at = read_value(text, at)
            items.append(item)
        return items, at + 1
    bare = re.compile(r"[-+0-9.eE]+|true|false|null").match(text, at)
    if bare is None:
        raise ValueError(f"no value at {text[at : at + 20]!r}")
    return json.loads(bare.group()), bare.end()


def _expect(text: str, fixed: str, at: int) -> int:
    if not text.startswith(fixed, at):
        raise ValueError(f"expected {fixed!r} at {text[at : at + 20]!r}")
    return at + len(fixed)


def call_end(text: str, at: int) -> int | None:
    """Just past the arguments object that opens at ``text[at]`` once ``text`` has it
    whole, else None (braces inside strings do not count)."""
    depth = 0
    while at < len(text):
        if text.startswith(GEMMA_ESCAPE, at):
            end = text.find(GEMMA_ESCAPE, at + len(GEMMA_ESCAPE))
            if end < 0:
                return None
            at = end + len(GEMMA_ESCAPE)
            continue
        char = text[at]
        at += 1
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return at
    return None
