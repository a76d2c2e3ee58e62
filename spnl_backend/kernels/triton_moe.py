"""A fused mixture-of-experts layer in Triton (twin: `moe_ref.fused_moe_ref`).

The (token, slot) pairs are sorted by expert and each expert's run padded to whole blocks
of `BLOCK_M`, so that every block belongs to one expert: one grouped GEMM then computes
each block against its expert's gate and up rows (reading the token's activations), and a
second its down rows, the router's weight applied in its epilogue. Each token's slots are
summed afterwards, in slot order. Float experts (float32, float16, bfloat16); the products
accumulate in float32.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


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
        w = tl.load(
            w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
            mask=(cols[None, :] < n) & (ks[:, None] < k),
            other=0.0,
        )
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


def fused_moe_triton(x: Tensor, w13: Tensor, w2: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    """`moe_ref.fused_moe_ref`'s contract (``ids``, ``weights``: each token's experts and
    their weights), on the GPU (or Triton's interpreter)."""
    tokens, top_k = ids.shape
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    inner = w13.shape[1] // 2
    sorted_pairs = sort_pairs(ids, w13.shape[0])
    h = _grouped(x, w13, sorted_pairs, weights, top_k, by_token=True)
    act = (F.silu(h[:, :inner]) * h[:, inner:]).to(x.dtype).contiguous()
    out = _grouped(act, w2, sorted_pairs, weights, top_k, by_token=False)
    return out.view(tokens, top_k, -1).sum(dim=1)


def _grouped(
    a: Tensor,
    w: Tensor,
    sorted_pairs: tuple[Tensor, Tensor],
    weights: Tensor,
    top_k: int,
    by_token: bool,
) -> Tensor:
    """Every pair's row of ``a`` (its token's, ``by_token``; else its own) times its
    expert's ``w [n, k]``, weighted by the router where ``a`` is not by token: ``[pairs, n]``
    in float32."""
    pairs, block_expert = sorted_pairs
    num_pairs, n, k = weights.numel(), w.shape[1], w.shape[2]
    out = torch.empty(num_pairs, n, dtype=torch.float32, device=a.device)
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_matmul[grid](
        a, w, out, pairs, block_expert, weights.contiguous().view(-1), num_pairs, n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, A_BY_TOKEN=by_token, WEIGH=not by_token, IEEE=a.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out
