"""Plain values from what a caller passes: each read once and copied to a plain int, float
or str (so that a subclass cannot change its mind between a check and a use), or None
where it is not one; text checked to be encodable as UTF-8; and JSON text parsed with its
nesting bounded."""

import json
import math
import numbers
import operator
from types import UnionType
from typing import Any

from .errors import RequestError

# Arrays and objects within one another in any JSON a caller sends (a span query's 64
# groups take two levels each). Deeper would run Python's parser, or whatever reads the
# value after it (a chat template, a schema's translation), into its recursion limit.
MAX_JSON_DEPTH = 160


def read_once(value: object, kinds: type | UnionType) -> list[object] | None:
    """``value``'s items, read once, if it is one of ``kinds``; None where it is not, or
    where reading it raises (a list subclass with a hostile ``__iter__``)."""
    if not isinstance(value, kinds):
        return None
    try:
        return list(value)  # type: ignore[call-overload]
    except Exception:
        return None


def check_text(text: str, what: str) -> str:
    """``text`` if it can be encoded as UTF-8 (a lone surrogate cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"{what} is not valid Unicode text: {exc.reason} at character {exc.start} "
            f"({text[exc.start : exc.end]!r}); expected text that can be encoded as UTF-8"
        ) from None
    return text


def is_bool(value: object) -> bool:
    """A Python bool or numpy's (``numpy.bool_``; under numpy 2 its type is named
    ``numpy.bool``)."""
    kind = type(value)
    return isinstance(value, bool) or (
        kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")
    )


def plain_int(value: object) -> int | None:
    """``value`` as a plain int if it is an integer (numpy's too; not a bool), else None."""
    if is_bool(value):
        return None
    try:
        if isinstance(value, int):
            return int.__index__(value)  # the int itself, whatever a subclass overrides
        if isinstance(value, numbers.Integral):
            plain = operator.index(value)
            return int.__index__(plain) if isinstance(plain, int) else None
    except Exception:  # a hostile __index__
        return None
    return None


def plain_float(value: object) -> float | None:
    """``value`` as a plain finite float if it is a real number (not a bool), else None."""
    if is_bool(value):
        return None
    try:
        if isinstance(value, float):
            plain = float.__float__(value)  # the float itself, whatever a subclass overrides
        elif isinstance(value, int):
            plain = float(int.__index__(value))
        elif isinstance(value, numbers.Real):
            plain = float(value)
            plain = float.__float__(plain) if isinstance(plain, float) else math.nan
        else:
            return None
    except Exception:  # an int too large for a float, a hostile __float__
        return None
    return plain if math.isfinite(plain) else None


def plain_str(value: object) -> str | None:
    """``value`` as a plain str if it is a str (a subclass's own methods not called)."""
    return str.__str__(value) if isinstance(value, str) else None


def json_value(text: str, what: str, **loads: Any) -> Any:
    """``text`` parsed as JSON (``loads``: `json.loads`'s options), nested at most
    `MAX_JSON_DEPTH` deep; else a `RequestError` naming ``what``."""
    try:
        value = json.loads(text, **loads)
    except RecursionError:
        raise _too_deep(what) from None
    except ValueError as exc:  # not JSON; an integer past Python's digit limit
        reason = str(exc)[:200] or type(exc).__name__
        raise RequestError(f"{what} is not valid JSON: {reason}") from None
    if nests_deeper(value, MAX_JSON_DEPTH):
        raise _too_deep(_deep_part(value, what))
    return value


def _deep_part(value: object, what: str) -> str:
    """``what``, narrowed to the object's first member that nests too deep."""
    if isinstance(value, dict):
        for key, item in value.items():
            if nests_deeper(item, MAX_JSON_DEPTH - 1):
                return f"{what}'s {key!r}"
    return what


def nests_deeper(value: object, limit: int) -> bool:
    """Whether ``value`` holds lists and dicts more than ``limit`` deep: read a level at a
    time, each container once, with no recursion."""
    level = [value] if isinstance(value, dict | list) else []
    for _ in range(limit):
        if not level:
            return False
        level = [
            child
            for item in level
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, dict | list)
        ]
    return bool(level)


def _too_deep(what: str) -> RequestError:
    return RequestError(
        f"{what} nests JSON arrays and objects more than {MAX_JSON_DEPTH} deep; at most "
        f"{MAX_JSON_DEPTH} levels are read"
    )
