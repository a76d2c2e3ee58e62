"""Several models behind one server: loaded on their first request, let go once idle for
their keep-alive, within one memory budget; a model that fails to load fails its own
requests only."""

import asyncio
import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from helpers import CPU
from live_server import LiveServer

from spnl_backend import load_backend
from spnl_backend.server.models import ModelSet
from spnl_backend.server.protocol import ApiError


class FakeBackend:
    def __init__(self, source: str) -> None:
        self.source, self.closed = source, False

    def close(self) -> None:
        self.closed = True

    def cache_info(self) -> SimpleNamespace:
        """A source named 'states-<MB>' is a model whose state group may take that much."""
        name = source_name(self.source)
        mb = int(name.split("-")[1]) if name.startswith("states-") else 0
        return SimpleNamespace(state_bytes=(mb << 20) or None)


def source_name(source: str) -> str:
    return source.rsplit("/", 1)[-1].removesuffix(".gguf")


class Loads:
    """A loader that counts its loads and fails for sources named 'broken'."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.count, self.delay_s = 0, delay_s

    def __call__(self, source: str) -> FakeBackend:
        self.count += 1
        time.sleep(self.delay_s)
        if "broken" in source:
            raise OSError(f"{source}: no such file")
        return FakeBackend(source)


def _sized(tmp_path, name: str, mb: int) -> str:
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(b"\0" * (mb << 20))
    return str(path)


def test_a_model_loads_once_on_its_first_requests(tmp_path):
    loads = Loads(delay_s=0.2)
    models = ModelSet({"a": "a", "b": "b"}, loads)
    got = []
    threads = [threading.Thread(target=lambda: got.append(models.acquire("a"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert loads.count == 1
    assert len({id(b) for b in got}) == 1
    assert [m.name for m in models.loaded()] == ["a"]
    with pytest.raises(ApiError) as unknown:
        models.acquire("c")
    assert unknown.value.status == 404


def test_keep_alive_zero_negative_and_expiry():
    models = ModelSet({"a": "a", "b": "b"}, Loads(), keep_alive_s=0.2)
    first = models.acquire("a")
    models.release("a", keep_alive_s=0)  # Ollama's "unload now"
    assert first.closed
    models.acquire("a", keep_alive_s=-1)
    models.release("a")
    models.acquire("b")
    models.release("b")
    time.sleep(0.3)
    models.reap()
    assert [m.name for m in models.loaded()] == ["a"]  # kept for ever; b expired
    held = models.acquire("a", keep_alive_s=0.0)
    models.reap()
    assert not held.closed  # in use: never unloaded under a request


def test_the_budget_unloads_the_least_recently_used_idle_model(tmp_path):
    sources = {n: _sized(tmp_path, n, 4) for n in ("a", "b", "c")}
    models = ModelSet(sources, Loads(), budget_bytes=9 << 20)
    a = models.acquire("a")
    models.release("a")
    b = models.acquire("b")
    models.release("b")
    models.acquire("a")  # a is now the most recently used
    models.release("a")
    models.acquire("c")  # 3 x 4 MB > 9 MB: b goes
    assert b.closed
    assert not a.closed
    models.acquire("a")  # a and c held: nothing idle to unload for b
    with pytest.raises(ApiError) as full:
        models.acquire("b")
    assert full.value.status == 503
    assert "memory budget" in full.value.message
    assert full.value.headers["Retry-After"]


def test_a_models_state_group_counts_in_its_footprint(tmp_path):
    """A hybrid's states are allocated as its sequences run, so its footprint counts the
    most they take (6 MB here) beside its load's: with another 4 MB model the 12 MB budget
    is passed, and the idle hybrid is unloaded."""
    sources = {"hybrid": _sized(tmp_path, "states-6", 4), "dense": _sized(tmp_path, "dense", 4)}
    models = ModelSet(sources, Loads(), budget_bytes=12 << 20)
    hybrid = models.acquire("hybrid")
    models.release("hybrid")
    assert models.models["hybrid"].footprint >= (4 + 6) << 20
    models.acquire("dense")
    assert hybrid.closed


def test_a_load_failure_fails_its_requests_and_is_tried_again():
    loads = Loads()
    models = ModelSet({"ok": "ok", "bad": "broken"}, loads)
    for _ in range(2):
        with pytest.raises(ApiError) as failed:
            models.acquire("bad")
        assert failed.value.status == 500
        assert "failed to load" in failed.value.message
        assert "no such file" in failed.value.message
    assert loads.count == 2  # tried again, not remembered as failed
    assert not models.acquire("ok").closed


@pytest.fixture(scope="module")
def two(tiny):
    llama, qwen = str(tiny.hf("llama").path), str(tiny.hf("qwen2").path)
    models = ModelSet(
        {"llama": llama, "qwen": qwen, "gone": "/nonexistent/model"},
        lambda path: load_backend(path, settings=CPU),
    )
    server = LiveServer(None, models=models)
    yield server, models, {"llama": llama, "qwen": qwen}
    server.stop()
    models.close()


def test_a_server_of_several_models(two):
    server, _, paths = two
    listed = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["llama", "qwen", "gone"]
    assert httpx.get(server.url + "/health").json()["loaded"] == []
    for name in ("llama", "qwen"):
        body = {"model": name, "prompt": "The capital of France is", "max_tokens": 6}
        reply = server.post("/v1/completions", {**body, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == name
        with load_backend(paths[name], settings=CPU) as alone:
            expected = alone.generate(body["prompt"], max_tokens=6, temperature=0).text
        assert reply.json()["choices"][0]["text"] == expected
    running = httpx.get(server.url + "/api/ps").json()["models"]
    assert sorted(m["name"] for m in running) == ["llama", "qwen"]
    metrics = httpx.get(server.url + "/metrics").text
    assert 'spnl_model_requests_total{model="llama",outcome="ok"}' in metrics
    assert 'spnl_running_sequences{model="qwen"}' in metrics
    assert 'spnl_kv_blocks_free{model="llama"}' in metrics


def test_a_model_that_fails_to_load_fails_alone(two):
    server, _, _ = two
    reply = server.post("/v1/completions", {"model": "gone", "prompt": "x", "max_tokens": 2})
    assert reply.status_code == 500
    assert reply.json()["error"]["code"] == "model_load_failed"
    ok = server.post("/v1/completions", {"model": "llama", "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_ollamas_keep_alive_zero_unloads(two):
    server, models, _ = two
    server.post("/api/generate", {"model": "qwen", "prompt": "hi", "stream": False})
    assert "qwen" in [m.name for m in models.loaded()]
    unloaded = server.post("/api/generate", {"model": "qwen:latest", "keep_alive": 0}).json()
    assert unloaded["done_reason"] == "unload"
    assert "qwen" not in [m.name for m in models.loaded()]
    tags = httpx.get(server.url + "/api/tags").json()["models"]
    assert [t["name"] for t in tags] == ["llama", "qwen", "gone"]


def test_serve_takes_paths_or_names_each_once(tmp_path):
    from spnl_backend.errors import SettingsError
    from spnl_backend.server import run
    from spnl_backend.settings import load_settings

    settings = load_settings()
    assert run._several(["only"], None, 300, None, settings) is None  # one model: as before
    (tmp_path / "a.gguf").write_bytes(b"")  # a file's name without .gguf
    models = run._several([str(tmp_path / "a.gguf"), "b=/x/y"], None, 60, 100, settings)
    assert models.names == ["a", "b"]
    assert models.budget_bytes == 100 << 20
    assert models.models["a"].keep_alive_s == 60
    for given, served, budget in [
        (["a=/x", "a=/y"], None, None),
        (["a=/x", "b="], None, None),
        (["a=/x", "b=/y"], "name", None),
        (["a=/x", "b=/y"], None, 0),
    ]:
        with pytest.raises(SettingsError):
            run._several(given, served, 300, budget, settings)


def test_the_cli_reads_keep_alive_as_ollama_does():
    from spnl_backend.cli import _keep_alive
    from spnl_backend.errors import SettingsError

    assert _keep_alive("5m") == 300
    assert _keep_alive("-1") == -1
    with pytest.raises(SettingsError, match="--keep-alive"):
        _keep_alive("soon")


async def _gone_at_the_first_send(app, path: str, payload: bytes) -> None:
    """One request through the app itself, its client gone while the response's head is
    being sent: the stream is cancelled before its body's generator starts."""
    messages = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        await asyncio.sleep(0.05)

    headers = [(b"content-type", b"application/json"), (b"host", b"x")]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    scope.update(asgi={"version": "3.0", "spec_version": "2.3"}, query_string=b"")
    scope.update(scheme="http", server=("x", 80), client=("127.0.0.1", 1), root_path="")
    await app(scope, receive, send)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 400, "stream": True}),
        ("/api/generate", {"prompt": "Once upon a time", "options": {"num_predict": 400}}),
    ],
)
def test_a_stream_whose_client_leaves_at_once_lets_its_model_go(two, path, body):
    # Gone before the first byte: the answer's generator never starts, so its own cleanup
    # cannot be what releases the model, the in-flight count and the engine's sequence.
    server, models, _ = two
    server.post("/v1/completions", {"model": "llama", "prompt": "x", "max_tokens": 1})
    payload = json.dumps({"model": "llama", **body}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port))) as sock:
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    asyncio.run(_gone_at_the_first_send(server.server.config.app, path, payload))
    (llama,) = [m for m in models.loaded() if m.name == "llama"]

    def held():
        stats = llama.backend.stats()
        return llama.users, server.state.in_flight, stats.running + stats.waiting

    deadline = time.monotonic() + 60  # the sequences would run 400 tokens each if left
    while time.monotonic() < deadline and held() != (0, 0, 0):
        time.sleep(0.05)
    assert held() == (0, 0, 0)


def test_each_model_may_have_its_own_chat_template(tiny, tmp_path):
    from spnl_backend.errors import SettingsError
    from spnl_backend.server import run
    from spnl_backend.settings import BackendSettings

    path = str(tiny.hf("llama").path)
    own = tmp_path / "own.jinja"
    own.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    every = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    given = [every, f"b={own}"]
    shared, templates = run._chat_templates(given, [f"a={path}", f"b={path}"])
    assert (shared, templates) == (every, {"b": str(own)})
    settings = BackendSettings(device="cpu", chat_template=shared)
    models = run._several([f"a={path}", f"b={path}"], None, 60, None, settings, templates)
    try:
        a, b = models.acquire("a"), models.acquire("b")
        assert a.tokenizer.hf.chat_template == every
        assert b.tokenizer.hf.chat_template == own.read_text()
    finally:
        models.close()
    for bad in (["{{ x }}", "{{ y }}"], [f"b={own}", f"b={own}"], [f"b={tmp_path / 'none'}"]):
        with pytest.raises(SettingsError):
            run._chat_templates(bad, [f"a={path}", f"b={path}"])
