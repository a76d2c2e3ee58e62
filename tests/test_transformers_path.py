"""Models without a family module, on transformers' own modeling code over our paged KV
cache (``MISTRALRS_MODEL_IMPL``, `loader.transformers_path`): greedy tokens against
``transformers.generate``, batches and prefix hits against single runs, and each refusal
with its reason."""

import json
import zlib
from functools import cache
from pathlib import Path

import pytest
import torch
from helpers import CPU, PROMPT, SHARED_PREFIX_PROMPTS
from tiny_models import TinyModel, _common, _save, build_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from spnl_backend import BackendSettings, SettingsError, load_backend
from spnl_backend.cli import main
from spnl_backend.errors import UnsupportedArchitectureError
from spnl_backend.loader.resolve import ModelSource
from spnl_backend.loader.transformers_path import Probe, check_probe, choose_implementation
from spnl_backend.models.transformers_lm import LayerCall, TransformersCausalLM

# Decoders transformers has and the registry lacks, each calling the attention interface.
FAMILIES = {
    "helium": {"head_dim": 16},  # Llama-like
    "persimmon": {"qk_layernorm": True},  # partial rotary, LayerNorm per head, relu²
    "gptj": {"rotary_dim": 8},  # interleaved rotary on part of the head, parallel block
}
TRANSFORMERS = BackendSettings(device="cpu", model_impl="transformers")


def _random(model: torch.nn.Module) -> None:
    """Peaked random weights (greedy choices far from ties): norms near one, the rest
    wide."""
    with torch.no_grad():
        for module in model.modules():
            norm = "Norm" in type(module).__name__
            for name, param in module.named_parameters(recurse=False):
                if norm and name == "weight":
                    param.copy_(1.0 + 0.1 * torch.randn_like(param))
                else:
                    param.normal_(0.0, 0.15)


def _tiny(root: Path, model_type: str, overrides: dict | None = None) -> TinyModel:
    return _built(root, model_type, json.dumps(overrides or {}, sort_keys=True))


@cache
def _built(root: Path, model_type: str, overrides: str) -> TinyModel:
    """A tiny random model of ``model_type`` saved under ``root`` (once per overrides)."""
    tokenizer = build_tokenizer()
    keys = {**_common(len(tokenizer)), **json.loads(overrides)}
    config = AutoConfig.for_model(model_type, **keys)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    ).eval()
    _random(model)
    name = f"{model_type}-{zlib.crc32(overrides.encode()):08x}"
    return _save(TinyModel(model_type, root / name, model, tokenizer))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("transformers_path")


@pytest.fixture(scope="module")
def helium(root) -> tuple[TinyModel, object]:
    tiny = _tiny(root, "helium", FAMILIES["helium"])
    return tiny, load_backend(str(tiny.path), settings=CPU)


def _expected(tiny: TinyModel, prompt: str, tokens: int) -> list[int]:
    ids = tiny.tokenizer(prompt).input_ids
    out = tiny.hf.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_tokens_match_transformers_generate(root, model_type):
    tiny = _tiny(root, model_type, FAMILIES[model_type])
    backend = load_backend(str(tiny.path), settings=CPU)  # auto: no family module
    assert isinstance(backend.model, TransformersCausalLM)
    assert backend.model_config.implementation == "transformers"
    expected = _expected(tiny, PROMPT, 24)
    assert len(set(expected)) > 3  # not a degenerate repetition
    assert backend.generate(PROMPT, max_tokens=24, temperature=0).token_ids == expected
    assert backend.cache_info().kind == "paged"


def test_a_batch_of_different_lengths_equals_single_runs(helium):
    tiny, backend = helium
    alone = [
        backend.generate(p, max_tokens=12, temperature=0).token_ids for p in SHARED_PREFIX_PROMPTS
    ]
    together = backend.generate(SHARED_PREFIX_PROMPTS, max_tokens=12, temperature=0)
    assert [r.token_ids for r in together] == alone
    assert alone[1] == _expected(tiny, SHARED_PREFIX_PROMPTS[1], 12)


def test_a_prefix_hit_gives_the_same_tokens(helium):
    tiny, backend = helium
    backend.reset_prefix_cache()
    first = backend.generate(PROMPT, max_tokens=12, temperature=0)
    again = backend.generate(PROMPT + " And again", max_tokens=12, temperature=0)
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens >= 32  # whole blocks of the shared prompt
    assert again.token_ids == _expected(tiny, PROMPT + " And again", 12)


@pytest.mark.parametrize(
    "settings",
    [
        {"paged_attn": False},  # the contiguous cache
        {"speculative_method": "ngram", "speculative_gamma": 4},  # n-gram drafts verified
    ],
)
def test_the_other_caches_and_speculation_give_the_same_tokens(helium, settings):
    tiny, _ = helium
    backend = load_backend(str(tiny.path), settings=BackendSettings(device="cpu", **settings))
    prompt = PROMPT + " " + PROMPT  # repeats, so n-gram drafts are proposed
    result = backend.generate(prompt, max_tokens=16, temperature=0)
    assert result.token_ids == _expected(tiny, prompt, 16)
    if "paged_attn" in settings:
        assert backend.cache_info().kind == "contiguous"
    else:
        assert result.usage.draft_tokens > 0


def test_a_native_family_forced_onto_transformers_matches_native(tiny):
    path = str(tiny.hf("llama").path)
    native = load_backend(path, settings=CPU)
    forced = load_backend(path, settings=TRANSFORMERS)
    assert isinstance(forced.model, TransformersCausalLM)
    assert not isinstance(native.model, TransformersCausalLM)
    expected = native.generate(PROMPT, max_tokens=24, temperature=0).token_ids
    assert forced.generate(PROMPT, max_tokens=24, temperature=0).token_ids == expected


def test_isq_quantizes_transformers_linear_layers(tiny):
    """Q8_0 on both paths: every projection quantized alike (the native path also
    quantizes the embedding, which stays float here), so greedy tokens agree."""
    from spnl_backend.quant.linear import QuantLinear

    path = str(tiny.trained().path)
    native = load_backend(path, settings=BackendSettings(device="cpu", isq="q8_0"))
    forced = load_backend(
        path, settings=BackendSettings(device="cpu", model_impl="transformers", isq="q8_0")
    )
    linears = [m for m in forced.model.hf.modules() if isinstance(m, torch.nn.Linear)]
    assert not linears
    assert sum(isinstance(m, QuantLinear) for m in forced.model.hf.modules()) == 2 * 7 + 1
    prompt = "The capital of France is"
    expected = native.generate(prompt, max_tokens=16, temperature=0).token_ids
    assert forced.generate(prompt, max_tokens=16, temperature=0).token_ids == expected


def test_a_hybrid_is_refused_with_the_reason(root):
    tiny = _tiny(root, "lfm2", {"layer_types": ["conv", "full_attention", "conv"]})
    with pytest.raises(UnsupportedArchitectureError, match="its layers include conv"):
        load_backend(str(tiny.path), settings=CPU)


def test_a_head_that_scales_the_logits_is_refused_by_the_probe(root):
    """Cohere multiplies the logits by logit_scale after its head: the probe pass sees
    that the split forward / compute_logits would not give transformers' logits (Cohere
    has a family module: the transformers path asked for by name)."""
    tiny = _tiny(root, "cohere", {"logit_scale": 0.5})
    with pytest.raises(UnsupportedArchitectureError, match="head does more than project"):
        load_backend(str(tiny.path), settings=TRANSFORMERS)


def test_a_sliding_window_is_refused(tiny):
    settings = TRANSFORMERS
    with pytest.raises(UnsupportedArchitectureError, match="sliding"):
        load_backend(str(tiny.hf("gemma2").path), settings=settings)


def test_a_rope_that_follows_the_pass_length_is_refused(root):
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    tiny = _tiny(root, "helium", {"rope_parameters": rope})
    with pytest.raises(UnsupportedArchitectureError, match="a dynamic rope"):
        load_backend(str(tiny.path), settings=CPU)


@pytest.mark.parametrize(
    ("calls", "reason"),
    [
        ([], "no layer calls"),
        ([LayerCall(0, 4, 2, 16, 16, 0.25, ())], "only 1 of its 3 layers"),
        ([LayerCall(i, 4, 2, 16, 16, 0.25, ("softcap=50.0",)) for i in range(3)], "softcap"),
        ([LayerCall(0, 4, 2, 16, 16, 0.25, ())] * 3, "layer_idx"),
        ([LayerCall(i, 4, 2 + i % 2, 16, 16, 0.25, ()) for i in range(3)], "differ in shape"),
    ],
)
def test_the_probe_refuses_what_it_cannot_run(calls, reason):
    config = AutoConfig.for_model("helium", num_hidden_layers=3)
    with pytest.raises(UnsupportedArchitectureError, match=reason):
        check_probe(Probe(calls, head_exact=True, vocab=320), config, Path("config.json"))


def test_native_refuses_a_model_type_without_a_module(helium, monkeypatch):
    tiny, _ = helium
    monkeypatch.setenv("MISTRALRS_MODEL_IMPL", "native")
    with pytest.raises(UnsupportedArchitectureError, match="MISTRALRS_MODEL_IMPL=native"):
        load_backend(str(tiny.path), settings=BackendSettings(device="cpu"))


def test_an_invalid_value_names_the_accepted_ones(monkeypatch):
    monkeypatch.setenv("MISTRALRS_MODEL_IMPL", "hf")
    with pytest.raises(
        SettingsError, match=r"MISTRALRS_MODEL_IMPL='hf'.*auto, native, transformers"
    ):
        BackendSettings()


def test_gguf_is_refused_on_the_transformers_path(tmp_path):
    source = ModelSource("gguf", tmp_path / "model.gguf", "model.gguf")
    with pytest.raises(SettingsError, match="safetensors models only"):
        choose_implementation(source, "transformers")
    assert choose_implementation(source, "auto")[0] == "native"


def test_pic_is_refused_on_the_transformers_path(helium):
    _, backend = helium
    with pytest.raises(Exception, match="transformers' modeling code"):
        backend.generate(blocks=[("plus", "A block."), ("cross", "Why?")], max_tokens=2)


def test_pic_settings_and_adapters_are_refused_at_load(helium, tmp_path):
    tiny, _ = helium
    settings = BackendSettings(device="cpu", pic_reuse="relaxed")
    with pytest.raises(SettingsError, match=r"MISTRALRS_PIC_REUSE=relaxed.*transformers"):
        load_backend(str(tiny.path), settings=settings)
    settings = BackendSettings(device="cpu", lora_adapters=f"a={tmp_path}")
    with pytest.raises(SettingsError, match=r"MISTRALRS_LORA_ADAPTERS.*transformers"):
        load_backend(str(tiny.path), settings=settings)


def test_info_says_which_path_and_why(helium, tiny, monkeypatch, capsys):
    tiny_helium, _ = helium
    assert main(["info", "--model", str(tiny_helium.path)]) == 0
    out = capsys.readouterr().out
    assert "implementation  transformers" in out
    assert "'helium' has no family module" in out
    monkeypatch.setenv("MISTRALRS_MODEL_IMPL", "transformers")
    assert main(["info", "--json", "--model", str(tiny.hf("llama").path)]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["implementation"] == "transformers"
    assert model["why"] == "MISTRALRS_MODEL_IMPL=transformers"
