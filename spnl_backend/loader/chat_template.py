"""A model's chat template, compiled at load and rendered within bounds.

Templates come with the model file, so they are untrusted code: they run in jinja's
immutable sandbox, set up as transformers sets up its own (the same filters, globals and
`{% generation %}` tag), with two bounds transformers does not have, so that no template
can hang its caller: at most `MAX_ITERATIONS` values from ``range()`` per rendering, and
no ``*`` or ``**`` whose result would be huge. A template that does not compile is a
`ModelFileError` at load; one that fails on some messages (its own ``raise_exception``
included) is a `RequestError` for that call.
"""

import contextvars
import json
import threading
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ModelFileError, RequestError, SettingsError

MAX_ITERATIONS = 1_000_000  # per rendering, over every range() it calls
MAX_RANGE = 100_000  # one range(), as jinja's sandbox allows
MAX_REPEATED = 1_000_000  # items or characters a `*` may produce
MAX_EXPONENT = 1_000

_left: contextvars.ContextVar[int] = contextvars.ContextVar("chat_template_iterations")


class ChatTemplate:
    """A compiled template; `render` gives the prompt text for a conversation."""

    def __init__(self, source: str, where: str) -> None:
        try:
            self.template = _ENVIRONMENT.from_string(source)
        except TemplateError as exc:
            line = getattr(exc, "lineno", None)
            at = f" (line {line})" if line else ""
            raise ModelFileError(
                f"{where}: the chat template does not compile{at}: {exc}"
            ) from None

    def render(self, messages: list[dict[str, str]], **variables: Any) -> str:
        token = _left.set(MAX_ITERATIONS)
        try:
            return self.template.render(messages=messages, **variables)
        except RequestError:
            raise
        except TemplateError as exc:
            if type(exc) is TemplateError:  # the template's own raise_exception()
                raise RequestError(
                    f"the model's chat template refuses these messages: {exc}"
                ) from None
            raise RequestError(
                f"the model's chat template failed on these messages: {exc}"
            ) from None
        except (RecursionError, MemoryError) as exc:
            raise RequestError(
                f"the model's chat template ran away: {type(exc).__name__}"
            ) from None
        except Exception as exc:  # whatever the template's expressions raise
            raise RequestError(
                f"the model's chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from None
        finally:
            _left.reset(token)


# Requests' own templates (``chat_template`` on a chat), compiled once each: the most
# recently used are kept, so that a client sending the same one pays its compile once.
REQUEST_TEMPLATES_KEPT = 32
_request_templates: "OrderedDict[str, ChatTemplate]" = OrderedDict()
_request_templates_lock = threading.Lock()


def request_template(source: str) -> ChatTemplate:
    """A request's chat template compiled (kept among the last `REQUEST_TEMPLATES_KEPT`);
    one that does not compile is a `RequestError` naming the line."""
    with _request_templates_lock:
        compiled = _request_templates.get(source)
        if compiled is not None:
            _request_templates.move_to_end(source)
            return compiled
    try:
        compiled = ChatTemplate(source, "chat_template")
    except ModelFileError as exc:
        raise RequestError(str(exc)) from None
    with _request_templates_lock:
        _request_templates[source] = compiled
        while len(_request_templates) > REQUEST_TEMPLATES_KEPT:
            _request_templates.popitem(last=False)
    return compiled


def user_chat_template(value: str | None) -> str | None:
    """The template a user chose instead of the model's (``MISTRALRS_CHAT_TEMPLATE``,
    ``serve --chat-template``): a file's contents, or the value itself where it is Jinja
    source; compiled now, so that a bad one fails before the model loads."""
    if value is None:
        return None
    where = "MISTRALRS_CHAT_TEMPLATE (--chat-template)"
    if "{{" in value or "{%" in value:
        source = value
    else:
        path = Path(value).expanduser()
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SettingsError(
                f"{where}={value!r}: neither Jinja source (no '{{{{' or '{{%') nor a readable "
                f"template file ({type(exc).__name__}: {exc})"
            ) from None
        where = f"{where} {path}"
    try:
        ChatTemplate(source, where)
    except ModelFileError as exc:
        raise SettingsError(str(exc)) from None
    return source


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*" and _repeats_too_much(left, right):
            raise SecurityError(f"a '*' in the chat template would repeat past {MAX_REPEATED:,}")
        if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"a '**' in the chat template has an exponent past {MAX_EXPONENT}")
        return super().call_binop(context, operator, left, right)


def _repeats_too_much(left: Any, right: Any) -> bool:
    for sequence, times in ((left, right), (right, left)):
        if isinstance(sequence, str | list | tuple) and isinstance(times, int):
            return len(sequence) * times > MAX_REPEATED
    return False


def _bounded_range(*args: int) -> range:
    values = range(*args)
    if len(values) > MAX_RANGE:
        raise SecurityError(f"a range() of {len(values):,} values in the chat template")
    left = _left.get(MAX_ITERATIONS) - len(values)
    if left < 0:
        raise RequestError(
            f"the model's chat template iterated over more than {MAX_ITERATIONS:,} values; "
            "refused rather than left to run"
        )
    _left.set(left)
    return values


class _Generation(Extension):
    """``{% generation %} ... {% endgeneration %}``: marks assistant text for training
    masks; rendering just keeps the text."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` without underscore attributes (no way to CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        for name in dict(*args, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *args, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute {name!r} in the chat template")


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)``, and nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _now() -> datetime:
    """The clock a template's ``strftime_now`` reads (one place, so a test can fix it)."""
    return datetime.now()


def _environment() -> ImmutableSandboxedEnvironment:
    environment = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals.update(
        range=_bounded_range,
        raise_exception=_raise_exception,
        strftime_now=lambda format: _now().strftime(format),
        dict=_Dict(),
        namespace=_Namespace,
    )
    return environment


_ENVIRONMENT = _environment()
