"""The model's interface to the KV cache: what a layer's attention needs besides q, k, v
(`AttentionSpec`) and what stores a step's K/V and attends for it (`StepAttention`, which
the engine's caches implement)."""

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..kernels.sets import NativeKeys


@dataclass(frozen=True)
class AttentionSpec:
    """What a layer's attention needs besides q, k, v: fixed per layer.

    ``sinks``: gpt-oss's learned logit per query head ``[heads]`` (float32), a column every
    query's softmax shares but whose value is zero: it only adds ``e^sink`` to the
    denominator. The layer's weight, so the model sets it once its weights are in
    (`models.attention.Attention`); a description made from the config has None."""

    layer: int
    scale: float
    num_kv_groups: int
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False, repr=False)


class StepAttention(Protocol):
    """The KV-cache interface the model calls: store this step's K/V, attend over the cache.

    ``q [T, heads, head_dim]``, ``k`` and ``v [T, kv_heads, head_dim]`` for the T
    tokens of this step, packed sequence after sequence; returns ``[T, heads, head_dim]``.
    """

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor: ...

    def native_keys(
        self, windows: tuple[int, ...]
    ) -> tuple[NativeKeys, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """The step's keys and each layer's (key, value) pool where the native layer blocks
        may run the step (`models.native_blocks`: the paged pool on the CPU's kernels), else
        None; ``windows``: the model's sliding windows."""
        ...


class WithoutLayerBlocks:
    """A step's attention whose layers never run as the native layer blocks (their keys
    are not in the paged pool): every step takes the per-op path."""

    def native_keys(self, windows: tuple[int, ...]) -> None:
        return None
