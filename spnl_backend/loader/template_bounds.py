"""What a chat template may make while it renders: counted, never timed, so that a
template's verdict is the same on any machine and under any load.

- **One value** (a string, a list, a dict, the text of a printed value, the output) holds
  at most `Bounds.value` characters or items: a million, and four times the text of what
  the template is given (the conversation, its tools, the variables). Where an operation's
  arguments say how large its result will be (a width, a repeat, a join, a format, the
  text of nested containers, which a list holding itself twice over doubles at each
  level), the size is checked before anything is made; else the result is checked as soon
  as it is made, and no operation can make more than a few times a value that passed.
- **All values made** over a rendering add up to at most `MADE_PER_VALUE` times that: the
  work is bounded with the memory.
- **Loop iterations and macro calls**: at most `MAX_ITERATIONS` per rendering, over
  every ``for``.
- **Nesting**: a namespace holds no value nested more than `MAX_NESTING` deep (a loop
  carries values from one iteration to the next only through namespaces).

Each refusal is a jinja `SecurityError` (the caller makes it a `RequestError`), except the
two totals, which are `RequestError`s of their own.
"""

import contextvars
import json
import re
from collections.abc import Iterable, Iterator, KeysView, Sized, ValuesView
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from jinja2.exceptions import SecurityError
from jinja2.utils import Namespace

from ..errors import RequestError

MAX_ITERATIONS = 1_000_000  # per rendering, over every loop
MIN_VALUE = 1 << 20  # characters or items a value may hold, whatever the input
INPUT_TIMES = 4  # and this many times the input's own text
MADE_PER_VALUE = 64  # all values made in a rendering, in units of the one-value bound
MAX_NESTING = 100  # levels of containers in a value a namespace holds


@dataclass
class Bounds:
    value: int
    made_left: int
    iterations_left: int = MAX_ITERATIONS
    # text sizes found, by id (each with its object, so that the id stays its own)
    sizes: dict[Any, tuple[object, int]] = field(default_factory=dict)


_current: contextvars.ContextVar[Bounds | None] = contextvars.ContextVar(
    "chat_template_bounds", default=None
)


def current() -> Bounds:
    """This rendering's bounds; outside one (a constant folded while the template
    compiles: its values come from the template's source), fresh ones of the least size."""
    bounds = _current.get()
    return bounds if bounds is not None else Bounds(MIN_VALUE, MADE_PER_VALUE * MIN_VALUE)


def rendering_now() -> bool:
    """Whether a rendering is under way (else a template is compiling)."""
    return _current.get() is not None


@contextmanager
def rendering(given: dict[str, Any]) -> Iterator[Bounds]:
    """The bounds of one rendering of a template given ``given``."""
    value = MIN_VALUE + INPUT_TIMES * _input_size(given)
    bounds = Bounds(value, MADE_PER_VALUE * value)
    token = _current.set(bounds)
    try:
        yield bounds
    finally:
        _current.reset(token)


def _input_size(given: Any) -> int:
    """About the text of what a template is given: its strings and two characters an item,
    each container once (a loop, not recursion: a tool's schema may nest deep)."""
    size, stack, seen = 0, [given], set()
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            size += len(value) + 2
        elif isinstance(value, list | tuple | dict) and id(value) not in seen:
            seen.add(id(value))
            if isinstance(value, dict):  # keys and values, not item pairs: a pair is
                stack.extend(value.keys())  # freed at once, and its id given to the next
                stack.extend(value.values())
            else:
                stack.extend(value)
            size += 2 * len(value) + 2
        else:
            size += 8
    return size


# ---- sizes ------------------------------------------------------------------------------


class _TooLargeError(Exception):
    pass


def check_size(size: int, what: str) -> None:
    """Refuse, before it is made, a value of ``size`` characters or items."""
    cap = current().value
    if size > cap:
        raise SecurityError(
            f"{what} would make {size:,} characters or items, past the {cap:,} a value of "
            "this rendering may hold"
        )


def charge(size: int) -> None:
    """Count ``size`` characters or items made against the rendering's total."""
    bounds = current()
    bounds.made_left -= size + 1
    if bounds.made_left < 0:
        raise RequestError(
            f"the model's chat template made more than {MADE_PER_VALUE * bounds.value:,} "
            "characters or items in all; refused rather than left to run"
        )


def check_depth(value: Any) -> None:
    """Refuse a value nested more than `MAX_NESTING` containers deep (hashing or comparing
    one nested far deeper crashes the interpreter)."""
    bounds = current()
    if _depth(value, bounds.sizes) > MAX_NESTING:
        raise SecurityError(f"a value nested more than {MAX_NESTING} deep in the chat template")


def _depth(value: Any, memo: dict) -> int:
    if not isinstance(value, list | tuple | dict):
        return 0
    key = ("depth", id(value))
    known = memo.get(key)
    if known is not None:
        return known[1]
    items = value.values() if isinstance(value, dict) else value
    depth = 1 + max((_depth(x, memo) for x in items), default=0)
    if depth > MAX_NESTING:
        return depth  # not kept: the value is refused
    memo[key] = (value, depth)
    return depth


def made(value: Any, what: str) -> Any:
    """``value`` as made by ``what``: checked against the one-value bound, and counted."""
    bounds = current()
    size = len(value) if isinstance(value, str | list | tuple | dict | set | frozenset) else 0
    if size > bounds.value:
        raise SecurityError(
            f"{what} made {size:,} characters or items, past the {bounds.value:,} a value of "
            "this rendering may hold"
        )
    charge(size)
    return value


def printed_size(value: Any) -> int:
    """The characters of ``str(value)`` (past the bound: the bound plus one), found
    without making it: containers summed item by item (a shared item once, from the
    rendering's sizes), strings inside them quoted."""
    bounds = current()
    try:
        return _text_size(value, bounds.value, bounds.sizes, top=True)
    except _TooLargeError:
        return bounds.value + 1


def _text_size(value: Any, cap: int, memo: dict, top: bool) -> int:
    if isinstance(value, str):
        if top:
            return len(value)
        return _memo(value, memo, ("repr", id(value)), lambda: len(repr(value)), cap)
    if isinstance(value, Namespace):  # its attributes change: sized anew each time
        attrs = object.__getattribute__(value, "_Namespace__attrs")
        return len("<Namespace >") + _container(attrs, cap, memo)
    if isinstance(value, list | tuple | set | frozenset | dict | KeysView | ValuesView):
        return _memo(value, memo, ("str", id(value)), lambda: _container(value, cap, memo), cap)
    try:
        return len(str(value) if top else repr(value))
    except ValueError:  # an int past Python's digit limit: its conversion fails anyway
        return 0


def _memo(value: Any, memo: dict, key: Any, size_of: Any, cap: int) -> int:
    known = memo.get(key)
    if known is not None:
        return known[1]
    size = size_of()
    if size > cap:
        raise _TooLargeError
    memo[key] = (value, size)
    return size


def _container(value: Any, cap: int, memo: dict) -> int:
    items: Iterable[Any] = (
        (x for pair in value.items() for x in pair) if isinstance(value, dict) else value
    )
    size = 2 + (isinstance(value, tuple) and len(value) == 1) + 14  # a view's "dict_keys()"
    for item in items:
        size += _text_size(item, cap, memo, top=False) + 2
        if size > cap:
            raise _TooLargeError
    return size


def json_size(value: Any, *, ensure_ascii: bool, indent: Any, separators: Any) -> int:
    """At least the length of ``json.dumps(value, ...)`` (past the bound: the bound plus
    one), found without making it."""
    bounds = current()
    if isinstance(indent, int):
        step = max(indent, 0)
    else:
        step = len(indent) if isinstance(indent, str) else 0
    item_sep, key_sep = (", " if indent is None else ",", ": ")
    if separators is not None:
        item_sep, key_sep = (str(s) for s in separators)
    shape = (ensure_ascii, step if indent is not None else None, len(item_sep), len(key_sep))
    try:
        return _json(value, 0, shape, bounds.value, bounds.sizes)
    except _TooLargeError:
        return bounds.value + 1


def _json(value: Any, depth: int, shape: tuple, cap: int, memo: dict) -> int:
    ensure_ascii, step, item_sep, key_sep = shape
    if isinstance(value, str):
        return _memo(
            value,
            memo,
            ("json", ensure_ascii, id(value)),
            lambda: len(json.dumps(value, ensure_ascii=ensure_ascii)),
            cap,
        )
    if not isinstance(value, list | tuple | dict):
        try:
            return len(json.dumps(value))
        except (TypeError, ValueError):  # not JSON: the dump fails anyway
            return 0

    def size() -> int:
        line = 0 if step is None else 1 + step * (depth + 1)
        total = 2 + (0 if step is None else 1 + step * depth)
        pairs = value.items() if isinstance(value, dict) else ((None, x) for x in value)
        for key, item in pairs:
            if key is not None:
                key_size = _json(key if isinstance(key, str) else str(key), 0, shape, cap, memo)
                total += key_size + key_sep
            total += line + item_sep + _json(item, depth + 1, shape, cap, memo)
            if total > cap:
                raise _TooLargeError
        return total

    return _memo(value, memo, ("json", shape, depth, id(value)), size, cap)


# Every run of digits (ASCII: a width or precision is only that), each counted whole.
_DIGIT_RUNS = re.compile(r"[0-9]+")


def percent_size(template: str, values: Any) -> int:
    """At least the length of ``template % values``: the template, every number written
    in it (each width or precision among them), each conversion the largest value's text
    (a mapping's key may be named many times), and every integer value ('*' widths)."""
    fields = template.count("%")
    if isinstance(values, dict):
        arguments = list(values.values())
    else:
        arguments = list(values) if isinstance(values, tuple) else [values]
    largest = max(map(printed_size, arguments), default=0)
    numbers = sum(abs(x) for x in arguments if isinstance(x, int) and not isinstance(x, bool))
    return len(template) + _numbers_in(template) + fields * largest + numbers * (fields > 0)


def _numbers_in(text: str) -> int:
    return sum(int(run) for run in _DIGIT_RUNS.findall(text))


def format_size(template: str, args: tuple, kwargs: dict) -> int:
    """At least the length of ``template.format(*args, **kwargs)``: the template, every
    number in its fields' specs, the arguments' text (a nested field is refused)."""
    fields = re.findall(r"\{[^{}]*\}", template)
    largest = max(map(printed_size, [*args, *kwargs.values()]), default=0)
    size = len(template) + len(fields) * largest
    for spec in fields:
        size += _numbers_in(spec.partition(":")[2])
    if re.search(r"\{[^{}]*\{", template.replace("{{", "").replace("}}", "")):
        raise SecurityError("a format field nested in another in the chat template")
    return size


def join_size(items: Sized, separator: str) -> int:
    return printed_size(list(items)) + len(separator) * max(len(items) - 1, 0)


def replace_size(text: str, old: str, new: str, count: int = -1) -> int:
    found = len(text) + 1 if old == "" else text.count(old)
    if count >= 0:
        found = min(found, count)
    return len(text) + found * max(len(new) - len(old), 0)


# ---- loops ------------------------------------------------------------------------------


def counted(iterable: Iterable[Any]) -> Iterator[Any]:
    """``iterable``'s items, each one of this rendering's `MAX_ITERATIONS`."""
    for item in iterable:
        count_one()
        yield item


def count_one() -> None:
    """One more iteration (a loop's item, a macro's call) of the rendering's budget."""
    bounds = current()
    bounds.iterations_left -= 1
    if bounds.iterations_left < 0:
        raise RequestError(
            f"the model's chat template iterated over more than {MAX_ITERATIONS:,} values "
            "(loop items and macro calls); refused rather than left to run"
        )
