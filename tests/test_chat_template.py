"""Chat templates come with model files: they render as transformers renders them, and no
template can hang or crash its caller (it fails the call with the library's error)."""

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
        ("{{ 'x' * 10**9 }}", "would repeat past"),
        ("{{ [1] * 10**9 }}", "would repeat past"),
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
