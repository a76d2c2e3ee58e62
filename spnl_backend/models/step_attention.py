"""The model's interface to the cache: what a layer's attention needs besides q, k, v
(`AttentionSpec`), what stores a step's K/V and attends for it (`StepAttention`, which
the engine's caches implement), and the sequences' states where a model has state
layers (`StateSegment`, which the step gives them as ``states``)."""

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..kernels.scoring import Scoring
from ..kernels.sets import NativeKeys


@dataclass(frozen=True)
class AttentionSpec:
    """What a layer's attention needs besides q, k, v: fixed per layer. ``scoring`` goes
    whole to the kernels; its sinks are the layer's weight, so the model sets them once its
    weights are in (`models.attention.Attention`)."""

    layer: int
    num_kv_groups: int
    scoring: Scoring
    # The K and V at ``layer`` are an earlier layer's (Gemma 4's shared layers): this layer
    # stores nothing and attends over them (its k and v are None).
    shared_kv: bool = False
    # Multi-head latent attention (DeepSeek): the layer keeps one key per token (a single
    # KV head, no V of its own) whose first ``latent`` dims are also its value; 0: K and V.
    latent: int = 0


class StepAttention(Protocol):
    """The KV-cache interface the model calls: store this step's K/V, attend over the cache.

    ``q [T, heads, head_dim]``, ``k`` and ``v [T, kv_heads, head_dim]`` for the T
    tokens of this step, packed sequence after sequence (None for a layer that reads
    another's, ``spec.shared_kv``); returns ``[T, heads, head_dim]``. A latent layer
    (``spec.latent``) gives ``k [T, 1, head_dim]`` and no ``v``, its values the first
    ``spec.latent`` dims of its keys, and gets ``[T, heads, spec.latent]``.
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
    """One sequence's memory in the state layers (`models.layers.StateMixer`): per state
    layer its convolution's last inputs ``[kernel - 1, conv_dim]`` and its recurrent
    state (float32; shaped as its mixer's ``recurrent_shape``), both updated in place as
    the sequence's tokens are computed."""

    conv: list[torch.Tensor]
    recurrent: list[torch.Tensor]


@dataclass(frozen=True)
class StateSegment:
    """A sequence's rows of a step (``start``, ``count``) and its state. The state layers
    compute the rows in pieces ending at multiples of ``piece`` positions (``position``:
    the first row's), so that where a sequence resumes never changes its arithmetic, and
    after each count of rows in ``copies`` they copy their state into its entry (a
    snapshot at a block boundary; the state after each draft, for rolling back)."""

    start: int
    count: int
    state: SequenceState
    position: int = 0
    piece: int = 64
    copies: dict[int, SequenceState] = field(default_factory=dict)

    def pieces(self) -> list[tuple[int, int]]:
        """The rows' pieces, as (first row, count) within the segment."""
        pieces, row = [], 0
        while row < self.count:
            ends = [self.piece - (self.position + row) % self.piece, self.count - row]
            ends += [at - row for at in self.copies if at > row]
            size = min(ends)
            pieces.append((row, size))
            row += size
        return pieces

    def computed_pieces(self, layer: int) -> Iterator[tuple[slice, slice]]:
        """The pieces as (rows within the segment, rows within the step), in order, for a
        state layer (its place ``layer`` in the states) to compute one after another: once
        a piece is computed, the layer's recurrent state is copied where a copy is due."""
        for first, count in self.pieces():
            yield slice(first, first + count), slice(self.start + first, self.start + first + count)
            if (copy := self.copies.get(first + count)) is not None:
                copy.recurrent[layer].copy_(self.state.recurrent[layer])

    def conv_copies(self, layer: int) -> dict[int, torch.Tensor]:
        """Where a state layer's convolution copies its last inputs: after so many rows."""
        return {after: copy.conv[layer] for after, copy in self.copies.items()}


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
