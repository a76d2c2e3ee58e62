"""The state group: what a model's state layers (Gated DeltaNet, Mamba-2, Mamba-1) keep
per sequence, beside the KV cache that its attention layers use.

A sequence's state is made when the cache admits it and dropped when it is released,
finished or preempted; a preempted sequence comes back from its last snapshot or its
first token, its state rebuilt on the way. The state layers compute a sequence in pieces
that end at absolute multiples of ``piece`` tokens (the KV pool's block size; the rule's
chunk without one), so a sequence's arithmetic does not depend on where it starts being
computed from a snapshot at such a boundary.

Prefix caching (paged pool): in each step a sequence whose tokens cross a block boundary
leaves a copy of its state at the last one crossed; once the block ending there is
registered, the copy is kept under that block's hash (the prefix it ends), the least
recently used dropped past ``max_snapshots``. A sequence admitted with a prefix hit keeps
the hit up to its deepest block with a snapshot and starts from a copy of it.

Slots: at most ``slots`` sequences hold a state at once (`engine.budget` sizes them and
the snapshots from the memory budget). A sequence admitted while every slot is held gets
none, and its cache refuses to reserve for it, so the scheduler leaves it waiting (a
paused sequence gives up its slot for it, as for KV blocks); a sequence released,
finished or preempted frees its slot.
`StatefulCacheManager` is the KV cache's manager with the state group beside it.
"""

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..models.config import ModelConfig
from ..models.step_attention import AttentionSpec, SequenceState, StateSegment, StepAttention
from .cache import CacheManager, Feed, PoolUsage, StateUsage
from .sequence import CachedTokens, ScheduledSeq

RULE_CHUNK = 64  # the pieces' length where no block size sets it (`kernels.delta_rule`)


@dataclass(frozen=True)
class StateShape:
    """One state layer's two states, per sequence (as its mixer gives them)."""

    conv: tuple[int, ...]  # in the model's dtype
    recurrent: tuple[int, ...]  # in float32 at least


def copies_per_slot(snapshots: bool, trail_rows: int) -> int:
    """The states a running sequence may hold at once: its live one, with snapshots on
    the copy it leaves at a block boundary, with a speculative draft the copies after the
    last ``trail_rows`` rows of its last two steps (`StateCache._trail`)."""
    return 1 + int(snapshots) + 2 * trail_rows


def state_shapes(config: ModelConfig) -> list[StateShape]:
    return [
        StateShape(mixer.conv_shape, mixer.recurrent_shape)
        for spec in config.layers
        if (mixer := spec.state_mixer) is not None
    ]


def state_bytes_per_seq(shapes: list[StateShape], dtype: torch.dtype) -> int:
    """A sequence's states in bytes: the convs in the model's ``dtype``, the recurrent
    states in float32 at least (what the rule computes in)."""
    wide = torch.promote_types(dtype, torch.float32)
    conv = sum(math.prod(s.conv) for s in shapes) * dtype.itemsize
    return conv + sum(math.prod(s.recurrent) for s in shapes) * wide.itemsize


class StateCache:
    """Each admitted sequence's `SequenceState`, and the snapshots kept for prefix hits."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        piece: int = RULE_CHUNK,
        max_snapshots: int = 0,
        slots: int | None = None,
    ) -> None:
        self.shapes, self.dtype, self.device = state_shapes(config), dtype, device
        self.wide = torch.promote_types(dtype, torch.float32)  # what the rule computes in
        self.piece, self.max_snapshots = piece, max_snapshots
        self.slots = slots  # sequences that may hold a state at once (None: no bound)
        # With a speculative draft: the last rows of each step whose states are kept, so
        # that a sequence can go back to where its accepted tokens end (0: none kept).
        self.trail_rows = 0
        self._states: dict[int, tuple[CachedTokens, SequenceState]] = {}
        self._position: dict[int, int] = {}  # where each state stands (tokens computed)
        # A sequence's copy at the last boundary its step crossed: (tokens, state).
        self._pending: dict[int, tuple[int, SequenceState]] = {}
        # Each sequence's states after its last steps' rows, by position (speculative).
        self._trails: dict[int, OrderedDict[int, SequenceState]] = {}
        self.snapshots: OrderedDict[int, SequenceState] = OrderedDict()  # by block hash, LRU

    @property
    def bytes_per_sequence(self) -> int:
        return state_bytes_per_seq(self.shapes, self.dtype)

    @property
    def num_holders(self) -> int:
        return len(self._states)

    @property
    def slot_free(self) -> bool:
        return self.slots is None or len(self._states) < self.slots

    def holds(self, seq: CachedTokens) -> bool:
        return id(seq) in self._states

    def claim(self, seq: CachedTokens, start: SequenceState | None = None) -> None:
        """Give ``seq`` its state: a copy of ``start`` (a snapshot), else zeros."""
        if id(seq) in self._states:
            return
        if not self.slot_free:
            raise RuntimeError(f"every one of the {self.slots} state slots is held")
        state = self._fresh() if start is None else _copy(start)
        self._states[id(seq)] = (seq, state)

    def usage(self) -> StateUsage:
        """Slots held, and the states held now: live, copies and snapshots."""
        copies = {id(state) for _, state in self._pending.values()}
        for trail in self._trails.values():
            copies.update(id(state) for state in trail.values())
        held = len(self._states) + len(copies) + len(self.snapshots)
        return StateUsage(
            slots=self.slots,
            in_use=len(self._states),
            snapshots=len(self.snapshots),
            snapshot_bytes=len(self.snapshots) * self.bytes_per_sequence,
            bytes=held * self.bytes_per_sequence,
        )

    def drop(self, seq: CachedTokens) -> None:
        for held in (self._states, self._position, self._pending, self._trails):
            held.pop(id(seq), None)

    def segments(self, batch: list[ScheduledSeq], snapshots: bool) -> list[StateSegment]:
        """Each scheduled sequence's rows of the step (packed in batch order) and state;
        with ``snapshots``, where it crosses a block boundary, a copy to take there; with
        ``trail_rows``, a copy after each of its last rows."""
        segments, start = [], 0
        for item in batch:
            seq, count = item.seq, item.num_new_tokens
            first = seq.num_computed_tokens
            copies: dict[int, SequenceState] = {}
            boundary = (first + count) // self.piece * self.piece
            if snapshots and boundary > first:
                copies[boundary - first] = self._fresh()
                self._pending[id(seq)] = (boundary, copies[boundary - first])
            if self.trail_rows:
                self._trail(seq, first, count, copies)
            state = self._of(seq)
            segments.append(StateSegment(start, count, state, first, self.piece, copies))
            self._position[id(seq)] = first + count
            start += count
        return segments

    def _trail(
        self, seq: CachedTokens, first: int, count: int, copies: dict[int, SequenceState]
    ) -> None:
        """Copies after each of the step's last ``trail_rows`` rows, kept by position."""
        trail = self._trails.setdefault(id(seq), OrderedDict())
        for after in range(max(1, count - self.trail_rows + 1), count + 1):
            copies[after] = copies.get(after) or self._fresh()
            trail[first + after] = copies[after]
        while len(trail) > 2 * self.trail_rows:  # a step's and the one before it
            trail.popitem(last=False)

    def roll_back(self, seq: CachedTokens, position: int) -> None:
        """Put ``seq``'s state back to where ``position`` tokens end (its accepted
        tokens, after a speculative step), from the copies its steps left."""
        trail = self._trails.pop(id(seq), {})
        pending = self._pending.get(id(seq))
        if pending is not None and pending[0] > position:  # a boundary of rejected tokens
            del self._pending[id(seq)]
        if self._position.get(id(seq), position) == position:
            return
        saved = trail.get(position)
        if saved is None:
            raise RuntimeError(f"no state kept at position {position} to go back to")
        live = self._of(seq)
        for to, source in zip(
            live.conv + live.recurrent, saved.conv + saved.recurrent, strict=True
        ):
            to.copy_(source)
        self._position[id(seq)] = position

    def keep_snapshot(self, seq: CachedTokens, hashes: Sequence[int]) -> None:
        """The copy ``seq`` left at a boundary, kept under the hash of the block ending
        there once that block is registered (``hashes``: its registered blocks')."""
        pending = self._pending.get(id(seq))
        if pending is None:
            return
        boundary, state = pending
        index = boundary // self.piece - 1
        if index >= len(hashes):
            return  # not registered (yet): a later step may
        del self._pending[id(seq)]
        self.snapshots[hashes[index]] = state
        self.snapshots.move_to_end(hashes[index])
        while len(self.snapshots) > self.max_snapshots:
            self.snapshots.popitem(last=False)

    def deepest_snapshot(self, hashes: Sequence[int]) -> tuple[int, SequenceState | None]:
        """Of a prefix's block ``hashes``, how many end at a kept snapshot, and that one."""
        for count in range(len(hashes), 0, -1):
            state = self.snapshots.get(hashes[count - 1])
            if state is not None:
                self.snapshots.move_to_end(hashes[count - 1])
                return count, state
        return 0, None

    def forget_snapshots(self) -> None:
        self.snapshots.clear()

    def standalone(self, lengths: list[int]) -> list[StateSegment]:
        """Fresh states for packed texts of ``lengths`` that no sequence holds (a pass
        without a cache: embeddings)."""
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        return [
            StateSegment(s, n, self._fresh(), 0, self.piece)
            for s, n in zip(starts, lengths, strict=True)
        ]

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


def _copy(state: SequenceState) -> SequenceState:
    return SequenceState([t.clone() for t in state.conv], [t.clone() for t in state.recurrent])


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


class BlockHashes(Protocol):
    """What snapshots need of a paged KV manager (`engine.paged.PagedCacheManager`)."""

    def block_hashes(self, seq: CachedTokens) -> Sequence[int]: ...
    def limit_hit(self, seq: CachedTokens, num_blocks: int) -> None: ...


class StatefulCacheManager:
    """A `CacheManager`: the KV cache's manager (``kv``), with the state group beside it.
    ``paged``: the KV manager, where it keys blocks by hash (prefix hits start from
    snapshots); None where it does not (a sequence is computed from its first token: the
    KV manager is built without prefix caching)."""

    def __init__(
        self, kv: CacheManager, states: StateCache, paged: BlockHashes | None = None
    ) -> None:
        self.kv, self.states, self.paged = kv, states, paged

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
        """The KV manager's admission, its prefix hit kept up to the deepest block with a
        state snapshot, the state starting from that snapshot; nothing where every slot
        is held (`reserve` then refuses, and the sequence waits)."""
        if not self.states.slot_free:
            return
        self.kv.admit(seq)
        start = None
        if seq.num_computed_tokens:
            if self.paged is None:
                raise RuntimeError("a sequence with state layers was admitted past its start")
            hit = seq.num_computed_tokens // self.states.piece
            kept, start = self.states.deepest_snapshot(self.paged.block_hashes(seq)[:hit])
            self.paged.limit_hit(seq, kept)
        self.states.claim(seq, start)

    def reserve(self, seq: CachedTokens, num_tokens: int) -> bool:
        """The KV manager's room, for a sequence that holds a state slot."""
        return self.states.holds(seq) and self.kv.reserve(seq, num_tokens)

    def release(self, seq: CachedTokens) -> None:
        self.states.drop(seq)
        self.kv.release(seq)

    def truncate(self, seq: CachedTokens) -> None:
        """The KV past the computed tokens returned, the state put back to them."""
        self.kv.truncate(seq)
        self.states.roll_back(seq, seq.num_computed_tokens)

    def after_step(self, batch: list[ScheduledSeq]) -> None:
        self.kv.after_step(batch)
        if self.paged is not None:
            for item in batch:
                self.states.keep_snapshot(item.seq, self.paged.block_hashes(item.seq))

    def chunk(self, seq: CachedTokens, count: int) -> int:
        """The KV manager's chunk, ended at a piece boundary where it ends a prefill chunk
        early (so a later hit's pieces are the cold run's), unless none is in reach."""
        count = self.kv.chunk(seq, count)
        end = seq.num_computed_tokens + count
        if end >= len(seq.token_ids):
            return count
        aligned = end // self.states.piece * self.states.piece - seq.num_computed_tokens
        return aligned if aligned > 0 else count

    def probes(self, batch: list[ScheduledSeq]) -> list:
        return self.kv.probes(batch)

    def feed(self, seq: CachedTokens, count: int) -> Feed:
        return self.kv.feed(seq, count)

    def attention(self, batch: list[ScheduledSeq], device: torch.device) -> StatefulStep:
        segments = self.states.segments(batch, snapshots=self._snapshots_on)
        return StatefulStep(self.kv.attention(batch, device), segments)

    def reset_prefix_cache(self) -> int:
        self.states.forget_snapshots()
        return self.kv.reset_prefix_cache()

    @property
    def _snapshots_on(self) -> bool:
        return self.paged is not None and self.states.max_snapshots > 0


def state_usage(cache: object) -> StateUsage | None:
    """The state group's usage of an engine's cache (a speculative pair's: the target's);
    None where the model has no state layers."""
    cache = getattr(cache, "target", cache)
    return cache.states.usage() if isinstance(cache, StatefulCacheManager) else None
