"""The segmented LoRA product on the native kernels (``lora.c``): every adapter's rows of a
step in one call, each row computed alone (twin: `kernels.lora_ref.lora_add_ref`); and
its form inside the native layer blocks, where each projection's adapters are a table by
slot (`LoraTables`) and the step's rows are groups by slot (`lora_groups`)."""

import ctypes

import torch

from ..lora_ref import LoraPair, LoraSegment
from .abi import I64, PTR, LoraGroup, LoraTable
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
            k_in,
            rows_in,
            k_in,
            result.data_ptr(),
            n_out,
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
    a, bt = seg.pair.a.contiguous(), seg.pair.bt
    if bt is None:  # a pair not made for the CPU's float32 (refused below)
        bt = seg.pair.b.T.contiguous()
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


class LoraTables:
    """The layer blocks' form of one projection's adapters (``spnl_lora_table``): each
    slot's A, B transposed, rank and scale, rebuilt only when its pairs change."""

    def __init__(self) -> None:
        self.key: tuple = ()
        self.table: LoraTable | None = None
        self.keep: list = []  # what the table points into
        self._pointer = None

    def pointer(self, pairs: dict[int, LoraPair], k_in: int, n_out: int):
        """`of`'s table as a pointer for ``spnl_layer_args.lora`` (None: no adapter)."""
        table = self.of(pairs, k_in, n_out)
        if table is None:
            return None
        if self._pointer is None or self._pointer.contents is not table:
            self._pointer = ctypes.pointer(table)
        return self._pointer

    def of(self, pairs: dict[int, LoraPair], k_in: int, n_out: int) -> LoraTable | None:
        """The table of ``pairs`` (None where there are none) for a projection
        ``k_in → n_out``; each pair checked as `lora_add_native` checks it."""
        key = tuple(sorted((slot, id(pair)) for slot, pair in pairs.items()))
        if key == self.key:
            return self.table
        if not pairs:
            self.key, self.table, self.keep = key, None, []
            return None
        slots = max(pairs) + 1
        a, bt = (PTR * slots)(), (PTR * slots)()
        rank, scale = (I64 * slots)(), (ctypes.c_double * slots)()
        keep: list = [a, bt, rank, scale, *pairs.values()]  # the pairs: no id reused
        for slot, pair in pairs.items():
            seg_a, seg_bt, _ = _checked(LoraSegment(_NO_ROWS, pair, pair.scale), k_in, n_out)
            a[slot], bt[slot], rank[slot], scale[slot] = (
                seg_a.data_ptr(),
                seg_bt.data_ptr(),
                len(seg_a),
                pair.scale,
            )
            keep += [seg_a, seg_bt]
        self.table = LoraTable(slots, a, bt, rank, scale)
        self.key, self.keep = key, keep
        return self.table


_NO_ROWS = torch.zeros(0, dtype=torch.int64)


def lora_groups(groups: list[tuple[int, float, torch.Tensor]]) -> tuple[ctypes.Array, list]:
    """A step's ``(slot, factor, rows)`` as ``spnl_lora_group``s, and what they point into."""
    rows = [r.to(device="cpu", dtype=torch.int64).contiguous() for _, _, r in groups]
    array = (LoraGroup * len(groups))(
        *(
            LoraGroup(slot, factor, r.data_ptr(), r.numel())
            for (slot, factor, _), r in zip(groups, rows, strict=True)
        )
    )
    return array, rows
