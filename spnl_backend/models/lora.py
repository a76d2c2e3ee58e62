"""LoRA adapters attached to one base model: each in a slot, its matrices beside the
projections they adapt (`kernels.lora_ref.LoraSite`), chosen per row of a step.

The base weights are never changed: a step's rows of the base model compute exactly what
they compute without adapters, and each adapter row adds its own low-rank product.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..errors import ModelFileError
from ..kernels.lora_ref import LoraPair, LoraSite, LoraStep
from ..quant.linear import QuantLinear
from .linear import Linear

BASE_SLOT = -1  # a row of the base model: no adapter


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter as read from its files: ``pairs`` by our module name
    (``model.layers.0.self_attn.q_proj``); ``root``: the first link of its sequences'
    prefix-cache hash chains (from its files' bytes and scale), so no cached K/V is ever
    shared with the base or another adapter."""

    name: str
    path: str
    rank: int
    scale: float
    root: int
    pairs: dict[str, LoraPair] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for p in self.pairs.values())


@dataclass(frozen=True)
class AdapterInfo:
    """What `Backend.adapters` tells of a loaded adapter."""

    name: str
    path: str
    rank: int
    scale: float
    modules: int
    nbytes: int


class LoraAdapters:
    """The adapters attached to a model, by name. ``step`` is shared with every adapted
    projection: the engine fills it with the current step's rows (`rows_of`)."""

    def __init__(self) -> None:
        self.step = LoraStep()
        self.by_name: dict[str, tuple[int, LoraAdapter]] = {}

    def __len__(self) -> int:
        return len(self.by_name)

    def attach(self, model: torch.nn.Module, adapter: LoraAdapter) -> None:
        """Place ``adapter``'s matrices beside the projections of ``model`` it adapts
        (checked against them by the loader first)."""
        if adapter.name in self.by_name:
            raise ModelFileError(f"two LoRA adapters are named {adapter.name!r}")
        slot = len(self.by_name)
        for name, pair in adapter.pairs.items():
            module = model.get_submodule(name)
            if not isinstance(module, (Linear, QuantLinear)):
                raise ModelFileError(f"{adapter.path}: {name} is not a projection of the model")
            if module.lora is None:
                module.lora = LoraSite(self.step)
            module.lora.pairs[slot] = pair
        self.by_name[adapter.name] = (slot, adapter)

    def find(self, name: str) -> tuple[int, LoraAdapter] | None:
        return self.by_name.get(name)

    def names(self) -> list[str]:
        return list(self.by_name)

    def info(self) -> list[AdapterInfo]:
        return [
            AdapterInfo(a.name, a.path, a.rank, a.scale, len(a.pairs), a.nbytes)
            for _, a in self.by_name.values()
        ]

    def rows_of(
        self, slots: Iterable[tuple[int, float, int]], device: torch.device
    ) -> list[tuple[int, float, torch.Tensor]]:
        """A step's rows by adapter and scale factor, from each scheduled sequence's
        ``(slot, factor, new tokens)`` in packing order; base rows are left out."""
        by_slot: dict[tuple[int, float], list[int]] = {}
        start = 0
        for slot, factor, count in slots:
            if slot != BASE_SLOT:
                by_slot.setdefault((slot, factor), []).extend(range(start, start + count))
            start += count
        return [
            (slot, factor, torch.tensor(rows, device=device))
            for (slot, factor), rows in by_slot.items()
        ]
