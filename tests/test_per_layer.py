"""Gemma 4's per-layer projection packed as a float16 native product."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

import spnl_backend.kernels.cpu as cpu
from spnl_backend.kernels.matmuls import CpuMatmuls, quantized_matmuls_ref
from spnl_backend.models.per_layer import packed_projection
from spnl_backend.quant.linear import QuantLinear


@pytest.fixture(scope="module")
def matmuls():
    native = cpu.cpu_kernels()
    if native is None:
        pytest.fail("the CPU kernels did not build: is there a C compiler?")
    return CpuMatmuls(native)


def _projection(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


def test_a_float16_valued_projection_becomes_a_float16_product(matmuls):
    weight = torch.randn(48, 64).to(torch.float16).float()
    packed = packed_projection(_projection(weight), matmuls)
    assert isinstance(packed, QuantLinear)
    assert packed.weight_q.qtype == Q.F16
    assert torch.equal(packed.weight_q.dequantize(), weight)
    x = torch.randn(3, 64)
    torch.testing.assert_close(packed(x), x @ weight.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed(x[:1]), x[:1] @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "weight",
    [torch.randn(48, 64), torch.randn(48, 40).to(torch.float16).float()],
    ids=["not-float16-exact", "rows-not-whole-blocks"],
)
def test_other_projections_stay_float(matmuls, weight):
    layer = _projection(weight)
    assert packed_projection(layer, matmuls) is layer


def test_without_the_cpu_kernels_the_projection_stays_float():
    layer = _projection(torch.randn(48, 64).to(torch.float16).float())
    assert packed_projection(layer, quantized_matmuls_ref) is layer
