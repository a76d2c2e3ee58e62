"""gpt-oss as OpenAI's checkpoints store it: the experts as MXFP4 blocks and scales
(``quantization_config.quant_method`` "mxfp4"). They load as MXFP4 and run as stored;
the model computes what transformers computes with those experts dequantized, and what
our own load of the dequantized float weights computes. Any other quantization, and
blocks or scales that do not fit the config, are refused naming the tensor."""

import json
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType
from helpers import model_logits
from safetensors.torch import load_file, save_file
from tiny_models import build_hf_model, mxfp4_microscaling, write_mxfp4_gpt_oss

from spnl_backend import (
    BackendSettings,
    ModelFileError,
    UnsupportedArchitectureError,
    load_backend,
)
from spnl_backend.quant.linear import QuantLinear

PROMPT = "the cat sat on the mat and the dog"
TOKENS = 24
BLOCKS = "model.layers.1.mlp.experts.gate_up_proj_blocks"
SCALES = "model.layers.1.mlp.experts.gate_up_proj_scales"

# The products in float32: the experts compute as their dequantized weights do (the
# default int8 products quantize the activations too; tests/test_moe.py holds them to
# their twin).
CPU = BackendSettings(device="cpu", cpu_matmul="float32")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny float gpt-oss, its MXFP4 checkpoint, and a float checkpoint of the same
    model with the experts dequantized (transformers' layout)."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    tiny = build_hf_model("gpt_oss", root / "float")
    dequantized = write_mxfp4_gpt_oss(tiny, root / "mxfp4")
    plain = root / "dequantized"
    shutil.copytree(tiny.path, plain)
    weights = load_file(plain / "model.safetensors")
    assert dequantized.keys() <= weights.keys()
    save_file({**weights, **dequantized}, plain / "model.safetensors", metadata={"format": "pt"})
    return tiny, root / "mxfp4", plain


@pytest.fixture(scope="module")
def transformers_dequantized(checkpoint):
    """transformers' own load of the MXFP4 checkpoint, its experts dequantized to float32."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    _, path, _ = checkpoint
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()


def test_the_test_quantizer_is_mxfp4_within_half_a_step():
    """The helper's quantizer: each value within half an E2M1 step of its group's scale
    (steps of 0.5 up to 2, 1 up to 4, 2 up to 6), the largest of a group within 6."""
    weight = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(0))
    blocks, scales = mxfp4_microscaling(weight)
    assert (blocks.shape, scales.shape) == ((3, 8, 2, 16), (3, 8, 2))
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    back = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    scale = (2.0 ** (scales.float() - 127)).repeat_interleave(32, -1)
    assert ((back - weight).abs() <= scale).all()  # at most one step of 2 units: 6 vs 4
    groups = weight.unflatten(-1, (-1, 32)).abs().amax(-1)
    assert (groups / 2.0 ** (scales.float() - 127) <= 6).all()


def test_the_experts_load_as_mxfp4_and_compute_as_transformers_dequantized(
    checkpoint, transformers_dequantized
):
    tiny, path, _ = checkpoint
    backend = load_backend(str(path), settings=CPU)
    assert backend.model_config.quantization == "mxfp4"
    layer = backend.model.model.layers[1].mlp
    for expert in layer.experts:
        for proj in (expert.gate_proj, expert.up_proj, expert.down_proj):
            assert isinstance(proj, QuantLinear)
            assert proj.weight_q.qtype == GGMLQuantizationType.MXFP4
    assert not isinstance(layer.gate, QuantLinear)  # the router stays float
    ids = tiny.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        expected = transformers_dequantized(torch.tensor([ids])).logits[0]
        greedy = transformers_dequantized.generate(
            torch.tensor([ids]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False
        )[0, len(ids) :]
        original = tiny.hf(torch.tensor([ids])).logits[0]
    assert not torch.allclose(expected, original, atol=1e-2)  # the experts are quantized
    torch.testing.assert_close(model_logits(backend, ids), expected, rtol=1e-4, atol=1e-4)
    result = backend.generate(prompt_token_ids=ids, max_tokens=TOKENS, temperature=0)
    assert result.token_ids == greedy.tolist()[: len(result.token_ids)]
    assert len(result.token_ids) == TOKENS or result.finish_reason == "stop"


def test_each_expert_holds_its_own_gate_and_up_rows(checkpoint, transformers_dequantized):
    """gate_up's rows interleave gate (even) and up (odd): each expert's blocks dequantize
    to transformers' gate and up columns."""
    _, path, _ = checkpoint
    backend = load_backend(str(path), settings=CPU)
    theirs = transformers_dequantized.model.layers[0].mlp.experts
    for index, expert in enumerate(backend.model.model.layers[0].mlp.experts):
        gate_up = theirs.gate_up_proj[index].detach()
        assert torch.equal(expert.gate_proj.weight_q.dequantize(), gate_up[:, ::2].T)
        assert torch.equal(expert.up_proj.weight_q.dequantize(), gate_up[:, 1::2].T)
        assert torch.equal(expert.down_proj.weight_q.dequantize(), theirs.down_proj[index].T)


def test_the_same_as_our_load_of_the_dequantized_float_weights(checkpoint):
    tiny, path, plain = checkpoint
    quantized = load_backend(str(path), settings=CPU)
    dense = load_backend(str(plain), settings=CPU)
    assert dense.model_config.quantization is None
    assert not any(isinstance(m, QuantLinear) for m in dense.model.modules())
    ids = tiny.tokenizer(PROMPT).input_ids
    torch.testing.assert_close(
        model_logits(quantized, ids), model_logits(dense, ids), rtol=1e-4, atol=1e-4
    )
    prompts = [PROMPT, "once upon a time"]
    expected = [r.token_ids for r in dense.generate(prompts, max_tokens=12, temperature=0)]
    assert [r.token_ids for r in quantized.generate(prompts, max_tokens=12, temperature=0)] == (
        expected
    )


def _variant(checkpoint, tmp_path, config=None, tensors=None):
    """The MXFP4 checkpoint with ``config`` (config.json → config.json) and ``tensors``
    (the tensors → the tensors) applied."""
    _, source, _ = checkpoint
    path = tmp_path / "variant"
    shutil.copytree(source, path)
    if config is not None:
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config(raw)))
    if tensors is not None:
        weights = tensors(load_file(path / "model.safetensors"))
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _with(name, value):
    return lambda weights: {**weights, name: value}


def _without(name):
    return lambda weights: {k: v for k, v in weights.items() if k != name}


def _nan_scale(weights):
    scales = weights[SCALES].clone()
    scales[0, 3, 1] = 0xFF
    return {**weights, SCALES: scales}


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        (
            lambda w: _with(BLOCKS, w[BLOCKS][..., :8].contiguous())(w),
            rf"{BLOCKS}' is uint8 \[8, 192, 2, 8\]; expected uint8 \[8, 192, 2, 16\]",
        ),
        (
            lambda w: _with(SCALES, w[SCALES].to(torch.int16))(w),
            rf"{SCALES}' is int16 \[8, 192, 2\]; expected uint8 \[8, 192, 2\] \(E8M0",
        ),
        (
            lambda w: _with(SCALES, w[SCALES][:, :96].contiguous())(w),
            rf"{SCALES}' is uint8 \[8, 96, 2\]; expected uint8 \[8, 192, 2\]",
        ),
        (_without(SCALES), rf"{BLOCKS}' has no '{SCALES}' beside it"),
        (_nan_scale, rf"{SCALES}' holds 1 NaN exponents"),
    ],
    ids=["blocks-shape", "scales-dtype", "scales-rows", "no-scales", "nan-scale"],
)
def test_malformed_blocks_or_scales_are_refused_naming_the_tensor(
    checkpoint, tmp_path, tensors, message
):
    path = _variant(checkpoint, tmp_path, tensors=tensors)
    with pytest.raises(ModelFileError, match=message):
        load_backend(str(path), settings=CPU)


def test_blocks_without_the_quantization_config_are_refused(checkpoint, tmp_path):
    path = _variant(checkpoint, tmp_path, config=lambda c: {**c, "quantization_config": None})
    with pytest.raises(ModelFileError, match=r"_blocks' is stored as uint8; expected a float"):
        load_backend(str(path), settings=CPU)


@pytest.mark.parametrize(
    ("section", "error", "message"),
    [
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128]},
            UnsupportedArchitectureError,
            r"quant_method 'fp8' is not supported for gpt_oss checkpoints; supported: 'mxfp4'",
        ),
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True},
            UnsupportedArchitectureError,
            r"quant_method 'bitsandbytes' is not supported .* supported: 'mxfp4'",
        ),
        ({"modules_to_not_convert": []}, ModelFileError, r"'quantization_config' is .*quant_meth"),
    ],
    ids=["fp8", "bitsandbytes", "no-method"],
)
def test_other_quantizations_are_refused_naming_the_method(
    checkpoint, tmp_path, section, error, message
):
    path = _variant(checkpoint, tmp_path, config=lambda c: {**c, "quantization_config": section})
    with pytest.raises(error, match=message):
        load_backend(str(path), settings=CPU)


def test_a_family_without_quantized_checkpoints_refuses_mxfp4(tiny, tmp_path):
    path = tmp_path / "llama"
    shutil.copytree(tiny.hf("llama").path, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"'mxfp4' is not supported for llama checkpoints; supported: none",
    ):
        load_backend(str(path), settings=CPU)


def test_isq_quantizes_the_float_projections_and_keeps_the_mxfp4_experts(checkpoint):
    _, path, _ = checkpoint
    backend = load_backend(str(path), settings=BackendSettings(device="cpu", isq="Q8_0"))
    layer = backend.model.model.layers[0]
    assert layer.self_attn.q_proj.weight_q.qtype == GGMLQuantizationType.Q8_0
    expert = layer.mlp.experts[0]
    assert expert.gate_proj.weight_q.qtype == GGMLQuantizationType.MXFP4
    assert expert.down_proj.weight_q.qtype == GGMLQuantizationType.MXFP4
    result = backend.generate(PROMPT, max_tokens=4, temperature=0, ignore_eos=True)
    assert len(result.token_ids) == 4
