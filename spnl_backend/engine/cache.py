"""The KV cache as the scheduler, the runner and the engine see it, paged or contiguous:
the manager protocol, and what a cache reports of itself."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from ..models.step_attention import StepAttention
from .sequence import CachedTokens, ScheduledSeq

if TYPE_CHECKING:
    from .pic_probe import RecomputeProbe

# A sequence's next tokens to compute: their first position (consecutive ones) or each
# one's position, and their ids.
Feed = tuple[int | list[int], list[int]]


@dataclass(frozen=True)
class CacheInfo:
    """The KV cache the engine runs on (with a speculative draft: the target's; the draft
    keeps one of the same kind beside it)."""

    kind: Literal["paged", "contiguous"]  # one block pool for all sequences, or a store each
    capacity_tokens: int | None  # tokens the pool holds; None: contiguous stores grow
    block_size: int | None  # tokens per block (None in contiguous mode)
    num_blocks: int | None  # blocks in the pool (None in contiguous mode)
    # What the storage holds: the model's dtype, float8_e4m3fn, or a compression
    # method's uint8 records; None where a compression plugin keeps its own.
    dtype: torch.dtype | None
    bytes_per_token: int | None  # K and V of every layer; None: a plugin's own records
    compression: str | None  # the MISTRALRS_KV_CACHE_COMPRESSION method; None: plain K/V
    # The kernels the pool attends through: "cpu" (the compiled kernels, which hand a
    # cache dtype they have no kernel for, such as FP8, to the torch twins), "triton" or
    # "torch"; None in contiguous mode, which attends per sequence in torch.
    kernels: str | None
    # The state group (`engine.state_cache`), None where the model has no state layers:
    # what a sequence keeps in the state layers (a conv and a recurrent state per layer);
    # the states a slot may hold at once (`state_cache.copies_per_slot`) and their bytes;
    # the slots (sequences that may run at once) and snapshots the budget gives
    # (`engine.budget`); and all of them in bytes, the most the group holds.
    state_bytes_per_seq: int | None = None
    state_copies_per_slot: int | None = None
    state_slots: int | None = None
    state_snapshots: int | None = None
    state_bytes: int | None = None
    # Every KV layer of one shape and every attention layer with its own K and V
    # (`ModelConfig.uniform_kv`; False: Gemma 4's KV groups and shared layers).
    uniform_kv: bool = True
    # The KV layers keep one latent per token (DeepSeek's multi-head latent attention,
    # `ModelConfig.kv_planes`), not K and V per head.
    latent_kv: bool = False
    # Some layer attends within chunks of absolute positions (`ModelConfig.chunked_attention`).
    chunked_attention: bool = False
    # The cache can drop the tokens of a step's rejected proposals (False: a compression
    # plugin's non-paged caches without truncate, which speculation cannot run on).
    rolls_back: bool = True
    # The sliding-window layers' own pool (`engine.window_pool`): its blocks, where it is
    # on; where the model can have one (on at a budget where it is smaller), those layers'
    # share of ``bytes_per_token`` and the most tokens it takes at any budget.
    window_blocks: int | None = None
    window_bytes_per_token: int | None = None
    window_most_tokens: int | None = None


@dataclass(frozen=True)
class PoolUsage:
    """The paged block pool: blocks in all, held by sequences, and cached (unreferenced,
    holding a reusable prefix; evicted when needed)."""

    blocks: int
    in_use: int
    cached: int
    # The sliding-window layers' own pool, where it has one (`engine.window_pool`): its
    # blocks, those held by sequences' windows, and those kept for prefix hits.
    window_blocks: int | None = None
    window_in_use: int | None = None
    window_cached: int | None = None

    @property
    def usage(self) -> float | None:
        """The fraction of the fuller pool held by sequences (1 is full): a request needs
        room in both, so the global pool's room alone overstates it. None for no blocks."""
        if not self.blocks:
            return None
        held = self.in_use / self.blocks
        if self.window_blocks and self.window_in_use is not None:
            held = max(held, self.window_in_use / self.window_blocks)
        return held

    def load_blocks(self) -> int:
        """Blocks held, counted against the global pool's size: its own, or where the
        windowed pool is fuller, that pool's share of the global pool (rounded up), so a
        reader that compares the load with the global pool sees how full the fuller is."""
        if not self.window_blocks or self.window_in_use is None:
            return self.in_use
        scaled = -(-self.window_in_use * self.blocks // self.window_blocks)
        return max(self.in_use, scaled)


@dataclass(frozen=True)
class StateUsage:
    """The state group now: its slots (None: no bound) and those held by sequences, the
    snapshots kept for prefix hits and their bytes, and the bytes of every state held
    (live, the copies steps leave, snapshots)."""

    slots: int | None
    in_use: int
    snapshots: int
    snapshot_bytes: int
    bytes: int


class CacheManager(Protocol):
    """The KV cache as the scheduler and runner see it (paged or contiguous)."""

    capacity_tokens: int | None
    num_holders: int

    def pool_usage(self) -> PoolUsage | None: ...

    def arriving(self, seq: CachedTokens) -> None: ...
    def admit(self, seq: CachedTokens) -> None: ...
    def reserve(self, seq: CachedTokens, num_tokens: int) -> bool: ...
    def release(self, seq: CachedTokens) -> None: ...
    def truncate(self, seq: CachedTokens) -> None: ...
    def after_step(self, batch: list[ScheduledSeq]) -> None: ...
    def chunk(self, seq: CachedTokens, count: int) -> int: ...
    def probes(self, batch: list[ScheduledSeq]) -> list["RecomputeProbe"]: ...
    def feed(self, seq: CachedTokens, count: int) -> Feed: ...
    def attention(self, batch: list[ScheduledSeq], device: torch.device) -> StepAttention: ...
    def reset_prefix_cache(self) -> int: ...


def in_order(seq: CachedTokens, count: int) -> Feed:
    """The next ``count`` tokens of a sequence computed in token order (every sequence
    but a PIC one, whose cache picks its order)."""
    start = seq.num_computed_tokens
    return start, seq.token_ids[start : start + count]
