"""The server against hostile requests (issue 53): each is refused with a 4xx that names
what it broke, promptly, and legitimate requests of the same shape still pass."""

import json
import time

import httpx
import pytest
from live_server import MODEL, LiveServer, served_backend
from test_tools import TOOL_TEMPLATE

from spnl_backend.plain import MAX_JSON_DEPTH
from spnl_backend.server.rules import ROUTES


@pytest.fixture(scope="module")
def backend(tiny):
    backend = served_backend(tiny, TOOL_TEMPLATE)
    yield backend
    backend.close()


def _nested(depth: int) -> str:
    return "[" * (depth - 1) + "{}" + "]" * (depth - 1)


def _called(path: str, arguments: object) -> dict:
    """A chat whose past assistant turn called ``f`` with ``arguments``, as ``path`` takes it."""
    call = {"function": {"name": "f", "arguments": arguments}}
    result = {"role": "tool", "content": "done"}
    if path.startswith("/v1/"):
        call = {"id": "c1", "type": "function", **call}
        result["tool_call_id"] = "c1"
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        result,
    ]
    limit = {"max_tokens": 1} if path.startswith("/v1/") else {"options": {"num_predict": 1}}
    return {"model": MODEL, "messages": messages, "stream": False, **limit}


# ---- JSON nested too deep, in the body or in a JSON string inside it ---------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
def test_a_past_calls_arguments_nested_too_deep_are_a_400(live, path):
    # 990 levels under 10 KB: once a RecursionError, and a 500.
    deep = json.dumps({"a": json.loads(_nested(MAX_JSON_DEPTH))})
    for arguments in ("[" * 990 + "]" * 990, deep):
        reply = live.post(path, _called(path, arguments))
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        message = error if isinstance(error, str) else error["message"]
        assert "tool_calls" in message
        assert f"more than {MAX_JSON_DEPTH} deep" in message
    shallow = json.dumps({"a": json.loads(_nested(MAX_JSON_DEPTH - 1))})
    assert live.post(path, _called(path, shallow)).status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "x"}),
        ("/api/generate", {"model": MODEL, "prompt": "x"}),
        ("/v1/query/execute", {"g": {"model": MODEL, "input": {"user": "x"}}}),
    ],
)
def test_a_body_nested_too_deep_is_a_400_that_names_the_limit(live, path, body):
    deep = {**body, "extra": json.loads(_nested(MAX_JSON_DEPTH))}
    reply = live.post(path, deep)
    assert reply.status_code == 400, reply.text
    assert f"more than {MAX_JSON_DEPTH} deep" in reply.text
    past_the_parser = json.dumps(body)[:-1] + ', "extra": ' + "[" * 5000 + "]" * 5000 + "}"
    reply = live.post(path, None, content=past_the_parser)
    assert reply.status_code == 400, reply.text


# ---- a web page's requests, on every POST route -------------------------------------------

PAGES = ("https://evil.example", "null")  # null: a sandboxed frame's, or a file's
# What a page may POST without the browser asking first (no preflight).
SIMPLE_BODIES = (
    ("text/plain", b"{}"),
    (None, b"{}"),
    ("application/x-www-form-urlencoded", b"a=1"),
    ("multipart/form-data; boundary=x", b"--x--\r\n"),
)


def _post_paths(server: LiveServer) -> list[str]:
    """Every POST route the app has, read from the app itself."""
    return [r.path for r in server.app.routes if "POST" in (getattr(r, "methods", None) or ())]


def _walk_pages(server: LiveServer, headers: dict[str, str]) -> None:
    paths = _post_paths(server)
    assert "/reset_prefix_cache" in paths
    for path in paths:
        for origin in PAGES:
            for media, body in SIMPLE_BODIES:
                sent = {**headers, "Origin": origin}
                if media is not None:
                    sent["Content-Type"] = media
                reply = httpx.post(server.url + path, content=body, headers=sent, timeout=60)
                assert reply.status_code == 403, (path, origin, media, reply.text)
                assert "origin_refused" in reply.text or "web page" in reply.text


@pytest.fixture
def resets(backend, monkeypatch):
    """The calls that reached `Backend.reset_prefix_cache`."""
    calls = []
    monkeypatch.setattr(backend, "reset_prefix_cache", lambda: calls.append(1) or 0)
    return calls


def test_no_post_route_takes_a_web_pages_simple_request(live, resets):
    _walk_pages(live, {})
    assert resets == []
    assert httpx.post(live.url + "/reset_prefix_cache", timeout=60).status_code == 200  # curl
    assert resets == [1]


def test_with_a_key_too_a_page_is_refused_even_with_the_key(backend, resets):
    server = LiveServer(backend, api_key="sesame")
    try:
        _walk_pages(server, {"Authorization": "Bearer sesame"})
        assert resets == []
    finally:
        server.stop()


def test_every_route_is_made_from_the_rule_table(live):
    made = {(r.path, next(iter(r.methods - {"HEAD"}))) for r in live.app.routes}
    assert made == {(rule.path, rule.method) for rule in ROUTES}
    for rule in ROUTES:  # from a client that is no browser: text is JSON's route's 415
        if rule.method != "POST":
            continue
        reply = httpx.post(
            live.url + rule.path, content=b"{}", headers={"Content-Type": "text/plain"}, timeout=60
        )
        assert (reply.status_code == 415) == (rule.body == "json"), (rule.path, reply.text)
        assert reply.status_code != 403


# ---- counts and sizes before any tokenization ---------------------------------------------


@pytest.fixture
def tokenized(backend, monkeypatch):
    """The prompts that reached tokenization: span queries' and completions'."""
    calls = []
    pic, prompt_ids = backend._pic, backend.prompt_ids
    from_query = pic.from_query
    monkeypatch.setattr(pic, "from_query", lambda q: calls.append(q) or from_query(q))
    monkeypatch.setattr(backend, "prompt_ids", lambda *a: calls.append(a) or prompt_ids(*a))
    return calls


def _map(inputs: list[str]) -> dict:
    return {"map": {"metadata": {"model": MODEL, "max_tokens": 1}, "inputs": inputs}}


def test_a_map_of_too_many_inputs_is_refused_before_tokenizing(live, backend, tokenized):
    most = backend.max_num_seqs + 256  # the server's default queue
    started = time.perf_counter()
    reply = live.post("/v1/query/execute", _map(["abcd"] * 300_000))  # 1.2 MB: once 38.7 s
    assert reply.status_code == 400, reply.text
    assert f"at most {most}" in reply.json()["error"]["message"]
    assert time.perf_counter() - started < 10.0  # generous; the check itself is a len()
    assert live.post("/v1/query/execute", _map(["a"] * (most + 1))).status_code == 400
    many = {"model": MODEL, "prompt": ["a"] * (most + 1), "max_tokens": 1}
    assert live.post("/v1/completions", many).status_code == 400
    assert tokenized == []
    assert live.post("/v1/query/execute", _map(["a", "b"])).status_code == 200
    assert len(tokenized) == 1


def test_a_map_input_longer_than_the_context_is_refused_before_tokenizing(live, backend, tokenized):
    from spnl_backend.request import MAX_CHARS_PER_TOKEN

    long = "x" * (MAX_CHARS_PER_TOKEN * backend.max_model_len + 1)
    reply = live.post("/v1/query/execute", _map(["a", long]))
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "context_length_exceeded"
    assert "query.map.inputs[1]" in reply.json()["error"]["message"]
    generate = {"g": {"model": MODEL, "input": {"seq": [{"user": long[:-2]}, {"user": "ab"}]}}}
    assert live.post("/v1/query/execute", generate).status_code == 400
    assert tokenized == []


def test_a_prompt_longer_than_the_context_is_refused_before_tokenizing(live, backend, monkeypatch):
    """A prompt, a chat or an embedding input of more characters than the context's tokens
    could hold is refused by its length: tokenizing 7 MB took 5 s, during which the
    tokenizer held the GIL and every other request and stream waited."""
    from spnl_backend.request import MAX_CHARS_PER_TOKEN

    encoded = []
    tokenizer = backend.tokenizer
    for name in ("encode", "encode_plain"):
        own = getattr(tokenizer, name)
        monkeypatch.setattr(
            tokenizer, name, lambda text, own=own: encoded.append(len(text)) or own(text)
        )
    long = "x" * (MAX_CHARS_PER_TOKEN * backend.max_model_len + 1)
    requests = [
        ("/v1/completions", {"model": MODEL, "prompt": long, "max_tokens": 1}, "the prompt"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": long}], "max_tokens": 1},
            "the messages' content",
        ),
        ("/v1/embeddings", {"model": MODEL, "input": ["a", long]}, "input[1]"),
    ]
    for path, body, what in requests:
        reply = live.post(path, body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "context_length_exceeded", error
        assert f"{what} has {len(long):,} characters" in error["message"], error
    assert max(encoded, default=0) < len(long)
    fits = {"model": MODEL, "prompt": "x" * 100, "max_tokens": 1}
    assert live.post("/v1/completions", fits).status_code == 200


# ---- the Host header, read strictly ---------------------------------------------------------


def test_a_host_is_read_strictly():
    from spnl_backend.server.app import host_name

    read = {
        "127.0.0.1:8000": "127.0.0.1",
        "LocalHost": "localhost",
        "[::1]:80": "::1",
        "[::1]": "::1",
        "api.example.": "api.example.",
    }
    assert {host: host_name(host) for host in read} == read
    for hostile in (
        "127.0.0.1:8000@evil.example",
        "127.0.0.1@evil.example",
        "localhost:80:80",
        "localhost:http",
        "localhost:99999",
        "localhost:",
        "[::1]x",
        "[::1]:8000@evil.example",
        "[evil.example]",
        "-localhost",
        "local host",
        "a..b",
        "",
        "a" * 300,
    ):
        assert host_name(hostile) is None, hostile


def test_a_host_with_more_after_its_port_is_refused(backend):
    from spnl_backend.server.run import _allowed_hosts

    server = LiveServer(backend, allowed_hosts=_allowed_hosts("127.0.0.1", None))
    try:
        port = server.url.rsplit(":", 1)[1]
        for ours in (f"127.0.0.1:{port}", "localhost", f"[::1]:{port}"):
            assert httpx.get(server.url + "/health", headers={"Host": ours}).status_code == 200
        for theirs in (f"127.0.0.1:{port}@evil.example", f"localhost:{port}.evil.example"):
            reply = httpx.get(server.url + "/health", headers={"Host": theirs})
            assert reply.status_code == 403, theirs
            assert reply.json()["error"]["code"] == "host_refused"
    finally:
        server.stop()


def test_the_docs_state_the_rule_table():
    """docs/serving.md's table of each route's rules says what `rules.ROUTES` does."""
    from pathlib import Path

    page = Path(__file__).resolve().parent.parent / "docs" / "serving.md"
    rows = [line for line in page.read_text().splitlines() if line.startswith("| `GET /")]
    rows += [line for line in page.read_text().splitlines() if line.startswith("| `POST /")]
    rows += [line for line in page.read_text().splitlines() if line.startswith("| `DELETE /")]
    key = {"asked (401)": "asked", "asked unless `--open-metrics`": "metrics", "not asked": "open"}
    body = {"JSON, or untyped": "json", "any type": "any", "none read": "none"}
    stated = {}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if len(cells) != 4 or cells[2] not in key:
            continue  # the endpoints' table, not the rules'
        first, *others = (part.strip().strip("`") for part in cells[0].split(","))
        method, path = first.split(" ", 1)
        paths = [path, *others]
        kind = next(v for k, v in body.items() if cells[3].startswith(k))
        for path in paths:
            stated[method, path] = (key[cells[2]], kind)
    assert stated == {(rule.method, rule.path): (rule.key, rule.body) for rule in ROUTES}
