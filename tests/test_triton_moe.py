"""The fused mixture-of-experts kernel (Triton: compiled on a GPU, interpreted on the CPU)
against its torch twin: token counts, top-k 1/2/8, 4 to 64 experts, idle experts."""

import pytest
import torch
from triton_support import DEVICE

pytest.importorskip("triton")

from spnl_backend.kernels.moe_ref import fused_moe_ref
from spnl_backend.kernels.triton_moe import BLOCK_M, fused_moe_triton, sort_pairs

HIDDEN, INNER = 32, 40  # neither a whole number of the kernel's column tiles


def _case(tokens: int, top_k: int, experts: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    w13 = torch.randn(experts, 2 * INNER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(experts, HIDDEN, INNER, generator=gen) / INNER**0.5
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights)]


@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize(("top_k", "experts"), [(1, 4), (2, 4), (2, 16), (8, 64)])
def test_fused_moe_equals_the_twin(tokens, top_k, experts):
    case = _case(tokens, top_k, experts, torch.float32)
    out = fused_moe_triton(*case)
    torch.testing.assert_close(out.cpu(), fused_moe_ref(*case).cpu(), rtol=1e-5, atol=1e-5)


def test_half_precision_experts_accumulate_in_float32():
    case = _case(9, 2, 8, torch.float16, seed=1)
    out = fused_moe_triton(*case)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), fused_moe_ref(*case).cpu(), rtol=2e-2, atol=2e-2)


def test_pairs_are_sorted_by_expert_in_whole_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    pairs, block_expert = sort_pairs(ids, num_experts=5)
    assert block_expert.tolist() == [0, 1, 3]  # idle experts 2 and 4 get no block
    runs = pairs.view(-1, BLOCK_M).tolist()
    padding = ids.numel()
    assert [[p for p in run if p != padding] for run in runs] == [[1, 4], [3], [0, 2, 5]]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
def test_a_model_runs_its_float_experts_through_the_fused_kernel(tiny, arch):
    """What loading on CUDA does (`KernelChoice.fused_moe`), here through the interpreter:
    the experts stacked once (each expert's weights become views of the stacks) and every
    MoE layer through the kernel, with the logits of the per-expert path."""
    from helpers import CPU, model_logits

    from spnl_backend import load_backend
    from spnl_backend.models.layers import SparseMoE

    path = str(tiny.hf(arch).path)
    ids = tiny.hf(arch).tokenizer("the cat sat on the mat").input_ids
    expected = model_logits(load_backend(path, settings=CPU), ids)
    fused = load_backend(path, settings=CPU)
    fused.model.use_fused_moe(fused_moe_triton)
    layers = [m for m in fused.model.modules() if isinstance(m, SparseMoE)]
    assert all(layer.fused is fused_moe_triton for layer in layers)
    w13, _ = layers[0]._stacked
    assert layers[0].experts[1].gate_proj.weight.data_ptr() == w13[1].data_ptr()
    torch.testing.assert_close(model_logits(fused, ids), expected, rtol=1e-4, atol=1e-4)
