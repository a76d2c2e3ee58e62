"""The model's interface to the cache: what a layer's attention needs besides q, k, v
(`AttentionSpec`), what stores a step's K/V and attends for it (`StepAttention`, which
the engine's caches implement), and the sequences' states where a model has state
layers (`StateSegment`, which the step gives them as ``states``)."""

from dataclasses import dataclass
from typing import Protocol

import torch

from ..kernels.sets import NativeKeys


@dataclass(frozen=True)
class AttentionSpec:
    """What a layer's attention needs besides q, k, v: fixed per layer."""

    layer: int
    scale: float
    num_kv_groups: int
    sliding_window: int | None = None
    softcap: float | None = None
    # The K and V at ``layer`` are an earlier layer's (Gemma 4's shared layers): this layer
    # stores nothing and attends over them (its k and v are None).
    shared_kv: bool = False


class StepAttention(Protocol):
    """The KV-cache interface the model calls: store this step's K/V, attend over the cache.

    ``q [T, heads, head_dim]``, ``k`` and ``v [T, kv_heads, head_dim]`` for the T
    tokens of this step, packed sequence after sequence (None for a layer that reads
    another's, ``spec.shared_kv``); returns ``[T, heads, head_dim]``.
    """

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        spec: AttentionSpec,
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


@dataclass
class SequenceState:
    """One sequence's memory in the state layers (`models.layers.DeltaNetMixer`): per
    state layer its convolution's last inputs ``[kernel - 1, conv_dim]`` and its
    recurrent state ``[num_v_heads, head_k_dim, head_v_dim]`` (float32), both updated in
    place as the sequence's tokens are computed."""

    conv: list[torch.Tensor]
    recurrent: list[torch.Tensor]


@dataclass(frozen=True)
class StateSegment:
    """A sequence's rows of a step (``start``, ``count``) and its state."""

    start: int
    count: int
    state: SequenceState


class StatefulStep(StepAttention, Protocol):
    """A step of a model with state layers: also each sequence's rows and state, in the
    step's order (`engine.state_cache` wraps the KV cache's step with them)."""

    states: list[StateSegment]
