"""Anthropic's Messages API and OpenAI's Responses API on the server, through their
official SDKs (``anthropic``, ``openai``): plain and streamed answers, a tool call and its
result turn, ``count_tokens``, ``previous_response_id``, and the errors in each API's
shape."""

import json
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from live_server import MODEL, LiveServer, served_backend
from test_tools import ASK, SCHEMAS, TOOL_TEMPLATE, TOOLS

from spnl_backend.engine.detokenizer import IncrementalDetokenizer
from spnl_backend.server import answer, responses_api

# The tools as Anthropic's clients write them.
ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
]
# ... and as the Responses API's do.
FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS]
# Greedy decoding: Anthropic's SDK has no sampling arguments any more, its API still does.
GREEDY = {"temperature": 0}
SYSTEM = "answer " * 40


@pytest.fixture(scope="module")
def backend(tiny):
    backend = served_backend(tiny, TOOL_TEMPLATE)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def claude(live) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)


def _chat(live, **body) -> dict:
    """The same question through the chat route, greedy: what the others must match."""
    answer = live.post("/v1/chat/completions", {"model": MODEL, "temperature": 0, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


# ---- Anthropic --------------------------------------------------------------------------


def test_messages_create_answers_as_the_chat_route_does(live, claude, backend):
    message = claude.messages.create(
        model=MODEL,
        max_tokens=12,
        extra_body=GREEDY,
        system="be brief",
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi there"}]}],
    )
    chat = _chat(
        live,
        max_tokens=12,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi there"},
        ],
    )
    choice = chat["choices"][0]
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == choice["message"]["content"]
    assert (
        message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice["finish_reason"]]
    )
    usage = chat["usage"]
    assert message.usage.output_tokens == usage["completion_tokens"]
    # The same prompt again: read from the prefix cache, counted apart as Anthropic does.
    assert (
        message.usage.input_tokens + message.usage.cache_read_input_tokens == usage["prompt_tokens"]
    )


def test_messages_stream_sends_anthropics_events_and_the_same_answer(live, claude):
    asked = dict(
        model=MODEL,
        max_tokens=10,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "tell"}],
    )
    whole = claude.messages.create(**asked)
    with claude.messages.stream(**asked) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds
    assert "content_block_stop" in kinds
    raw = {**asked, **GREEDY, "stream": True}
    del raw["extra_body"]
    with httpx.stream("POST", live.url + "/v1/messages", json=raw, timeout=60) as response:
        events = _sse(response)
    assert [kind for kind, _ in events[:2]] == ["message_start", "ping"]
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (
        whole.stop_reason,
        whole.usage.output_tokens,
    )


def test_a_stop_sequence_is_named_in_the_answer(claude):
    asked = dict(
        model=MODEL, max_tokens=16, extra_body=GREEDY, messages=[{"role": "user", "content": "go"}]
    )
    text = claude.messages.create(**asked).content[0].text
    assert len(text) > 2, "the tiny model's greedy answer is long enough to cut"
    stop = text[1:3]
    cut = claude.messages.create(**asked, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence"
    assert cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


class _Chars:
    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def test_the_detokenizer_names_the_stop_string_found_first():
    detok = IncrementalDetokenizer(_Chars(), [], ("xyz", "bc"))
    for char in "abcxyz":
        detok.add(ord(char))
    assert (detok.text, detok.matched, detok.stopped) == ("a", "bc", True)
    never = IncrementalDetokenizer(_Chars(), [], ("q",))
    never.add(ord("a"))
    assert never.matched is None


def _valid(name: str, given: dict) -> None:
    jsonschema.validate(given, SCHEMAS[name])


def test_a_tool_use_round_trip(claude, backend):
    asked = dict(model=MODEL, max_tokens=120, extra_body=GREEDY, tools=ANTHROPIC_TOOLS)
    asked["tool_choice"] = {"type": "any", "disable_parallel_tool_use": True}
    question = [{"role": "user", "content": ASK[0]["content"]}]
    message = claude.messages.create(**asked, messages=question)
    assert message.stop_reason == "tool_use"
    (call,) = message.content
    assert call.type == "tool_use"
    assert call.id.startswith("toolu_")
    _valid(call.name, call.input)
    with claude.messages.stream(**asked, messages=question) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds.count("content_block_start") == 1
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas
    assert set(deltas) == {"input_json_delta"}
    (streamed_call,) = streamed.content
    assert (streamed_call.name, streamed_call.input) == (call.name, call.input)
    assert streamed.stop_reason == "tool_use"
    # The result turn goes back through the template as the chat route's tool turn does.
    turns = [
        *question,
        {"role": "assistant", "content": message.content},  # sent back as the SDK gave it
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}],
        },
    ]
    answer = claude.messages.create(
        model=MODEL,
        max_tokens=8,
        extra_body=GREEDY,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "none"},
        messages=turns,
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    arguments = json.dumps(call.input)
    chat_turns = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    tokens = claude.messages.count_tokens(model=MODEL, tools=ANTHROPIC_TOOLS, messages=turns)
    chat = backend.chat_prompt_ids(chat_turns, _tool_request())
    assert tokens.input_tokens == len(chat)


def _tool_request():
    from spnl_backend.tools.spec import tool_request

    return tool_request(TOOLS)


def test_streamed_tool_use_sends_its_input_as_json_deltas(live):
    body = {
        "model": MODEL,
        "max_tokens": 120,
        "temperature": 0,
        "stream": True,
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "tool", "name": "add", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "add"}],
    }
    with httpx.stream("POST", live.url + "/v1/messages", json=body, timeout=60) as response:
        events = _sse(response)
    starts = [data for kind, data in events if kind == "content_block_start"]
    assert len(starts) == 1
    assert starts[0]["content_block"]["type"] == "tool_use"
    assert starts[0]["content_block"]["name"] == "add"
    partial = "".join(
        data["delta"]["partial_json"]
        for kind, data in events
        if kind == "content_block_delta" and data["delta"]["type"] == "input_json_delta"
    )
    _valid("add", json.loads(partial))
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def _sse(response: httpx.Response) -> list[tuple[str, dict]]:
    events, kind = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert data["type"] == kind
            events.append((kind, data))
    return events


def test_count_tokens_counts_the_templated_prompt(claude, backend):
    counted = claude.messages.count_tokens(
        model=MODEL, system="sys", messages=[{"role": "user", "content": "hello"}]
    )
    prompt = backend.chat_prompt_ids(
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]
    )
    assert counted.input_tokens == len(prompt)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens=None: required"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens=0"),
        ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "top-level 'system'"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": "The answer is"},
                ],
            },
            "prefill",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            "'image' block",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "mcp_servers": []},
            "mcp_servers",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "stop_sequences": [7],
            },
            "stop_sequences",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"name": "f"}],
            },
            "input_schema",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "thinking": {"type": "enabled", "budget_tokens": 9},
            },
            "thinking",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "output_config": {"effort": "max"},
            },
            "output_config.effort='max'",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "z"}]},
                    {"role": "user", "content": "y"},
                ],
            },
            "redacted_thinking",
        ),
    ],
)
def test_bad_messages_are_400_in_anthropics_shape(live, body, message):
    refused = live.post("/v1/messages", {"model": MODEL, **body})
    assert refused.status_code == 400
    error = refused.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"]


def test_the_api_key_is_read_from_x_api_key_and_refusals_are_anthropics(backend):
    server = LiveServer(backend, api_key="sesame")
    try:
        asked = dict(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
        ok = anthropic.Anthropic(base_url=server.url, api_key="sesame", max_retries=0)
        assert ok.messages.create(**asked).usage.output_tokens >= 1
        wrong = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as raised:
            wrong.messages.create(**asked)
        assert raised.value.body["error"]["type"] == "authentication_error"
        missing = server.post(
            "/v1/messages", {**asked, "model": "other"}, headers={"x-api-key": "sesame"}
        )
        assert missing.status_code == 404
        assert missing.json()["error"]["type"] == "not_found_error"
    finally:
        server.stop()


# ---- Responses --------------------------------------------------------------------------


def test_responses_create_answers_as_the_chat_route_does(live):
    client = live.client()
    response = client.responses.create(
        model=MODEL, input="hi there", instructions="be brief", max_output_tokens=12, temperature=0
    )
    chat = _chat(
        live,
        max_tokens=12,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi there"},
        ],
    )
    assert response.object == "response"
    assert response.id.startswith("resp_")
    (item,) = response.output
    assert item.type == "message"
    assert item.content[0].type == "output_text"
    assert response.output_text == chat["choices"][0]["message"]["content"]
    finish = chat["choices"][0]["finish_reason"]
    assert response.status == ("incomplete" if finish == "length" else "completed")
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert response.usage.input_tokens_details.cached_tokens > 0  # the same prompt, again


def test_a_streamed_response_sends_the_typed_events_and_the_same_output(live):
    client = live.client()
    asked = dict(model=MODEL, input="tell", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**asked)
    events = list(client.responses.create(**asked, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    done = events[-1].response
    assert done.output_text == whole.output_text
    assert done.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(**asked) as stream:
        last = list(stream)[-1]
    assert last.type == f"response.{whole.status}"
    assert last.response.output_text == whole.output_text


def test_a_function_call_and_its_output_through_responses(live):
    client = live.client()
    asked = dict(model=MODEL, tools=FUNCTIONS, tool_choice="required", max_output_tokens=120)
    response = client.responses.create(
        **asked, input=ASK[0]["content"], temperature=0, parallel_tool_calls=False
    )
    (call,) = response.output
    assert call.type == "function_call"
    assert call.status == "completed"
    _valid(call.name, json.loads(call.arguments))
    events = list(
        client.responses.create(
            **asked, input=ASK[0]["content"], temperature=0, parallel_tool_calls=False, stream=True
        )
    )
    fragments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert fragments == call.arguments
    # The call's output goes back by previous_response_id, or with the call sent whole.
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    rest = dict(
        model=MODEL, tools=FUNCTIONS, tool_choice="none", max_output_tokens=8, temperature=0
    )
    continued = client.responses.create(**rest, previous_response_id=response.id, input=[output])
    whole = client.responses.create(
        **rest,
        input=[
            {"role": "user", "content": ASK[0]["content"]},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            output,
        ],
    )
    assert continued.output_text == whole.output_text
    echoed = client.responses.create(  # the output items sent back as the SDK gave them
        **rest, input=[{"role": "user", "content": ASK[0]["content"]}, *response.output, output]
    )
    assert echoed.output_text == whole.output_text
    assert continued.usage.input_tokens == whole.usage.input_tokens


def test_previous_response_id_equals_the_conversation_sent_whole(live):
    client = live.client()
    # Instructions are not carried over: given again, and long enough to fill a block.
    asked = dict(model=MODEL, max_output_tokens=6, temperature=0, instructions=SYSTEM)
    first = client.responses.create(**asked, input="one")
    second = client.responses.create(**asked, input="two", previous_response_id=first.id)
    whole = client.responses.create(
        **asked,
        input=[
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "two"},
        ],
    )
    assert second.output_text == whole.output_text
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prefix
    assert client.responses.retrieve(first.id).output_text == first.output_text
    items = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["two"]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(**asked, input="x", previous_response_id=first.id)
    assert raised.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(**asked, input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_keeps_the_newest_responses():
    store = responses_api.ResponseStore(limit=2)
    for ident in "abc":
        store.put(ident, responses_api.Stored({"id": ident}, [], []))
    assert [store.get(i) is not None for i in "abc"] == [False, True, True]
    assert store.delete("b")
    assert not store.delete("b")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "image_generation_call"}]}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "store": "yes"}, "store"),
        ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning"),
        ({"input": "x", "conversation": "c"}, "conversation"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
    ],
)
def test_bad_responses_requests_are_400_naming_the_field(live, body, param):
    with pytest.raises(openai.BadRequestError) as raised:
        live.client().responses.create(model=MODEL, **body)
    assert raised.value.body["param"] == param


def test_a_past_calls_bad_arguments_are_named_as_the_input_item():
    """Not as the chat message they become (it said messages[0]['tool_calls'])."""
    from spnl_backend.server.protocol import ApiError
    from spnl_backend.server.responses_api import _item

    item = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{bad"}
    with pytest.raises(ApiError) as raised:
        _item(item, "input[0]")
    assert "input[0].arguments is not valid JSON" in str(raised.value)


CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_a_json_schema_holds_the_answer_on_both_apis(live, claude):
    ask = [{"role": "user", "content": "where?"}]
    message = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=ask,
        output_config={"format": {"type": "json_schema", "schema": CITY}},
    )
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), CITY)
    response = live.client().responses.create(
        model=MODEL,
        input="where?",
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY}},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), CITY)
    assert response.text.format.type == "json_schema"


# ---- reasoning -----------------------------------------------------------------------------

R1 = (
    Path(__file__).parent / "data" / "templates" / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
).read_text()


@pytest.fixture
def r1(backend):
    """DeepSeek-R1's template, whose generation prompt opens the thinking block (closed
    again unless enable_thinking): the tiny model's greedy output is all reasoning."""
    before = backend.tokenizer.hf.chat_template
    backend.tokenizer.hf.chat_template = R1
    yield
    backend.tokenizer.hf.chat_template = before


def _greedy_after(backend, variables: dict | None, max_tokens: int) -> str:
    ids = backend.chat_prompt_ids([{"role": "user", "content": "think"}], None, variables)
    return backend.generate(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0).text


def test_thinking_enabled_gives_a_thinking_block_whole_and_streamed(claude, backend, r1):
    text = _greedy_after(backend, {"enable_thinking": True}, 10)
    assert "</think>" not in text
    asked = dict(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "think"}])
    # This vocabulary spells </think> in pieces: a budget cannot be kept, and is refused.
    budget = {"type": "enabled", "budget_tokens": 5}
    with pytest.raises(anthropic.BadRequestError, match="not single tokens"):
        claude.messages.create(**asked, thinking=budget, extra_body=GREEDY)
    thinking = {"type": "adaptive"}
    message = claude.messages.create(**asked, thinking=thinking, extra_body=GREEDY)
    assert [(b.type, b.thinking) for b in message.content] == [("thinking", text.lstrip())]
    assert message.stop_reason == "max_tokens"
    with claude.messages.stream(**asked, thinking=thinking, extra_body=GREEDY) as stream:
        deltas = {e.delta.type for e in stream if e.type == "content_block_delta"}
        final = stream.get_final_message()
    assert deltas == {"thinking_delta"}
    assert final.content[0].thinking == text.lstrip()
    closed = claude.messages.create(**asked, thinking={"type": "disabled"}, extra_body=GREEDY)
    assert {b.type for b in closed.content} <= {"text"}
    assert "".join(b.text for b in closed.content) == _greedy_after(backend, None, 10)
    past = [  # a past turn's thinking block is read back as its reasoning
        {"role": "user", "content": "think"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": ""},
                {"type": "text", "text": "yes"},
            ],
        },
        {"role": "user", "content": "again"},
    ]
    counted = claude.messages.count_tokens(model=MODEL, messages=past)
    chat = [
        {"role": "user", "content": "think"},
        {"role": "assistant", "content": "yes", "reasoning_content": "hm"},
        {"role": "user", "content": "again"},
    ]
    assert counted.input_tokens == len(backend.chat_prompt_ids(chat))


def test_reasoning_items_from_a_reasoning_template(live, backend, r1):
    text = _greedy_after(backend, {"enable_thinking": True}, 10)
    client = live.client()
    asked = dict(model=MODEL, input="think", max_output_tokens=10, temperature=0)
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    for response in (
        client.responses.create(
            **asked, extra_body=on, reasoning={"effort": "low", "summary": "auto"}
        ),
        list(client.responses.create(**asked, extra_body=on, stream=True))[-1].response,
    ):
        (item,) = response.output
        assert item.type == "reasoning"
        assert item.content[0].text == text.lstrip()
        assert response.output_text == ""
        assert response.usage.output_tokens_details.reasoning_tokens is None
    first = client.responses.create(**asked, extra_body=on)
    del asked["input"]
    continued = client.responses.create(**asked, previous_response_id=first.id, input="more")
    whole = client.responses.create(
        **asked,
        input=[
            {"role": "user", "content": "think"},
            *first.output,  # the reasoning item sent back as the SDK gave it
            {"role": "user", "content": "more"},
        ],
    )
    assert continued.usage.input_tokens == whole.usage.input_tokens
    assert continued.output_text == whole.output_text


# ---- the reasoning seam -----------------------------------------------------------------


class _FirstChars:
    """A stand-in reasoning reader: an answer's first `THOUGHT` characters are its
    "reasoning"."""

    def __init__(self) -> None:
        self.seen = 0

    def feed(self, piece: str) -> tuple[str, str]:
        cut = max(0, min(len(piece), THOUGHT - self.seen))
        self.seen += len(piece)
        return piece[:cut], piece[cut:]

    def finish(self) -> tuple[str, str]:
        return "", ""


THOUGHT = 3


@pytest.fixture
def reasoning_prefix(monkeypatch):
    monkeypatch.setattr(answer, "reasoning_reader", lambda reasoning: _FirstChars())


def test_a_reasoning_reader_gives_thinking_blocks(live, claude, reasoning_prefix):
    asked = dict(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "think"}])
    plain = _chat(live, max_tokens=12, messages=asked["messages"])["choices"][0]["message"][
        "content"
    ]
    assert len(plain) > THOUGHT, "the tiny model's answer is longer than its thought"
    split = THOUGHT
    message = claude.messages.create(**asked, extra_body=GREEDY)
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in message.content] == [
        ("thinking", plain[:split]),
        ("text", plain[split:]),
    ]
    with claude.messages.stream(**asked, extra_body=GREEDY) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert "thinking_delta" in deltas
    assert "text_delta" in deltas
    assert [b.type for b in streamed.content] == ["thinking", "text"]
    assert (streamed.content[0].thinking, streamed.content[1].text) == (
        plain[:split],
        plain[split:],
    )


def test_a_reasoning_reader_gives_reasoning_items(live, reasoning_prefix):
    client = live.client()
    asked = dict(model=MODEL, input="think", max_output_tokens=12, temperature=0)
    plain = _chat(live, max_tokens=12, messages=[{"role": "user", "content": "think"}])
    text = plain["choices"][0]["message"]["content"]
    split = THOUGHT
    for response in (
        client.responses.create(**asked),
        list(client.responses.create(**asked, stream=True))[-1].response,
    ):
        reasoning, message = response.output
        assert reasoning.type == "reasoning"
        assert reasoning.content[0].text == text[:split]
        assert message.type == "message"
        assert response.output_text == text[split:]
