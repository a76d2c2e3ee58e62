"""LoRA adapters on a server of several models: each adapter belongs to one served model
(``--lora MODEL:NAME=PATH``); ``model=<adapter>`` runs its base with it, giving the one-model
server's tokens; adapters load and unload at run time on their base, come back with it
after it is let go, and count in its footprint within the memory budget."""

import re
from types import SimpleNamespace

import httpx
import pytest
from helpers import CPU
from live_server import LiveServer
from tiny_models import build_hf_model, write_adapter

from spnl_backend import load_backend
from spnl_backend.errors import SettingsError
from spnl_backend.server import run
from spnl_backend.server.models import ModelSet

PROMPT = "The quick brown fox"
KEY = "secret"
SETTINGS = CPU.model_copy(update={"paged_attn_block_size": 16, "prefix_cache_n": 0})


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    """Two models, llama with adapter "one" given at start, and adapter "two" (for qwen2)
    left to load at run time."""
    root = tmp_path_factory.mktemp("several_lora")
    llama, qwen = tiny.hf("llama"), tiny.hf("qwen2")
    write_adapter(root / "one", llama.hf, seed=1)
    write_adapter(root / "two", qwen.hf, seed=2, rank=8)
    given = [f"llama={llama.path}", f"qwen={qwen.path}"]
    settings = SETTINGS.model_copy(update={"lora_adapters": f"llama:one={root / 'one'}"})
    models = run._several(given, None, 300, None, settings)
    server = LiveServer(None, models=models, api_key=KEY)
    paths = {"llama": str(llama.path), "qwen": str(qwen.path)}
    yield server, models, paths, root
    server.stop()
    models.close()


def _complete(server: LiveServer, model: str):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    return server.post("/v1/completions", body, headers={"Authorization": f"Bearer {KEY}"})


def _alone(path: str, spec: str, adapter: str | None) -> str:
    """The one-model server's backend with that adapter: its greedy text."""
    settings = SETTINGS.model_copy(update={"lora_adapters": spec})
    with load_backend(path, settings=settings) as backend:
        return backend.generate(PROMPT, max_tokens=8, temperature=0, adapter=adapter).text


def _post(server: LiveServer, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return server.post(path, body, headers=headers)


def test_an_adapter_routes_to_its_base(served):
    server, models, paths, root = served
    listed = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    data = listed.json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [
        ("llama", None),
        ("qwen", None),
        ("one", "llama"),
    ]
    assert models.loaded() == []  # listed before its base ever loads
    by_adapter = _complete(server, "one")
    assert by_adapter.status_code == 200, by_adapter.text
    assert by_adapter.json()["model"] == "one"
    spec = f"one={root / 'one'}"
    want = _alone(paths["llama"], spec, "one")
    assert by_adapter.json()["choices"][0]["text"] == want
    base = _complete(server, "llama").json()["choices"][0]["text"]
    assert base == _alone(paths["llama"], spec, None) != want
    info = httpx.get(server.url + "/get_server_info", headers={"Authorization": f"Bearer {KEY}"})
    llama = info.json()["memory"]["models"][0]
    assert llama["name"] == "llama"
    assert llama["adapters"] == ["one"]
    assert llama["adapter_bytes"] == models.models["llama"].backend.stats().adapters.nbytes > 0
    assert llama["footprint_bytes"] >= llama["adapter_bytes"]
    lora = {"model": "llama", "prompt": PROMPT, "lora": [{"name": "one"}]}
    refused = _post(server, "/v1/completions", lora)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "lora"
    # An adapter's name is no model elsewhere: Ollama's API runs served models only.
    ollama = _post(server, "/api/generate", {"model": "one", "prompt": "x", "stream": False})
    assert ollama.status_code == 404
    assert "adapter of 'llama'" in ollama.text
    assert _post(server, "/tokenize", {"model": "one", "prompt": "x"}).status_code == 404


def test_load_and_unload_with_two_models(served):
    server, models, paths, root = served
    path = str(root / "two")
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "two"}, key=None).status_code == 401
    for body, param in [
        ({"lora_name": "two", "lora_path": path}, "model"),  # no base named
        ({"lora_name": "two", "lora_path": path, "model": "nope"}, "model"),
        ({"lora_name": "one", "lora_path": path, "model": "qwen"}, "lora_name"),  # taken
        ({"lora_name": "llama", "lora_path": path, "model": "qwen"}, "lora_name"),
        ({"lora_name": "two", "lora_path": str(root / "missing"), "model": "qwen"}, "lora_path"),
    ]:
        refused = _post(server, "/v1/load_lora_adapter", body)
        assert refused.status_code == 400, (body, refused.text)
        assert refused.json()["error"]["param"] == param, refused.text
    loaded = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "two", "lora_path": path, "model": "qwen"}
    )
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["model"] == "qwen"
    ids = [
        (m["id"], m.get("parent"))
        for m in httpx.get(
            server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}
        ).json()["data"]
    ]
    assert ("two", "qwen") in ids
    want = _alone(paths["qwen"], f"two={path}", "two")
    first = _complete(server, "two")
    assert first.json()["choices"][0]["text"] == want
    # Let go (as keep-alive would), its base comes back with the adapter loaded at run time.
    assert models.unload("qwen")
    again = _complete(server, "two")
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == want
    # The adapter given at start, unloaded while its base is let go, stays unloaded.
    assert _complete(server, "one").status_code == 200  # loaded with "one"
    assert models.unload("llama")
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "one"}).status_code == 200
    assert _complete(server, "one").status_code == 404
    assert _complete(server, "llama").status_code == 200
    backend = models.models["llama"].backend
    assert backend is not None
    assert backend.adapters() == []
    unloaded = _post(server, "/v1/unload_lora_adapter", {"lora_name": "two"})
    assert unloaded.json() == {"status": "ok", "model": "qwen", "lora_name": "two"}
    assert _complete(server, "two").status_code == 404
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "two"}).status_code == 404
    assert _post(server, "/lora-adapters", [{"id": 0, "scale": 1}]).status_code == 400


def test_bad_lora_options_with_several_models(tiny, tmp_path):
    given = ["a=/nowhere/a", "b=/nowhere/b"]
    for spec, message in [
        ("one=/x", "expected MODEL:NAME=PATH"),
        ("c:one=/x", r"MODEL one of the served models \(a, b\)"),
        ("a:one=/x,b:one=/y", "'one' is an adapter of 'a''s name already"),
        ("a:b=/x", "'b' is a served model's name already"),
    ]:
        settings = CPU.model_copy(update={"lora_adapters": spec})
        with pytest.raises(SettingsError, match=message):
            run._several(given, None, 300, None, settings)
    with pytest.raises(SettingsError, match="MODEL:NAME=PATH"):
        run.serve(model=given, port=0, lora=["one=/nowhere/one"])
    # A served name holding ':' takes the longest that fits.
    settings = CPU.model_copy(update={"lora_adapters": "m:7b:x=/p"})
    models = run._several(["m=/a", "m:7b=/b"], None, 300, None, settings)
    assert models.adapter_list() == [("x", "m:7b", "/p")]
    # An adapter made for another base fails its base's load, naming the tensor.
    wide = build_hf_model("llama", tmp_path / "wide", overrides={"hidden_size": 96})
    write_adapter(tmp_path / "w", wide.hf, seed=4)
    settings = SETTINGS.model_copy(update={"lora_adapters": f"llama:w={tmp_path / 'w'}"})
    models = run._several(
        [f"llama={tiny.hf('llama').path}", "other=/nowhere"], None, 300, None, settings
    )
    server = LiveServer(None, models=models)
    try:
        failed = _complete(server, "w")
        assert failed.status_code == 500
        message = failed.json()["error"]["message"]
        assert re.search(r"'llama' failed to load: .*lora_[AB]\.weight has shape", message)
    finally:
        server.stop()
        models.close()


class FakeBackend:
    """A backend whose adapters are each 1 MB held."""

    def __init__(self, given: dict[str, str]) -> None:
        self.held, self.closed = dict(given), False

    def close(self) -> None:
        self.closed = True

    def cache_info(self) -> SimpleNamespace:
        return SimpleNamespace(state_bytes=None)

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(adapters=SimpleNamespace(nbytes=len(self.held) << 20))

    def adapters(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(name=n) for n in self.held]

    def load_adapter(self, name: str, path: str) -> None:
        self.held[name] = path

    def unload_adapter(self, name: str) -> None:
        del self.held[name]


def test_adapters_count_in_the_budget(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"\0" * (4 << 20))
    (tmp_path / "b.gguf").write_bytes(b"\0" * (4 << 20))
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "adapter_model.safetensors").write_bytes(b"\0" * (2 << 20))
    given = {"one": str(tmp_path / "one")}
    models = ModelSet(
        {"a": str(tmp_path / "a.gguf"), "b": str(tmp_path / "b.gguf")},
        lambda source: FakeBackend(given if source.endswith("a.gguf") else {}),
        budget_bytes=9 << 20,
        adapters={"a": given},
    )
    assert models.models["a"].estimate() == 6 << 20  # its file and its adapter's, unloaded
    models.acquire("one")  # the adapter's name holds its base
    a = models.models["a"]
    assert a.adapter_bytes == 1 << 20
    assert a.footprint >= 5 << 20  # its file's 4 MB and its adapter's 1 MB held
    before = a.footprint
    models.add_adapter("a", "extra", "/x")
    a.backend.load_adapter("extra", "/x")  # as the server does, before telling the set
    models.count_adapters("a")
    assert a.footprint == before + (1 << 20)
    memory = models.memory()
    assert memory["models"][0]["adapters"] == ["one", "extra"]
    assert memory["models"][0]["adapter_bytes"] == 2 << 20
    models.release("one")
    models.acquire("b")  # 4 MB more: past the budget, so "a" (idle) is let go
    assert models.models["a"].backend is None
    models.release("b")
    models.remove_adapter("one")  # while "a" is let go: not loaded with it again
    back = models.acquire("extra")
    assert sorted(back.held) == ["extra"]
    assert models.base_of("one") is None
