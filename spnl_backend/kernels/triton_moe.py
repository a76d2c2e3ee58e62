"""A fused mixture-of-experts layer in Triton (twin: `moe_ref.fused_moe_ref`).

The (token, slot) pairs are sorted by expert and each expert's run padded to whole blocks
of `BLOCK_M`, so that every block belongs to one expert: one grouped GEMM then computes
each block against its expert's gate and up rows (reading the token's activations), and a
second its down rows, the router's weight applied in its epilogue. Each token's slots are
summed afterwards, in slot order. The products accumulate in float32.

Experts are float (``[E, rows, cols]`` tensors: float32, float16, bfloat16) or GGML blocks
(`moe_ref.PackedExperts`: ``[E, rows, row_bytes]`` uint8, one type per projection): a
``QTYPE`` constexpr then has the grouped GEMM decode each weight tile inside the kernel
with `triton_quant`'s block decoder, in float32, the activations widened to float32 too.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .moe_ref import Experts, sum_slots
from .triton_quant import block_format, weight_tile

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32
# GGML experts: the tiles of `triton_quant`'s fused product, which decodes the same way.
PACKED_BLOCK_N, PACKED_BLOCK_K = 64, 64


@triton.jit
def _expert_tile(
    w_ptr,
    expert,
    cols,
    ks,
    n,
    k,
    stride_we,
    stride_wn,
    QTYPE: tl.constexpr,
    QK: tl.constexpr,
    BYTES: tl.constexpr,
):
    """The expert's ``W[cols, ks]`` transposed, ``[BLOCK_K, BLOCK_N]`` (zero outside the
    matrix): loaded as it is, or decoded from GGML blocks (``QTYPE`` > 0) into float32."""
    base = w_ptr + expert.to(tl.int64) * stride_we  # int64: E x rows x cols may pass 2^31
    if QTYPE == 0:
        w = tl.load(
            base + cols[None, :] * stride_wn + ks[:, None],
            mask=(cols[None, :] < n) & (ks[:, None] < k),
            other=0.0,
        )
    else:
        w = tl.trans(weight_tile(base, cols, ks, n, k, stride_wn, QTYPE, QK, BYTES))
    return w


@triton.jit
def _grouped_matmul(
    a_ptr,
    w_ptr,
    out_ptr,
    pairs_ptr,
    block_expert_ptr,
    weights_ptr,
    num_pairs,
    n,
    k,
    stride_a,
    stride_we,
    stride_wn,
    stride_out,
    TOP_K: tl.constexpr,
    A_BY_TOKEN: tl.constexpr,
    WEIGH: tl.constexpr,
    IEEE: tl.constexpr,
    QTYPE: tl.constexpr,
    QK: tl.constexpr,
    BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[pair, n] = a[row of pair] . w[expert of the block, n] (times the pair's weight)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs  # padding: num_pairs
    row = pair // TOP_K if A_BY_TOKEN else pair
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + row[:, None] * stride_a + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < k),
            other=0.0,
        )
        w = _expert_tile(w_ptr, expert, cols, ks, n, k, stride_we, stride_wn, QTYPE, QK, BYTES)
        if IEEE:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if WEIGH:
        acc *= tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(
        out_ptr + pair[:, None] * stride_out + cols[None, :],
        acc,
        mask=valid[:, None] & (cols[None, :] < n),
    )


def sort_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs (``token * k + slot``) sorted by expert, each expert's run padded to whole
    blocks of `BLOCK_M` with ``T * k`` (no pair), and the expert of every block."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    padded_start = torch.cumsum(blocks * BLOCK_M, 0) - blocks * BLOCK_M
    start = torch.cumsum(counts, 0) - counts
    experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - start[experts]
    pairs = torch.full((int(blocks.sum()) * BLOCK_M,), num_pairs, device=flat.device)
    pairs[padded_start[experts] + rank] = order
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), blocks)
    return pairs.to(torch.int32), block_expert.to(torch.int32)


Tensor = torch.Tensor


def fused_moe_triton(x: Tensor, w13: Experts, w2: Experts, ids: Tensor, weights: Tensor) -> Tensor:
    """`moe_ref.fused_moe_ref`'s contract (``ids``, ``weights``: each token's experts and
    their weights), on the GPU (or Triton's interpreter)."""
    top_k = ids.shape[1]
    x = x.contiguous()
    inner = _shape(w13)[0] // 2
    sorted_pairs = sort_pairs(ids, _num_experts(w13))
    h = _grouped(x, w13, sorted_pairs, weights, top_k, by_token=True)
    act = (F.silu(h[:, :inner]) * h[:, inner:]).to(x.dtype).contiguous()
    out = _grouped(act, w2, sorted_pairs, weights, top_k, by_token=False)
    return sum_slots(out, top_k)


def _shape(w: Experts) -> tuple[int, int]:
    """One expert's ``(rows, cols)``."""
    return tuple(w.shape[1:]) if isinstance(w, Tensor) else w.shape


def _num_experts(w: Experts) -> int:
    return (w if isinstance(w, Tensor) else w.data).shape[0]


def _grouped(
    a: Tensor,
    w: Experts,
    sorted_pairs: tuple[Tensor, Tensor],
    weights: Tensor,
    top_k: int,
    by_token: bool,
) -> Tensor:
    """Every pair's row of ``a`` (its token's, ``by_token``; else its own) times its
    expert's ``w [n, k]``, weighted by the router where ``a`` is not by token: ``[pairs, n]``
    in float32."""
    pairs, block_expert = sorted_pairs
    num_pairs, (n, k) = weights.numel(), _shape(w)
    data, meta = _weight_args(w, a.dtype)
    out = torch.empty(num_pairs, n, dtype=torch.float32, device=a.device)
    grid = (block_expert.numel(), triton.cdiv(n, meta["BLOCK_N"]))
    _grouped_matmul[grid](
        a, data, out, pairs, block_expert, weights.contiguous().view(-1), num_pairs, n, k,
        a.stride(0), data.stride(0), data.stride(1), out.stride(0),
        TOP_K=top_k, A_BY_TOKEN=by_token, WEIGH=not by_token, BLOCK_M=BLOCK_M, **meta,
    )  # fmt: skip
    return out


def _weight_args(w: Experts, dtype: torch.dtype) -> tuple[Tensor, dict]:
    """The experts' tensor and the kernel's constexprs for it: float tiles as they are
    (half precision on the tensor cores), GGML blocks decoded into float32, and the product
    then in float32 too."""
    if isinstance(w, Tensor):
        float_tiles = {"QTYPE": 0, "QK": 1, "BYTES": 1, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K}
        return w.contiguous(), {**float_tiles, "IEEE": dtype == torch.float32}
    data = w.data.contiguous()
    fmt = block_format(w.qtype, w.shape[1], data.shape[2])
    return data, {**fmt, "BLOCK_N": PACKED_BLOCK_N, "BLOCK_K": PACKED_BLOCK_K, "IEEE": True}
