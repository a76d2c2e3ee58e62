"""Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE) from safetensors: each against
transformers on the same tiny random model, its routing rule included."""

import shutil

import pytest
import torch
from gguf import GGMLQuantizationType
from helpers import CPU, model_logits
from tiny_models import MOE_ARCHITECTURES

from spnl_backend import BackendSettings, UnsupportedArchitectureError, load_backend
from spnl_backend.models.layers import GatedMLP, SparseMoE
from spnl_backend.quant.linear import QuantLinear

PROMPT = "the cat sat on the mat and the dog"
TOKENS = 32


@pytest.fixture(scope="module")
def moe(tiny):
    return {arch: (tiny.hf(arch), tiny.backend(arch)) for arch in MOE_ARCHITECTURES}


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_logits_and_greedy_tokens_equal_transformers(moe, arch):
    reference, backend = moe[arch]
    ids = reference.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        expected = reference.hf(torch.tensor([ids])).logits[0]
        greedy = reference.hf.generate(
            torch.tensor([ids]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False
        )[0, len(ids) :]
    assert torch.allclose(model_logits(backend, ids), expected, atol=1e-4)
    result = backend.generate(prompt_token_ids=ids, max_tokens=TOKENS, temperature=0)
    assert result.token_ids == greedy.tolist()[: len(result.token_ids)]
    assert len(result.token_ids) == TOKENS or result.finish_reason == "stop"


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_the_router_chooses_as_transformers_does(moe, arch):
    reference, backend = moe[arch]
    ours = next(m for m in backend.model.modules() if isinstance(m, SparseMoE))
    theirs = reference.hf.model.layers[0].mlp.gate
    x = torch.randn(64, reference.hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    experts, weights = ours.route(x)
    with torch.no_grad():
        _, their_weights, their_experts = theirs(x)
    assert torch.equal(experts, their_experts)
    assert torch.allclose(weights.float(), their_weights.float(), atol=1e-6)


def test_qwen3_moe_keeps_its_dense_layers(moe):
    layers = moe["qwen3_moe"][1].model.model.layers
    assert [type(layer.mlp) for layer in layers] == [SparseMoE, GatedMLP, SparseMoE]


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_batched_paged_or_not_and_fused_files_give_the_same_tokens(moe, arch, tmp_path):
    reference, backend = moe[arch]
    prompts = [PROMPT, "once upon a time", "x = 1"]
    alone = [backend.generate(p, max_tokens=12, temperature=0).token_ids for p in prompts]
    batched = backend.generate(prompts, max_tokens=12, temperature=0)
    assert [r.token_ids for r in batched] == alone
    plain = load_backend(
        str(reference.path), settings=BackendSettings(device="cpu", paged_attn=False)
    )
    assert [plain.generate(p, max_tokens=12, temperature=0).token_ids for p in prompts] == alone
    fused = tmp_path / "fused"  # transformers' own layout: experts stacked [E, 2I, H]
    reference.hf.save_pretrained(fused, save_original_format=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(reference.path / name, fused / name)
    from_fused = load_backend(str(fused), settings=CPU)
    ids = reference.tokenizer(PROMPT).input_ids
    assert torch.equal(model_logits(from_fused, ids), model_logits(backend, ids))


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_isq_quantizes_every_expert_and_computes_with_its_blocks(moe, arch):
    """Float activations in the products, so the quantized model must compute exactly
    what the same model with each block dequantized into a float projection computes."""
    reference, _ = moe[arch]
    settings = BackendSettings(device="cpu", isq="Q8_0", cpu_matmul="float32")
    quantized = load_backend(str(reference.path), settings=settings)
    moe_layer = next(m for m in quantized.model.modules() if isinstance(m, SparseMoE))
    assert all(isinstance(e.gate_proj, QuantLinear) for e in moe_layer.experts)
    assert not isinstance(moe_layer.gate, QuantLinear)  # the router stays in float
    ids = reference.tokenizer(PROMPT).input_ids
    expected = model_logits(quantized, ids)
    _dequantize_in_place(quantized)
    assert torch.allclose(model_logits(quantized, ids), expected, atol=1e-4)


def test_speculative_decoding_with_an_moe_target(moe, tiny):
    reference, backend = moe["mixtral"]
    expected = backend.generate(PROMPT, max_tokens=16, temperature=0).token_ids
    for draft in (
        {"speculative_draft_isq": "Q8_0"},
        {"speculative_draft_model": str(tiny.hf("llama").path)},
    ):
        spec = load_backend(
            str(reference.path),
            settings=BackendSettings(device="cpu", speculative_gamma=4, **draft),
        )
        result = spec.generate(PROMPT, max_tokens=16, temperature=0)
        assert result.token_ids == expected
        assert result.usage.draft_tokens > 0


def test_an_unsupported_moe_variant_names_the_supported_ones(tmp_path, tiny):
    import json

    source = tiny.hf("qwen3_moe").path
    other = tmp_path / "qwen2moe"
    shutil.copytree(source, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "qwen2_moe"}))
    with pytest.raises(UnsupportedArchitectureError, match="qwen3_moe, mixtral, olmoe"):
        load_backend(str(other), settings=CPU)


def test_a_compressed_cache_and_a_constraint_run_an_moe_model(moe):
    reference, _ = moe["olmoe"]
    settings = BackendSettings(device="cpu", kv_cache_compression="int8")
    compressed = load_backend(str(reference.path), settings=settings)
    result = compressed.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert len(result.token_ids) == 8
    chat = compressed.generate(PROMPT, max_tokens=8, temperature=0, choice=["yes", "no"])
    assert chat.text in ("yes", "no")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_gguf_twins_with_stacked_experts(moe, tiny, arch):
    """llama.cpp's layout: ``ffn_gate_inp`` and the experts stacked per projection
    (``ffn_gate_exps`` ...). Float: the same logits as the safetensors model. Q8_0: each
    expert keeps its own blocks (close to its float weights) and the model computes
    exactly what those blocks dequantized compute."""
    reference, backend = moe[arch]
    ids = reference.tokenizer(PROMPT).input_ids
    float_twin = load_backend(str(tiny.gguf(arch, GGMLQuantizationType.F32)), settings=CPU)
    assert float_twin.model_config.architecture == arch
    assert torch.allclose(model_logits(float_twin, ids), model_logits(backend, ids), atol=1e-5)
    settings = BackendSettings(device="cpu", cpu_matmul="float32")
    quantized = load_backend(str(tiny.gguf(arch, GGMLQuantizationType.Q8_0)), settings=settings)
    layer = quantized.model.model.layers[0].mlp
    stacked = reference.hf.model.layers[0].mlp.experts.gate_up_proj.detach()
    inner = stacked.shape[1] // 2
    for expert, mlp in enumerate(layer.experts):
        blocks = mlp.gate_proj.weight_q.dequantize().float()
        assert torch.allclose(blocks, stacked[expert, :inner], atol=0.02)
    expected = model_logits(quantized, ids)
    _dequantize_in_place(quantized)
    assert torch.allclose(model_logits(quantized, ids), expected, atol=1e-4)


def test_an_olmoe_gguf_is_refused_with_the_supported_ones(tiny):
    path = tiny.gguf("olmoe", GGMLQuantizationType.F32)
    with pytest.raises(UnsupportedArchitectureError, match="'olmoe' is not supported"):
        load_backend(str(path), settings=CPU)


def _dequantize_in_place(backend) -> None:
    """Every quantized projection replaced by a float one holding its blocks' values."""
    for name, module in list(backend.model.named_modules()):
        if isinstance(module, QuantLinear):
            parent, _, attr = name.rpartition(".")
            dense = torch.nn.Linear(module.in_features, module.out_features, bias=False)
            dense.weight = torch.nn.Parameter(module.weight_q.dequantize().float())
            setattr(backend.model.get_submodule(parent), attr, dense)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_a_decode_step_of_quantized_experts_equals_the_grouped_path(moe, arch):
    """One token takes a shortcut (its experts' gate and up in one native pass): the same
    numbers as the grouped path, so a sequence's tokens do not depend on its batch."""
    reference, _ = moe[arch]
    quantized = load_backend(
        str(reference.path), settings=BackendSettings(device="cpu", isq="Q8_0")
    )
    layer = next(m for m in quantized.model.modules() if isinstance(m, SparseMoE))
    x = torch.randn(5, reference.hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        together = layer(x)  # the grouped path
        alone = torch.cat([layer(row[None]) for row in x])  # the shortcut, row by row
    assert torch.equal(alone, together)
    prompts = [PROMPT, "once upon a time", "x = 1"]
    singly = [quantized.generate(p, max_tokens=10, temperature=0).token_ids for p in prompts]
    batched = quantized.generate(prompts, max_tokens=10, temperature=0)
    assert [r.token_ids for r in batched] == singly


def test_a_top_k_wider_than_one_native_call_decodes_on_the_grouped_path(tmp_path):
    """33 experts a token: more gate and up products than one native call takes (64)."""
    from tiny_models import _common, build_tokenizer
    from transformers import AutoModelForCausalLM, OlmoeConfig

    tokenizer = build_tokenizer()
    config = OlmoeConfig(**_common(len(tokenizer)), num_experts=36, num_experts_per_tok=33)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    backend = load_backend(str(tmp_path), settings=BackendSettings(device="cpu", isq="Q8_0"))
    alone = backend.generate(PROMPT, max_tokens=4, temperature=0, ignore_eos=True)
    batched = backend.generate([PROMPT, "x = 1"], max_tokens=4, temperature=0, ignore_eos=True)
    assert batched[0].token_ids == alone.token_ids
    assert len(alone.token_ids) == 4
