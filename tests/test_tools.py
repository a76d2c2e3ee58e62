"""Tool calling: the request's tools checked, the call syntax known from the template, the
output held to the calls' grammar, calls read as they stream; through the official
``openai`` client (streamed and not, one call and several, a call and its result turn) and
the Python API."""

import json

import jsonschema
import pytest
from live_server import MODEL, served_backend
from llguidance import LLMatcher, LLTokenizer
from tiny_models import EOS, build_tokenizer

from spnl_backend.errors import RequestError
from spnl_backend.tools.calls import CallReader
from spnl_backend.tools.formats import HERMES, LLAMA3, MISTRAL, template_format
from spnl_backend.tools.grammar import tool_grammar
from spnl_backend.tools.spec import tool_request

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "sum", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
# Hermes-style, as Qwen's template writes tools, calls and their results.
TOOL_TEMPLATE = (
    "<bos>{% if tools %}system: tools {% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] %}assistant: "
    "{% for c in m['tool_calls'] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "\n</tool_call>{% endfor %}\n"
    "{% elif m['role'] == 'tool' %}tool: <tool_response>{{ m['content'] }}</tool_response>\n"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]


def _tokenizer():
    hf = build_tokenizer()
    return hf, LLTokenizer(hf.backend_tokenizer.to_str(), n_vocab=len(hf), eos_token=[EOS])


def _accepts(grammar: str, text: str) -> bool:
    hf, tokenizer = _tokenizer()
    assert not LLMatcher.validate_grammar(grammar, tokenizer)
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    return all(matcher.consume_token(t) for t in hf(text, add_special_tokens=False)["input_ids"])


def _hermes(*calls: tuple[str, dict]) -> str:
    blocks = [
        "<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>"
        for n, a in calls
    ]
    return "\n".join(blocks)


# ---- the request's tools ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "message"),
    [
        ("f", None, None, "expected a list of function tools"),
        ([{"type": "retrieval"}], None, None, "tools[0]"),
        ([{"type": "function", "function": {"name": "a b"}}], None, None, "letters, digits"),
        (TOOLS + TOOLS[:1], None, None, "more than once"),
        (TOOLS, "sometimes", None, "tool_choice='sometimes'"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "not among"),
        (TOOLS, None, "yes", "parallel_tool_calls"),
        ([], "required", None, "needs tools"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            None,
            None,
            "arguments are an object",
        ),
    ],
)
def test_bad_tools_are_refused_naming_what_is_wrong(tools, choice, parallel, message):
    with pytest.raises(RequestError, match=message.replace("[", r"\[").replace("(", r"\(")):
        tool_request(tools, choice, parallel)


def test_no_tools_is_no_tool_request_and_a_named_choice_narrows_the_callable():
    assert tool_request(None) is None
    assert tool_request([], "none") is None
    named = tool_request(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert [t.name for t in named.callable()] == ["add"]
    assert named.parallel
    assert tool_request(TOOLS, "none").constrained is False


def test_the_call_syntax_comes_from_the_template():
    no_special = lambda text: None  # noqa: E731
    assert template_format("{{ tools }}<tool_call>", no_special) == HERMES
    assert template_format("{{ tools }}<|start_header_id|>", no_special) == LLAMA3
    assert template_format("{{ tools }}[TOOL_CALLS]", lambda t: 7).marker_id == 7
    assert template_format("{{ tools }}[TOOL_CALLS]", no_special).opening == "[TOOL_CALLS]["
    assert template_format("{{ tools }}[TOOL_CALLS]", no_special).family == MISTRAL.family
    with pytest.raises(RequestError, match="does not render tools"):
        template_format("{{ messages }}", no_special)
    with pytest.raises(RequestError, match="has none"):
        template_format(None, no_special)
    with pytest.raises(RequestError, match="call syntax this server does not parse"):
        template_format("{{ tools }}<|im_start|>", no_special)


# ---- the grammar ------------------------------------------------------------------------


def test_auto_takes_a_text_answer_or_calls_that_validate():
    grammar = tool_grammar(HERMES, tool_request(TOOLS))
    assert _accepts(grammar, "It is sunny in Paris.")
    assert _accepts(grammar, _hermes(("get_weather", {"city": "Paris", "days": 2})))
    two = _hermes(("get_weather", {"city": "Oslo", "days": 1}), ("add", {"a": 3, "b": True}))
    assert _accepts(grammar, two)
    assert not _accepts(grammar, _hermes(("get_weather", {"city": "Lima", "days": 2})))
    assert not _accepts(grammar, _hermes(("get_weather", {"days": 2, "city": "Paris"})))
    assert not _accepts(grammar, _hermes(("nope", {})))
    assert not _accepts(grammar, "\n" + _hermes(("add", {"a": 1, "b": False})))


def test_required_named_and_single_calls_narrow_the_grammar():
    single = tool_grammar(HERMES, tool_request(TOOLS, "required", False))
    one = _hermes(("add", {"a": 1, "b": False}))
    assert _accepts(single, one)
    assert not _accepts(single, "text")
    assert not _accepts(single, one + "\n" + one)
    named = tool_grammar(HERMES, tool_request(TOOLS, {"function": {"name": "get_weather"}}))
    assert not _accepts(named, one)


def test_mistral_and_llama_layouts():
    call = {"name": "add", "arguments": {"a": 1, "b": True}}
    text_mistral = template_format("{{ tools }}[TOOL_CALLS]", lambda t: None)
    grammar = tool_grammar(text_mistral, tool_request(TOOLS))
    assert _accepts(grammar, "[TOOL_CALLS][" + json.dumps(call) + ", " + json.dumps(call) + "]")
    llama = tool_grammar(LLAMA3, tool_request(TOOLS))
    parameters = {"name": "add", "parameters": {"a": 1, "b": True}}
    assert _accepts(llama, json.dumps(parameters) + "; " + json.dumps(parameters))
    assert _accepts(llama, "Sure: 4")
    assert not _accepts(llama, '{"answer": 4}')


# ---- reading the calls ------------------------------------------------------------------


def _read_in_pieces(fmt, text: str, size: int):
    reader, started, arguments, content = CallReader(fmt), [], {}, ""
    for at in range(0, len(text), size):
        delta = reader.feed(text[at : at + size])
        started += [(c.index, c.name) for c in delta.started]
        for index, fragment in delta.arguments:
            arguments[index] = arguments.get(index, "") + fragment
        content += delta.content
    content += reader.finish().content
    return reader, started, arguments, content


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_calls_read_in_any_pieces_equal_the_whole(size):
    two = _hermes(("get_weather", {"city": "Oslo", "days": 1}), ("add", {"a": 3, "b": True}))
    reader, started, arguments, content = _read_in_pieces(HERMES, two, size)
    assert content == ""
    assert reader.content is None
    assert started == [(0, "get_weather"), (1, "add")]
    assert [json.loads(arguments[i]) for i in (0, 1)] == [
        {"city": "Oslo", "days": 1},
        {"a": 3, "b": True},
    ]
    assert all(c.whole for c in reader.calls)
    assert len({c.id for c in reader.calls}) == 2


@pytest.mark.parametrize("text", ["Plain text {with braces}", "<tool", "<tool_ca]ll>", ""])
def test_a_text_answer_is_passed_on_whole(text):
    reader, started, _arguments, content = _read_in_pieces(HERMES, text, 2)
    assert content == text
    assert reader.content == text
    assert not started


def test_a_call_cut_short_is_not_whole():
    reader = CallReader(HERMES)
    reader.feed('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert [c.whole for c in reader.calls] == [False]
    assert reader.calls[0].arguments == '{"a": 1'


# ---- end to end -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(tiny):
    backend = served_backend(tiny, TOOL_TEMPLATE)
    yield backend
    backend.close()


def _valid(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_required_call_through_the_openai_client_streamed_and_not(live, backend):
    client = live.client()
    asked = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0)
    whole = client.chat.completions.create(**asked, max_tokens=120, parallel_tool_calls=False)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    _valid(call)
    assert call.id.startswith("call_")
    assert call.type == "function"
    chunks = list(
        client.chat.completions.create(
            **asked, max_tokens=120, parallel_tool_calls=False, stream=True
        )
    )
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for entry in chunk.choices[0].delta.tool_calls or []:
            into = calls.setdefault(entry.index, {"name": None, "arguments": "", "id": None})
            into["id"] = entry.id or into["id"]
            into["name"] = entry.function.name or into["name"]
            into["arguments"] += entry.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert calls == {
        0: {"name": call.function.name, "arguments": call.function.arguments, "id": calls[0]["id"]}
    }
    python = backend.chat(ASK, max_tokens=120, temperature=0, tools=TOOLS, tool_choice="required")
    assert python.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in python.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_parallel_calls_each_validate(live, backend):
    # EOS forbidden: the grammar then allows only a next call after each one.
    reply = live.client().chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=150,
        logit_bias={str(EOS): -100},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert len(choice.message.tool_calls) >= 2
    for call in choice.message.tool_calls:
        _valid(call)
    assert choice.message.content is None  # cut short: no call markup as content


def test_a_named_tool_and_auto(live, backend):
    client = live.client()
    named = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=0,
        max_tokens=120,
    )
    assert [c.function.name for c in named.choices[0].message.tool_calls][:1] == ["add"]
    for seed in range(4):
        auto = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, seed=seed, max_tokens=60
        )
        choice = auto.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason in ("tool_calls", "length")
            for call in choice.message.tool_calls:
                _valid(call)
        else:
            assert not choice.message.content.startswith("<tool_call>")


def test_a_call_and_its_result_turn_are_templated(live, backend):
    arguments = json.dumps({"city": "Paris", "days": 1})
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    call["function"]["arguments"] = arguments
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    reply = live.client().chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.choices[0].message.tool_calls is None
    text = backend.tokenizer.render_chat(
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        **call,
                        "function": {"name": "get_weather", "arguments": json.loads(arguments)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ],
        add_generation_prompt=True,
        tools=[t for t in TOOLS],
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<tool_response>sunny, 21 C</tool_response>" in text


def test_tools_on_a_template_without_them_and_with_a_format_are_400(live, backend):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS}
    both = live.post("/v1/chat/completions", {**body, "response_format": {"type": "json_object"}})
    assert both.status_code == 400
    assert "tool_choice 'none'" in both.json()["error"]["message"]
    bad = live.post("/v1/chat/completions", {**body, "tool_choice": "maybe"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "tool_choice"
    template = backend.tokenizer.hf.chat_template
    backend.tokenizer.hf.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        plain = live.post("/v1/chat/completions", body)
    finally:
        backend.tokenizer.hf.chat_template = template
    assert plain.status_code == 400
    assert "does not render tools" in plain.json()["error"]["message"]
    assert plain.json()["error"]["param"] == "tools"


@pytest.mark.parametrize("size", [1, 2, 7])
def test_braces_and_quotes_inside_strings_do_not_end_the_arguments(size):
    arguments = {"note": 'a } and { and \\" and ]', "list": [1, {"deep": "}"}]}
    text = _hermes(("add", arguments), ("add", {"a": 1}))
    reader, _, read, _ = _read_in_pieces(HERMES, text, size)
    assert [json.loads(read[i]) for i in (0, 1)] == [arguments, {"a": 1}]
    assert [c.whole for c in reader.calls] == [True, True]


def test_a_schema_the_grammar_engine_cannot_compile_is_a_400_on_tools(live, backend):
    bad = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": bad}}]
    reply = live.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": ASK, "tools": tools, "tool_choice": "required"},
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "tools"


def test_a_schema_with_defs_and_refs_resolves_in_its_own_grammar():
    unit = {"enum": ["c", "f"], "type": "string"}
    parameters = {
        "$defs": {"Unit": unit},
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "required": ["unit"],
    }
    tools = [{"type": "function", "function": {"name": "temp", "parameters": parameters}}]
    grammar = tool_grammar(HERMES, tool_request(tools, "required"))
    assert _accepts(grammar, _hermes(("temp", {"unit": "c"})))
    assert not _accepts(grammar, _hermes(("temp", {"unit": "k"})))


@pytest.mark.parametrize(
    ("choice", "parallel", "message"),
    [
        ({"type": "bogus", "function": {"name": "add"}}, None, "tool_choice"),
        (None, "x", "parallel_tool_calls"),
    ],
)
def test_choice_type_and_parallel_are_checked_with_or_without_tools(choice, parallel, message):
    with pytest.raises(RequestError, match=message):
        tool_request(TOOLS, choice, parallel)
    if parallel is not None:
        with pytest.raises(RequestError, match=message):
            tool_request(None, None, parallel)


def test_a_numeric_tool_name_is_shown_as_given():
    with pytest.raises(RequestError, match=r"\['name'\]=5"):
        tool_request([{"type": "function", "function": {"name": 5}}])


@pytest.mark.parametrize(
    "calls",
    [
        [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}],
        [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}],
        5,
        [{"function": {}}],
    ],
)
def test_assistant_calls_are_checked_without_tools_too(live, calls):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls}]
    reply = live.post("/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert reply.status_code == 400, reply.text
    assert "tool_calls" in reply.json()["error"]["message"]
