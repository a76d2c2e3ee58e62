"""The state group: what a model's state layers (Gated DeltaNet, Mamba-2) keep per sequence,
beside the KV cache that its attention layers use.

A sequence's state is made (zeros) when the cache admits it and dropped when it is
released, finished or preempted; a preempted sequence is computed again from its first
token, so its state is rebuilt on the way. Between those, each step's chunk of its
tokens carries the state on, so chunked prefill and decode continue where the last step
stopped. `StatefulCacheManager` is the KV cache's manager with the state group beside
it: the step it gives the model is the KV step with each sequence's rows and state.
"""

import math
from dataclasses import dataclass

import torch

from ..models.config import ModelConfig
from ..models.step_attention import AttentionSpec, SequenceState, StateSegment, StepAttention
from .cache import CacheManager, Feed, PoolUsage
from .sequence import CachedTokens, ScheduledSeq


@dataclass(frozen=True)
class StateShape:
    """One state layer's two states, per sequence (as its mixer gives them)."""

    conv: tuple[int, ...]  # in the model's dtype
    recurrent: tuple[int, ...]  # in float32 at least


def state_shapes(config: ModelConfig) -> list[StateShape]:
    return [
        StateShape(mixer.conv_shape, mixer.recurrent_shape)
        for spec in config.layers
        if (mixer := spec.state_mixer) is not None
    ]


class StateCache:
    """Each admitted sequence's `SequenceState`, made on admission, dropped on release."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.shapes, self.dtype, self.device = state_shapes(config), dtype, device
        self.wide = torch.promote_types(dtype, torch.float32)  # what the rule computes in
        self._states: dict[int, tuple[CachedTokens, SequenceState]] = {}

    @property
    def bytes_per_sequence(self) -> int:
        conv = sum(math.prod(s.conv) for s in self.shapes) * self.dtype.itemsize
        return conv + sum(math.prod(s.recurrent) for s in self.shapes) * self.wide.itemsize

    @property
    def num_holders(self) -> int:
        return len(self._states)

    def claim(self, seq: CachedTokens) -> None:
        if id(seq) not in self._states:
            self._states[id(seq)] = (seq, self._fresh())

    def drop(self, seq: CachedTokens) -> None:
        self._states.pop(id(seq), None)

    def segments(self, batch: list[ScheduledSeq]) -> list[StateSegment]:
        """Each scheduled sequence's rows of the step (packed in batch order) and state."""
        segments, start = [], 0
        for item in batch:
            segments.append(StateSegment(start, item.num_new_tokens, self._of(item.seq)))
            start += item.num_new_tokens
        return segments

    def standalone(self, lengths: list[int]) -> list[StateSegment]:
        """Fresh states for packed texts of ``lengths`` that no sequence holds (a pass
        without a cache: embeddings)."""
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        return [StateSegment(s, n, self._fresh()) for s, n in zip(starts, lengths, strict=True)]

    def _of(self, seq: CachedTokens) -> SequenceState:
        held = self._states.get(id(seq))
        if held is None:
            raise RuntimeError("a sequence in a step has no state: it was never admitted")
        return held[1]

    def _fresh(self) -> SequenceState:
        return SequenceState(
            conv=[torch.zeros(s.conv, dtype=self.dtype, device=self.device) for s in self.shapes],
            recurrent=[
                torch.zeros(s.recurrent, dtype=self.wide, device=self.device) for s in self.shapes
            ],
        )


class StatefulStep:
    """The KV cache's step, with each sequence's rows and state for the state layers."""

    def __init__(self, kv: StepAttention, states: list[StateSegment]) -> None:
        self.kv, self.states = kv, states

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        return self.kv.attend(q, k, v, spec)

    def native_keys(self, windows: tuple[int, ...]) -> None:
        return None  # state layers run per op: never the native layer blocks


class StatefulCacheManager:
    """A `CacheManager`: the KV cache's manager (``kv``), with the state group beside it.
    A sequence starts from its first token (the KV manager is built without prefix
    caching: a prefix hit would need the state at that point, which is not kept)."""

    def __init__(self, kv: CacheManager, states: StateCache) -> None:
        self.kv, self.states = kv, states

    @property
    def capacity_tokens(self) -> int | None:
        return self.kv.capacity_tokens

    @property
    def num_holders(self) -> int:
        return self.kv.num_holders

    def pool_usage(self) -> PoolUsage | None:
        return self.kv.pool_usage()

    def arriving(self, seq: CachedTokens) -> None:
        self.kv.arriving(seq)

    def admit(self, seq: CachedTokens) -> None:
        self.kv.admit(seq)
        if seq.num_computed_tokens:  # never, while the KV manager caches no prefix
            raise RuntimeError("a sequence with state layers was admitted past its start")
        self.states.claim(seq)

    def reserve(self, seq: CachedTokens, num_tokens: int) -> bool:
        return self.kv.reserve(seq, num_tokens)

    def release(self, seq: CachedTokens) -> None:
        self.states.drop(seq)
        self.kv.release(seq)

    def truncate(self, seq: CachedTokens) -> None:
        self.kv.truncate(seq)

    def after_step(self, batch: list[ScheduledSeq]) -> None:
        self.kv.after_step(batch)

    def chunk(self, seq: CachedTokens, count: int) -> int:
        return self.kv.chunk(seq, count)

    def probes(self, batch: list[ScheduledSeq]) -> list:
        return self.kv.probes(batch)

    def feed(self, seq: CachedTokens, count: int) -> Feed:
        return self.kv.feed(seq, count)

    def attention(self, batch: list[ScheduledSeq], device: torch.device) -> StatefulStep:
        return StatefulStep(self.kv.attention(batch, device), self.states.segments(batch))

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()
