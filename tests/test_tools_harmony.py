"""Tool calling on gpt-oss (harmony): the calls' grammar in the template's own message
syntax, the calls read by the reasoning module's harmony parser, whole and streamed,
through the official ``openai`` client and Ollama's; a call's result fed back through the
template; ``tool_choice``'s variants; a call made with no tools offered kept as the
answer's text. A tiny gpt-oss model whose vocabulary has harmony's tags as special tokens
serves with gpt-oss's shipped chat template."""

import dataclasses
import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import ollama
import pytest
from helpers import NO_SPECULATION, scripted_logits
from live_server import MODEL
from llguidance import LLMatcher, LLTokenizer
from test_tools import ASK, SCHEMAS, TOOLS
from tiny_models import EOS, build_hf_model, build_tokenizer

from spnl_backend import load_backend
from spnl_backend.errors import RequestError
from spnl_backend.models.arch.harmony import HARMONY_CHAT_TEMPLATE
from spnl_backend.reasoning import HARMONY_TAGS, Reasoning
from spnl_backend.server.responses import Reply
from spnl_backend.settings import BackendSettings
from spnl_backend.tools.formats import HARMONY, template_format
from spnl_backend.tools.grammar import tool_grammar
from spnl_backend.tools.spec import tool_request

GPT_OSS = (Path(__file__).parent / "data" / "templates" / "openai-gpt-oss-120b.jinja").read_text()
NAMED = {"type": "function", "function": {"name": "add"}}
CALL = (
    "<|channel|>analysis<|message|>Paris, one day.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "days": 1}<|call|>'
)


def _matcher(specials: tuple[str, ...], request) -> tuple[object, LLMatcher]:
    hf = build_tokenizer(specials=specials)
    tokenizer = LLTokenizer(hf.backend_tokenizer.to_str(), n_vocab=len(hf), eos_token=[EOS])
    special = {t: hf.convert_tokens_to_ids(t) for t in specials}
    fmt = template_format(GPT_OSS, special.get)
    grammar = tool_grammar(fmt, request)
    assert not LLMatcher.validate_grammar(grammar, tokenizer)
    return hf, LLMatcher(tokenizer, grammar, log_level=0)


def _accepts(specials: tuple[str, ...], choice: object, text: str) -> bool:
    hf, matcher = _matcher(specials, tool_request(TOOLS, choice))
    ids = hf(text, add_special_tokens=False)["input_ids"]
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


# ---- the format and its grammar -----------------------------------------------------------


def test_gpt_oss_template_calls_in_harmony_keeping_its_special_tags():
    hf = build_tokenizer(specials=HARMONY_TAGS)
    special = {t: hf.convert_tokens_to_ids(t) for t in HARMONY_TAGS}
    fmt = template_format(GPT_OSS, special.get)
    assert fmt.family == "harmony"
    assert dict(fmt.kept) == special  # the constraint keeps them in the output's text
    assert template_format(GPT_OSS, lambda _: None).kept == ()  # spelled as text
    # The template a file without one is given (models.arch.harmony) calls the same way.
    assert template_format(HARMONY_CHAT_TEMPLATE, special.get) == fmt


TEXTS = {
    "answer": "<|channel|>final<|message|>It is sunny.",
    "reasoned call": CALL,
    "call": "<|channel|>commentary to=functions.add <|constrain|>json<|message|>"
    + '{"a": 3, "b": true}',
    "bad arguments": CALL.replace('"days": 1', '"days": 9'),
    "unknown tool": CALL.replace("get_weather", "get_time"),
    "preamble": "<|channel|>commentary<|message|>Let me look.<|end|>",
}
ACCEPTED = {
    "auto": {"answer", "reasoned call", "call"},
    "required": {"reasoned call", "call"},
    "add": {"call"},
}


@pytest.mark.parametrize("specials", [HARMONY_TAGS, ()], ids=["special", "text"])
@pytest.mark.parametrize("choice", ["auto", "required", "add"])
def test_the_grammar_takes_an_answer_or_a_call_as_tool_choice_says(specials, choice):
    asked = NAMED if choice == "add" else choice
    accepted = {name for name, text in TEXTS.items() if _accepts(specials, asked, text)}
    assert accepted == ACCEPTED[choice]


def test_text_tags_keep_the_reasoning_from_holding_a_tag_start():
    # Where the tags are text, '<' never starts the reasoning's or the answer's text.
    assert not _accepts((), "auto", "<|channel|>final<|message|>a < b")
    assert _accepts(HARMONY_TAGS, "auto", "<|channel|>final<|message|>a < b")


# ---- read whole and streamed ---------------------------------------------------------------


def _fake_seq(text: str, finish: str = "stop") -> SimpleNamespace:
    params = SimpleNamespace(logprobs=False)
    return SimpleNamespace(seq_id=3, text=text, finish_reason=finish, params=params, logprobs=[])


def _reply(seq) -> Reply:
    return Reply("chat", MODEL, [seq], 1, tools=HARMONY, reasoning=Reasoning("harmony", calls=True))


def test_reasoning_and_a_call_whole_and_streamed_in_any_pieces():
    seq = _fake_seq(CALL)
    whole = _reply(seq)._choice(seq)
    assert whole["finish_reason"] == "tool_calls"
    message = whole["message"]
    assert (message["content"], message["reasoning"]) == (None, "Paris, one day.")
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}
    assert call["id"].startswith("call_")
    assert call["type"] == "function"
    rng = random.Random(7)
    for _ in range(10):
        reply = _reply(seq)
        cuts = sorted(rng.sample(range(1, len(CALL)), 9))
        pieces = [CALL[a:b] for a, b in zip([0, *cuts], [*cuts, len(CALL)], strict=True)]
        chunks = [c for p in pieces if (c := reply.text_chunk(seq, p)) is not None]
        chunks.append(reply.end_chunk(seq))
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("reasoning") or "" for d in deltas) == "Paris, one day."
        assert "".join(d.get("content") or "" for d in deltas) == ""
        entries = [e for d in deltas for e in d.get("tool_calls", [])]
        assert [e["function"]["name"] for e in entries if "id" in e] == ["get_weather"]
        assert "".join(e["function"]["arguments"] for e in entries) == call["function"]["arguments"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_call_cut_short_is_left_out_and_an_answer_is_text():
    cut = _fake_seq(CALL[:-12], finish="length")
    choice = _reply(cut)._choice(cut)
    assert (choice["finish_reason"], choice["message"]["tool_calls"]) == ("length", [])
    answer = _fake_seq(TEXTS["answer"])
    choice = _reply(answer)._choice(answer)
    assert choice["message"]["content"] == "It is sunny."
    assert "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


# ---- end to end: a tiny gpt-oss ------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    # gpt-oss's system and developer messages with two tools: some 470 tokens.
    wide = {"max_position_embeddings": 2048}
    path = tmp_path_factory.mktemp("gpt_oss")
    tiny = build_hf_model("gpt_oss", path, specials=HARMONY_TAGS, overrides=wide)
    backend = load_backend(str(tiny.path), settings=NO_SPECULATION)
    backend.tokenizer.hf.chat_template = GPT_OSS
    yield backend
    backend.close()


def _ids(backend) -> dict[str, int]:
    return {t: backend.tokenizer.hf.convert_tokens_to_ids(t) for t in HARMONY_TAGS}


def _ending(backend) -> dict[str, int]:
    """Messages end as soon as the grammar lets them (the tiny model's reasoning would
    otherwise run to max_tokens)."""
    ids = _ids(backend)
    return {str(ids[t]): 100 for t in ("<|end|>", "<|call|>", "<|return|>")}


def _valid(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def _streamed_calls(chunks) -> dict[int, dict]:
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for entry in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            into = calls.setdefault(entry.index, {"name": None, "arguments": "", "id": None})
            into["id"] = entry.id or into["id"]
            into["name"] = entry.function.name or into["name"]
            into["arguments"] += entry.function.arguments or ""
    return calls


def test_a_required_call_through_the_openai_client_whole_and_streamed(live, backend):
    client = live.client()
    asked = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=80,
        logit_bias=_ending(backend),
    )
    whole = client.chat.completions.create(**asked)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    _valid(call)
    assert call.id.startswith("call_")
    assert call.type == "function"
    chunks = list(client.chat.completions.create(**asked, stream=True))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    streamed = _streamed_calls(chunks)
    assert streamed == {
        0: {
            "name": call.function.name,
            "arguments": call.function.arguments,
            "id": streamed[0]["id"],
        }
    }
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    python = backend.chat(
        ASK,
        max_tokens=80,
        temperature=0,
        tools=TOOLS,
        tool_choice="required",
        logit_bias=_ending(backend),
    )
    assert python.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in python.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_a_named_tool_and_auto(live, backend):
    client = live.client()
    asked = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, logit_bias=_ending(backend))
    named = client.chat.completions.create(**asked, tool_choice=NAMED, temperature=0)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "add"
    _valid(call)
    for seed in range(6):
        choice = client.chat.completions.create(**asked, seed=seed).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            (call,) = choice.message.tool_calls
            _valid(call)
        else:
            assert choice.finish_reason in ("stop", "length")
            assert "<|" not in (choice.message.content or "")


def test_a_call_and_its_result_are_templated_for_the_next_turn(live, backend):
    arguments = json.dumps({"city": "Paris", "days": 1})
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": arguments}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    prompt = backend.tokenizer.decode_keeping(
        backend.chat_prompt_ids(messages, tool_request(TOOLS)), frozenset(_ids(backend).values())
    )
    assert (
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris", "days": 1}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny, 21 C"'
        "<|end|><|start|>assistant"
    ) in prompt
    assert "type get_weather = (_: {" in prompt  # the tools, as the developer message has them
    client = live.client()
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice=NAMED,
        temperature=0,
        max_tokens=80,
        logit_bias=_ending(backend),
    )
    (again,) = reply.choices[0].message.tool_calls
    assert again.function.name == "add"
    two = {**messages[1], "tool_calls": [call, {**call, "id": "call_2"}]}
    refused = live.post(
        "/v1/chat/completions", {"model": MODEL, "messages": [*ASK, two], "tools": TOOLS}
    )
    assert refused.status_code == 400
    assert "one call a turn" in refused.json()["error"]["message"]


WRITTEN = (
    '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 7, "b": false}'
    "<|call|>"
)


@pytest.mark.parametrize("tools", [None, "none"])
def test_a_call_made_with_no_tools_to_call_is_the_answers_text(live, backend, tools, monkeypatch):
    # The call written by the model, scripted (a constraint would hold the answer alone,
    # after the reasoning's end), the tags as the special tokens they are.
    script = scripted_logits(backend, monkeypatch)
    written = [*backend.tokenizer.encode_plain(WRITTEN), EOS]
    body = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 80}
    if tools is not None:
        body.update(tools=TOOLS, tool_choice=tools)
    script[:] = written
    reply = live.post("/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["message"]["content"] == WRITTEN  # kept as written, not dropped
    assert "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    script[:] = written
    streamed = live.post("/v1/chat/completions", {**body, "stream": True})
    lines = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in map(json.loads, lines) if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == WRITTEN
    assert not any("tool_calls" in d for d in deltas)


def _calls_only(backend, monkeypatch) -> None:
    """The tools' grammar narrowed to a call with no reasoning, so that the tiny model
    makes one where the API has no logit_bias to end its reasoning."""
    made = backend.tool_chat

    def calling(tools, params, template=None):
        chat = made(tools, params, template)
        grammar = re.sub(
            r"start: analysis\? \((final \| )?call\)", "start: call", chat.constraint.grammar
        )
        assert grammar != chat.constraint.grammar
        return dataclasses.replace(
            chat, constraint=dataclasses.replace(chat.constraint, grammar=grammar)
        )

    monkeypatch.setattr(backend, "tool_chat", calling)


def test_ollama_chat_returns_the_call_whole_and_streamed(live, backend, monkeypatch):
    _calls_only(backend, monkeypatch)  # Ollama's chat has neither tool_choice nor logit_bias
    client = ollama.Client(host=live.url)
    asked = dict(
        model=MODEL, messages=ASK, tools=TOOLS, options={"temperature": 0, "num_predict": 80}
    )
    whole = client.chat(**asked)
    (call,) = whole.message.tool_calls
    # Ollama's client sends a schema's types and required keys only (no bounds).
    assert set(call.function.arguments) == set(SCHEMAS[call.function.name]["required"])
    assert (whole.message.content, whole.done_reason) == ("", "stop")
    streamed = list(client.chat(**asked, stream=True))
    calls = [c for part in streamed for c in part.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]
    assert not "".join(part.message.content for part in streamed)


def test_tools_need_the_harmony_reader(live, backend, monkeypatch):
    settings = BackendSettings(device="cpu", reasoning_format="none")
    monkeypatch.setattr(backend, "settings", settings)
    reply = live.post(
        "/v1/chat/completions", {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4}
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "tools"
    assert "MISTRALRS_REASONING_FORMAT" in error["message"]
    with pytest.raises(RequestError, match="harmony reasoning format"):
        backend.chat(ASK, tools=TOOLS, max_tokens=4)


def test_the_anthropic_and_responses_apis_read_the_call_too(live, backend, monkeypatch):
    _calls_only(backend, monkeypatch)
    question = [{"role": "user", "content": ASK[0]["content"]}]
    anthropic_tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    body = {"model": MODEL, "max_tokens": 80, "messages": question, "tools": anthropic_tools}
    body["tool_choice"] = {"type": "any"}
    message = live.post("/v1/messages", {**body, "temperature": 0})
    assert message.status_code == 200, message.text
    (block,) = message.json()["content"]
    assert block["type"] == "tool_use"
    jsonschema.validate(block["input"], SCHEMAS[block["name"]])
    assert message.json()["stop_reason"] == "tool_use"
    client = live.client()
    asked = dict(model=MODEL, tools=[{"type": "function", **t["function"]} for t in TOOLS])
    asked.update(tool_choice="required", max_output_tokens=80, input=ASK[0]["content"])
    response = client.responses.create(**asked, temperature=0)
    (call,) = response.output
    assert (call.type, call.status) == ("function_call", "completed")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    events = list(client.responses.create(**asked, temperature=0, stream=True))
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(fragments) == call.arguments


def test_ends_that_are_end_of_sequence_tokens_as_in_gpt_oss(tmp_path):
    # gpt-oss's generation config lists <|return|> and <|call|> as end-of-sequence tokens.
    hf = build_tokenizer(specials=HARMONY_TAGS)
    ends = [hf.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    config = {"max_position_embeddings": 2048, "eos_token_id": [EOS, *ends]}
    tiny = build_hf_model("gpt_oss", tmp_path, specials=HARMONY_TAGS, overrides=config)
    backend = load_backend(str(tiny.path), settings=NO_SPECULATION)
    try:
        backend.tokenizer.hf.chat_template = GPT_OSS
        bias = _ending(backend)
        asked = dict(max_tokens=80, temperature=0, tools=TOOLS, logit_bias=bias)
        called = backend.chat(ASK, tool_choice="required", **asked)
        assert called.finish_reason == "tool_calls"
        (call,) = called.tool_calls
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        answered = backend.chat(ASK, tool_choice="none", **asked)
        assert answered.tool_calls is None
        assert "<|" not in answered.text
    finally:
        backend.close()


def test_a_reasoning_budget_ends_the_analysis_and_the_grammar_goes_on(live, backend, monkeypatch):
    # The tools' grammar spans the analysis message: it sees every token, and a spent
    # budget closes the analysis alone; the grammar then has the answer or a call.
    script = scripted_logits(backend, monkeypatch)
    encode = backend.tokenizer.encode_plain
    header, thought = encode("<|channel|>analysis<|message|>"), encode("I add two and two")
    script[:] = [*header, *thought]
    body = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 80}
    body.update(tools=TOOLS, tool_choice="required", logprobs=True, thinking_token_budget=2)
    body["logit_bias"] = _ending(backend)
    reply = live.post("/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
    reopened = len(header) + 2
    assert choice["message"]["reasoning"] == backend.tokenizer.decode(thought[:2])
    ends = [backend.tokenizer.hf.convert_ids_to_tokens(i) for i in encode("<|end|><|start|>")]
    assert tokens[reopened : reopened + 2] == ends
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] in SCHEMAS
