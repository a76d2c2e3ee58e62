"""Chat templates come with model files: they render as transformers renders them, and no
template can hang or crash its caller (it fails the call with the library's error)."""

import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from spnl_backend import ModelFileError, RequestError
from spnl_backend.loader.chat_template import ChatTemplate
from spnl_backend.models.arch.gemma3 import GEMMA_CHAT_TEMPLATE

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] | trim + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
STRICT_ALTERNATION = (
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}{{ message['content'] }}{% endfor %}"
)
FEATURES = (
    "{% set ns = namespace(count=0) %}{% for m in messages %}{% set ns.count = ns.count + 1 %}"
    "{% generation %}{{ m | tojson }}{% endgeneration %}{% if loop.index == 2 %}{% break %}"
    "{% endif %}{% endfor %}{{ ns.count }} {{ dict(a=1) | tojson }} {{ range(3) | list }}"
)


@pytest.mark.parametrize(
    "source", [GEMMA_CHAT_TEMPLATE, CHATML, FEATURES], ids=["gemma", "chatml", "features"]
)
def test_renders_as_transformers_does(source):
    ours = ChatTemplate(source, "test").render(MESSAGES, add_generation_prompt=True, **SPECIALS)
    (theirs,), _ = render_jinja_template(
        conversations=[MESSAGES], chat_template=source, add_generation_prompt=True, **SPECIALS
    )
    assert ours == theirs


def test_a_template_that_does_not_compile_fails_the_load():
    with pytest.raises(ModelFileError, match=r"model\.gguf: the chat template does not compile"):
        ChatTemplate("{% for %}", "model.gguf")


def test_the_templates_own_refusal_is_a_request_error():
    template = ChatTemplate(STRICT_ALTERNATION, "test")
    with pytest.raises(RequestError, match="refuses these messages: Conversation roles must"):
        template.render([MESSAGES[1], MESSAGES[1]])


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ foo.bar.baz }}", "failed on these messages: 'foo' is undefined"),
        ("{{ messages[0].__class__.__mro__ }}", "attribute '__class__' of 'dict' object is unsafe"),
        ("{% set ns = namespace(_x=1) %}", "namespace attribute '_x'"),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "iterated over more than 1,000,000 values",
        ),
        ("{{ range(10**9) }}", r"a range\(\) of 1,000,000,000 values"),
        ("{{ 'x' * 10**9 }}", "a '\\*' .* would make 1,000,000,000 characters"),
        ("{{ [1] * 10**9 }}", "a '\\*' .* would make 1,000,000,000 characters"),
        ("{% set big = 10**9 %}{{ 7 ** big }}", "exponent past"),  # jinja's ** groups left
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "ran away: RecursionError"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ],
)
def test_no_template_hangs_or_escapes(source, message):
    """Each limit is counted (iterations, sizes), not timed: it holds on any machine."""
    template = ChatTemplate(source, "test")
    with pytest.raises(RequestError, match=message):
        template.render(MESSAGES)


def test_the_iteration_budget_is_per_rendering():
    template = ChatTemplate("{% for i in range(100000) %}{% endfor %}ok", "test")
    for _ in range(20):  # 2,000,000 values in all, never more than 100,000 in one rendering
        assert template.render(MESSAGES) == "ok"


DOUBLED = (
    "{% set ns = namespace(v=START) %}{% for i in range(40) %}{% set ns.v = STEP %}{% endfor %}"
)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ '%200000000s' % 'a' }}", "a '%' .* would make 200,000,0"),
        ("{{ '%.*f' % (10**9, 1.0) }}", "a '%' .* would make"),
        ("{{ '%200000000s' | format('a') }}", "the filter 'format' .* would make"),
        ("{{ 'a'.ljust(200000000) }}", "a 'ljust' .* would make 200,000,000"),
        ("{{ 'a'.zfill(200000000) }}", "a 'zfill' .* would make"),
        ("{{ '\t'.expandtabs(200000000) }}", "a 'expandtabs' .* would make"),
        ("{{ ('ab' * 1000).replace('', 'x' * 1000) }}", "a 'replace' .* would make"),
        ("{{ ('x' * 100000).join(['a'] * 100) }}", "a 'join' .* would make"),
        ("{{ '{:>200000000}'.format('a') }}", "a 'format' .* would make"),
        ("{{ '{}'.format_map({'a': 1}) }}", "Key|KeyError|IndexError|failed"),
        ("{{ 'a' | center(200000000) }}", "the filter 'center' .* would make"),
        ("{{ 'a\nb' | indent(200000000) }}", "the filter 'indent' .* would make"),
        ("{{ ('a ' * 1000) | wordwrap(1, wrapstring='x' * 5000) }}", "the filter 'wordwrap'"),
        ("{{ ('a' * 500000) | wordwrap(1) | length }}", "wordwrap .* takes at most 65,536"),
        ("{{ [1] | batch(10**9, 0) | list }}", "the filter 'batch' .* would make"),
        ("{{ messages | tojson(indent=1000000000) }}", "the filter 'tojson' .* would make"),
        ("{{ ('ab' * 1000) | replace('', 'y' * 1000) }}", "the filter 'replace' .* would make"),
        # values that double at each step: refused at the step that passes the bound
        (DOUBLED.replace("START", "'x'").replace("STEP", "ns.v ~ ns.v"), "a '~' .* would make"),
        (DOUBLED.replace("START", "'x'").replace("STEP", "ns.v + ns.v"), "a '\\+' .* would make"),
        (DOUBLED.replace("START", "[1]").replace("STEP", "ns.v + ns.v"), "a '\\+' .* would make"),
        # a list holding the one before twice: 40 levels print 2**40 ones
        (
            DOUBLED.replace("START", "[1]").replace("STEP", "[ns.v, ns.v]") + "{{ ns.v }}",
            "a printed value",
        ),
        (
            DOUBLED.replace("START", "[1]").replace("STEP", "[ns.v, ns.v]") + "{{ ns.v ~ '' }}",
            "a '~'",
        ),
        (
            DOUBLED.replace("START", "[1]").replace("STEP", "[ns.v, ns.v]") + "{{ ns.v | string }}",
            "the filter 'string'",
        ),
        (
            DOUBLED.replace("START", "[1]").replace("STEP", "[ns.v, ns.v]") + "{{ ns.v | tojson }}",
            "the filter 'tojson'",
        ),
        (
            DOUBLED.replace("START", "[1]").replace("STEP", "[ns.v, ns.v]") + "{{ ns.v | join }}",
            "the filter 'join'",
        ),
        (
            DOUBLED.replace("START", "[1]").replace("STEP", "[ns.v, ns.v]")
            + "{{ '%s' % (ns.v,) }}",
            "a '%'",
        ),
        (
            DOUBLED.replace("START", "[1]").replace("STEP", "[ns.v, ns.v]") + "{{ ns }}",
            "a printed value",
        ),
        # loops over anything, not only range(), count
        (
            "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
            "iterated over more than 1,000,000 values",
        ),
        (
            "{% for x in [1] recursive %}{{ loop(range(100000)) }}{% endfor %}",
            "iterated over more than 1,000,000|ran away",
        ),
        # the output, and all that is made
        ("{% for i in range(100000) %}{{ 'x' * 20 }}{% endfor %}", "output passed the"),
        (
            "{% set big = 'x' * 1000000 %}{% for i in range(1000) %}{% set y = big ~ i %}"
            "{% endfor %}",
            "made more than",
        ),
        ("{{ lipsum(10**6) }}", "'lipsum' is undefined"),
        # a review's attacks: bytes, slices, repeated fields, views, buffers, big integers
        (
            "{{ ('a'.encode() * 3000000000) is none }}",
            "attribute 'encode' of 'str' object is unsafe",
        ),
        ("{{ (0).to_bytes(3000000000, 'big') is none }}", "'to_bytes' of 'int' object is unsafe"),
        ("{{ ('a' * 2000).translate({97: 'b'}) }}", "'translate' of 'str' object is unsafe"),
        ("{{ ([] | slice(100000000) | list) is none }}", "the filter 'slice' .* would make"),
        (
            "{% set big = 'b' * 1000000 %}{{ ('{0}' * 2000).format(big) is none }}",
            "a 'format' .* would make",
        ),
        ("{% set big = 'b' * 1000000 %}{{ ('%(a)s' * 2000) % {'a': big} }}", "a '%' .* would make"),
        ("{{ '%(a(b)x)1500000000s' % {'a(b)x': 1} }}", "a '%' .* would make"),
        (
            "{% set big = 'b' * 1000000 %}"
            "{% set ns = namespace(x=0) %}{{ ns }}{% set ns.x = big %}"
            "{{ (([ns] * 2000) | string) is none }}",
            "the filter 'string' .* would make",
        ),
        (
            "{% set big = 'b' * 1000000 %}"
            "{% set d = dict.fromkeys(range(100000), big) %}{{ d.values() }}",
            "a printed value",
        ),
        (
            "{% set L = [1] * 330000 %}{% set out %}{% for i in range(2000) %}{{ L }}"
            "{% endfor %}{% endset %}",
            "made more than",
        ),
        ("{{ strftime_now('%99999Y' * 140000) | length }}", "strftime_now takes a format"),
        ("{{ (3 ** 1000 ** 1000 ** 1000) is number }}", "an integer past 65,536 bits"),
        (
            "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
            "{% endfor %}",
            "an integer past",
        ),
        (
            "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
            "{{ f(22) }}",
            "iterated over more than 1,000,000 values",
        ),
        ("{{ ([[0]] * 140000) | sum(start=[]) | length }}", "the filter 'sum' .* would make"),
        # comparisons of large values, or a scan of a large string, on each iteration
        (
            "{% set a = ['b' * 1000000] * 1000 %}{% set b = ['b' * 1000000] * 1000 %}"
            "{% for i in range(1000) %}{% for j in range(1000) %}{% if a == b %}{% endif %}"
            "{% endfor %}{% endfor %}",
            "made more than",
        ),
        (
            "{% set s = 'b' * 1000000 %}{% for i in range(100000) %}{% if 'c' in s %}{% endif %}"
            "{% endfor %}",
            "made more than",
        ),
        (
            "{% set m = ['b' * 10000] * 50 %}{% for i in range(100000) %}"
            "{% set n = m | sort | length %}{% endfor %}",
            "made more than",
        ),
        (
            "{% set x = 'b' * 10000 %}{% set m = [{'c': x}] * 50 %}{% for i in range(100000) %}"
            "{% set n = m | selectattr('c', 'equalto', x) | list %}{% endfor %}",
            "made more than",
        ),
        (
            "{% set s = 'b' * 1000000 %}{% for i in range(100000) %}{% set n = s.count('c') %}"
            "{% endfor %}",
            "made more than",
        ),
        # a tuple 300,000 deep crashed the interpreter when hashed
        (
            "{% set ns = namespace(t=()) %}{% for i in range(1000) %}{% for j in range(300) %}"
            "{% set ns.t = (ns.t,) %}{% endfor %}{% endfor %}{{ ns.t in {} }}",
            "nested more than 100 deep",
        ),
    ],
)
def test_no_template_takes_the_memory(source, message):
    """What a template makes is sized before it is made wherever its arguments say the
    size: none of these allocates past a few times the bound (before, a per-request
    template of this kind took a server's memory until the system killed it)."""
    template = ChatTemplate(source, "test")
    with pytest.raises(RequestError, match=message):
        template.render(MESSAGES)


def test_the_filter_without_a_bound_is_not_there():
    """``pprint`` (a debugging aid) indents nested values without a bound: a template that
    uses it does not compile."""
    with pytest.raises(ModelFileError, match="No filter named 'pprint'"):
        ChatTemplate("{{ [1] | pprint }}", "test")


def test_the_bounds_grow_with_the_conversation():
    """A conversation of 3 MB renders whole, as transformers renders it: the one-value
    bound is a million characters and four times the input's text."""
    long = [
        {"role": "user", "content": "word " * 600_000},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again " * 1000},
    ]
    for source in (GEMMA_CHAT_TEMPLATE, CHATML, FEATURES):
        ours = ChatTemplate(source, "test").render(long, add_generation_prompt=True, **SPECIALS)
        (theirs,), _ = render_jinja_template(
            conversations=[long], chat_template=source, add_generation_prompt=True, **SPECIALS
        )
        assert ours == theirs
    tojson = ChatTemplate("{{ messages | tojson(indent=2) }}", "test").render(long)
    assert tojson == json.dumps(long, indent=2, ensure_ascii=False)


def test_nothing_runs_while_a_template_compiles():
    """jinja folds a filter of constants while it compiles, outside any rendering's bounds
    (2,000 centred constants took 7.6 GB to compile): a filter now refuses to run there."""
    source = "{% if false %}" + "{{ 'a' | center(1000000) }}" * 2000 + "{% endif %}ok"
    assert ChatTemplate(source, "test").render(MESSAGES) == "ok"


@pytest.mark.parametrize(
    "source",
    ["{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "{% for a in b %}" * 25 + "{% endfor %}" * 25],
)
def test_a_template_nested_past_pythons_limits_does_not_compile(source):
    with pytest.raises(ModelFileError, match=r"does not compile: (RecursionError|SyntaxError)"):
        ChatTemplate(source, "test")


def test_a_deeply_nested_tool_schema_is_given_whole():
    """What a template is given is sized by a loop, not recursion: a schema 150 levels deep
    (transformers renders it) was a RecursionError before the template ran."""
    schema: dict = {}
    for _ in range(150):
        schema = {"type": "object", "properties": {"x": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    assert ChatTemplate(CHATML, "test").render(MESSAGES, tools=[tool]).startswith("<|im_start|>")


@pytest.mark.parametrize("source", [None, 5, ["{{ 1 }}"]])
def test_a_request_template_that_is_not_source_is_refused(source):
    """jinja takes any object that is not a string for a parsed template (an
    AttributeError deep inside it): refused by name first."""
    from spnl_backend.loader.chat_template import request_template

    with pytest.raises(RequestError, match=r"chat_template=.*expected a Jinja template's source"):
        request_template(source)
