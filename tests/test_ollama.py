"""Ollama's API through the official ``ollama`` client: chat and generate, streamed and
not, with the same tokens as the Python API; format through the grammar engine; tool
calls; embeddings; the listings; and its errors."""

import json
import time

import jsonschema
import ollama
import pytest
from live_server import MODEL, served_backend
from test_tools import ASK, SCHEMAS, TOOL_TEMPLATE, TOOLS

OPTIONS = {"temperature": 0, "num_predict": 12, "seed": 3}


@pytest.fixture(scope="module")
def backend(tiny):
    backend = served_backend(tiny, TOOL_TEMPLATE)
    yield backend
    backend.close()


@pytest.fixture
def client(live):
    return ollama.Client(host=live.url)


def test_chat_streamed_and_not_equals_the_python_api(client, backend):
    expected = backend.chat(ASK, max_tokens=12, temperature=0)
    whole = client.chat(model=MODEL, messages=ASK, options=OPTIONS, stream=False)
    assert whole.message.content == expected.text
    assert whole.done
    assert whole.done_reason == "length"
    assert whole.eval_count == 12
    assert whole.prompt_eval_count == expected.usage.prompt_tokens
    parts = list(client.chat(model=MODEL + ":latest", messages=ASK, options=OPTIONS, stream=True))
    assert "".join(p.message.content for p in parts) == expected.text
    assert [p.done for p in parts][-1]
    assert not any(p.done for p in parts[:-1])


def test_generate_templated_raw_and_load(client, backend):
    templated = client.generate(
        model=MODEL, prompt="what is the weather in Paris?", options=OPTIONS
    )
    assert templated.response == backend.chat(ASK, max_tokens=12, temperature=0).text
    raw = client.generate(model=MODEL, prompt="Once upon a time", raw=True, options=OPTIONS)
    assert raw.response == backend.generate("Once upon a time", max_tokens=12, temperature=0).text
    streamed = client.generate(
        model=MODEL, prompt="Once upon a time", raw=True, stream=True, options=OPTIONS
    )
    assert "".join(p.response for p in streamed) == raw.response
    loaded = client.generate(model=MODEL)
    assert loaded.done_reason == "load"


def test_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "ok": {"type": "boolean"}},
        "required": ["city", "ok"],
        "additionalProperties": False,
    }
    reply = client.chat(
        model=MODEL, messages=ASK, format=schema, options={"temperature": 0, "num_predict": 60}
    )
    jsonschema.validate(json.loads(reply.message.content), schema)
    anything = client.chat(
        model=MODEL, messages=ASK, format="json", options={"temperature": 0, "num_predict": 60}
    )
    # Any object: the tiny model may write strings until num_predict runs out.
    assert anything.message.content.startswith("{")
    if anything.done_reason == "stop":
        assert isinstance(json.loads(anything.message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls(client, stream):
    options = {"temperature": 0, "num_predict": 120, "stop": []}
    forced = [{**TOOLS[0]}]  # one tool: Ollama has no tool_choice; the model picks
    reply = client.chat(model=MODEL, messages=ASK, tools=forced, options=options, stream=stream)
    parts = list(reply) if stream else [reply]
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    text = "".join(p.message.content or "" for p in parts)
    if calls:
        for call in calls:
            jsonschema.validate(dict(call.function.arguments), SCHEMAS[call.function.name])
    else:
        assert not text.startswith("<tool_call>")
    follow_up = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}}
            ],
        },
        {"role": "tool", "content": "rain", "tool_name": "get_weather"},
    ]
    answer = client.chat(model=MODEL, messages=follow_up, options=OPTIONS)
    assert answer.done


def test_embed_equals_the_python_api(client, backend):
    reply = client.embed(model=MODEL, input=["a fox", "a dog"])
    expected = backend.embed(["a fox", "a dog"]).vectors
    assert len(reply.embeddings) == 2
    for got, want in zip(reply.embeddings, expected.tolist(), strict=True):
        assert got == pytest.approx(want, abs=1e-6)


def test_listings_and_version(client, live, backend):
    (tag,) = client.list().models
    assert tag.model == MODEL
    assert tag.details.family == "llama"
    (running,) = client.ps().models
    assert running.model == MODEL
    shown = client.show(MODEL)
    assert "tools" in shown.capabilities
    assert shown.template == TOOL_TEMPLATE
    assert live.post("/api/version", {}).status_code == 405
    assert "version" in __import__("httpx").get(live.url + "/api/version").json()


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": "nope", "messages": ASK}, "does not exist"),
        ({"model": MODEL, "messages": ASK, "options": {"mirostat": 1}}, "options.mirostat"),
        ({"model": MODEL, "messages": ASK, "options": {"num_ctx": 10**6}}, "num_ctx"),
        ({"model": MODEL, "messages": ASK, "keep_alive": "soon"}, "keep_alive"),
        ({"model": MODEL, "messages": ASK, "format": "xml"}, "format"),
        ({"model": MODEL, "messages": ASK, "think": True}, "think"),
        ({"model": MODEL, "messages": [{"role": "user", "images": ["x"]}]}, "images"),
        ({"model": MODEL, "messages": ASK, "template": "{{ x }}"}, "template"),
        ({"model": MODEL, "messages": ASK, "keep_alive": 10**400}, "keep_alive"),
        ({"model": MODEL, "messages": ASK, "options": {"stop": 5}}, "options.stop"),
        ({"model": MODEL, "messages": ASK, "options": {"repeat_penalty": -1}}, "repeat_penalty"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 0}]}, "content"),
        ({"model": MODEL, "messages": [{"role": "tool", "content": "x", "tool_name": 5}]}, "tool"),
    ],
)
def test_bad_requests_get_ollamas_error_shape(live, body, words):
    reply = live.post("/api/chat", body)
    assert reply.status_code in (400, 404), reply.text
    assert words in reply.json()["error"]


def test_the_client_raises_the_servers_message(client):
    with pytest.raises(ollama.ResponseError, match="does not exist"):
        client.chat(model="nope", messages=ASK)
    durations = [("5m", 300), ("1h30m", 5400), (0, 0), (-1, -1), ("250ms", 0.25)]
    from spnl_backend.server.ollama import keep_alive_s

    for given, seconds in durations:
        assert keep_alive_s(given) == seconds


def test_untyped_bodies_as_curl_posts_them_but_not_from_a_page(live):
    body = json.dumps({"model": MODEL, "prompt": "Once", "raw": True, "stream": False})
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    import httpx

    reply = httpx.post(live.url + "/api/generate", content=body, headers=form, timeout=60)
    assert reply.status_code == 200
    page = {**form, "Origin": "http://evil.example"}
    refused = httpx.post(live.url + "/api/generate", content=body, headers=page, timeout=60)
    assert refused.status_code == 403
    assert "web page" in refused.json()["error"]


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/api/generate", {"prompt": "hi", "raw": "yes"}, "raw"),
        ("/api/embed", {"input": "hi", "options": {"zz": 1}}, "options.zz"),
        ("/api/embed", {"input": "hi", "format": 5}, "format"),
        ("/api/embed", {"input": "hi", "truncate": "yes"}, "truncate"),
        ("/api/embed", {"input": "hi", "dimensions": True}, "dimensions"),
        ("/api/embed", {"input": "hi", "keep_alive": 10**400}, "keep_alive"),
    ],
)
def test_generate_and_embed_check_their_fields(live, path, body, words):
    reply = live.post(path, {"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    assert words in reply.json()["error"]


def test_a_long_keep_alive_is_refused_at_once(live):
    # A run of digits with no unit once took 39 s of backtracking on the event loop.
    from spnl_backend.server.ollama import MAX_DURATION_CHARS, keep_alive_s

    assert keep_alive_s("1h30m45.5s") == 5445.5
    assert keep_alive_s(" -1 ") == -1
    hostile = "1" * 32_000 + "x"
    started = time.perf_counter()
    for path, body in (
        ("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/api/generate", {"prompt": "hi"}),
        ("/api/embed", {"input": "hi"}),
    ):
        reply = live.post(path, {"model": MODEL, "keep_alive": hostile, **body})
        assert reply.status_code == 400, reply.text
        assert f"at most {MAX_DURATION_CHARS} characters" in reply.json()["error"]
    assert time.perf_counter() - started < 2.0  # generous: the bug took 39 s per request
