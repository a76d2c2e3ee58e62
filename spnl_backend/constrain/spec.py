"""What a request asks its output to match, checked before it reaches the engine.

One of: any JSON object (OpenAI's ``{"type": "json_object"}``), a JSON schema, a regular
expression, a grammar (Lark, or GBNF as llama.cpp writes it) or a choice among fixed
strings. A `ConstraintSpec` holds it as llguidance's grammar text; compiling it against
the model's vocabulary is `grammar.GrammarCompiler`'s job.
"""

import contextlib
import json
import re
import threading
from dataclasses import dataclass

from ..errors import RequestError, shown
from ..plain import check_text, json_value, plain_str, read_once
from .gbnf import to_lark

# Beyond this a grammar's source is refused before anything parses it.
MAX_SOURCE_CHARS = 1_000_000
MAX_CHOICES = 1024
# GBNF from this length converts one at a time: the conversion is Python, holding the GIL,
# and eight 8,000-rule grammars converting at once kept a server's event loop from it.
LARGE_SOURCE_CHARS = 100_000
_LARGE_CONVERSIONS = threading.BoundedSemaphore(1)
KINDS = ("json_object", "json_schema", "regex", "grammar", "choice")


@dataclass(frozen=True)
class ConstraintSpec:
    """A checked constraint: its kind (one of `KINDS`) and llguidance's grammar text;
    ``kept_token_ids``: special tokens the grammar writes that the output's text keeps
    (where they are part of what is read back, as Gemma's call delimiters are)."""

    kind: str
    grammar: str
    kept_token_ids: tuple[int, ...] = ()


def constraint_spec(
    response_format: object = None,
    json_schema: object = None,
    regex: object = None,
    grammar: object = None,
    choice: object = None,
) -> ConstraintSpec | None:
    """The one constraint given, as a spec (None where none is); two or more, or one that
    is malformed, is a `RequestError` naming it."""
    given = {
        name: value
        for name, value in (
            ("response_format", response_format),
            ("json_schema", json_schema),
            ("regex", regex),
            ("grammar", grammar),
            ("choice", choice),
        )
        if value is not None
    }
    if len(given) > 1:
        raise RequestError(
            f"give at most one of response_format, json_schema, regex, grammar and choice, "
            f"not {' and '.join(given)}"
        )
    if not given:
        return None
    ((name, value),) = given.items()
    if name == "response_format":
        return _response_format(value)
    if name == "json_schema":
        return schema_spec(value, "json_schema")
    if name == "regex":
        return regex_spec(value)
    if name == "grammar":
        return grammar_spec(value)
    return choice_spec(value)


def _response_format(value: object) -> ConstraintSpec | None:
    """OpenAI's ``response_format``: ``{"type": "text" | "json_object" | "json_schema"}``,
    the last with ``"json_schema": {"schema": {...}, "name": ..., "strict": ...}``."""
    if not isinstance(value, dict):
        raise _bad("response_format", value, _FORMATS)
    kind = plain_str(dict.get(value, "type"))
    if kind in ("text", "json_object"):
        _only_keys(value, ("type",), "response_format")
        if kind == "text":
            return None
        return ConstraintSpec("json_object", _json_grammar('{"type": "object"}', "response_format"))
    if kind == "json_schema":
        _only_keys(value, ("type", "json_schema"), "response_format")
        inner = dict.get(value, "json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise _bad(
                "response_format['json_schema']",
                inner,
                "a dict with the schema under 'schema' (and optionally 'name', 'strict')",
            )
        _only_keys(inner, _SCHEMA_KEYS, "response_format['json_schema']")
        return schema_spec(dict.get(inner, "schema"), "response_format['json_schema']['schema']")
    raise _bad("response_format", value, _FORMATS)


# What a json_schema response format may say: its name (a label) and strict (the schema
# is always held to: strict or not, the output matches it). OpenAI's 'description' is
# shown to its model; this server has no place to show it, so it is refused, not dropped.
_SCHEMA_KEYS = ("schema", "name", "strict")


def _only_keys(value: dict, known: tuple[str, ...], name: str) -> None:
    unknown = [key for key in value if key not in known]
    if unknown:
        raise RequestError(
            f"{name}: {', '.join(map(shown, unknown))} not supported (it takes "
            f"{', '.join(map(repr, known))}; nothing is silently ignored)"
        )


_FORMATS = (
    "{'type': 'text'}, {'type': 'json_object'} or "
    "{'type': 'json_schema', 'json_schema': {'schema': {...}}}"
)


def schema_spec(schema: object, name: str) -> ConstraintSpec:
    """A JSON schema: a dict, True (any JSON value), or its JSON text."""
    text = plain_str(schema)
    if text is not None:
        _check_size(text, name)
        schema = json_value(text, name, parse_constant=_no_constant)
    if schema is True:
        schema = {}
    if schema is False:
        raise RequestError(f"{name}=False: a schema that no value matches")
    if not isinstance(schema, dict):
        raise _bad(name, schema, "a JSON schema: a dict, True, or its JSON text")
    try:  # once, to plain JSON text: what a dict subclass does is not read again
        text = json.dumps(schema, allow_nan=False, ensure_ascii=False)
    except Exception as exc:  # a cycle, NaN, a non-JSON value, nesting, a hostile dict
        raise RequestError(
            f"{name} cannot be written as JSON: {type(exc).__name__}: {exc}"
        ) from None
    _check_size(check_text(text, name), name)
    return ConstraintSpec("json_schema", _json_grammar(text, name))


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def regex_spec(pattern: object) -> ConstraintSpec:
    """A regular expression the whole output matches (Rust's regex syntax, anchored)."""
    text = plain_str(pattern)
    if not text:
        raise _bad("regex", pattern, "a non-empty regular expression string")
    _check_size(check_text(text, "regex"), "regex")
    return ConstraintSpec("regex", _regex_grammar(text, "regex"))


def grammar_spec(source: object) -> ConstraintSpec:
    """A grammar in Lark's syntax (llguidance's dialect), or GBNF (``root ::= ...``)."""
    text = plain_str(source)
    if not text or not text.strip():
        raise _bad("grammar", source, "a non-empty Lark or GBNF grammar string")
    _check_size(check_text(text, "grammar"), "grammar")
    try:
        with _LARGE_CONVERSIONS if len(text) >= LARGE_SOURCE_CHARS else contextlib.nullcontext():
            lark = to_lark(text)
    except RequestError:
        raise
    except BaseException as exc:  # the parser's own errors (nesting too deep), whatever their class
        if not library_failure(exc):
            raise
        raise RequestError(f"grammar: {exc}") from None
    return ConstraintSpec("grammar", lark)


def choice_spec(choices: object) -> ConstraintSpec:
    """One of a list of fixed strings, exactly."""
    items = [plain_str(item) for item in read_once(choices, list | tuple) or ()]
    if not items or len(items) > MAX_CHOICES or not all(items):
        raise _bad("choice", choices, f"a list of 1 to {MAX_CHOICES} non-empty strings")
    _check_size(check_text("".join(items), "choice"), "choice")  # type: ignore[arg-type]
    alternatives = "|".join(re.escape(item) for item in items)  # type: ignore[arg-type]
    return ConstraintSpec("choice", _regex_grammar(alternatives, "choice"))


# JSON is written compactly, as Python's json.dumps does (", " and ": "), with no other
# whitespace: a model free to add whitespace can add it until max_tokens runs out.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def library_failure(exc: BaseException) -> bool:
    """A failure of the grammar library's own making: an exception, or a panic of its
    Rust code, which pyo3 raises as a BaseException (so that `except Exception` misses
    it); not an interrupt or an exit."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


def check_stops(spec: ConstraintSpec | None, stop: tuple[str, ...], stop_token_ids) -> None:
    """A constrained output is not also cut by stop strings or stop tokens: a stop could
    end it inside the grammar, where the text does not match, and it would be reported as
    finished ("stop") all the same. The two together are a `RequestError`."""
    given = [name for name, value in (("stop", stop), ("stop_token_ids", stop_token_ids)) if value]
    if spec is None or not given:
        return
    raise RequestError(
        f"{' and '.join(given)} cannot be combined with a constrained output (here a "
        f"{KIND_NAMES[spec.kind]}): a stop could cut it where it does not match the grammar; "
        "end the output in the grammar itself (the model stops where the grammar ends)"
    )


KIND_NAMES = {
    "json_object": "JSON-object format",
    "json_schema": "JSON schema",
    "regex": "regex",
    "grammar": "grammar",
    "choice": "choice",
    "tools": "tool-call grammar",
}


def _json_grammar(schema: str, name: str) -> str:
    from llguidance import LLMatcher

    try:
        return LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_LAYOUT)
    except BaseException as exc:  # the library's limits, e.g. its JSON reader's nesting
        if not library_failure(exc):
            raise
        raise RequestError(f"{name}: the grammar engine cannot take it: {_limit(exc)}") from None


def _regex_grammar(pattern: str, name: str) -> str:
    from llguidance import LLMatcher

    try:
        return LLMatcher.grammar_from_regex(pattern)
    except BaseException as exc:
        if not library_failure(exc):
            raise
        raise RequestError(f"{name}: the grammar engine cannot take it: {_limit(exc)}") from None


def _limit(exc: BaseException) -> str:
    """The library's message, with the limit it means where that is known."""
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "recursion limit" in message:
        return f"{message} (it reads JSON nested at most 127 levels deep)"
    return message


def _check_size(text: str, name: str) -> None:
    if len(text) > MAX_SOURCE_CHARS:
        raise RequestError(
            f"{name} has {len(text):,} characters; at most {MAX_SOURCE_CHARS:,} are accepted"
        )


def _bad(name: str, value: object, expected: str) -> RequestError:
    return RequestError(f"{name}={shown(value)}: expected {expected}")
