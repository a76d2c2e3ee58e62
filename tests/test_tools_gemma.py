"""Gemma's call syntax (FunctionGemma): ``<start_function_call>call:NAME{key:value}`` with
strings between ``<escape>`` delimiters. The grammar translated from each schema takes
exactly the calls that validate, whether the delimiters are special tokens or text; calls
are read back as JSON in any pieces; through the ``openai`` client on a tiny model whose
vocabulary has the three special tokens, streamed and not, with the delimiters kept in
the text the reader sees and left out of everything else."""

import json

import jsonschema
import pytest
from helpers import CPU
from live_server import MODEL, LiveServer
from llguidance import LLMatcher, LLTokenizer
from tiny_models import EOS, build_hf_model, build_tokenizer

from spnl_backend import load_backend
from spnl_backend.errors import RequestError
from spnl_backend.tools.calls import call_reader, read_whole
from spnl_backend.tools.formats import GEMMA, template_format
from spnl_backend.tools.gemma import read_value
from spnl_backend.tools.grammar import tool_grammar
from spnl_backend.tools.spec import tool_request

SPECIALS = ("<start_function_call>", "<end_function_call>", "<escape>")
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "note": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "exact": {"type": ["boolean", "null"]}},
            "required": ["lat"],
        },
    },
    "required": ["city", "days"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
TEMPLATE = (
    "<bos>{% if tools %}developer: {% for t in tools %}<start_function_declaration>"
    "declaration:{{ t['function']['name'] }}<end_function_declaration>{% endfor %}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] %}model: {% for c in m['tool_calls'] %}"
    "<start_function_call>call:{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}<end_function_call>{% endfor %}\n"
    "{% elif m['role'] == 'tool' %}user: <start_function_response>{{ m['content'] }}"
    "<end_function_response>\n"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}model:{% endif %}"
)
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]
CALL, END, ESC = SPECIALS


def _format(specials: bool):
    vocab = build_tokenizer(SPECIALS if specials else ()).get_vocab()
    return template_format(TEMPLATE, lambda text: vocab.get(text) if specials else None)


def _accepts(grammar: str, text: str, specials: bool) -> bool:
    hf = build_tokenizer(SPECIALS if specials else ())
    tokenizer = LLTokenizer(hf.backend_tokenizer.to_str(), n_vocab=len(hf), eos_token=[EOS])
    assert not LLMatcher.validate_grammar(grammar, tokenizer)
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    tokens = hf(text, add_special_tokens=False)["input_ids"]
    return all(matcher.consume_token(t) for t in tokens) and matcher.is_accepting()


def _call(arguments: str, name: str = "get_weather") -> str:
    return f"{CALL}call:{name}{{{arguments}}}{END}"


def _s(text: str) -> str:
    return f"{ESC}{text}{ESC}"


VALID = [
    (f"city:{_s('Paris')},days:2", {"city": "Paris", "days": 2}),
    (
        f"city:{_s('Rome')},days:7,note:{_s('a{b},c:d')},tags:[true,false]",
        {"city": "Rome", "days": 7, "note": "a{b},c:d", "tags": [True, False]},
    ),
    (
        f"city:{_s('Paris')},days:1,note:{_s('')},where:{{lat:-1.5e2,exact:null}}",
        {"city": "Paris", "days": 1, "note": "", "where": {"lat": -150.0, "exact": None}},
    ),
    (f"city:{_s('Paris')},days:3,tags:[]", {"city": "Paris", "days": 3, "tags": []}),
]
INVALID = [
    f"city:{_s('Lima')},days:2",  # not in the enum
    f"city:{_s('Paris')},days:9",  # past the maximum
    "days:2",  # a required property missing
    f"days:2,city:{_s('Paris')}",  # out of the schema's order
    f"city:{_s('Paris')},days:2,wind:1",  # a property the schema has not
    f"city:{_s('Paris')},days:2,note:{_s('thirteen chars')}",  # past maxLength
    f"city:{_s('Paris')},days:2,tags:[true,true,true,true]",  # past maxItems
    f"city:{_s('Paris')},days:2,where:{{exact:true}}",  # a nested required one missing
    'city:"Paris",days:2',  # a string not between delimiters
]


@pytest.mark.parametrize("specials", [False, True], ids=["text", "special-tokens"])
def test_the_grammar_takes_exactly_the_calls_that_validate(specials):
    fmt = _format(specials)
    grammar = tool_grammar(fmt, tool_request(TOOLS, "required"))
    for arguments, value in VALID:
        assert _accepts(grammar, _call(arguments), specials), arguments
        jsonschema.validate(value, WEATHER)
    two = _call(VALID[0][0]) + _call(VALID[1][0])
    assert _accepts(grammar, two, specials)
    for arguments in INVALID:
        assert not _accepts(grammar, _call(arguments), specials), arguments
    assert not _accepts(grammar, _call(VALID[0][0], "nope"), specials)
    assert not _accepts(grammar, "It is sunny.", specials)  # required: calls only
    single = tool_grammar(fmt, tool_request(TOOLS, "required", False))
    assert not _accepts(single, two, specials)
    auto = tool_grammar(fmt, tool_request(TOOLS))
    assert _accepts(auto, "It is sunny.", specials)
    assert _accepts(auto, _call(VALID[0][0]), specials)


def test_the_format_keeps_the_special_tokens_it_finds():
    assert _format(False) == GEMMA
    assert dict(_format(True).kept) == {CALL: 320, END: 321, ESC: 322}
    with pytest.raises(RequestError, match="Gemma <start_function_call>"):
        template_format("{{ tools }}<|im_start|>", lambda t: None)


@pytest.mark.parametrize(
    ("parameters", "named"),
    [
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x+"}}}, "pattern"),
        ({"type": "object", "properties": {"a b": {"type": "string"}}}, "'a b'"),
        ({"type": "object", "properties": {"a": {}}}, "any value"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}, "$ref"),
    ],
)
def test_a_schema_the_translation_cannot_hold_is_refused_naming_the_part(parameters, named):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with pytest.raises(RequestError, match=r"tool 'f': .*" + named.replace("$", r"\$")):
        tool_grammar(GEMMA, tool_request(tools))


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_calls_read_in_any_pieces_equal_the_whole(size):
    text = "".join(_call(arguments) for arguments, _ in VALID)
    reader = call_reader(GEMMA)
    started, fragments = [], {}
    for at in range(0, len(text), size):
        delta = reader.feed(text[at : at + size])
        started += [c.name for c in delta.started]
        for index, fragment in delta.arguments:
            fragments[index] = fragments.get(index, "") + fragment
    assert reader.content is None
    assert started == ["get_weather"] * len(VALID)
    assert [json.loads(fragments[i]) for i in range(len(VALID))] == [v for _, v in VALID]
    whole = read_whole(GEMMA, text)
    assert [json.loads(c.arguments) for c in whole] == [v for _, v in VALID]
    assert read_whole(GEMMA, "Sunny.") is None
    cut = read_whole(GEMMA, _call(VALID[0][0])[:-25])
    assert cut == []  # a call cut short is not whole


def test_values_read_back_as_json_and_a_broken_one_is_an_error():
    text = f"[{_s('a')},{{k:[1,2]}},false]"
    assert read_value(text + "tail") == (["a", {"k": [1, 2]}, False], len(text))
    for broken in (f"{ESC}open", "{k:1", "[1,2", "?"):
        with pytest.raises(ValueError, match=r"unclosed|expected|no value"):
            read_value(broken)


# ---- end to end: a tiny model with the three special tokens ---------------------------


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    model = build_hf_model("llama", tmp_path_factory.mktemp("gemma-tools"), specials=SPECIALS)
    backend = load_backend(str(model.path), settings=CPU)
    backend.tokenizer.hf.chat_template = TEMPLATE
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def live(backend):
    server = LiveServer(backend)
    yield server
    server.stop()


def test_a_call_through_the_openai_client_streamed_and_not(live, backend):
    client = live.client()
    asked = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0)
    whole = client.chat.completions.create(**asked, max_tokens=80, parallel_tool_calls=False)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(
        client.chat.completions.create(
            **asked, max_tokens=80, parallel_tool_calls=False, stream=True
        )
    )
    calls: dict[int, dict] = {}
    for chunk in chunks:
        assert not chunk.choices[0].delta.content  # the delimiters never leak as text
        for entry in chunk.choices[0].delta.tool_calls or []:
            into = calls.setdefault(entry.index, {"name": None, "arguments": ""})
            into["name"] = entry.function.name or into["name"]
            into["arguments"] += entry.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    python = backend.chat(ASK, max_tokens=80, temperature=0, tools=TOOLS, tool_choice="required")
    assert [(c.name, c.arguments) for c in python.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_without_tools_the_special_tokens_stay_out_of_the_text(backend):
    # A plain answer decodes as before: nothing kept, whatever the model writes.
    result = backend.generate("what", max_tokens=40, temperature=1.0, seed=3)
    assert not any(text in result.text for text in SPECIALS)
