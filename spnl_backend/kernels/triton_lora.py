"""Triton's segmented LoRA product (twin: `lora_ref.lora_add_ref`): for each adapter's
segment of a step's rows, the shrink ``low = x A^T`` (float32, ``[rows, r]``), then the
expand ``out += scale * low B^T``, rounded once to ``out``'s dtype.

One program computes one row (and, in the expand, one tile of its outputs), its sums over
tiles of constant width in order: a row's arithmetic never depends on how many rows, or
which other adapters, share the step (batch invariance). A segment is a launch of each
kernel; the segments of a step touch disjoint rows.
"""

import torch
import triton
import triton.language as tl

from .cpu.checks import KernelArgumentError
from .lora_ref import LoraSegment

BLOCK_K = 64  # input columns per tile of the shrink
BLOCK_N = 64  # outputs per program of the expand


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    rows_ptr,
    low_ptr,
    k_in,
    rank,
    stride_x,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < k_in, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + ranks[:, None] * k_in + cols[None, :],
            mask=(ranks[:, None] < rank) & (cols[None, :] < k_in),
            other=0.0,
        )
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(low_ptr + i * BLOCK_R + ranks, acc)


@triton.jit
def _expand_kernel(
    low_ptr,
    b_ptr,
    rows_ptr,
    out_ptr,
    n_out,
    rank,
    stride_out,
    scale,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i = tl.program_id(0)
    tile = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    outs = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    low = tl.load(low_ptr + i * BLOCK_R + ranks)  # zero past the rank
    b = tl.load(
        b_ptr + outs[:, None] * rank + ranks[None, :],
        mask=(outs[:, None] < n_out) & (ranks[None, :] < rank),
        other=0.0,
    )
    delta = tl.sum(b * low[None, :], axis=1) * scale
    target = out_ptr + row * stride_out + outs
    base = tl.load(target, mask=outs < n_out, other=0.0).to(tl.float32)
    tl.store(target, (base + delta).to(out_ptr.dtype.element_ty), mask=outs < n_out)


def lora_add_triton(
    x: torch.Tensor, out: torch.Tensor, segments: list[LoraSegment]
) -> torch.Tensor:
    """``out [T, out]`` with each segment's ``scale * (x A^T) B^T`` added on its rows of
    ``x [T, in]`` (a new tensor); the adapters' matrices are float32."""
    x = x.contiguous()
    result = out.clone(memory_format=torch.contiguous_format)
    k_in, n_out = x.shape[1], result.shape[1]
    for seg in segments:
        rows = seg.rows.to(device=x.device, dtype=torch.int64).contiguous()
        count = rows.numel()
        if count == 0:
            continue
        a, b = seg.pair.a.contiguous(), seg.pair.b.contiguous()
        rank = a.shape[0]
        if a.shape[1] != k_in or tuple(b.shape) != (n_out, rank):
            raise KernelArgumentError(
                f"lora: A {tuple(a.shape)} and B {tuple(b.shape)} for a projection {k_in} → {n_out}"
            )
        block_r = max(16, triton.next_power_of_2(rank))
        low = torch.empty((count, block_r), dtype=torch.float32, device=x.device)
        _shrink_kernel[(count,)](
            x, a, rows, low, k_in, rank, x.stride(0), BLOCK_R=block_r, BLOCK_K=BLOCK_K
        )
        _expand_kernel[(count, triton.cdiv(n_out, BLOCK_N))](
            low,
            b,
            rows,
            result,
            n_out,
            rank,
            result.stride(0),
            float(seg.scale),
            BLOCK_R=block_r,
            BLOCK_N=BLOCK_N,
        )
    return result
