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


@dataclass
class SequenceState:
    """One sequence's memory in the state layers (`models.layers.StateMixer`): per state
    layer its convolution's last inputs ``[kernel - 1, conv_dim]`` and its recurrent
    state (float32; shaped as its mixer's ``recurrent_shape``), both updated in place as
    the sequence's tokens are computed."""

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


def sequence_states(attention: StepAttention) -> list[StateSegment]:
    """The step's sequences' rows and states, for a state layer; a step without them is a
    model run on a cache that keeps none, refused by name."""
    if not hasattr(attention, "states"):
        raise TypeError(
            f"{type(attention).__name__} carries no sequence states: a model with state "
            "layers runs on a cache with a state group (engine.state_cache)"
        )
    return attention.states
