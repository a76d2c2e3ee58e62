"""LoRA adapters attached to one base model: each in a slot, its matrices beside the
projections they adapt (`kernels.lora_ref.LoraSite`), chosen per row of a step.

The base weights are never changed: a step's rows of the base model compute exactly what
they compute without adapters, and each adapter row adds its own low-rank product.
"""

import dataclasses
import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..errors import ModelFileError
from ..kernels.lora_ref import LoraPair, LoraSite, LoraStep
from ..quant.linear import QuantLinear
from .linear import Linear


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
        return sum(p.nbytes for p in self.pairs.values())


@dataclass(frozen=True)
class AdapterInfo:
    """What `Backend.adapters` tells of an adapter: ``loaded`` where its matrices are held
    in memory now (else it is read again when a request asks for it); ``nbytes`` what
    they take there (when last read)."""

    name: str
    path: str
    rank: int
    scale: float
    modules: int
    nbytes: int
    loaded: bool = True

    @classmethod
    def of(cls, adapter: LoraAdapter, loaded: bool = True) -> "AdapterInfo":
        pairs = adapter.pairs
        return cls(
            adapter.name,
            adapter.path,
            adapter.rank,
            adapter.scale,
            len(pairs),
            adapter.nbytes,
            loaded,
        )


class LoraAdapters:
    """The adapters held on a model, by name, each in a slot (the smallest free one), in
    order of last use. ``step`` is shared with every adapted projection: the engine fills
    it with the current step's rows (`rows_of`)."""

    def __init__(self) -> None:
        self.step = LoraStep()
        self.by_name: dict[str, tuple[int, LoraAdapter]] = {}

    def __len__(self) -> int:
        return len(self.by_name)

    @property
    def nbytes(self) -> int:
        return sum(adapter.nbytes for _, adapter in self.by_name.values())

    def attach(self, model: torch.nn.Module, adapter: LoraAdapter, slot: int | None = None) -> int:
        """Place ``adapter``'s matrices beside the projections of ``model`` it adapts
        (checked against them by the loader first), in ``slot`` (else the smallest free
        one); its slot. Under tensor parallelism each projection takes this rank's share of
        them (and what is held is that share), and the whole adapter is handed to the
        group (`Collectives.lora_attached`: the first rank passes it on to the others)."""
        if adapter.name in self.by_name:
            raise ModelFileError(f"two LoRA adapters are named {adapter.name!r}")
        taken = {s for s, _ in self.by_name.values()}
        if slot is None:
            slot = next(s for s in range(len(taken) + 1) if s not in taken)
        elif slot in taken:
            raise ValueError(f"LoRA slot {slot} is taken already ({adapter.name!r} asked for it)")
        modules = {name: model.get_submodule(name) for name in adapter.pairs}
        for name, module in modules.items():
            if not isinstance(module, (Linear, QuantLinear)):
                raise ModelFileError(f"{adapter.path}: {name} is not a projection of the model")
        tp = getattr(model, "tp", None)
        held = adapter
        if tp is not None:
            shares = {
                name: _placed(tp.lora_share(name, p), modules[name])
                for name, p in adapter.pairs.items()
            }
            held = dataclasses.replace(adapter, pairs=shares)
        for name, pair in held.pairs.items():
            module = modules[name]
            if module.lora is None:
                module.lora = LoraSite(self.step, getattr(model, "kernels", None))
            module.lora.pairs[slot] = pair
        self.by_name[adapter.name] = (slot, held)
        if tp is not None:
            tp.lora_attached(slot, adapter)
        return slot

    def detach(self, model: torch.nn.Module, name: str) -> LoraAdapter:
        """Take adapter ``name``'s matrices off ``model``; its slot is free again (no
        sequence may still run with it: the caller makes sure)."""
        slot, adapter = self.by_name.pop(name)
        for module_name in adapter.pairs:
            site = model.get_submodule(module_name).lora
            if site is not None:
                site.pairs.pop(slot, None)
        tp = getattr(model, "tp", None)
        if tp is not None:
            tp.lora_detached(slot)
        return adapter

    def named_at(self, slot: int) -> str | None:
        """The name of the adapter held in ``slot`` (None: the slot is free)."""
        return next((name for name, (s, _) in self.by_name.items() if s == slot), None)

    def touch(self, name: str) -> None:
        """Mark ``name`` as used last (the others are evicted before it)."""
        self.by_name[name] = self.by_name.pop(name)

    def find(self, name: str) -> tuple[int, LoraAdapter] | None:
        return self.by_name.get(name)

    def names(self) -> list[str]:
        """Those held, least recently used first."""
        return list(self.by_name)

    def rows_of(
        self, sequences: Iterable[tuple[tuple[tuple[int, float], ...], int]], device: torch.device
    ) -> list[tuple[int, float, torch.Tensor]]:
        """A step's rows by adapter and scale factor, from each scheduled sequence's
        ``((slot, factor), ...)`` and new tokens in packing order; base rows are in no
        group, a row of several adapters is in each of theirs. The groups come in the order
        of their hash roots (`scaled_root`), so each row adds its adapters' products in one
        order whatever shares its step (batch invariance), the order its cache keys name."""
        by_slot: dict[tuple[int, float], list[int]] = {}
        start = 0
        for lora, count in sequences:
            for slot, factor in lora:
                by_slot.setdefault((slot, factor), []).extend(range(start, start + count))
            start += count
        roots = {slot: adapter.root for slot, adapter in self.by_name.values()}
        order = sorted(by_slot, key=lambda key: (scaled_root(roots[key[0]], key[1]), *key))
        return [
            (slot, factor, torch.tensor(by_slot[slot, factor], device=device))
            for slot, factor in order
        ]


def _placed(pair: LoraPair, module: Linear | QuantLinear) -> LoraPair:
    """``pair`` on ``module``'s device (a share sent from another rank arrives on the CPU)."""
    device = (
        module.weight_q.data.device if isinstance(module, QuantLinear) else module.weight.device
    )
    return LoraPair(pair.a.to(device), pair.b.to(device), pair.scale)


def scaled_root(root: int, factor: float) -> int:
    """An adapter's hash root for a request scale: its own at 1, else one of that scale's
    (K/V computed at one scale is never read at another)."""
    if factor == 1.0:
        return root
    digest = hashlib.blake2b(struct.pack("<Qd", root, factor), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def set_root(roots: Iterable[int]) -> int:
    """The hash root of a request's adapters from each one's `scaled_root`: 0 (the base's)
    for none, an adapter's own alone, else one of the whole set in a canonical order (K/V
    computed under one set of adapters and scales is never read under another)."""
    ordered = sorted(roots)
    if len(ordered) <= 1:
        return ordered[0] if ordered else 0
    packed = struct.pack(f"<{len(ordered)}Q", *ordered)
    digest = hashlib.blake2b(b"lora-set" + packed, digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1
