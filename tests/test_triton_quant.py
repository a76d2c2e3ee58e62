"""The Triton quantized kernels against their torch twins, for every GGML format: under
Triton's interpreter on the CPU, compiled on a GPU (where the tests carry `cuda`)."""

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from triton_support import DEVICE, load_kernels

from spnl_backend import BackendSettings, load_backend
from spnl_backend.kernels.matmuls import (
    quantized_matmul_ref,
    quantized_matmuls_ref,
    quantized_matmuls_triton,
    quantized_matmuls_triton_fastest,
)
from spnl_backend.kernels.thresholds import TRITON_FUSED_ROWS
from spnl_backend.quant.linear import QuantEmbedding, QuantizedWeight, QuantLinear
from spnl_backend.quant.quantize import QUANTIZERS

pytest.importorskip("triton")
load_kernels()  # refuses to run uninterpreted without a GPU
from spnl_backend.kernels.triton_quant import dequantize_triton, qmatmul_triton  # noqa: E402

pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []
TYPES = sorted(QUANTIZERS, key=lambda t: t.value)


def _weight(qtype: Q, rows: int, seed: int = 0) -> QuantizedWeight:
    # Two blocks of 256 for the K-quants; 96 (three 32-blocks, not a multiple of the 64-wide
    # tile) for the others. 70 rows: a partial tile of 64.
    cols = 512 if qtype.value >= Q.Q2_K.value else 96
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator)
    weight[3] = 0.0  # an all-zero row
    weight[5, :32] = 2.5  # a block of one repeated value
    return QuantizedWeight.from_float(weight, qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_exact(qtype):
    weight = _weight(qtype, rows=70)
    out = dequantize_triton(weight.data.to(DEVICE), qtype, weight.shape)
    torch.testing.assert_close(out.cpu(), weight.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m_rows", [1, 3, 17])
def test_fused_product_equals_the_twin(qtype, m_rows):
    weight = _weight(qtype, rows=70, seed=m_rows)
    x = torch.randn(m_rows, weight.shape[1], generator=torch.Generator().manual_seed(1))
    out = qmatmul_triton(x.to(DEVICE), weight.data.to(DEVICE), qtype, weight.shape[0])
    expected = quantized_matmul_ref(x, weight)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m_rows", [1, 17])
def test_mxfp4_decodes_exactly_and_multiplies_as_the_twin(m_rows):
    """gpt-oss's MXFP4 experts as stored: random blocks (scales 2^-12 to 2^-1, the two
    denormal ones among them), against the torch dequantizer and its product."""
    gen = torch.Generator().manual_seed(m_rows)
    blocks = torch.randint(0, 256, (70 * 3, 17), dtype=torch.uint8, generator=gen)
    blocks[:, 0] = torch.randint(116, 128, (len(blocks),), dtype=torch.uint8, generator=gen)
    blocks[:2, 0] = torch.tensor([0, 1], dtype=torch.uint8)
    weight = QuantizedWeight(blocks.view(70, -1), Q.MXFP4, (70, 96))
    out = dequantize_triton(weight.data.to(DEVICE), Q.MXFP4, weight.shape)
    assert torch.equal(out.cpu(), weight.dequantize())
    x = torch.randn(m_rows, 96, generator=gen)
    product = qmatmul_triton(x.to(DEVICE), weight.data.to(DEVICE), Q.MXFP4, 70)
    torch.testing.assert_close(product.cpu(), quantized_matmul_ref(x, weight), rtol=1e-4, atol=1e-4)


def test_dequantize_into_half_precision():
    weight = _weight(Q.Q4_K, rows=8)
    out = dequantize_triton(weight.data.to(DEVICE), Q.Q4_K, weight.shape, torch.float16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.cpu().float(), weight.dequantize(), rtol=1e-3, atol=1e-3)


def test_many_rows_unpack_then_multiply():
    weights = [_weight(Q.Q6_K, rows=70), _weight(Q.Q4_K, rows=40, seed=2)]
    x = torch.randn(80, 512, generator=torch.Generator().manual_seed(3))
    out = quantized_matmuls_triton(x.to(DEVICE), [w.to(DEVICE) for w in weights])
    torch.testing.assert_close(out.cpu(), quantized_matmuls_ref(x, weights), rtol=1e-4, atol=1e-4)


def test_tiled_weights_reach_triton_as_rows():
    """The CPU's tiles (`quant.tiles`) are its own kernels' layout: Triton reads a tiled
    weight's rows (a model loaded on the CPU and handed Triton's products, as below)."""
    from spnl_backend.kernels.cpu import cpu_kernels

    native = cpu_kernels()
    if native is None or not native.tiles_native(Q.Q6_K):
        pytest.skip("no tile kernels compiled here")
    weights = [_weight(Q.Q6_K, rows=32), _weight(Q.Q4_K, rows=48, seed=2)]
    tiled = [w.as_tiles(native) for w in weights]
    assert all(w.tiled for w in tiled)
    on_device = [w.to(DEVICE) for w in tiled]  # off the host, tiles become rows
    generator = torch.Generator().manual_seed(4)
    for rows, matmuls in [
        (3, quantized_matmuls_triton),
        (TRITON_FUSED_ROWS + 1, quantized_matmuls_triton_fastest),  # dequantized, then a GEMM
    ]:
        x = torch.randn(rows, 512, generator=generator)
        out = matmuls(x.to(DEVICE), on_device)
        torch.testing.assert_close(
            out.cpu(), quantized_matmuls_ref(x, weights), rtol=1e-4, atol=1e-4
        )


def _quantized_layers(backend) -> list:
    model = backend.model
    return [m for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding)]


def _matmuls_of(layer):
    """The products a quantized layer runs: a linear's own, an embedding's (its tied
    output projection) those of the kernels it was given."""
    return layer.kernels.matmuls if isinstance(layer, QuantEmbedding) else layer.matmuls


def _use_matmuls(layer, matmuls) -> None:
    if isinstance(layer, QuantEmbedding):
        layer.kernels = dataclasses.replace(layer.kernels, matmuls=matmuls)
    else:
        layer.matmuls = matmuls


@pytest.mark.slow  # ~25 s interpreted
def test_isq_model_through_triton_gives_the_twins_greedy_tokens(tiny):
    path = str(tiny.trained().path)
    prompts = ["The capital of France is", "def add(a, b):"]
    reference = load_backend(path, settings=BackendSettings(device="cpu", isq="Q4K"))
    for layer in _quantized_layers(reference):
        _use_matmuls(layer, quantized_matmuls_ref)
    expected = reference.generate(prompts, max_tokens=4, temperature=0)
    backend = load_backend(path, settings=BackendSettings(device=DEVICE, isq="Q4K"))
    layers = _quantized_layers(backend)
    if DEVICE == "cpu":  # the platform picks the native kernels on the CPU; use Triton's
        for layer in layers:
            _use_matmuls(layer, quantized_matmuls_triton)
    assert layers
    assert all(_matmuls_of(layer) is quantized_matmuls_triton for layer in layers)
    results = backend.generate(prompts, max_tokens=4, temperature=0)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
