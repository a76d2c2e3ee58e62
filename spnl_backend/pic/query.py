"""spnl's span queries, as its ``spnl/`` provider posts them to ``/v1/query/execute``: the
JSON read into a tree, checked strictly (an unknown key, a wrong type or an empty
``cross`` is a `RequestError` naming where in the query it is).

A query is a ``repeat`` (``n`` completions of one generate), a bare generate ``g`` (one
completion) or a ``map`` (one completion per input string). A generate's input is a
tree of messages (``{"system": s}``, ``{"user": s}``, ``{"assistant": s}``) under
``seq``/``par`` (in order), ``plus`` (commuting elements) and ``cross`` (its last child
sees everything before it). Metadata follows spnl's defaults: ``max_tokens`` absent is 0
(until EOS or the end of the context), ``temperature`` absent is 0.6 and null is 0.
"""

import json
import math
from dataclasses import dataclass
from typing import Literal

from ..errors import RequestError, shown
from ..plain import check_text, json_value

Role = Literal["system", "user", "assistant"]
GroupKind = Literal["seq", "par", "plus", "cross"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant")
GROUPS: tuple[GroupKind, ...] = ("seq", "par", "plus", "cross")
MAX_DEPTH = 64  # nesting of groups in one query
MAX_NODES = 65_536  # messages and groups in one query
MAX_N = 255  # spnl's repeat count is a byte
SPNL_TEMPERATURE = 0.6  # spnl's default where a query names none
METADATA_KEYS = {"model", "max_tokens", "temperature"}


@dataclass(frozen=True)
class Message:
    role: Role
    content: str


@dataclass(frozen=True)
class Group:
    kind: GroupKind
    children: tuple["Node", ...]


Node = Message | Group


@dataclass(frozen=True)
class Metadata:
    model: str
    max_tokens: int | None  # None: until EOS or the end of the context
    temperature: float


@dataclass(frozen=True)
class Repeat:
    """``n`` completions of one input."""

    n: int
    metadata: Metadata
    input: Node


@dataclass(frozen=True)
class MapQuery:
    """One completion of each input, each a plus element of its own."""

    metadata: Metadata
    inputs: tuple[str, ...]


SpanQuery = Repeat | MapQuery


def parse_query(text: str) -> SpanQuery:
    """A query from its JSON text."""
    value = json_value(text, "the query")
    kind, body = _one_key(value, ("repeat", "g", "map"), "query")
    if kind == "map":
        return _map(body)
    if kind == "g":
        return Repeat(1, *_generate(body, "query.g"))
    fields = _fields(body, {"n", "g"}, {"n", "g"}, "query.repeat")
    n = fields["n"]
    if not (_whole(n) and 0 <= n <= MAX_N):
        raise RequestError(
            f"query.repeat.n = {shown(n)}: expected a whole number from 0 to {MAX_N} (0 is 1)"
        )
    return Repeat(max(n, 1), *_generate(fields["g"], "query.repeat.g"))


def query_text(query: dict) -> str:
    """A query given as a dict, as the JSON text `parse_query` reads."""
    try:
        return json.dumps(query, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise RequestError(f"the query cannot be written as JSON: {exc}") from None


def message_chars(node: Node) -> int:
    """The characters of every message under ``node`` (read with a stack of its own)."""
    chars, stack = 0, [node]
    while stack:
        item = stack.pop()
        if isinstance(item, Message):
            chars += len(item.content)
        else:
            stack.extend(item.children)
    return chars


def _map(body: object) -> MapQuery:
    fields = _fields(body, {"metadata", "inputs"}, {"metadata", "inputs"}, "query.map")
    inputs = fields["inputs"]
    if not isinstance(inputs, list) or not inputs:
        raise RequestError(
            f"query.map.inputs = {shown(inputs)}: expected a non-empty list of strings"
        )
    for index, item in enumerate(inputs):
        if not isinstance(item, str):
            raise RequestError(f"query.map.inputs[{index}] = {shown(item)}: expected a string")
        check_text(item, f"query.map.inputs[{index}]")
    where = "query.map.metadata"
    metadata = _metadata(_fields(fields["metadata"], {"model"}, METADATA_KEYS, where), where)
    return MapQuery(metadata, tuple(inputs))


def _generate(body: object, where: str) -> tuple[Metadata, Node]:
    fields = _fields(body, {"model", "input"}, {*METADATA_KEYS, "input"}, where)
    return _metadata(fields, where), _node(fields["input"], f"{where}.input", 0, [0])


def _metadata(fields: dict[str, object], where: str) -> Metadata:
    model = fields["model"]
    if not isinstance(model, str) or not model:
        raise RequestError(f"{where}.model = {shown(model)}: expected the model's name")
    max_tokens = fields.get("max_tokens")
    if max_tokens is not None and not (_whole(max_tokens) and 0 <= max_tokens < 2**31):
        raise RequestError(
            f"{where}.max_tokens = {shown(max_tokens)}: expected a whole number >= 0 (0: until "
            "EOS or the end of the context)"
        )
    temperature = fields.get("temperature", SPNL_TEMPERATURE)
    temperature = 0.0 if temperature is None else temperature
    if (
        not isinstance(temperature, int | float)
        or isinstance(temperature, bool)
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise RequestError(
            f"{where}.temperature = {shown(temperature)}: expected a finite number >= 0 "
            "(0 is greedy)"
        )
    return Metadata(model, max_tokens or None, float(temperature))


def _node(value: object, where: str, depth: int, counter: list[int]) -> Node:
    counter[0] += 1
    if counter[0] > MAX_NODES:
        raise RequestError(f"the query has more than {MAX_NODES:,} messages and groups")
    if depth > MAX_DEPTH:
        raise RequestError(f"{where}: groups nested more than {MAX_DEPTH} deep")
    kind, body = _one_key(value, (*ROLES, *GROUPS), where)
    if kind in ROLES:
        if not isinstance(body, str):
            raise RequestError(f"{where}.{kind} = {shown(body)}: expected the message's text")
        return Message(kind, check_text(body, f"{where}.{kind}"))  # type: ignore[arg-type]
    if not isinstance(body, list):
        raise RequestError(f"{where}.{kind} = {shown(body)}: expected a list of inputs")
    if kind == "cross" and not body:
        raise RequestError(f"{where}.cross is empty: a cross needs at least one input")
    children = tuple(
        _node(child, f"{where}.{kind}[{index}]", depth + 1, counter)
        for index, child in enumerate(body)
    )
    return Group(kind, children)  # type: ignore[arg-type]


def _one_key(value: object, accepted: tuple[str, ...], where: str) -> tuple[str, object]:
    if not isinstance(value, dict) or len(value) != 1:
        raise RequestError(
            f"{where} = {shown(value)}: expected an object with one key, one of "
            f"{', '.join(accepted)}"
        )
    ((key, body),) = value.items()
    if key not in accepted:
        hint = " (a nested generate runs in spnl's client, not here)" if key == "g" else ""
        raise RequestError(
            f"{where}: unknown key {key!r}{hint}; expected one of {', '.join(accepted)}"
        )
    return key, body


def _fields(body: object, required: set[str], allowed: set[str], where: str) -> dict[str, object]:
    """``body``'s keys, checked: an object with the ``required`` keys and no other key
    outside ``allowed``."""
    if not isinstance(body, dict):
        raise RequestError(f"{where} = {shown(body)}: expected an object")
    missing = sorted(required - body.keys())
    if missing:
        raise RequestError(f"{where}: missing {', '.join(missing)}")
    unknown = sorted(body.keys() - allowed)
    if unknown:
        raise RequestError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; accepted: "
            f"{', '.join(sorted(allowed))}"
        )
    return body


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
