"""A model's chat template, compiled at load and rendered within bounds.

Templates come with the model file, or with a request, so they are untrusted code: they
run in jinja's immutable sandbox, set up as transformers sets up its own (the same
filters, globals and `{% generation %}` tag), within bounds transformers does not have, so
that no template can hang its caller or take its memory: the sizes of the values it makes,
their total and its loop iterations, all counted (`template_bounds`). A template that does
not compile is a `ModelFileError` at load; one that fails on some messages (its own
``raise_exception`` and a bound included) is a `RequestError` for that call.
"""

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sized
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes, pass_context
from jinja2.compiler import CodeGenerator, Frame, operators
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ModelFileError, RequestError, SettingsError, shown
from . import template_bounds as bounds
from .template_bounds import MAX_ITERATIONS  # noqa: F401  (re-exported: the documented bound)

MAX_RANGE = 100_000  # one range(), as jinja's sandbox allows
MAX_EXPONENT = 1_000
_LOOP_FILTER = "spnl_counted_loop"  # wraps every for-loop's iterable (`_BoundedSandbox`)


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
        except (RecursionError, SyntaxError, MemoryError) as exc:  # nested past Python's limits
            raise ModelFileError(
                f"{where}: the chat template does not compile: {type(exc).__name__}: {exc}"
            ) from None

    def render(self, messages: list[dict[str, str]], **variables: Any) -> str:
        given = {"messages": messages, **variables}
        try:
            with bounds.rendering(given):
                return self.template.render(given)
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


# Requests' own templates (``chat_template`` on a chat), compiled once each: the most
# recently used are kept, so that a client sending the same one pays its compile once.
REQUEST_TEMPLATES_KEPT = 32
_request_templates: "OrderedDict[str, ChatTemplate]" = OrderedDict()
_request_templates_lock = threading.Lock()


def request_template(source: str) -> ChatTemplate:
    """A request's chat template compiled (kept among the last `REQUEST_TEMPLATES_KEPT`);
    one that does not compile is a `RequestError` naming the line."""
    if not isinstance(source, str):  # jinja would take any other object for a parsed one
        raise RequestError(f"chat_template={shown(source)}: expected a Jinja template's source")
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


class _BoundedCode(CodeGenerator):
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:  # noqa: N802 (jinja's)
        """``a ~ b``: through the environment's `joined`, which sizes it first."""
        self.write("environment.joined((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_Compare(self, node: nodes.Compare, frame: Frame) -> None:  # noqa: N802 (jinja's)
        """``a == b`` and the rest: each operand through the environment's `compared`,
        which counts what comparing it may read."""
        self.write("(environment.compared(")
        self.visit(node.expr, frame)
        self.write(")")
        for operand in node.ops:
            self.write(f" {operators[operand.op]} environment.compared(")
            self.visit(operand.expr, frame)
            self.write(")")
        self.write(")")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with `template_bounds` on everything that makes a value: operators,
    calls, filters, ``~``, printing, the output, and every loop."""

    code_generator_class = _BoundedCode
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if attr in _UNSIZED_METHODS and isinstance(obj, str | int | bytes):
            return False
        return super().is_safe_attribute(obj, attr, value)

    def _generate(self, source: nodes.Template, *args: Any, **kwargs: Any) -> str:
        for loop in source.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, _LOOP_FILTER, [], [], None, None)
            loop.iter.set_lineno(loop.lineno)
        return super()._generate(source, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        size = _binop_size(operator, left, right)
        if size is not None:
            bounds.check_size(size, f"a '{operator}' in the chat template")
        result = super().call_binop(context, operator, left, right)
        return bounds.made(result, f"a '{operator}' in the chat template")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        if isinstance(__obj, LoopContext):  # a recursive loop's next level
            args = (bounds.counted(args[0]), *args[1:])
        elif isinstance(__obj, Macro):  # each call one iteration: recursion doubles them
            bounds.count_one()
        else:
            args = _sized_call(__obj, args, kwargs)
        return bounds.made(
            super().call(__context, __obj, *args, **kwargs), "a call in the chat template"
        )

    @staticmethod
    def compared(value: Any) -> Any:
        if isinstance(value, str | list | tuple | dict | set | frozenset):
            bounds.charge(bounds.printed_size(value))
        return value

    @staticmethod
    def joined(values: tuple) -> str:
        bounds.check_size(sum(map(bounds.printed_size, values)), "a '~' in the chat template")
        return bounds.made("".join(map(str, values)), "a '~' in the chat template")


# Methods whose results no bound sizes (bytes, translations): no template needs them.
_UNSIZED_METHODS = frozenset({"encode", "translate", "maketrans", "to_bytes", "from_bytes"})
MAX_INT_BITS = 1 << 16  # an integer's, made by '*' or '**' (a product's work grows with it)


def _integers_too_large(operator: str, left: Any, right: Any) -> bool:
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (left, right)):
        return False
    if operator == "*":
        return left.bit_length() + right.bit_length() > MAX_INT_BITS
    return operator == "**" and left.bit_length() * max(right, 0) > MAX_INT_BITS


def _binop_size(operator: str, left: Any, right: Any) -> int | None:
    """The size of ``left operator right`` where its operands set it; None elsewhere."""
    if operator == "*":
        for sequence, times in ((left, right), (right, left)):
            if isinstance(sequence, str | list | tuple) and isinstance(times, int):
                return len(sequence) * times
    if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
        raise SecurityError(f"a '**' in the chat template has an exponent past {MAX_EXPONENT}")
    if _integers_too_large(operator, left, right):
        raise SecurityError(
            f"a '{operator}' in the chat template would make an integer past {MAX_INT_BITS:,} bits"
        )
    if operator == "%" and isinstance(left, str):
        return bounds.percent_size(left, right)
    if operator == "+" and isinstance(left, str | list | tuple) and isinstance(right, type(left)):
        return len(left) + len(right)
    return None


def _sized_call(function: Any, args: tuple, kwargs: dict) -> tuple:
    """Check the size of a string method's result where its arguments set it (widths, joins,
    replacements, formats); the arguments to call it with (a join's items as a list)."""
    method = getattr(function, "__wrapped__", function)  # the sandbox wraps str.format
    text = getattr(method, "__self__", None)
    if not isinstance(text, str):
        return args
    name, what = method.__name__, f"a '{method.__name__}' in the chat template"
    bounds.charge(len(text))  # what a scan of it costs (count, find, split, strip...)
    given = [*args, *kwargs.values()]
    if name in ("ljust", "rjust", "center", "zfill") and given and isinstance(given[0], int):
        bounds.check_size(max(len(text), given[0]), what)
    elif name == "expandtabs":
        tabsize = given[0] if given and isinstance(given[0], int) else 8
        bounds.check_size(len(text) + text.count("\t") * max(tabsize, 0), what)
    elif name == "replace" and len(given) >= 2 and all(isinstance(x, str) for x in given[:2]):
        count = given[2] if len(given) > 2 and isinstance(given[2], int) else -1
        bounds.check_size(bounds.replace_size(text, given[0], given[1], count), what)
    elif name == "join" and args:
        items = list(bounds.counted(args[0]))
        bounds.check_size(bounds.join_size(items, text), what)
        return (items, *args[1:])
    elif name == "format":
        bounds.check_size(bounds.format_size(text, args, kwargs), what)
    elif name == "format_map" and args:
        bounds.check_size(bounds.format_size(text, (), dict(args[0])), what)
    return args


def _bounded_filters(filters: dict[str, Callable]) -> dict[str, Callable]:
    """Every filter sized before it runs (by `_FILTER_SIZES`, else the text of its value:
    nearly all make their value a string first) and its result counted."""
    return {name: _bounded_filter(name, function) for name, function in filters.items()}


def _bounded_filter(name: str, function: Callable) -> Callable:
    passed = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0
    size_of = _FILTER_SIZES.get(name, lambda value, *_, **__: bounds.printed_size(value))
    what = f"the filter '{name}' in the chat template"

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if not bounds.rendering_now():
            # jinja folds a filter of constants while it compiles (its optimizer, and
            # every printed constant): refused there, so it runs within a rendering
            raise RuntimeError("a filter runs only while a template renders")
        own = list(args[passed:])
        if name == "join" and own and not isinstance(own[0], Sized):
            own[0] = list(bounds.counted(own[0]))  # sized, then joined
        bounds.check_size(size_of(*own, **kwargs), what)
        if name in _COMPARING_FILTERS and own and isinstance(own[0], Sized):
            rounds = max(len(own[0]), 1).bit_length()  # a sort's comparisons an item
            bounds.charge(bounds.printed_size(own[0]) * rounds)
        return bounds.made(function(*args[:passed], *own, **kwargs), what)

    return bounded


def _text(value: Any) -> int:
    return bounds.printed_size(value)


def _width(width: Any) -> int:
    return width if isinstance(width, int) else len(str(width))


def _indent_size(s: Any, width: Any = 4, *_: Any, **__: Any) -> int:
    lines = s.count("\n") + 1 if isinstance(s, str) else _text(s) + 1
    return _text(s) + _width(width) * lines


def _format_filter_size(value: Any, *args: Any, **kwargs: Any) -> int:
    if not isinstance(value, str):
        return _text(value)
    return bounds.percent_size(value, kwargs or args)


def _replace_filter_size(s: Any, old: Any, new: Any, count: Any = None, **_: Any) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return _text(s) + _text(new) * (_text(s) + 1)
    return bounds.replace_size(s, old, new, count if isinstance(count, int) else -1)


def _join_filter_size(value: Any, d: Any = "", attribute: Any = None) -> int:
    return bounds.join_size(value, str(d)) if isinstance(value, Sized) else 0


def _tojson_size(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> int:
    return bounds.json_size(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators)


def _items_and(value: Any, count: Any, *_: Any, **__: Any) -> int:
    """``batch`` and ``slice``: the value's items, and as many more lists as asked for."""
    return (len(value) if isinstance(value, Sized) else 0) + max(_width(count), 0)


def _sum_size(value: Any) -> int:
    """A sum of lists or strings copies its total once per item: sized as that work."""
    if not isinstance(value, list | tuple):
        return _text(value)
    total = sum(len(x) for x in value if isinstance(x, str | list | tuple))
    return total * (len(value) + 1) // 2 // bounds.MADE_PER_VALUE


MAX_WRAPPED = 1 << 16  # characters wordwrap takes: its work grows with their square


def _wordwrap_size(s: Any, width: Any = 79, b: Any = True, wrapstring: Any = None, *_: Any) -> int:
    if _text(s) > MAX_WRAPPED:
        raise SecurityError(
            f"wordwrap in the chat template takes at most {MAX_WRAPPED:,} characters"
        )
    return _text(s) * (1 + len(str(wrapstring or "\n")))


def _urlize_size(value: Any, *_: Any, target: Any = None, rel: Any = None, **__: Any) -> int:
    return _text(value) * (12 + len(str(target or "")) + len(str(rel or "")))


# What a filter's arguments say of its result's size, where its value's text does not.
_FILTER_SIZES: dict[str, Callable[..., int]] = {
    "tojson": _tojson_size,
    "center": lambda value, width=80, *_, **__: max(_text(value), _width(width)),
    "indent": _indent_size,
    "format": _format_filter_size,
    "replace": _replace_filter_size,
    "join": _join_filter_size,
    "batch": _items_and,
    "wordwrap": _wordwrap_size,
    "slice": _items_and,
    "sum": lambda value, *_, **__: _sum_size(value),
    "urlize": _urlize_size,
}


# The filters that compare their items with each other: each counts its value's text once
# a round of comparisons.
_COMPARING_FILTERS = frozenset({"sort", "unique", "min", "max", "dictsort", "groupby"})

# The tests that compare or scan their values: each counts the text it may read, as a
# comparison does (`_BoundedSandbox.compared`).
_READING_TESTS = (
    *("eq", "equalto", "==", "ne", "!=", "lt", "lessthan", "<", "le", "<="),
    *("gt", "greaterthan", ">", "ge", ">=", "in", "lower", "upper"),
)


def _counted_test(test: Callable) -> Callable:
    @functools.wraps(test)
    def counted(*args: Any) -> bool:
        for value in args:
            _BoundedSandbox.compared(value)
        return test(*args)

    return counted


@pass_context
def _counted_loop(context: Any, iterable: Any) -> Any:
    return bounds.counted(iterable)


def _bounded_range(*args: int) -> range:
    values = range(*args)
    if len(values) > MAX_RANGE:
        raise SecurityError(f"a range() of {len(values):,} values in the chat template")
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
        bounds.check_depth(value)  # a loop can wrap a value once more each time only here
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


MAX_TIME_FORMAT = 256  # characters of a strftime format (CPython grows its buffer 256-fold)


def _strftime_now(format: str) -> str:
    if not isinstance(format, str) or len(format) > MAX_TIME_FORMAT:
        raise SecurityError(f"strftime_now takes a format of at most {MAX_TIME_FORMAT} characters")
    return _now().strftime(format)


def _now() -> datetime:
    """The clock a template's ``strftime_now`` reads (one place, so a test can fix it)."""
    return datetime.now()


def _environment() -> ImmutableSandboxedEnvironment:
    environment = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_Generation, loopcontrols],
        finalize=_printed,
    )
    environment.concat = _output  # the output, and each macro's or block's
    environment.filters["tojson"] = _tojson
    del environment.filters["pprint"]  # a debugging aid, whose indentation has no bound
    environment.filters = _bounded_filters(environment.filters)
    environment.filters[_LOOP_FILTER] = _counted_loop
    for name in _READING_TESTS:
        environment.tests[name] = _counted_test(environment.tests[name])
    del environment.globals["lipsum"]  # paragraphs of filler, as many as asked
    environment.globals.update(
        range=_bounded_range,
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_Dict(),
        namespace=_Namespace,
    )
    return environment


def _printed(value: Any) -> Any:
    """A value printed by ``{{ }}``: its text sized before it is made."""
    size = bounds.printed_size(value)
    bounds.check_size(size, "a printed value in the chat template")
    bounds.charge(size)  # a block's or macro's buffer holds it before any join sizes it
    return value


def _output(chunks: Any) -> str:
    """The template's output (or a macro's, or a block's), refused once it passes the
    one-value bound."""
    cap, parts, size = bounds.current().value, [], 0
    for chunk in chunks:
        size += len(chunk)
        if size > cap:
            raise SecurityError(
                f"the chat template's output passed the {cap:,} characters this rendering may make"
            )
        parts.append(chunk)
    return bounds.made("".join(parts), "the chat template's output")


_ENVIRONMENT = _environment()
