"""The fused mixture-of-experts kernel (Triton: compiled on a GPU, interpreted on the CPU)
against its torch twin: token counts, top-k 1/2/8, 4 to 64 experts, idle experts; float
experts and experts kept in GGML blocks, every type the kernel decodes."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from triton_support import DEVICE

pytest.importorskip("triton")

from spnl_backend.kernels.moe_ref import fused_moe_ref
from spnl_backend.kernels.triton_moe import BLOCK_M, fused_moe_triton, sort_pairs
from spnl_backend.quant.linear import QuantizedExperts, QuantizedWeight
from spnl_backend.quant.quantize import QUANTIZERS

HIDDEN, INNER = 32, 40  # neither a whole number of the kernel's column tiles
TYPES = sorted(QUANTIZERS, key=lambda t: t.value)


def _case(
    tokens: int,
    top_k: int,
    experts: int,
    dtype: torch.dtype,
    seed: int = 0,
    hidden: int = HIDDEN,
    inner: int = INNER,
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inner, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inner, generator=gen) / inner**0.5
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights)]


def _packed_case(tokens, top_k, experts, types=(Q.Q8_0, Q.Q8_0), dtype=torch.float32, seed=0):
    """`_case` with its experts in GGML blocks (``types``: gate/up's, down's): widths of
    whole blocks, not whole 64-wide tiles where the blocks allow it (the K-quants' 256)."""
    k_quant = any(t.value >= Q.Q2_K.value for t in types)
    hidden, inner = (256, 256) if k_quant else (64, 96)
    x, w13, w2, ids, weights = _case(tokens, top_k, experts, torch.float32, seed, hidden, inner)
    packed = [_packed(w.cpu(), qtype) for w, qtype in zip((w13, w2), types, strict=True)]
    return x.to(dtype), *packed, ids, weights


def _packed(w: torch.Tensor, qtype: Q) -> QuantizedExperts:
    stack = QuantizedExperts.stack([[QuantizedWeight.from_float(m, qtype)] for m in w])
    return QuantizedExperts(stack.data.to(DEVICE), stack.qtype, stack.shape)


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


# Tolerances: the kernel decodes the blocks exactly (`test_triton_quant`), so the kernel
# and the twin multiply the same floats and differ only in the order of float32 sums.
@pytest.mark.parametrize(
    ("tokens", "top_k", "experts"),
    [(t, k, e) for t in (1, 5, 33) for k, e in [(1, 4), (2, 4), (2, 16)]]
    + [(1, 8, 64), (5, 8, 64)],  # 64 experts with few tokens: the interpreter is slow
)
def test_packed_experts_equal_the_twin(tokens, top_k, experts):
    case = _packed_case(tokens, top_k, experts)
    out = fused_moe_triton(*case)
    torch.testing.assert_close(out.cpu(), fused_moe_ref(*case).cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "types",
    [(t, t) for t in TYPES] + [(Q.Q4_K, Q.Q6_K)],
    ids=lambda ts: "-".join(t.name for t in ts),
)
def test_every_ggml_type_decodes_in_the_kernel(types):
    """Each type the kernel decodes; Q4_K_M's experts: gate/up Q4_K, down Q6_K."""
    case = _packed_case(4, 1, 2, types, seed=types[0].value)
    out = fused_moe_triton(*case)
    torch.testing.assert_close(out.cpu(), fused_moe_ref(*case).cpu(), rtol=1e-5, atol=1e-5)


def test_idle_experts_blocks_are_never_read():
    x, w13, w2, _, weights = _packed_case(5, 2, 8)
    ids = torch.tensor([[1, 6], [6, 1], [1, 6], [6, 1], [1, 6]], device=DEVICE)
    for idle in (0, 2, 3, 4, 5, 7):  # all-ones bytes: NaN scales, were they decoded
        w13.data[idle] = 0xFF
        w2.data[idle] = 0xFF
    out = fused_moe_triton(x, w13, w2, ids, weights)
    assert out.isfinite().all()
    torch.testing.assert_close(
        out.cpu(), fused_moe_ref(x, w13, w2, ids, weights).cpu(), rtol=1e-5, atol=1e-5
    )


def test_half_precision_activations_with_packed_experts():
    """Widened to float32 in the kernel; the activation between the GEMMs is rounded to
    float16 there (as the per-expert path rounds it), not in the twin."""
    case = _packed_case(9, 2, 8, dtype=torch.float16, seed=1)
    out = fused_moe_triton(*case)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), fused_moe_ref(*case).cpu(), rtol=1e-2, atol=1e-2)


def _fuse(model) -> None:
    """What a model built with `KernelChoice.fused_moe` does on its first step: every MoE
    layer takes the fused kernel."""
    from spnl_backend.models.moe import SparseMoE

    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.use_fused(fused_moe_triton)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
def test_a_model_runs_its_float_experts_through_the_fused_kernel(tiny, arch):
    """What loading on CUDA does (`KernelChoice.fused_moe`), here through the interpreter:
    the experts stacked once (each expert's weights become views of the stacks) and every
    MoE layer through the kernel, with the logits of the per-expert path."""
    from helpers import CPU, model_logits

    from spnl_backend import load_backend
    from spnl_backend.models.moe import SparseMoE

    path = str(tiny.hf(arch).path)
    ids = tiny.hf(arch).tokenizer("the cat sat on the mat").input_ids
    expected = model_logits(load_backend(path, settings=CPU), ids)
    fused = load_backend(path, settings=CPU)
    _fuse(fused.model)
    layers = [m for m in fused.model.modules() if isinstance(m, SparseMoE)]
    assert all(layer.fused is fused_moe_triton for layer in layers)
    w13, _ = layers[0]._stacked
    assert layers[0].experts[1].gate_proj.weight.data_ptr() == w13[1].data_ptr()
    torch.testing.assert_close(model_logits(fused, ids), expected, rtol=1e-4, atol=1e-4)


def test_a_model_whose_choice_names_the_fused_kernel_stacks_its_experts_for_it(tiny):
    """The route on CUDA (`KernelChoice.fused_moe`, given to the model when it is built),
    here through the interpreter: once the weights are in (`CausalLM.prepare_experts`, as
    loading calls it) each MoE layer takes the kernel, and the logits are the per-expert
    path's."""
    import dataclasses

    from helpers import CPU, model_logits

    from spnl_backend import load_backend
    from spnl_backend.models.moe import SparseMoE

    path = str(tiny.hf("qwen3_moe").path)
    ids = tiny.hf("qwen3_moe").tokenizer("the cat sat on the mat").input_ids
    expected = model_logits(load_backend(path, settings=CPU), ids)
    fused = load_backend(path, settings=CPU)
    choice = dataclasses.replace(fused.model.kernels, fused_moe=fused_moe_triton)
    layers = [m for m in fused.model.modules() if isinstance(m, SparseMoE)]
    for layer in layers:  # as a model built with that choice holds it
        layer.kernels = choice
    assert all(layer.fused is None for layer in layers)  # the CPU's choice fused nothing
    fused.model.prepare_experts()
    assert all(layer.fused is fused_moe_triton for layer in layers)
    torch.testing.assert_close(model_logits(fused, ids), expected, rtol=1e-4, atol=1e-4)


# The torch products on the CPU (dequantize, float32 GEMM), so that two models differ only
# where one runs the fused kernel.
Q8_ON_TORCH = {"device": "cpu", "isq": "Q8_0", "cpu_kernels": "torch"}


def test_a_model_runs_its_quantized_experts_through_the_fused_kernel(tiny):
    """ISQ's Q8_0 experts stacked as blocks once (each expert's blocks become views of the
    stacks) and every MoE layer through the kernel, with the logits of the per-expert
    path."""
    from helpers import model_logits

    from spnl_backend import BackendSettings, load_backend
    from spnl_backend.models.moe import SparseMoE

    settings = BackendSettings(**Q8_ON_TORCH)
    path = str(tiny.hf("qwen3_moe").path)
    ids = tiny.hf("qwen3_moe").tokenizer("the cat sat on the mat").input_ids
    expected = model_logits(load_backend(path, settings=settings), ids)
    fused = load_backend(path, settings=settings)
    _fuse(fused.model)
    layers = [m for m in fused.model.modules() if isinstance(m, SparseMoE)]
    assert layers
    assert all(layer.fused is fused_moe_triton for layer in layers)
    w13, w2 = layers[0]._stacked
    assert (w13.qtype, w2.qtype) == (Q.Q8_0, Q.Q8_0)
    expert, inner = layers[0].experts[1], w13.shape[0] // 2
    assert expert.gate_proj.weight_q.data.data_ptr() == w13.data[1].data_ptr()
    assert expert.up_proj.weight_q.data.data_ptr() == w13.data[1, inner:].data_ptr()
    assert expert.down_proj.weight_q.data.data_ptr() == w2.data[1].data_ptr()
    torch.testing.assert_close(model_logits(fused, ids), expected, rtol=1e-4, atol=1e-4)


def test_experts_of_mixed_types_keep_the_per_expert_path(tiny):
    from spnl_backend import BackendSettings, load_backend
    from spnl_backend.models.moe import SparseMoE

    backend = load_backend(str(tiny.hf("qwen3_moe").path), settings=BackendSettings(**Q8_ON_TORCH))
    layers = [m for m in backend.model.modules() if isinstance(m, SparseMoE)]
    down = layers[0].experts[2].down_proj
    down.weight_q = QuantizedWeight.from_float(down.weight_q.dequantize(), Q.Q4_0)
    _fuse(backend.model)
    assert layers[0].fused is None
    assert layers[0]._stacked is None
    assert all(layer.fused is fused_moe_triton for layer in layers[1:])
