"""LoRA adapters (PEFT directories) on a tiny base model: the adapter's greedy tokens and
logits equal transformers' with the merged weights ``W + scale * B @ A``; base and adapter
rows sharing a step each get what they get alone; the prefix cache never shares blocks
between adapters; what is not run is refused by name."""

import copy
import math
import re
from functools import cache
from pathlib import Path

import httpx
import pytest
import torch
from gguf import GGMLQuantizationType
from helpers import engine_internals, greedy_with_logits, run_together
from llama_cpp_converter import convert_lora
from safetensors.torch import load_file, save_file
from tiny_models import build_hf_model, write_adapter, write_gguf_adapter

from spnl_backend import BackendSettings, load_backend
from spnl_backend.engine.adapters import AdapterUsage
from spnl_backend.errors import AdapterInUseError, ModelFileError, RequestError, SettingsError
from spnl_backend.kernels.lora_ref import lora_delta_ref
from spnl_backend.loader.gguf_file import GGUFFile
from spnl_backend.loader.weights import unpermute_rows

PROMPT_IDS = [5, 17, 33, 8, 21, 40, 12, 9, 27, 31, 6, 14]
LONG_IDS = [(7 * i + 3) % 50 + 4 for i in range(80)]  # several 16-token blocks
TOKENS = 8


def merged(hf: torch.nn.Module, pairs: dict, scale: float) -> torch.nn.Module:
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, (a, b) in pairs.items():
            model.get_submodule(name).weight += scale * (b @ a)
    return model


def hf_greedy(model: torch.nn.Module, ids: list[int], tokens: int):
    """Greedy tokens of transformers' model, and the first step's logits."""
    seq, first = list(ids), None
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(torch.tensor([seq])).logits[0, -1]
            first = logits if first is None else first
            seq.append(int(logits.argmax()))
    return seq[len(ids) :], first


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    """Per architecture: the tiny model and two adapters (one with rsLoRA), each with its
    merged reference model."""
    root = tmp_path_factory.mktemp("lora")

    @cache
    def made(arch: str):
        tiny_model = tiny.hf(arch)
        one = write_adapter(root / arch / "one", tiny_model.hf, seed=1)
        two = write_adapter(root / arch / "two", tiny_model.hf, seed=2, rank=8, use_rslora=True)
        refs = {
            "one": merged(tiny_model.hf, one, 8.0 / 4),
            "two": merged(tiny_model.hf, two, 8.0 / math.sqrt(8)),
        }
        spec = f"one={root / arch / 'one'},two={root / arch / 'two'}"
        return tiny_model, spec, refs

    return made


def convert_to_gguf(adapter: Path, base: Path, out: Path) -> Path:
    """A PEFT adapter directory converted by llama.cpp's own converter."""
    return convert_lora(adapter, base, out)


@cache
def _backend(path: str, spec: str, **extra):
    fields = {"device": "cpu", "paged_attn_block_size": 16, "lora_adapters": spec, **extra}
    return load_backend(path, settings=BackendSettings(**fields))


def _greedy(backend, ids=PROMPT_IDS, tokens=TOKENS, **options):
    result = backend.generate(prompt_token_ids=ids, max_tokens=tokens, temperature=0, **options)
    return result.token_ids


@pytest.mark.parametrize("arch", ["llama", "qwen3", "cohere"])  # (Cohere's q/k rows reordered)
def test_adapter_equals_merged_weights(adapters, arch):
    tiny_model, spec, refs = adapters(arch)
    backend = _backend(str(tiny_model.path), spec, paged_cache_type="f32")  # K/V as computed
    base_tokens, _ = hf_greedy(tiny_model.hf, PROMPT_IDS, TOKENS)
    assert _greedy(backend, ignore_eos=True) == base_tokens
    for name, ref in refs.items():
        want, want_logits = hf_greedy(ref, PROMPT_IDS, TOKENS)
        assert want != base_tokens  # the adapter changes the output: the test can fail
        got, logits, _ = greedy_with_logits(
            backend, TOKENS, prompt_token_ids=PROMPT_IDS, adapter=name, ignore_eos=True
        )
        assert got == want
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_fused_projections(tiny, tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj: lora_B's rows placed on our separate
    projections, lora_A shared."""
    tiny_model = tiny.hf("phi3")
    fused = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    pairs = write_adapter(tmp_path / "f", tiny_model.hf, seed=6, targets=fused)
    assert any(name.endswith("qkv_proj") for name in pairs)
    backend = _backend(str(tiny_model.path), f"f={tmp_path / 'f'}", paged_cache_type="f32")
    want, want_logits = hf_greedy(merged(tiny_model.hf, pairs, 2.0), PROMPT_IDS, TOKENS)
    assert want != hf_greedy(tiny_model.hf, PROMPT_IDS, TOKENS)[0]
    got, logits, _ = greedy_with_logits(
        backend, TOKENS, prompt_token_ids=PROMPT_IDS, adapter="f", ignore_eos=True
    )
    assert got == want
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_request_scale(adapters):
    """``adapter_scale`` multiplies the adapter's scale: equal to the weights merged at that
    scale; blocks computed at one scale are not read at another."""
    tiny_model, spec, _ = adapters("llama")
    backend = _backend(str(tiny_model.path), spec, paged_cache_type="f32")
    pairs = write_adapter(tiny_model.path.parent / "again", tiny_model.hf, seed=1)  # "one"
    want, want_logits = hf_greedy(merged(tiny_model.hf, pairs, 0.5 * 8.0 / 4), PROMPT_IDS, TOKENS)
    got, logits, _ = greedy_with_logits(
        backend,
        TOKENS,
        prompt_token_ids=PROMPT_IDS,
        adapter="one",
        adapter_scale=0.5,
        ignore_eos=True,
    )
    assert got == want
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    backend.reset_prefix_cache()
    ask = dict(prompt_token_ids=LONG_IDS, max_tokens=2, temperature=0, adapter="one")
    assert backend.generate(**ask).usage.cached_tokens == 0
    assert backend.generate(**ask, adapter_scale=0.5).usage.cached_tokens == 0
    assert backend.generate(**ask, adapter_scale=0.5).usage.cached_tokens > 0
    with pytest.raises(RequestError, match="adapter_scale needs an adapter"):
        backend.generate("x", adapter_scale=0.5)


def test_mixed_batch_equals_each_alone(adapters):
    tiny_model, spec, _ = adapters("llama")
    backend = _backend(str(tiny_model.path), spec, prefix_cache_n=0)
    alone = {name: _greedy(backend, adapter=name) for name in (None, "one", "two")}
    assert len(set(map(tuple, alone.values()))) == 3
    calls = [lambda name=name: _greedy(backend, adapter=name) for name in alone] * 2
    together = run_together(backend, *calls)
    assert together == list(alone.values()) * 2


def test_prefix_cache_is_kept_per_adapter(adapters):
    tiny_model, spec, _ = adapters("llama")
    plain = _backend(str(tiny_model.path), spec, prefix_cache_n=0)
    backend = _backend(str(tiny_model.path), spec)
    backend.reset_prefix_cache()

    def run(adapter):
        result = backend.generate(
            prompt_token_ids=LONG_IDS, max_tokens=4, temperature=0, adapter=adapter
        )
        return result.token_ids, result.usage.cached_tokens

    assert run(None)[1] == 0
    for name in ("one", "two"):
        tokens, cached = run(name)
        assert cached == 0  # the base's blocks, and the other adapter's, are not its own
        assert tokens == _greedy(plain, LONG_IDS, 4, adapter=name)
        tokens, cached = run(name)
        assert cached > 0
        assert tokens == _greedy(plain, LONG_IDS, 4, adapter=name)
    assert run(None)[1] > 0


def test_contiguous_cache_is_kept_per_adapter(adapters):
    """Without paged attention, a finished sequence's cache serves its own adapter only."""
    tiny_model, spec, _ = adapters("llama")
    backend = _backend(str(tiny_model.path), spec, paged_attn=False)
    plain = _backend(str(tiny_model.path), spec, prefix_cache_n=0)
    first = backend.generate(prompt_token_ids=LONG_IDS, max_tokens=4, temperature=0)
    assert first.usage.cached_tokens == 0
    other = backend.generate(prompt_token_ids=LONG_IDS, max_tokens=4, temperature=0, adapter="one")
    assert other.usage.cached_tokens == 0
    assert other.token_ids == _greedy(plain, LONG_IDS, 4, adapter="one")
    again = backend.generate(prompt_token_ids=LONG_IDS, max_tokens=4, temperature=0, adapter="one")
    assert again.usage.cached_tokens > 0
    assert again.token_ids == other.token_ids


def test_stream_and_chat_take_the_adapter(adapters):
    tiny_model, spec, _ = adapters("llama")
    backend = _backend(str(tiny_model.path), spec, prefix_cache_n=0)
    prompt = "The quick brown fox"
    for name in (None, "one"):
        whole = backend.generate(prompt, max_tokens=8, temperature=0, adapter=name).text
        assert "".join(backend.stream(prompt, max_tokens=8, temperature=0, adapter=name)) == whole
    assert whole != backend.generate(prompt, max_tokens=8, temperature=0).text
    chatty = _backend(
        str(tiny_model.path), spec, prefix_cache_n=0, chat_template="{{ messages[0].content }}"
    )
    chats = {
        name: chatty.chat(
            [{"role": "user", "content": prompt}], max_tokens=8, temperature=0, adapter=name
        ).text
        for name in (None, "one")
    }
    assert chats[None] != chats["one"]
    with pytest.raises(RequestError, match="adapter='nope'"):
        chatty.chat([{"role": "user", "content": "hi"}], adapter="nope")


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0])
def test_gguf_base(adapters, tiny, qtype):
    """A GGUF base (its q and k rows put back in the checkpoint's order at load) takes the
    adapter's matrices as written for the Hugging Face model, and a quantized one stays
    quantized: on the torch kernels (float activations) it equals transformers with the
    dequantized weights plus ``scale * B @ A``."""
    tiny_model, spec, _ = adapters("llama")
    path = tiny.gguf("llama", qtype)
    backend = _backend(str(path), spec, paged_cache_type="f32", cpu_kernels="torch")
    pairs = write_adapter(path.parent / "again", tiny_model.hf, seed=1)  # "one" once more
    loaded, quantized = _as_loaded(tiny_model.hf, backend.model)
    assert quantized == (0 if qtype == GGMLQuantizationType.F32 else 7 * 3)
    reference = merged(loaded, pairs, 8.0 / 4)
    want, want_logits = hf_greedy(reference, PROMPT_IDS, TOKENS)
    got, logits, _ = greedy_with_logits(
        backend, TOKENS, prompt_token_ids=PROMPT_IDS, adapter="one", ignore_eos=True
    )
    assert got == want
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def _as_loaded(hf: torch.nn.Module, ours: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """transformers' model with our loaded weights where they are quantized (dequantized),
    and how many projections of the layers are."""
    from spnl_backend.quant.linear import QuantEmbedding, QuantLinear

    model = copy.deepcopy(hf)
    quantized = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            module_name, _, field = name.rpartition(".")
            try:
                module = ours.get_submodule(module_name)
            except AttributeError:
                continue
            if isinstance(module, (QuantLinear, QuantEmbedding)) and field == "weight":
                param.copy_(module.weight_q.dequantize())
                quantized += isinstance(module, QuantLinear) and ".layers." in name
    return model, quantized


def test_quantized_base_mixed_batch(adapters):
    """An ISQ base keeps its blocks; the adapters add float products, rows apart."""
    tiny_model, spec, _ = adapters("llama")
    backend = _backend(str(tiny_model.path), spec, isq="Q8_0", prefix_cache_n=0)
    alone = {name: _greedy(backend, adapter=name) for name in (None, "one", "two")}
    assert len(set(map(tuple, alone.values()))) == 3
    calls = [lambda name=name: _greedy(backend, adapter=name) for name in alone]
    assert run_together(backend, *calls) == list(alone.values())


def test_unknown_adapter_in_a_request(adapters):
    tiny_model, spec, _ = adapters("llama")
    backend = _backend(str(tiny_model.path), spec)
    with pytest.raises(RequestError, match=r"no LoRA adapter of that name.*loaded: one, two"):
        _greedy(backend, adapter="three")
    with pytest.raises(RequestError, match="adapter=5"):
        _greedy(backend, adapter=5)
    assert [a.name for a in backend.adapters()] == ["one", "two"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "use_dora = True is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias = 'all' is not supported; accepted: 'none'"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "names embed_tokens"),
        ({"target_modules": ".*proj"}, "a regular expression is not accepted"),
        ({"r": 3}, r"lora_A.weight has shape \(4, \d+\); r = 3"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "only 'LORA'"),
    ],
)
def test_refused_configs(tiny, tmp_path, change, message):
    tiny_model = tiny.hf("llama")
    write_adapter(tmp_path / "a", tiny_model.hf, seed=3, **change)
    with pytest.raises(ModelFileError, match=message):
        _backend(str(tiny_model.path), f"a={tmp_path / 'a'}")


def test_adapter_for_another_base_is_refused(tiny, tmp_path):
    wide = build_hf_model("llama", tmp_path / "wide", overrides={"hidden_size": 96})
    write_adapter(tmp_path / "q", wide.hf, seed=4)
    with pytest.raises(
        ModelFileError,
        match=r"lora_[AB]\.weight has shape \(\d+, \d+\); r = 4 and the base model.s projection",
    ):
        _backend(str(tiny.hf("llama").path), f"q={tmp_path / 'q'}")


def test_missing_or_broken_files_are_named(tiny, tmp_path):
    tiny_model = tiny.hf("llama")
    with pytest.raises(ModelFileError, match=r"nowhere/adapter_config\.json"):
        _backend(str(tiny_model.path), f"a={tmp_path / 'nowhere'}")
    write_adapter(tmp_path / "a", tiny_model.hf, seed=7)
    weights = tmp_path / "a" / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, weights)
    with pytest.raises(ModelFileError, match=rf"{re.escape(name)}.*non-finite"):
        _backend(str(tiny_model.path), f"a={tmp_path / 'a'}")


def test_unexpected_tensor_is_refused(tiny, tmp_path):
    tiny_model = tiny.hf("llama")
    write_adapter(tmp_path / "a", tiny_model.hf, seed=5)
    weights = tmp_path / "a" / "adapter_model.safetensors"
    tensors = load_file(weights)
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 8)
    save_file(tensors, weights)
    with pytest.raises(ModelFileError, match=r"embed_tokens\.lora_embedding_A.*not a LoRA matrix"):
        _backend(str(tiny_model.path), f"a={tmp_path / 'a'}")


@pytest.mark.parametrize("value", ["one", "=path", "a=x,a=y", "bad name=x"])
def test_bad_setting(value):
    with pytest.raises(SettingsError, match="MISTRALRS_LORA_ADAPTERS"):
        BackendSettings(lora_adapters=value)


def test_delta_rows_do_not_depend_on_their_neighbours():
    """The torch twin's rows: the same bits alone as among many (batch invariance)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=gen)
    a, b = torch.randn(8, 96, generator=gen), torch.randn(80, 8, generator=gen)
    together = lora_delta_ref(x, a, b, 0.5)
    for row in (0, 5, 36):
        assert torch.equal(lora_delta_ref(x[row : row + 1], a, b, 0.5)[0], together[row])
    torch.testing.assert_close(together, 0.5 * (x @ a.T) @ b.T, rtol=1e-5, atol=1e-5)


def test_server_model_names_an_adapter(adapters):
    from live_server import MODEL, LiveServer

    tiny_model, spec, _ = adapters("llama")
    backend = _backend(str(tiny_model.path), spec, prefix_cache_n=0)
    server = LiveServer(backend)
    try:
        listed = httpx.get(server.url + "/v1/models").json()["data"]
        assert [m["id"] for m in listed] == [MODEL, "one", "two"]
        assert [m.get("parent") for m in listed] == [None, MODEL, MODEL]
        texts = {}
        for name in (MODEL, "one", "two"):
            body = {"model": name, "prompt": "The quick brown fox", "max_tokens": 8}
            answer = server.post("/v1/completions", {**body, "temperature": 0})
            assert answer.status_code == 200, answer.text
            texts[name] = answer.json()["choices"][0]["text"]
            adapter = None if name == MODEL else name
            alone = backend.generate(
                "The quick brown fox", max_tokens=8, temperature=0, adapter=adapter
            )
            assert texts[name] == alone.text
        assert len(set(texts.values())) == 3
        # llama-server's per-request list: by id (load order) or name, with a scale.
        prompt = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8}
        by_id = server.post("/v1/completions", {**prompt, "temperature": 0, "lora": [{"id": 1}]})
        assert by_id.json()["choices"][0]["text"] == texts["two"]
        half = [{"name": "one", "scale": 0.5}, {"id": 1, "scale": 0}]
        scaled = server.post("/v1/completions", {**prompt, "temperature": 0, "lora": half})
        alone = backend.generate(
            "The quick brown fox", max_tokens=8, temperature=0, adapter="one", adapter_scale=0.5
        )
        assert scaled.json()["choices"][0]["text"] == alone.text
        for bad in (
            [{"id": 2}],
            [{"name": "x"}],
            [{"id": 0}, {"name": "one"}],
            {"id": 0},
            [{"ids": 0}],
        ):
            refused = server.post("/v1/completions", {**prompt, "lora": bad})
            assert refused.status_code == 400, bad
            assert refused.json()["error"]["param"] == "lora"
        missing = server.post("/v1/completions", {"model": "three", "prompt": "x"})
        assert missing.status_code == 404
        assert "three" in missing.json()["error"]["message"]
    finally:
        server.stop()


def test_serve_lora_option_is_checked_before_anything_starts():
    from spnl_backend.server.run import serve

    with pytest.raises(SettingsError, match=r"(?i)lora_adapters.*name=path pairs"):
        serve(model="unused", port=0, lora=["no-path"])
    with pytest.raises(SettingsError, match="with several models, expected MODEL:NAME=PATH"):
        serve(model=["a=/nowhere/a", "b=/nowhere/b"], port=0, lora=["one=/nowhere/one"])


@pytest.fixture(scope="module")
def converted(adapters):
    """Per architecture: adapter "one" converted to GGUF by llama.cpp's converter."""

    @cache
    def made(arch: str) -> Path:
        tiny_model, spec, _ = adapters(arch)
        one = Path(_spec_paths(spec)["one"])
        return convert_to_gguf(one, tiny_model.path, one.parent / "one.gguf")

    return made


def _spec_paths(spec: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in spec.split(","))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_adapter_equals_peft(adapters, converted, arch):
    """llama.cpp's GGUF of adapter "one" on a safetensors base: the PEFT adapter's tokens
    and logits, and transformers' with the weights merged. Llama's q and k lora_b come
    permuted (llama.cpp's rope layout) and are put back as the base's rows are."""
    tiny_model, spec, refs = adapters(arch)
    path = converted(arch)
    backend = _backend(str(tiny_model.path), f"{spec},g={path}", paged_cache_type="f32")
    gguf = GGUFFile(path)
    assert gguf.metadata["general.type"] == "adapter"
    assert gguf.metadata["adapter.type"] == "lora"
    peft_b = load_file(Path(_spec_paths(spec)["one"]) / "adapter_model.safetensors")[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    ]
    gguf_b = gguf.load("blk.0.attn_q.weight.lora_b")
    heads = tiny_model.hf.config.num_attention_heads
    if arch == "llama":  # the converter permutes: a loader that does not undo it fails here
        assert not torch.equal(gguf_b, peft_b)
        assert torch.equal(unpermute_rows(gguf_b, heads), peft_b)
    else:
        assert torch.equal(gguf_b, peft_b)
    want, want_logits = hf_greedy(refs["one"], PROMPT_IDS, TOKENS)
    peft, peft_logits, _ = greedy_with_logits(
        backend, TOKENS, prompt_token_ids=PROMPT_IDS, adapter="one", ignore_eos=True
    )
    got, logits, _ = greedy_with_logits(
        backend, TOKENS, prompt_token_ids=PROMPT_IDS, adapter="g", ignore_eos=True
    )
    assert got == peft == want
    assert torch.equal(logits, peft_logits)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    info = {a.name: a for a in backend.adapters()}
    assert (info["g"].rank, info["g"].scale, info["g"].modules) == (4, 2.0, info["one"].modules)


@pytest.mark.slow
def test_gguf_adapter_on_a_quantized_gguf_base(adapters, converted, tiny):
    """Both formats of one adapter on a Q8_0 GGUF base (its q/k rows unpermuted at load):
    the same bits, and different from the base's."""
    _, spec, _ = adapters("llama")
    base = tiny.gguf("llama", GGMLQuantizationType.Q8_0)
    backend = _backend(
        str(base), f"{spec},g={converted('llama')}", paged_cache_type="f32", prefix_cache_n=0
    )
    peft, peft_logits, _ = greedy_with_logits(
        backend, TOKENS, prompt_token_ids=PROMPT_IDS, adapter="one", ignore_eos=True
    )
    got, logits, _ = greedy_with_logits(
        backend, TOKENS, prompt_token_ids=PROMPT_IDS, adapter="g", ignore_eos=True
    )
    assert got == peft != _greedy(backend, ignore_eos=True)
    assert torch.equal(logits, peft_logits)


def _held_stream(backend, adapter: str, tokens: int = 300):
    """A stream with ``adapter`` that has given its first piece and is not read further:
    its request stays unfinished (the loop pauses it once 64 pieces wait unread)."""
    stream = backend.stream(
        "The quick brown fox", max_tokens=tokens, temperature=0, adapter=adapter, ignore_eos=True
    )
    first = next(stream)
    return stream, first


def test_load_and_unload_at_run_time(adapters):
    """An adapter loaded while the backend runs equals the merged weights; the base's
    tokens do not change with it; unloading is refused while a request runs with it (whose
    output stays its own), then done; a name once unloaded is unknown."""
    tiny_model, spec, refs = adapters("llama")
    paths = _spec_paths(spec)
    backend = load_backend(
        str(tiny_model.path),
        settings=BackendSettings(device="cpu", paged_attn_block_size=16, paged_cache_type="f32"),
    )
    try:
        base = _greedy(backend, ignore_eos=True)
        assert backend.adapters() == []
        with pytest.raises(RequestError, match="no LoRA adapter of that name"):
            _greedy(backend, adapter="one")
        info = backend.load_adapter("one", paths["one"])
        assert (info.name, info.rank, info.scale, info.loaded) == ("one", 4, 2.0, True)
        assert (
            _greedy(backend, adapter="one", ignore_eos=True)
            == hf_greedy(refs["one"], PROMPT_IDS, TOKENS)[0]
        )
        assert _greedy(backend, ignore_eos=True) == base
        with pytest.raises(RequestError, match="loaded already"):
            backend.load_adapter("one", paths["two"])
        with pytest.raises(ModelFileError, match=r"nowhere/adapter_config\.json"):
            backend.load_adapter("bad", str(Path(paths["one"]).parent / "nowhere"))
        with pytest.raises(RequestError, match="lora_name="):
            backend.load_adapter("bad name", paths["one"])
        alone = backend.generate(
            "The quick brown fox", max_tokens=300, temperature=0, adapter="one", ignore_eos=True
        )
        stream, first = _held_stream(backend, "one")
        with pytest.raises(AdapterInUseError, match=r"'one' is in use by 1 unfinished request"):
            backend.unload_adapter("one")
        assert first + "".join(stream) == alone.text
        assert stream.seq.output_token_ids == alone.token_ids
        backend.unload_adapter("one")
        assert backend.adapters() == []
        with pytest.raises(RequestError, match=r"adapter='one': no LoRA adapter"):
            _greedy(backend, adapter="one")
        assert backend.stats().adapters == AdapterUsage(known=0, loaded=0, nbytes=0, max_loaded=0)
    finally:
        backend.close()


def test_a_bound_on_adapters_held(adapters):
    """MISTRALRS_LORA_MAX_LOADED=1: the least recently used idle adapter is evicted and read
    again when asked for, with the same tokens and its prefix-cache blocks still its own; one
    in use is never evicted (another adapter's request is refused meanwhile)."""
    tiny_model, spec, _ = adapters("llama")
    unbounded = _backend(str(tiny_model.path), spec, prefix_cache_n=0)
    want = {name: _greedy(unbounded, LONG_IDS, 4, adapter=name) for name in ("one", "two")}
    backend = _backend(str(tiny_model.path), spec, lora_max_loaded=1)
    sizes = {a.name: a.nbytes for a in unbounded.adapters()}

    def held() -> dict[str, bool]:
        return {a.name: a.loaded for a in backend.adapters()}

    assert held() == {"one": False, "two": True}  # "two" was loaded last
    for name in ("one", "two", "one", "one"):
        result = backend.generate(
            prompt_token_ids=LONG_IDS, max_tokens=4, temperature=0, adapter=name
        )
        assert result.token_ids == want[name]
        assert held() == {"one": name == "one", "two": name == "two"}
        usage = backend.stats().adapters
        assert (usage.known, usage.loaded, usage.nbytes, usage.max_loaded) == (
            2,
            1,
            sizes[name],
            1,
        )
    assert result.usage.cached_tokens > 0  # read again: the same root, its blocks still hit
    stream, _ = _held_stream(backend, "one")
    try:
        with pytest.raises(RequestError, match=r"MISTRALRS_LORA_MAX_LOADED.*all in use"):
            _greedy(backend, adapter="two")
        assert held() == {"one": True, "two": False}
    finally:
        stream.close()
    assert _greedy(backend, LONG_IDS, 4, adapter="two") == want["two"]


def test_server_loads_and_unloads_adapters(adapters):
    """vLLM's load and unload routes and llama-server's /lora-adapters, behind the API
    key; /v1/models follows; a 409 while a request runs with the adapter."""
    from live_server import MODEL, LiveServer

    tiny_model, spec, _ = adapters("llama")
    paths = _spec_paths(spec)
    backend = load_backend(
        str(tiny_model.path), settings=BackendSettings(device="cpu", prefix_cache_n=0)
    )
    server = LiveServer(backend, api_key="secret")
    key = {"headers": {"Authorization": "Bearer secret"}}
    prompt = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}

    def text(body: dict) -> str:
        answer = server.post("/v1/completions", {**prompt, **body}, **key)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["text"]

    def listed() -> list[str]:
        return [m["id"] for m in httpx.get(server.url + "/v1/models", **key).json()["data"]]

    try:
        load = {"lora_name": "one", "lora_path": paths["one"]}
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/lora-adapters"):
            assert server.post(route, load).status_code == 401
        assert httpx.get(server.url + "/lora-adapters").status_code == 401
        loaded = server.post("/v1/load_lora_adapter", load, **key)
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["lora_name"] == "one"
        assert listed() == [MODEL, "one"]
        two = {"lora_name": "two", "lora_path": paths["two"]}
        assert server.post("/v1/load_lora_adapter", two, **key).status_code == 200
        metrics = httpx.get(server.url + "/metrics", **key).text
        held = sum(a.nbytes for a in backend.adapters())
        for line in ("spnl_lora_adapters 2.0", "spnl_lora_adapters_held 2.0"):
            assert line in metrics.splitlines()
        assert f"spnl_lora_adapter_bytes {float(held)}" in metrics.splitlines()
        base = backend.generate("The quick brown fox", max_tokens=8, temperature=0).text
        one = backend.generate(
            "The quick brown fox", max_tokens=8, temperature=0, adapter="one"
        ).text
        assert base != one
        assert text({"model": "one"}) == one
        assert text({"model": MODEL}) == base
        for bad, status in (
            ({"lora_name": "one", "lora_path": paths["two"]}, 400),  # loaded already
            ({"lora_name": MODEL, "lora_path": paths["two"]}, 400),
            ({"lora_name": "x", "lora_path": paths["two"] + "/nowhere"}, 400),
            ({"lora_name": "x"}, 400),
        ):
            refused = server.post("/v1/load_lora_adapter", bad, **key)
            assert refused.status_code == status, refused.text
        refused = server.post(
            "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no"}, **key
        )
        assert "/no/adapter_config.json" in refused.json()["error"]["message"]
        # llama-server's list and global scale: the one adapter at a scale other than 0
        # runs each request that names none.
        adapters_list = httpx.get(server.url + "/lora-adapters", **key).json()
        assert adapters_list == [
            {"id": 0, "name": "one", "path": paths["one"], "scale": 0.0},
            {"id": 1, "name": "two", "path": paths["two"], "scale": 0.0},
        ]
        scales = server.post("/lora-adapters", [{"id": 0, "scale": 1.0}], **key)
        assert [a["scale"] for a in scales.json()] == [1.0, 0.0]
        assert text({"model": MODEL}) == one
        assert text({"model": MODEL, "lora": []}) == base  # its own list wins
        # several at once: each row adds both products; an adapter named twice is refused
        both = server.post("/lora-adapters", [{"id": 0, "scale": 1}, {"id": 1}], **key)
        assert [a["scale"] for a in both.json()] == [1.0, 1.0]
        pair = backend.generate(
            "The quick brown fox", max_tokens=8, temperature=0, adapters=["one", "two"]
        ).text
        assert pair not in (base, one)
        assert text({"model": MODEL}) == pair
        twice = server.post("/lora-adapters", [{"id": 0}, {"name": "one"}], **key)
        assert twice.status_code == 400
        assert "named twice" in twice.json()["error"]["message"]
        server.post("/lora-adapters", [{"id": 0, "scale": 1.0}], **key)
        # in flight: refused with a 409, the request's output unchanged
        alone = backend.generate(
            "The quick brown fox", max_tokens=300, temperature=0, adapter="one", ignore_eos=True
        )
        stream, first = _held_stream(backend, "one")
        busy = server.post("/v1/unload_lora_adapter", {"lora_name": "one"}, **key)
        assert busy.status_code == 409, busy.text
        assert busy.json()["error"]["code"] == "adapter_in_use"
        assert first + "".join(stream) == alone.text
        gone = server.post("/v1/unload_lora_adapter", {"lora_name": "one"}, **key)
        assert gone.status_code == 200, gone.text
        assert listed() == [MODEL, "two"]
        assert text({"model": MODEL}) == base  # its global scale went with it
        assert server.post("/v1/completions", {**prompt, "model": "one"}, **key).status_code == 404
        again = server.post("/v1/unload_lora_adapter", {"lora_name": "one"}, **key)
        assert again.status_code == 404
        assert httpx.get(server.url + "/lora-adapters", **key).json()[0]["id"] == 0
    finally:
        server.stop()
        backend.close()


def test_gguf_adapter_in_llama_cpps_layout(adapters, tmp_path):
    """A GGUF adapter written here in llama.cpp's layout (what the fuzzing mutates): the
    PEFT adapter's bits; alpha 0 runs at scale 1, as llama.cpp reads it."""
    tiny_model, spec, _ = adapters("llama")
    pairs = write_adapter(tmp_path / "again", tiny_model.hf, seed=1)  # "one" once more
    path = write_gguf_adapter(tmp_path / "one.gguf", "llama", pairs, alpha=8.0)
    unit = write_gguf_adapter(tmp_path / "unit.gguf", "llama", pairs, alpha=0.0)
    backend = _backend(
        str(tiny_model.path), f"{spec},g={path},u={unit}", paged_cache_type="f32", prefix_cache_n=0
    )
    got = greedy_with_logits(backend, TOKENS, prompt_token_ids=PROMPT_IDS, adapter="g")
    want = greedy_with_logits(backend, TOKENS, prompt_token_ids=PROMPT_IDS, adapter="one")
    assert got[0] == want[0]
    assert torch.equal(got[1], want[1])
    halved = greedy_with_logits(
        backend, TOKENS, prompt_token_ids=PROMPT_IDS, adapter="one", adapter_scale=0.5
    )
    unit_scale = greedy_with_logits(backend, TOKENS, prompt_token_ids=PROMPT_IDS, adapter="u")
    assert torch.equal(unit_scale[1], halved[1])  # 1 = 0.5 * (8 / 4)


def test_kv_tier_and_pic_are_kept_per_adapter(adapters, tmp_path):
    """The KV tier keys an adapter's blocks under its own root, across a restart: another
    adapter reads none of them, its own and the base's read theirs back."""
    tiny_model, spec, _ = adapters("llama")
    settings = BackendSettings(
        device="cpu", paged_attn_block_size=16, lora_adapters=spec, kv_tier_dir=str(tmp_path)
    )

    def run(backend, adapter):
        result = backend.generate(
            prompt_token_ids=LONG_IDS, max_tokens=4, temperature=0, adapter=adapter
        )
        return result.token_ids, result.usage.tier_hit_tokens

    with load_backend(str(tiny_model.path), settings=settings) as first:
        base, _ = run(first, None)
        one, _ = run(first, "one")
        engine_internals(first).cache.tier.tier.flush()
    with load_backend(str(tiny_model.path), settings=settings) as second:
        assert run(second, "two")[1] == 0
        tokens, hits = run(second, "one")
        assert hits > 0
        assert tokens == one
        tokens, hits = run(second, None)
        assert hits > 0
        assert tokens == base


def test_the_kv_budget_leaves_room_for_the_bound(adapters):
    """With MISTRALRS_LORA_MAX_LOADED, the pool's memory is less the room for the adapters
    the bound lets in beside those held, each the size of the largest."""
    from types import SimpleNamespace

    from spnl_backend.engine.build import _adapter_room

    tiny_model, spec, _ = adapters("llama")
    backend = _backend(str(tiny_model.path), spec)
    loaded = SimpleNamespace(model=backend.model)  # what the room is read from
    sizes = [a.nbytes for a in backend.adapters()]
    assert _adapter_room(loaded, BackendSettings(lora_max_loaded=0)) == 0
    assert _adapter_room(loaded, BackendSettings(lora_max_loaded=2)) == 0
    assert _adapter_room(loaded, BackendSettings(lora_max_loaded=5)) == 3 * max(sizes)


def test_loading_the_first_adapter_keeps_the_base_tokens(adapters, block_runs):
    """An ISQ base runs on the native layer blocks before and after an adapter is first
    loaded at run time (the blocks add the adapters' products): the base's tokens stay."""
    tiny_model, spec, _ = adapters("llama")
    backend = load_backend(
        str(tiny_model.path), settings=BackendSettings(device="cpu", isq="Q8_0", prefix_cache_n=0)
    )
    try:
        before = _greedy(backend, LONG_IDS, 6, ignore_eos=True)
        assert block_runs[0] > 0  # the layer blocks ran the base
        backend.load_adapter("one", _spec_paths(spec)["one"])
        runs = block_runs[0]
        assert _greedy(backend, LONG_IDS, 6, ignore_eos=True) == before
        assert _greedy(backend, LONG_IDS, 6, adapter="one", ignore_eos=True) != before
        assert block_runs[0] > runs  # the layer blocks ran them still
    finally:
        backend.close()


def test_layer_blocks_equal_the_per_op_path_with_adapters(adapters, block_runs):
    """With adapters held, an ISQ base on the native layer blocks gives each adapter's and
    the base's first logits bit for bit as the per-op path does, alone and in one mixed
    batch (the blocks call the per-op path's LoRA kernel at each projection)."""
    tiny_model, spec, _ = adapters("llama")
    settings = BackendSettings(
        device="cpu", isq="Q8_0", prefix_cache_n=0, lora_adapters=spec, paged_attn_block_size=16
    )
    blocks = load_backend(str(tiny_model.path), settings=settings)
    per_op = load_backend(str(tiny_model.path), settings=settings)
    per_op.model.model.use_layer_blocks = False
    try:
        names = (None, "one", "two")
        for name in names:
            runs = block_runs[0]
            got, logits, _ = greedy_with_logits(
                blocks, TOKENS, prompt_token_ids=LONG_IDS, adapter=name, ignore_eos=True
            )
            assert block_runs[0] > runs
            want, want_logits, _ = greedy_with_logits(
                per_op, TOKENS, prompt_token_ids=LONG_IDS, adapter=name, ignore_eos=True
            )
            assert got == want
            assert torch.equal(logits, want_logits)
        calls = [lambda name=name: _greedy(blocks, LONG_IDS, adapter=name) for name in names]
        alone = [_greedy(per_op, LONG_IDS, adapter=name) for name in names]
        assert len(set(map(tuple, alone))) == 3
        assert run_together(blocks, *calls) == alone
    finally:
        blocks.close()
        per_op.close()


@pytest.mark.parametrize(
    ("method", "draft"), [("ngram", None), ("suffix", None), ("auto", "a draft")]
)
def test_adapters_with_speculation_under_tensor_parallelism_are_refused(method, draft):
    from types import SimpleNamespace

    from spnl_backend.engine.build import _adapter_registry

    loaded = SimpleNamespace(
        model=SimpleNamespace(tp=object()),
        implementation="native",
        config=SimpleNamespace(folded_multipliers=None, architecture="LlamaForCausalLM"),
    )
    settings = SimpleNamespace(
        speculative=method if draft is None else "draft",
        lora_adapters="a=/nowhere",
        lora_max_loaded=0,
    )
    with pytest.raises(SettingsError, match="speculative decoding under tensor parallelism"):
        _adapter_registry(loaded, settings, draft)
    # without adapters named the model still runs, with the reason it takes none
    registry, why = _adapter_registry(
        loaded, SimpleNamespace(**{**vars(settings), "lora_adapters": None}), draft
    )
    assert registry is None
    assert "tensor parallelism" in why
