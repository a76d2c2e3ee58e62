"""The OpenAI-compatible server, driven by the official `openai` client and by raw HTTP:
its answers equal the Python API's, and every bad request gets OpenAI's error shape."""

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from helpers import loop_held
from live_server import MODEL, PROMPTS, LiveServer, served_backend


@pytest.fixture(scope="module")
def backend(tiny):
    backend = served_backend(tiny)
    yield backend
    backend.close()


def _greedy(backend, prompt, max_tokens=12):
    return backend.generate(prompt, max_tokens=max_tokens, temperature=0)


def _assert_pool_clean(backend, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = backend.stats()
        if (stats.running, stats.waiting, stats.cache_holders) == (0, 0, 0):
            assert stats.pool is None or stats.pool.in_use == 0
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)


# ---- answers equal the Python API's ---------------------------------------------------


def test_health_and_models(live):
    assert httpx.get(live.url + "/health").json()["status"] == "ok"
    assert [m.id for m in live.client().models.list()] == [MODEL]


def test_completion_equals_generate(live, backend):
    expected = _greedy(backend, PROMPTS[0])
    reply = live.client().completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0
    )
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == expected.usage.prompt_tokens
    assert reply.usage.completion_tokens == expected.usage.completion_tokens


def test_streamed_completion_equals_generate(live, backend):
    expected = _greedy(backend, PROMPTS[1])
    chunks = list(
        live.client().completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    assert all(isinstance(c.created, int) and c.id == chunks[0].id for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_backend_chat(live, backend, stream):
    messages = [{"role": "user", "content": "The capital"}]
    expected = backend.chat(messages, max_tokens=10, temperature=0)
    reply = live.client().chat.completions.create(
        model=f"openai/{MODEL}",  # as spnl names it
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        stream=stream,
        reasoning_effort="low",
    )
    if stream:
        chunks = list(reply)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        text = reply.choices[0].message.content
    assert text == expected.text


def test_a_list_of_prompts_and_token_ids(live, backend):
    expected = [_greedy(backend, p).text for p in PROMPTS]
    reply = live.client().completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0
    )
    assert [(c.index, c.text) for c in reply.choices] == list(enumerate(expected))
    ids = backend.tokenizer.encode(PROMPTS[2])
    by_ids = live.post(
        "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 12, "temperature": 0}
    )
    assert by_ids.json()["choices"][0]["text"] == expected[2]


def test_n_completions_share_the_prompt_and_are_reproducible(live, backend):
    greedy = live.client().completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, n=3
    )
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert {c.text for c in greedy.choices} == {_greedy(backend, PROMPTS[0], 8).text}
    assert greedy.usage.prompt_tokens == len(backend.tokenizer.encode(PROMPTS[0]))

    def sampled():
        reply = live.client().completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=7, n=3
        )
        return [c.text for c in reply.choices]

    texts = sampled()
    assert texts == sampled()
    alone = [
        backend.generate(PROMPTS[1], max_tokens=8, temperature=1.0, seed=7 + i).text
        for i in range(3)
    ]
    assert texts == alone  # completion i draws with seed + i


def test_n_streams_interleave_by_index(live):
    chunks = list(
        live.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=6,
            temperature=0,
            n=2,
            stream=True,
        )
    )
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] != ""


def test_32_concurrent_streams_equal_their_serial_runs(live, backend):
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(32)]
    expected = [_greedy(backend, p, 16).text for p in prompts]

    async def one(client, prompt):
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(all_of_them()) == expected
    _assert_pool_clean(backend)


def test_a_client_that_hangs_up_leaves_the_pool_as_it_was(live, backend):
    before = backend.stats().pool
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    _assert_pool_clean(backend)
    after = backend.stats().pool
    assert (after.in_use, after.blocks) == (before.in_use, before.blocks)


# ---- errors -----------------------------------------------------------------------------


def _error(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "hi"}, "model", "model is required"),
        ({"model": MODEL, "prompt": 5}, "prompt", "expected a string"),
        ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature", "temperature="),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens", ">= 1, or null"),
        # the same words for every bad value (a string was told ">= 0 (0 or None: ...")
        ({"model": MODEL, "prompt": "hi", "max_tokens": "x"}, "max_tokens", ">= 1, or null"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 2.5}, "max_tokens", ">= 1, or null"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, "n", "from 1 to"),
        ({"model": MODEL, "prompt": "hi", "logprobs": 30}, "logprobs", "from 0 to 20"),
        ({"model": MODEL, "prompt": "hi", "stop_token_ids": ["1"]}, "stop_token_ids", "ids"),
        ({"model": MODEL, "prompt": "hi", "logprobs": True}, "logprobs", "expected an integer"),
        ({"model": MODEL, "prompt": "hi", "echo": True}, "echo", "not supported"),
        ({"model": MODEL, "prompt": "hi", "guided_regex": "("}, "guided_regex", "does not compile"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias", "token ids"),
        ({"model": MODEL, "prompt": "hi", "min_p": 2}, "min_p", "[0, 1]"),
        ({"model": MODEL, "prompt": "hi", "frobnicate": 1}, "frobnicate", "unknown"),
        ({"model": MODEL, "prompt": [1, "a"]}, "prompt", "expected a string"),
        ({"model": MODEL, "prompt": [10**9]}, "prompt", "prompt_token_ids"),
        (
            {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed with stream",
        ),
    ],
)
def test_bad_completion_requests(live, body, param, words):
    error = _error(live.post("/v1/completions", body), 400)
    assert error["param"] == param
    assert words in error["message"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": MODEL, "messages": []}, "non-empty list"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 3}]}, "content"),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}},
            },
            "JSON schema does not compile",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "token_healing": True,
            },
            "token_healing applies to completions",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function"}],
            },
            "tools",
        ),
    ],
)
def test_bad_chat_requests(live, body, words):
    assert words in _error(live.post("/v1/chat/completions", body), 400)["message"]


def test_hostile_bodies_are_400s(live):
    deep = b'{"model": "x", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    raw = httpx.post(live.url + "/v1/completions", content=deep, timeout=30)
    assert "nests JSON arrays and objects more than" in _error(raw, 400)["message"]
    huge = b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    raw = httpx.post(live.url + "/v1/completions", content=huge, timeout=30)
    assert "not valid JSON" in _error(raw, 400)["message"]
    bad_stop = b'{"model": "' + MODEL.encode() + b'", "prompt": "Hi", "stop": "\\ud800"}'
    raw = httpx.post(live.url + "/v1/completions", content=bad_stop, timeout=30)
    assert _error(raw, 400)["param"] == "stop"
    never_fits = {"model": MODEL, "prompt": [[1]] * 400, "max_tokens": 1}
    assert _error(live.post("/v1/completions", never_fits), 400)["param"] == "n"


def test_a_null_max_completion_tokens_falls_back_to_max_tokens(live):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_completion_tokens": None,
        "max_tokens": 3,
        "temperature": 0,
    }
    assert live.post("/v1/chat/completions", body).json()["usage"]["completion_tokens"] == 3


def test_invalid_json_unknown_model_and_too_long_prompt(live, backend):
    raw = httpx.post(live.url + "/v1/completions", content=b"{not json", timeout=30)
    assert "not valid JSON" in _error(raw, 400)["message"]
    unknown = _error(live.post("/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404)
    assert unknown["code"] == "model_not_found"
    long = " ".join(["word"] * (backend.max_model_len + 10))
    too_long = _error(live.post("/v1/completions", {"model": MODEL, "prompt": long}), 400)
    assert too_long["code"] == "context_length_exceeded"
    assert _error(httpx.get(live.url + "/v2/nothing"), 404)["code"] == "not_found"


def test_a_method_a_route_does_not_take_is_a_405_that_says_which_it_does(live):
    for method, path in (("OPTIONS", "/v1/completions"), ("GET", "/v1/chat/completions")):
        reply = httpx.request(method, live.url + path, timeout=30)
        assert _error(reply, 405)["code"] == "method_not_allowed"
        assert "POST" in reply.headers["Allow"]
        assert "it takes" in reply.json()["error"]["message"]


def test_an_untyped_body_from_a_web_page_is_refused(live):
    # fetch(url, {method: "POST", mode: "no-cors", body: new Blob([json])}): no type, no
    # preflight, and the browser names the page.
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    page = httpx.post(
        live.url + "/v1/completions", content=body, headers={"Origin": "http://evil.example"}
    )
    assert _error(page, 403)["code"] == "origin_refused"
    assert httpx.post(live.url + "/v1/completions", content=body, timeout=60).status_code == 200


def test_a_loopback_server_answers_only_to_its_own_names(backend):
    from spnl_backend.server.app import LOOPBACK_NAMES, host_name
    from spnl_backend.server.run import _allowed_hosts

    assert _allowed_hosts("127.0.0.1", None) == (*LOOPBACK_NAMES, "127.0.0.1")
    assert _allowed_hosts("0.0.0.0", None) is None  # exposed by its operator: any name
    assert _allowed_hosts("0.0.0.0", ["api.example", " *"]) == ("api.example", "*")
    assert [host_name(h) for h in ("[::1]:80", "LocalHost:8000", "::1", "a.b")] == [
        "::1",
        "localhost",
        "::1",
        "a.b",
    ]
    server = LiveServer(backend, allowed_hosts=_allowed_hosts("127.0.0.1", None))
    try:
        port = server.url.rsplit(":", 1)[1]
        ours = httpx.get(server.url + "/health", headers={"Host": f"localhost:{port}"})
        assert ours.status_code == 200
        rebound = httpx.get(server.url + "/health", headers={"Host": f"evil.example:{port}"})
        assert _error(rebound, 403)["code"] == "host_refused"
        assert "--allowed-hosts" in rebound.json()["error"]["message"]
    finally:
        server.stop()


def test_no_web_page_may_read_answers_unless_its_origin_is_allowed(live):
    page = {"Origin": "https://app.example"}
    preflight = {**page, "Access-Control-Request-Method": "POST"}
    refused = httpx.options(live.url + "/v1/completions", headers=preflight)
    assert _error(refused, 405)["code"] == "method_not_allowed"
    assert refused.headers["Allow"] == "POST"
    answered = httpx.get(live.url + "/v1/models", headers=page)
    assert answered.status_code == 200
    assert "access-control-allow-origin" not in answered.headers


def test_allowed_origins_get_cors_answers_and_preflights(backend):
    from spnl_backend.cli import _build_parser

    args = _build_parser().parse_args(["serve", "--allowed-origins", "https://app.example"])
    assert args.allowed_origins == ["https://app.example"]
    server = LiveServer(backend, allowed_origins=("https://app.example",))
    ours, theirs = {"Origin": "https://app.example"}, {"Origin": "https://evil.example"}
    asks = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    try:
        url = server.url + "/v1/completions"
        preflight = httpx.options(url, headers={**ours, **asks})
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        other = httpx.options(url, headers={**theirs, **asks})
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        answered = httpx.post(url, json=body, headers=ours, timeout=60)
        assert answered.status_code == 200
        assert answered.headers["access-control-allow-origin"] == "https://app.example"
        unread = httpx.post(url, json=body, headers=theirs, timeout=60)
        assert "access-control-allow-origin" not in unread.headers
    finally:
        server.stop()


def test_the_openai_client_raises_on_a_400(live):
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        live.client().completions.create(model=MODEL, prompt="x", presence_penalty=3)


def test_metrics_follow_the_key_unless_opened(backend):
    right = {"Authorization": "Bearer s3cret"}
    closed = LiveServer(backend, api_key="s3cret")
    try:
        assert _error(httpx.get(closed.url + "/metrics"), 401)["code"] == "invalid_api_key"
        assert httpx.get(closed.url + "/metrics", headers=right).status_code == 200
        assert httpx.get(closed.url + "/health").status_code == 200  # orchestrators' probe
    finally:
        closed.stop()
    opened = LiveServer(backend, api_key="s3cret", open_metrics=True)
    try:
        assert "spnl_requests_total" in httpx.get(opened.url + "/metrics").text
    finally:
        opened.stop()


def test_api_key_oversized_body_and_a_full_queue(backend):
    server = LiveServer(backend, api_key="s3cret", max_body_bytes=4096, max_waiting=0)
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert _error(server.post("/v1/completions", body), 401)["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer nope"}
        assert server.post("/v1/completions", body, headers=wrong).status_code == 401
        assert httpx.get(server.url + "/v1/models").status_code == 401
        right = {"Authorization": "Bearer s3cret"}
        assert server.post("/v1/completions", body, headers=right).status_code == 200
        big = {**body, "prompt": "x" * 5000}
        assert _error(server.post("/v1/completions", big, headers=right), 413)
        # 64 completions in flight fill the running batch (the loop is held, so they
        # stay there); with no room to wait, the next request is turned away.
        held = {**body, "n": backend.max_num_seqs, "max_tokens": 50, "stream": True}
        with (
            loop_held(backend),
            httpx.stream(
                "POST", server.url + "/v1/completions", json=held, headers=right, timeout=30
            ),
        ):
            full = server.post("/v1/completions", body, headers=right)
            assert _error(full, 503)["code"] == "server_overloaded"
            assert full.headers["Retry-After"] == "1"
        _assert_pool_clean(backend)
    finally:
        server.stop()


def test_only_json_bodies_are_taken(live):
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    for media in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]:
        raw = httpx.post(
            live.url + "/v1/completions", content=body, headers={"Content-Type": media}
        )
        assert _error(raw, 415)["code"] == "unsupported_media_type", media
    typed = {"Content-Type": "application/json; charset=utf-8"}
    assert httpx.post(live.url + "/v1/completions", content=body, headers=typed).status_code == 200


def test_a_body_that_never_arrives_is_a_408(live, monkeypatch):
    from spnl_backend.server import app

    monkeypatch.setattr(app, "BODY_TIMEOUT_S", 0.5)
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
        sock.sendall(head.encode())
        reply = b""
        while chunk := sock.recv(65536):  # the head and the body may come apart
            reply += chunk
            if b"\r\n\r\n" in reply and reply.endswith(b"}"):
                break
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 408"), reply
    assert '"code":"timeout"' in reply, reply


def test_tokenizing_does_not_hold_up_the_server(live, backend, monkeypatch):
    """A prompt of megabytes takes seconds to tokenize; meanwhile the server answers."""
    entered, release = threading.Event(), threading.Event()
    tokenize = backend.prompt_ids

    def slow(*args, **kw):
        entered.set()
        release.wait(30)
        return tokenize(*args, **kw)

    monkeypatch.setattr(backend, "prompt_ids", slow)
    with ThreadPoolExecutor(1) as pool:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
        pending = pool.submit(live.post, "/v1/completions", body)
        assert entered.wait(30)
        try:
            assert httpx.get(live.url + "/health", timeout=10).status_code == 200
        finally:
            release.set()
        assert pending.result().json()["usage"]["completion_tokens"] == 3


def test_health_is_503_until_a_model_is_loaded(backend):
    server = LiveServer(None)
    try:
        assert httpx.get(server.url + "/health").status_code == 503
        reply = server.post("/v1/completions", {"model": MODEL, "prompt": "x"})
        assert _error(reply, 503)["code"] == "model_not_ready"
        server.state.backend = backend
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


def test_metrics_count_what_happened(live):
    live.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3})
    live.post("/v1/completions", {"model": MODEL, "prompt": "x", "bogus": 1})
    text = httpx.get(live.url + "/metrics").text
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples['spnl_requests_total{endpoint="completions",outcome="ok"}'] >= 1
    assert samples['spnl_requests_total{endpoint="completions",outcome="rejected"}'] >= 1
    assert samples["spnl_completion_tokens_total"] >= 3
    assert samples["spnl_time_to_first_token_seconds_count"] >= 1
    for name in (
        "spnl_running_sequences",
        "spnl_kv_blocks_used",
        "spnl_kv_blocks_free",
        "spnl_prefix_cache_hits_total",
        "spnl_preemptions_total",
        "spnl_spec_accepted_tokens_total",
        "spnl_inter_token_latency_seconds_count",
    ):
        assert name in samples, name


def test_sse_framing(live):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [line for line in reply.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        chunk = json.loads(event.removeprefix("data: "))
        assert chunk["object"] == "text_completion"
        assert isinstance(chunk["choices"][0]["text"], str)


# ---- nothing a request says is dropped silently ---------------------------------------


def _chat_reply(live, **body) -> httpx.Response:
    return live.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, **body})


def test_a_text_part_with_other_keys_is_refused(live):
    part = {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}
    reply = _chat_reply(live, messages=[{"role": "user", "content": [part]}])
    error = _error(reply, 400)
    assert error["code"] == "unsupported_parameter"
    assert "no other keys" in error["message"]
    plain = {"type": "text", "text": "hi"}
    assert _chat_reply(live, messages=[{"role": "user", "content": [plain]}]).status_code == 200


@pytest.mark.parametrize(
    ("response_format", "named"),
    [
        ({"type": "json_object", "schema": {}}, "'schema'"),
        ({"type": "text", "strict": True}, "'strict'"),
        ({"type": "json_schema", "json_schema": {"schema": {}}, "x": 1}, "'x'"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "description": "d"}}, "desc"),
    ],
)
def test_unknown_keys_in_response_format_are_refused(live, response_format, named):
    ask = [{"role": "user", "content": "hi"}]
    error = _error(_chat_reply(live, messages=ask, response_format=response_format), 400)
    assert named in error["message"]
    assert "nothing is silently ignored" in error["message"]
    kept = {"type": "json_schema", "json_schema": {"schema": {}, "name": "n", "strict": True}}
    assert _chat_reply(live, messages=ask, response_format=kept).status_code == 200


def test_a_message_name_is_refused_where_the_template_drops_it(live, backend):
    named = [{"role": "user", "content": "hi", "name": "ada"}]
    error = _error(_chat_reply(live, messages=named), 400)
    assert error["code"] == "unsupported_parameter"
    assert "messages[0]" in error["message"]
    assert "'name'" in error["message"]
    hf = backend.tokenizer.hf
    template = hf.chat_template
    hf.chat_template = template.replace("{{ m['role'] }}", "{{ m['role'] }} {{ m.name }}")
    try:
        assert _chat_reply(live, messages=named).status_code == 200
        rendered = backend.tokenizer.render_chat(named, True)
        assert "user ada: hi" in rendered
    finally:
        hf.chat_template = template


def test_the_servers_connections_send_without_waiting_for_acks():
    """A response goes out in two writes (head, body); with Nagle's algorithm on, the
    second waited for the client's delayed ACK: 44 ms on every kept-alive request. The
    listening socket sets TCP_NODELAY, which accepted connections inherit."""
    import socket

    from spnl_backend.server.run import _listen

    listener = _listen("127.0.0.1", 0)
    try:
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        accepted.close()
        client.close()
    finally:
        listener.close()
