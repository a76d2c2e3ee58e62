"""The one kernel route: a model built with a `KernelChoice` runs where it says, and the
choice alone says where each tensor may run natively."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from spnl_backend import BackendSettings, load_backend
from spnl_backend.compressors import Compressor
from spnl_backend.kernels.cpu.moe import MAX_EXPERTS
from spnl_backend.kernels.dispatch import TORCH_CHOICE, KernelChoice
from spnl_backend.kernels.matmuls import CpuMatmuls
from spnl_backend.kernels.thresholds import NATIVE_MAX_ROWS
from spnl_backend.models.norms import RMSNorm
from spnl_backend.models.rope import RotaryEmbedding
from spnl_backend.quant.linear import QuantEmbedding, QuantizedWeight, QuantLinear


@pytest.fixture(scope="module")
def native(native_kernels):
    return native_kernels


def test_native_kernels_take_float32_cpu_tensors_alone(native):
    choice = KernelChoice(native, matmuls=CpuMatmuls(native))
    assert choice.native_for(torch.zeros(2, 4)) is native
    assert choice.native_for(torch.zeros(2, 4, dtype=torch.bfloat16)) is None
    assert choice.native_for(torch.zeros(2, 4, dtype=torch.float64)) is None
    assert TORCH_CHOICE.native_for(torch.zeros(2, 4)) is None


def test_the_row_limit_of_the_products_bounds_the_native_rows(native):
    limited = KernelChoice(native, native_max_rows=NATIVE_MAX_ROWS)
    rows = torch.zeros(NATIVE_MAX_ROWS, 4)
    assert limited.native_rows(rows) is native
    assert limited.native_rows(torch.zeros(NATIVE_MAX_ROWS + 1, 4)) is None
    assert limited.layer_blocks(rows) is None  # the blocks call no GEMM: every count native
    invariant = KernelChoice(native)
    assert invariant.native_rows(torch.zeros(NATIVE_MAX_ROWS + 1, 4)) is native
    assert invariant.layer_blocks(rows) is native


def test_a_moe_layer_is_native_only_on_the_kernels_and_within_their_experts(native):
    weight = QuantizedWeight.from_float(torch.randn(32, 32), Q.Q8_0)  # inner = hidden = 32
    expert = ((weight.qtype.value, weight.data, 32),) * 3  # gate, up, down
    router = torch.randn(2, 32)
    assert KernelChoice(native).moe_layer(router[:2], [expert] * 2, 1, False) is not None
    assert TORCH_CHOICE.moe_layer(router[:2], [expert] * 2, 1, False) is None
    many = torch.randn(MAX_EXPERTS + 1, 32)
    assert KernelChoice(native).moe_layer(many, [expert] * (MAX_EXPERTS + 1), 1, False) is None


def test_a_method_without_codecs_turns_paging_off():
    def per_sequence(geometry):
        raise AssertionError("not built here")

    plain = Compressor("plain", "test", make_cache=per_sequence)
    paged = KernelChoice(paged=True)
    assert paged.pages(None)
    assert not paged.pages(plain)
    assert not KernelChoice().pages(None)


def test_the_embedding_rows_are_the_twins_on_either_path(native):
    weight = QuantizedWeight.from_float(torch.randn(16, 64), Q.Q8_0)
    ids = torch.tensor([3, 0, 15, 3])
    twin = TORCH_CHOICE.embedding_rows(weight, ids)
    assert torch.equal(twin, weight.rows(ids).dequantize())
    assert torch.equal(KernelChoice(native).embedding_rows(weight, ids), twin)


def test_a_loaded_model_runs_every_layer_on_its_one_choice(tiny):
    backend = load_backend(
        str(tiny.hf("llama").path), settings=BackendSettings(device="cpu", isq="Q8_0")
    )
    model = backend.model
    choice = model.kernels
    assert choice.native is not None
    for module in model.modules():
        if isinstance(module, RMSNorm | RotaryEmbedding):
            assert module.native is choice.native
        elif isinstance(module, QuantLinear):
            assert module.matmuls is choice.matmuls
        elif isinstance(module, QuantEmbedding):
            assert module.kernels is choice
