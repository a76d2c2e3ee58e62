"""LoRA adapters (PEFT directories) on a tiny base model: the adapter's greedy tokens and
logits equal transformers' with the merged weights ``W + scale * B @ A``; base and adapter
rows sharing a step each get what they get alone; the prefix cache never shares blocks
between adapters; what is not run is refused by name."""

import copy
import json
import math
import re
from functools import cache
from pathlib import Path

import httpx
import pytest
import torch
from gguf import GGMLQuantizationType
from helpers import greedy_with_logits, run_together
from safetensors.torch import load_file, save_file
from tiny_models import build_hf_model

from spnl_backend import BackendSettings, load_backend
from spnl_backend.errors import ModelFileError, RequestError, SettingsError
from spnl_backend.kernels.lora_ref import lora_delta_ref

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT_IDS = [5, 17, 33, 8, 21, 40, 12, 9, 27, 31, 6, 14]
LONG_IDS = [(7 * i + 3) % 50 + 4 for i in range(80)]  # several 16-token blocks
TOKENS = 8


def write_adapter(
    path: Path,
    hf: torch.nn.Module,
    seed: int,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = TARGETS,
    **config,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A random adapter over every projection, in PEFT's files; its (A, B) by module."""
    gen = torch.Generator().manual_seed(seed)
    pairs, tensors = {}, {}
    for name, module in hf.named_modules():
        if name.split(".")[-1] in targets and isinstance(module, torch.nn.Linear):
            a = torch.randn(rank, module.in_features, generator=gen) * 0.3
            b = torch.randn(module.out_features, rank, generator=gen) * 0.3
            pairs[name] = (a, b)
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    fields = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "lora_dropout": 0.0,
        **config,
    }
    (path / "adapter_config.json").write_text(json.dumps(fields))
    return pairs


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
        for bad in ([{"id": 2}], [{"name": "x"}], [{"id": 0}, {"id": 1}], {"id": 0}, [{"ids": 0}]):
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
    with pytest.raises(SettingsError, match="served on one model"):
        serve(model=["a=/nowhere/a", "b=/nowhere/b"], port=0, lora=["one=/nowhere/one"])


def test_a_speculative_draft_is_refused(adapters):
    tiny_model, spec, _ = adapters("llama")
    with pytest.raises(SettingsError, match=r"SPECULATIVE_DRAFT_MODEL.*without a speculative"):
        _backend(str(tiny_model.path), spec, speculative_draft_model=str(tiny_model.path))
