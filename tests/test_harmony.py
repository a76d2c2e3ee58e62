"""gpt-oss's chat template (`models.arch.harmony`), for files that carry none: for every
conversation, the same text as the template the gpt-oss checkpoints ship, rendered in
transformers' jinja2 environment; the same refusals.

``data/templates/openai-gpt-oss-120b.jinja`` is that template, unchanged: the
chat_template.jinja of the openai/gpt-oss-20b and -120b checkpoints (Apache-2.0), as
llama.cpp keeps it under models/templates. It is the test's reference only.
"""

import json
from pathlib import Path

import pytest
from jinja2.exceptions import TemplateError
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.models import WordLevel
from transformers.utils.chat_template_utils import _compile_jinja_template

from spnl_backend import RequestError
from spnl_backend.loader.chat_template import ChatTemplate
from spnl_backend.loader.tokenizer import Tokenizer, VocabTokenizer
from spnl_backend.models.arch import family
from spnl_backend.models.arch.harmony import HARMONY_CHAT_TEMPLATE
from spnl_backend.reasoning import detect_format

REFERENCE = (Path(__file__).parent / "data" / "templates" / "openai-gpt-oss-120b.jinja").read_text()
TODAY = {"strftime_now": lambda format: "2026-01-02"}  # the same date on both sides

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather at a place.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "A city and country."},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "days": {"type": "integer", "default": 1},
            },
            "required": ["location"],
        },
    },
}
# Every branch of the schema-to-TypeScript rendering, its quirks included.
KITCHEN_SINK = {
    "type": "function",
    "function": {
        "name": "everything",
        "description": "Takes one of each kind.",
        "parameters": {
            "type": "object",
            "properties": {
                "text": {"type": "string", "nullable": True},
                "ratio": {"type": "number", "default": 0.5},
                "flag": {"type": "boolean", "default": False, "description": "On or off."},
                "tags": {"type": "array", "items": {"type": "string"}, "nullable": True},
                "counts": {"type": "array", "items": {"type": "integer"}},
                "scores": {"type": "array", "items": {"type": "number"}},
                "bits": {"type": "array", "items": {"type": "boolean"}},
                "anything": {"type": "array"},
                "points": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"x": {"type": "number"}},
                        "required": ["x"],
                    },
                },
                "grid": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
                "blobs": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "payload": {"type": "string", "enum": ["a", "b", "c", "d", "e"]},
                        },
                    },
                },
                "either": {"type": ["string", "null"]},
                "single": {"type": ["integer"]},
                "choice": {
                    "oneOf": [
                        {"type": "string", "description": "a name"},
                        {"type": "integer", "default": 3},
                        {"type": "boolean"},
                    ],
                    "default": "x",
                },
                "shapes": {
                    "oneOf": [
                        {"type": "object", "properties": {"r": {"type": "number"}}},
                        {"type": "string"},
                    ]
                },
                "options": {"type": "object"},
                "nested": {
                    "type": "object",
                    "properties": {
                        "inner": {"type": "object", "properties": {"deep": {"type": "boolean"}}},
                        "label": {"type": "string", "enum": ["p", "q"]},
                    },
                    "required": ["label"],
                },
                "mystery": {"description": "No type at all."},
                "mode": {"type": "string", "enum": ["fast", "slow"]},
            },
            "required": ["text", "grid", "choice"],
        },
    },
}
NO_PARAMETERS = {
    "type": "function",
    "function": {"name": "now", "description": "The time.", "parameters": {"type": "object"}},
}
EMPTY_PROPERTIES = {
    "type": "function",
    "function": {
        "name": "ping",
        "description": "",
        "parameters": {"type": "object", "properties": {}},
    },
}


def _call(name, arguments, as_function=True):
    call = {"name": name, "arguments": arguments}
    return {"type": "function", "function": call} if as_function else call


CALLED = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "thinking": "I should look it up.",
        "tool_calls": [_call("get_weather", '{"location": "Paris, France"}')],
    },
    {"role": "tool", "content": '{"temperature": 21, "sky": "clear"}'},
]
ANSWERED = [
    *CALLED,
    {"role": "assistant", "content": "21 °C and clear."},
    {"role": "user", "content": "And in Köln, in fahrenheit?"},
]
CONVERSATIONS = {
    "user-only": ([{"role": "user", "content": "Hi"}], {}),
    "system-low": (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        {"reasoning_effort": "low"},
    ),
    "developer-high": (
        [
            {"role": "developer", "content": "Answer in French.\nAlways."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Bonjour", "thinking": "dropped: an earlier turn"},
            {"role": "user", "content": "How are you?"},
        ],
        {"reasoning_effort": "high"},
    ),
    "identity": (
        [{"role": "user", "content": "Who are you?"}],
        {"model_identity": "You are a tiny test model."},
    ),
    "empty-system": (
        [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}],
        {},
    ),
    "tools": (
        [{"role": "user", "content": "Weather in Paris?"}],
        {"tools": [WEATHER, NO_PARAMETERS, EMPTY_PROPERTIES]},
    ),
    "kitchen-sink-tool": (
        [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Go"}],
        {"tools": [KITCHEN_SINK], "reasoning_effort": "low"},
    ),
    "tool-call-pending": (CALLED, {"tools": [WEATHER]}),
    "tool-call-answered": (ANSWERED, {"tools": [WEATHER]}),
    "tool-call-content-as-reasoning": (
        [
            {"role": "user", "content": "Time?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [_call("now", {"zone": "UTC"}, as_function=False)],
            },
            {"role": "tool", "content": "12:00"},
        ],
        {"tools": [NO_PARAMETERS]},
    ),
    "tool-call-other-content-type": (
        [
            {"role": "user", "content": "Time?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "function": {
                            "name": "now",
                            "arguments": "{}",
                            "content_type": "<|constrain|>json",
                        }
                    },
                    _call("ignored", "{}"),  # one call per message: the first
                ],
            },
            {"role": "tool", "content": "12:00"},
            {"role": "tool", "content": "again"},
        ],
        {"tools": [NO_PARAMETERS]},
    ),
    "other-roles-dropped": (
        [
            {"role": "user", "content": "a"},
            {"role": "system", "content": "not first: not rendered"},
            {"role": "user", "content": "b"},
        ],
        {},
    ),
}


def _ours(messages, add_generation_prompt, variables):
    template = ChatTemplate(HARMONY_CHAT_TEMPLATE, "gpt-oss")
    return template.render(
        messages, add_generation_prompt=add_generation_prompt, **TODAY, **variables
    )


def _theirs(messages, add_generation_prompt, variables):
    """The shipped template in transformers' jinja2 environment (its sandbox, filters and
    globals), called directly so that the date can be fixed."""
    return _compile_jinja_template(REFERENCE).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **TODAY, **variables
    )


def test_it_is_the_familys_template_and_reads_as_harmony():
    """The family's template for files without one; the reasoning parser it implies is
    harmony's, as for the shipped one."""
    assert family("gpt_oss").chat_template == HARMONY_CHAT_TEMPLATE
    assert detect_format(HARMONY_CHAT_TEMPLATE) == detect_format(REFERENCE) == "harmony"


def test_the_tokenizer_passes_reasoning_effort_and_tools_to_it():
    """Through `Tokenizer.render_chat`, as a chat request renders (the date is today's on
    both sides)."""
    tokenizer = Tokenizer(VocabTokenizer(RustTokenizer(WordLevel({"x": 0})), {}, None), ())
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    expected = []
    for source in (HARMONY_CHAT_TEMPLATE, REFERENCE):
        tokenizer.hf.chat_template = source
        expected.append(
            tokenizer.render_chat(messages, True, [WEATHER], {"reasoning_effort": "high"})
        )
    assert expected[0] == expected[1]
    assert "\n\nReasoning: high\n\n" in expected[0]


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_renders_what_the_shipped_template_renders(name):
    messages, variables = CONVERSATIONS[name]
    expected = _theirs(messages, True, variables)
    assert _ours(messages, True, variables) == expected
    assert expected.endswith("<|start|>assistant")
    assert "Current date: 2026-01-02" in expected


@pytest.mark.parametrize("name", ["developer-high", "tool-call-answered"])
def test_a_training_example_ends_with_the_reasoning_and_return(name):
    """Without a generation prompt the last assistant turn keeps its thinking and ends
    with <|return|>."""
    messages, variables = CONVERSATIONS[name]
    last = {"role": "assistant", "content": "Fin.", "thinking": "Done thinking."}
    conversation = [*messages, last]
    expected = _theirs(conversation, False, variables)
    assert expected.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Done thinking.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Fin.<|return|>"
    )
    assert _ours(conversation, False, variables) == expected


def test_the_kitchen_sinks_typescript_is_rendered_in_full():
    """The reference's own text for the schema branches, so a change on both sides (the
    test data replaced) still shows here."""
    text = _ours(*CONVERSATIONS["kitchen-sink-tool"][:1], True, {"tools": [KITCHEN_SINK]})
    for line in (
        "text: string | null,\n",
        "ratio?: number, // default: 0.5,\n",
        "// On or off.\nflag?: boolean, // default: false,\n",
        "tags?: string[] | null,\n",
        "counts?: number[],\n",
        "anything?: any[],\n",
        "grid: string[][],\n",
        "blobs?: any[],\n",
        "either?: string | null,\n",
        "single?: integer,\n",
        'mode?: "fast" | "slow",\n',
        "options?: object,\n",
        "points?: {\nx: \n                number}[],\n",
        "shapes?: {\nr?: \n                number} | \nstring,\n",
        "nested?: {\ninner?: \n                {\ndeep?: \n                boolean}, label: \n"
        '                "p" | "q"},\n',
        "// No type at all.\nmystery?: any,\n",
        "choice: string// a name | \nnumber                    // default: 3 | \nboolean"
        "// default: x,\n",
    ):
        assert line in text


def test_reasoning_effort_is_the_system_messages():
    for effort in ("low", "medium", "high"):
        text = _ours([{"role": "user", "content": "Hi"}], True, {"reasoning_effort": effort})
        assert f"\n\nReasoning: {effort}\n\n# Valid channels" in text
    assert "Reasoning: medium\n" in _ours([{"role": "user", "content": "Hi"}], True, {})


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (
            [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<|channel|>final<|message|>Hello"},
            ],
            "content holds channel tags",
        ),
        (
            [
                {"role": "user", "content": "Hi"},
                {
                    "role": "assistant",
                    "content": "ok",
                    "thinking": "<|channel|>analysis<|message|>",
                },
            ],
            "thinking holds channel tags",
        ),
        (
            [
                {"role": "user", "content": "Time?"},
                {
                    "role": "assistant",
                    "content": "a",
                    "thinking": "b",
                    "tool_calls": [_call("now", "{}")],
                },
            ],
            "not both",
        ),
        (
            [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "orphan"}],
            "needs an assistant tool call",
        ),
    ],
    ids=["channel-in-content", "channel-in-thinking", "content-and-thinking", "orphan-tool"],
)
def test_refuses_what_the_shipped_template_refuses(messages, message):
    with pytest.raises(TemplateError):
        _theirs(messages, True, {})
    with pytest.raises(RequestError, match=message):
        _ours(messages, True, {})


def test_built_in_tools_are_refused_not_described():
    with pytest.raises(RequestError, match="builtin_tools"):
        _ours([{"role": "user", "content": "Hi"}], True, {"builtin_tools": ["browser"]})


def test_tool_results_are_json_strings():
    """A tool's result is quoted as a JSON string (the shipped template's tojson)."""
    text = _ours(CALLED, True, {"tools": [WEATHER]})
    result = json.dumps('{"temperature": 21, "sky": "clear"}')
    assert (
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        f"{result}<|end|>"
    ) in text
