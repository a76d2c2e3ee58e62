"""The segmented LoRA product on the native kernels (``lora.c``): every adapter's rows of a
step in one call, each row computed alone (twin: `kernels.lora_ref.lora_add_ref`)."""

import torch

from ..lora_ref import LoraSegment
from .abi import LoraSegment as SegmentArgs
from .checks import KernelArgumentError, check_status, require
from .wrappers import CpuKernels

MAX_RANK = 4096  # lora.c's MAX_RANK: a row's low values sit on its task's stack


def lora_add_native(
    kernels: CpuKernels, x: torch.Tensor, out: torch.Tensor, segments: list[LoraSegment]
) -> torch.Tensor:
    """``out [T, out]`` (float32) with each segment's ``scale * (x A^T) B^T`` added on its
    rows of ``x [T, in]`` (float32): a new tensor."""
    x = x.contiguous()
    require(x, torch.float32, "lora: x", dims=2)
    rows_in, k_in = x.shape
    result = out.clone(memory_format=torch.contiguous_format)  # the kernel adds in place
    require(result, torch.float32, "lora: out", dims=2)
    if out.shape[0] != rows_in:
        raise KernelArgumentError(f"lora: out {tuple(out.shape)} for x {tuple(x.shape)}")
    n_out = result.shape[1]
    keep, args = [], (SegmentArgs * len(segments))()
    for arg, seg in zip(args, segments, strict=True):
        a, bt, rows = _checked(seg, k_in, n_out)
        keep += [a, bt, rows]
        arg.rows, arg.count, arg.rank, arg.scale = rows.data_ptr(), rows.numel(), len(a), seg.scale
        arg.a, arg.bt = a.data_ptr(), bt.data_ptr()
    check_status(
        kernels.library.spnl_lora_add(
            args,
            len(segments),
            x.data_ptr(),
            rows_in,
            k_in,
            result.data_ptr(),
            n_out,
            kernels.threads,
        ),
        "lora_add",
    )
    return result


def _checked(
    seg: LoraSegment, k_in: int, n_out: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A segment's ``a [r, in]``, ``bt [r, out]`` and rows as the C code reads them."""
    a, bt = seg.pair.a, seg.pair.bt
    require(a, torch.float32, "lora: A", dims=2)
    require(bt, torch.float32, "lora: B", dims=2)
    rank = a.shape[0]
    if not (0 < rank <= MAX_RANK and a.shape[1] == k_in and tuple(bt.shape) == (rank, n_out)):
        raise KernelArgumentError(
            f"lora: A {tuple(a.shape)} and B {tuple(seg.pair.b.shape)} for a projection "
            f"{k_in} → {n_out} (rank 1 … {MAX_RANK})"
        )
    rows = seg.rows.to(torch.int64).contiguous()
    require(rows, torch.int64, "lora: rows", dims=1)
    return a, bt, rows
