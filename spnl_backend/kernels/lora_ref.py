"""LoRA products over a step's rows: each row adds ``scale * (x A^T) B^T`` of its own
adapter to the base projection's output (the base product is shared by every row).

The torch twin computes each row's product with elementwise multiplies and sums over the
last dimension: a reduction whose order depends on that dimension's length alone, never
on how many rows are computed together, so a row gets the same bits whatever shares its
step (batch invariance). No compiled kernel yet: this is the path every device runs.
"""

from dataclasses import dataclass, field

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
    """A projection's adapters by slot, read against the model's `LoraStep`."""

    def __init__(self, step: LoraStep) -> None:
        self.step = step
        self.pairs: dict[int, LoraPair] = {}

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the base product of ``x``, rows first) with each row's adapter product
        added; a new tensor where any row takes one, else ``out`` itself."""
        groups = [
            (self.pairs[slot], factor, rows)
            for slot, factor, rows in self.step.groups
            if slot in self.pairs
        ]
        if not groups:
            return out
        flat_x = x.reshape(-1, x.shape[-1])
        flat = out.reshape(-1, out.shape[-1]).clone()
        for pair, factor, rows in groups:
            rows = rows.to(flat.device)  # a no-op but under layer mapping
            delta = lora_delta_ref(flat_x[rows], pair.a, pair.b, pair.scale * factor)
            flat[rows] = (flat[rows].float() + delta).to(flat.dtype)
        return flat.reshape(out.shape)


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
