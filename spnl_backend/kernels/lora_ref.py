"""LoRA products over a step's rows: each row adds ``scale * (x A^T) B^T`` of its own
adapter to the base projection's output (the base product is shared by every row).

A step's adapter rows come as segments, one per adapter and scale (S-LoRA's and Punica's
grouping): each adapter's matrices are read once for all its rows. Three twins compute
them, chosen per call by the model's kernels (`KernelChoice.lora_add`): the C kernel on
the CPU (``kernels/cpu/lora.c``), Triton's on CUDA (`kernels.triton_lora`), and this
module's torch reference everywhere else. Each computes every row alone in an order fixed
by the matrices' shapes, never by how many rows or which adapters share the step, so a row
gets the same bits whatever shares its step (batch invariance); the twins agree with each
other to float32 rounding (their sums run in different orders).

The torch twin computes each row's product with elementwise multiplies and sums over the
last dimension: a reduction whose order depends on that dimension's length alone.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

# Float32 elements of the products' transient ``[rows, r, width]`` tensors at a time.
_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class LoraPair:
    """One adapter's matrices for one projection: ``a [r, in]``, ``b [out, r]`` (float32,
    on the projection's device) and the scale (``alpha / r``, or ``alpha / sqrt(r)``)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    # ``b`` transposed, ``[r, out]`` contiguous: what the C kernel reads, made with the pair
    # where it can run (float32 on the CPU), so `nbytes` counts it from the start.
    bt: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.b.is_cpu and self.b.dtype is torch.float32:
            object.__setattr__(self, "bt", self.b.T.contiguous())

    @property
    def nbytes(self) -> int:
        """The matrices' bytes, the transposed copy included."""
        return self.a.nbytes + self.b.nbytes + (0 if self.bt is None else self.bt.nbytes)


@dataclass(frozen=True)
class LoraSegment:
    """One adapter's rows of a step: ``rows`` (int64 indices into the step's rows, on its
    device; each row in one segment at most), its matrices and the scale they take."""

    rows: torch.Tensor
    pair: LoraPair
    scale: float


# A twin: ``(x [T, in], out [T, out], segments)`` → ``out`` with each segment's rows' products
# added (a new tensor; ``out`` itself is not changed).
LoraAdd = Callable[[torch.Tensor, torch.Tensor, list[LoraSegment]], torch.Tensor]


class LoraKernels(Protocol):
    """What picks the twin for a step's rows (`kernels.dispatch.KernelChoice`)."""

    def lora_add(self, x: torch.Tensor, out: torch.Tensor) -> LoraAdd: ...


@dataclass
class LoraStep:
    """Which rows of the current step take which adapter: ``(slot, factor, row indices)``
    for each adapter and request scale present (``factor`` multiplies the adapter's own
    scale; rows of the base model appear in none; a row of several adapters appears in
    each of their groups, and takes their products in the groups' order). Set by the
    engine around a forward pass, empty otherwise (a pass with no adapter rows adds
    nothing)."""

    groups: list[tuple[int, float, torch.Tensor]] = field(default_factory=list)


class LoraSite:
    """A projection's adapters by slot, read against the model's `LoraStep`; ``kernels``
    picks the twin that computes them (None: the torch reference)."""

    def __init__(self, step: LoraStep, kernels: LoraKernels | None = None) -> None:
        self.step, self.kernels = step, kernels
        self.pairs: dict[int, LoraPair] = {}

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the base product of ``x``, rows first) with each row's adapter product
        added; a new tensor where any row takes one, else ``out`` itself."""
        segments = [
            LoraSegment(rows.to(out.device), pair, pair.scale * factor)  # moved: layer mapping
            for slot, factor, rows in self.step.groups
            if (pair := self.pairs.get(slot)) is not None
        ]
        if not segments:
            return out
        flat_x = x.reshape(-1, x.shape[-1])
        flat = out.reshape(-1, out.shape[-1])
        add = lora_add_ref if self.kernels is None else self.kernels.lora_add(flat_x, flat)
        return add(flat_x, flat, segments).reshape(out.shape)


def lora_add_ref(x: torch.Tensor, out: torch.Tensor, segments: list[LoraSegment]) -> torch.Tensor:
    """The torch twin of the segmented product: ``out [T, out]`` with ``scale * (x A^T) B^T``
    of each segment's adapter added on its rows of ``x [T, in]``, in float32, then rounded
    to ``out``'s dtype."""
    out = out.clone()
    for seg in segments:
        delta = lora_delta_ref(x[seg.rows], seg.pair.a, seg.pair.b, seg.scale)
        out[seg.rows] = (out[seg.rows].float() + delta).to(out.dtype)
    return out


def lora_delta_ref(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * (x @ a.T) @ b.T`` in float32 for ``x [n, in]``, each row computed as it
    would be alone (see the module's note)."""
    x = x.float()
    rank, width = a.shape[0], max(a.shape[1], b.shape[0])
    step = max(1, _CHUNK_ELEMENTS // (rank * width))
    parts = []
    for start in range(0, x.shape[0], step):
        rows = x[start : start + step]
        low = (rows[:, None, :] * a[None]).sum(-1)  # [n, r]
        parts.append((low[:, None, :] * b[None]).sum(-1) * scale)  # [n, out]
    if not parts:
        return x.new_zeros((0, b.shape[0]))
    return torch.cat(parts)
