"""Phi-2, StarCoder2 and GPT-NeoX beyond their tiny models (which tests/test_models.py
runs): their variants against transformers, checkpoints as the hub stores them, and the
native layer blocks declining what they cannot run (LayerNorms, parallel residuals)."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from helpers import PROMPT, engine_logits
from safetensors.torch import load_file, save_file
from tiny_models import build_hf_model

from spnl_backend import BackendSettings, load_backend
from spnl_backend.errors import ModelFileError
from spnl_backend.models.native_blocks import _blocks_run
from spnl_backend.models.norms import norm_of

F32 = BackendSettings(device="cpu", paged_cache_type="f32")


def _matches_transformers(model, path) -> None:
    ids = model.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        reference = model.hf(torch.tensor([ids])).logits[0]
        expected = model.hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    with load_backend(str(path), settings=F32) as backend:
        ours = engine_logits(backend, ids)
        tokens = backend.generate(PROMPT, max_tokens=8, temperature=0).token_ids
    assert reference.std() > 0.5  # peaked enough that the comparison means something
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    assert tokens == expected[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    ("arch", "variant"),
    [
        ("gpt_neox", {"use_parallel_residual": False}),  # attention, then the MLP on its sum
        ("gpt_neox", {"attention_bias": False}),  # q, k, v and o unbiased, the MLP biased
        ("starcoder2", {"use_bias": False}),  # no bias anywhere, the LayerNorms' aside
        ("starcoder2", {"sliding_window": 8}),  # a window the 30-token prompt crosses
        ("nemotron", {"attention_bias": True, "mlp_bias": True}),  # biases on every projection
        ("olmo", {"clip_qkv": None}),  # unclamped
        # attention, then the MLP on its sum through a norm of its own; no q/k norms or biases
        ("stablelm", {"use_parallel_residual": False, "qk_layernorm": False}),
        ("stablelm", {"use_qkv_bias": False}),
    ],
)
def test_variants_match_transformers(tmp_path, arch, variant):
    _matches_transformers(build_hf_model(arch, tmp_path, overrides=variant), tmp_path)


def test_a_pythia_checkpoint_with_its_old_buffers_loads(tmp_path):
    """Pythia's files carry the causal mask (bool), a masked-bias scalar and the rotary
    frequencies beside the weights: left unread, the logits are transformers'."""
    model = build_hf_model("gpt_neox", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for layer in range(model.hf.config.num_hidden_layers):
        stem = f"gpt_neox.layers.{layer}.attention."
        tensors[stem + "bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
        tensors[stem + "masked_bias"] = torch.tensor(-1e9)
        tensors[stem + "rotary_emb.inv_freq"] = torch.rand(2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _matches_transformers(model, tmp_path)


def test_phi_with_q_and_k_layernorms_is_refused(tmp_path):
    build_hf_model("phi", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "qk_layernorm": True}))
    with pytest.raises(ModelFileError, match=r"qk_layernorm.*not supported"):
        load_backend(str(tmp_path), settings=F32)


def test_a_stablelm_missing_a_heads_q_norm_is_refused(tmp_path):
    """The per-head q norms are stacked a row per head: a head without one is named."""
    build_hf_model("stablelm", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.q_layernorm.norms.2.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFileError, match=r"layers\.1\.self_attn\.q_norm.*every head"):
        load_backend(str(tmp_path), settings=F32)


@pytest.mark.parametrize(
    ("kind", "offset", "affine"), [("layer_1p", 1.0, True), ("layer_plain", 0.0, False)]
)
def test_layernorm_kinds_match_torch(kind, offset, affine):
    """Nemotron's LayerNorm1p (weight as 1 + w, with a bias) and OLMo's weightless one."""
    norm = norm_of(SimpleNamespace(rms_norm_eps=1e-5), 64, None, kind)  # (its eps alone read)
    assert (norm.weight is not None) == affine
    assert (norm.bias is not None) == affine
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    weight = bias = None
    if affine:
        norm.weight.data, norm.bias.data = torch.randn(64), torch.randn(64)
        weight, bias = norm.weight.float() + offset, norm.bias.float()
    expected = torch.nn.functional.layer_norm(x.float(), (64,), weight, bias, 1e-5)
    torch.testing.assert_close(norm(x), expected.to(torch.bfloat16))


def test_a_gpt_neox_whose_fused_qkv_disagrees_with_the_config_is_refused(tmp_path):
    """Rows that are not q, k and v of every head cannot be put in order: refused by name."""
    build_hf_model("gpt_neox", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "gpt_neox.layers.0.attention.query_key_value.weight"
    tensors[name] = tensors[name][:-16]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFileError, match=r"query_key_value.*q, k and v of each head"):
        load_backend(str(tmp_path), settings=F32)


@pytest.mark.parametrize("change", [{"norms": "parallel"}, {"norms": "shared"}, {"norm": "layer"}])
def test_the_blocks_decline_a_layer_they_cannot_run(tiny, change):
    """A Llama's layers run on the native blocks; one layer described with a parallel
    residual or LayerNorms makes the whole model take the per-op path."""
    settings = BackendSettings(device="cpu", isq="Q8_0")
    with load_backend(str(tiny.hf("llama").path), settings=settings) as backend:
        backbone = backend.model.model
        layers = list(backbone.layers)
        assert _blocks_run(layers, backbone.norm)
        layers[1].spec = dataclasses.replace(layers[1].spec, **change)
        assert not _blocks_run(layers, backbone.norm)


def test_unbiased_layernorm_layers_take_the_per_op_path(tmp_path, block_runs):
    """StarCoder2 without biases: quantized projections the blocks could multiply, but
    LayerNorms and a plain MLP they have no call for."""
    build_hf_model("starcoder2", tmp_path, overrides={"use_bias": False})
    settings = BackendSettings(device="cpu", isq="Q8_0")
    with load_backend(str(tmp_path), settings=settings) as backend:
        assert backend.generate(PROMPT, max_tokens=4, temperature=0).token_ids
    assert block_runs[0] == 0
