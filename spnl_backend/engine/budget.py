"""How many KV blocks the paged cache gets, and how many state slots and snapshots a model
with state layers keeps: from exactly one budget, checked before allocation.

A byte budget (``MISTRALRS_PAGED_ATTN_MEMORY_MB`` / ``_MEMORY_FRACTION``) holds both kinds:
the state group takes at most half of it (`STATE_SHARE`): its snapshots for prefix hits
at most a quarter (`SNAPSHOT_SHARE`, and at most ``MISTRALRS_PREFIX_CACHE_N`` of them), its
slots (one per running sequence) what that half leaves, up to the engine's sequence limit;
the KV blocks take the rest. A token budget (``_CONTEXT_LEN``) sizes the KV blocks alone;
the states come on top (every slot, every snapshot) and the sum must fit in memory.
"""

from dataclasses import dataclass

from ..errors import PlatformError, SettingsError
from ..memory import MIB
from ..models.config import ModelConfig
from ..settings.backend_settings import KvBudget, env_name

# Kept free beside the cache for what a step allocates (activations, logits, the slices a
# prefill dequantizes): a budget may take what is free less this.
STEP_RESERVE_BYTES = 256 * MIB
# Of a byte budget: the most the state group takes, and of it the most its snapshots take.
STATE_SHARE = 0.5
SNAPSHOT_SHARE = 0.25
# The sliding-window layers' own pool holds the windows of this many sequences at once
# beside a prefill chunk of this many tokens (`WindowPlan`): more sequences in their
# windows wait (preempted like any that finds no room), a longer chunk is cut to fit.
# Sixteen: a busy server's batch. Where the global layers' pool holds no more than that
# (the default 4,096 tokens at a 512-token window), the windowed pool would be no smaller
# and stays off, so nothing waits that ran before; it pays at longer contexts.
WINDOW_SEQS = 16
WINDOW_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class StatePlan:
    """The state group's room: each sequence's states (``bytes_per_seq``: a conv and a
    recurrent state per state layer), the copies a slot holds (its live state, the copy it
    leaves at a block boundary for a snapshot, the states after a speculative step's last
    rows), how many slots (sequences that may run at once) and snapshots."""

    bytes_per_seq: int
    copies_per_slot: int
    slots: int
    snapshots: int

    @property
    def slot_bytes(self) -> int:
        return self.bytes_per_seq * self.copies_per_slot

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes + self.snapshots * self.bytes_per_seq

    def describe(self) -> str:
        """The figures in words, for errors and logs."""
        return (
            f"{self.slots} state slots x {self.slot_bytes:,} bytes ({self.copies_per_slot} "
            f"copies of a sequence's {self.bytes_per_seq:,} bytes) + {self.snapshots} snapshots "
            f"x {self.bytes_per_seq:,} bytes = {self.nbytes / MIB:,.2f} MB"
        )


@dataclass(frozen=True)
class WindowPlan:
    """The sliding-window layers' own pool (`engine.window_pool`): their K and V per token
    (``bytes_per_token``, of every layer's), their window, and room for the windows of
    ``seqs`` sequences at once beside one prefill chunk of ``chunk_tokens`` (a step's
    queries and the window before them are all in it: a longer chunk is cut to what fits,
    more sequences in their windows wait). Never more blocks than the whole pool."""

    bytes_per_token: int
    window: int
    seqs: int
    chunk_tokens: int

    def most_blocks(self, block_size: int) -> int:
        """The blocks the windowed pool takes where the whole pool has as many or more: a
        window and the block being written per sequence, and the chunk's blocks."""
        per_seq = -(-self.window // block_size) + 1
        return self.seqs * per_seq + -(-self.chunk_tokens // block_size)


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int  # K and V of every layer per token
    states: StatePlan | None = None  # a model with state layers: its slots and snapshots
    # With a windowed pool: its blocks, and the bytes per token of the layers in it (of
    # ``bytes_per_token``); the other layers hold ``num_blocks``.
    window_blocks: int | None = None
    window_bytes_per_token: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def window_tokens(self) -> int | None:
        return None if self.window_blocks is None else self.window_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        full = self.num_tokens * (self.bytes_per_token - self.window_bytes_per_token)
        windowed = (self.window_tokens or self.num_tokens) * self.window_bytes_per_token
        return full + windowed


def plan_kv_cache(
    config: ModelConfig,
    budget: KvBudget,
    block_size: int,
    per_token: int,
    available_bytes: int,
    states: StatePlan | None = None,
    window: WindowPlan | None = None,
) -> KVCachePlan:
    """Blocks for the budget, at ``per_token`` bytes of K and V per token, and with
    ``states`` (the most slots and snapshots a model with state layers asks for) the
    state group's share (`fit_states`); an error if it gives no block, or more than
    ``available_bytes`` (what the process may still allocate) less `STEP_RESERVE_BYTES`.
    A memory fraction is of that same usable memory. ``window``: the sliding-window
    layers' own pool (their share of ``per_token``), sized by it up to the whole pool's
    blocks; a byte budget gives the other layers what it leaves."""
    per_block = per_token * block_size
    usable = max(available_bytes - STEP_RESERVE_BYTES, 0)
    variable = env_name(f"paged_attn_{budget.kind}")
    if block_size > config.max_position_embeddings:
        raise SettingsError(
            f"MISTRALRS_PAGED_ATTN_BLOCK_SIZE={block_size} is larger than the model's "
            f"context ({config.max_position_embeddings} tokens); use a smaller block size"
        )
    budget_bytes = _budget_bytes(budget, usable)
    if states is not None:
        states = fit_states(states, budget, budget_bytes)
    state_bytes = 0 if states is None else states.nbytes
    if budget_bytes is None:
        num_blocks = -(-int(budget.value) // block_size)
    elif window is None:
        num_blocks = (budget_bytes - state_bytes) // per_block
    else:
        left = budget_bytes - state_bytes
        num_blocks = _blocks_beside_window(left, per_token, block_size, window)
    if num_blocks <= 0:
        beside = "" if states is None else f", beside the state group's {states.describe()}"
        raise SettingsError(
            f"{variable}={_given(budget.value)} gives no KV-cache block: one block of {block_size} "
            f"tokens needs {per_block / MIB:.2f} MB ({per_token:,} bytes of K and V per token for "
            f"{_kv_layers(config)}){beside}; raise the budget"
        )
    plan = KVCachePlan(num_blocks, block_size, per_token, states)
    if window is not None:
        window_blocks = min(num_blocks, window.most_blocks(block_size))
        plan = KVCachePlan(
            num_blocks, block_size, per_token, states, window_blocks, window.bytes_per_token
        )
    if plan.nbytes + state_bytes > usable:
        states_too = "" if states is None else f" and its states ({states.describe()})"
        raise PlatformError(
            f"the KV cache for {variable}={_given(budget.value)}"
            f"{'' if budget.explicit else ' (the default)'} needs {plan.nbytes / MIB:,.0f} MB "
            f"({plan.num_tokens:,} tokens){states_too}, but this process may allocate only "
            f"{available_bytes / MIB:,.0f} MB more on the device (its free memory, cgroup "
            f"and ulimit, the least of them), of which {STEP_RESERVE_BYTES // MIB} MB are "
            "kept for each step's activations; lower the budget"
            + ("" if states is None else ", or give it in MB (the states then share it)")
        )
    return plan


def _blocks_beside_window(
    budget_bytes: int, per_token: int, block_size: int, window: WindowPlan
) -> int:
    """The most blocks whose K and V fit ``budget_bytes`` with a windowed pool: every layer's
    for as many as the windowed pool holds, the other layers' for the rest."""
    per_block = per_token * block_size
    cap = window.most_blocks(block_size)
    if budget_bytes <= cap * per_block:
        return budget_bytes // per_block
    full_block = (per_token - window.bytes_per_token) * block_size
    return cap + (budget_bytes - cap * per_block) // full_block


def _budget_bytes(budget: KvBudget, usable: int) -> int | None:
    """The bytes a memory budget gives; None for a budget in tokens."""
    if budget.kind == "memory_mb":
        return int(budget.value * MIB)
    if budget.kind == "memory_fraction":
        return int(budget.value * usable)
    return None


def fit_states(asked: StatePlan, budget: KvBudget, budget_bytes: int | None) -> StatePlan:
    """``asked`` (the most slots and snapshots) within a byte budget's state share: the
    snapshots within `SNAPSHOT_SHARE` of it, the slots within what `STATE_SHARE` leaves;
    an error where not one slot fits. A budget in tokens (None) leaves ``asked`` whole."""
    if budget_bytes is None:
        return asked
    share = int(budget_bytes * STATE_SHARE)
    snapshots = min(asked.snapshots, int(budget_bytes * SNAPSHOT_SHARE) // asked.bytes_per_seq)
    slots = min(asked.slots, (share - snapshots * asked.bytes_per_seq) // asked.slot_bytes)
    if slots < 1:
        raise SettingsError(
            f"{env_name(f'paged_attn_{budget.kind}')}={_given(budget.value)} leaves the state "
            f"group {share / MIB:,.2f} MB (half of the budget), and one state slot needs "
            f"{asked.slot_bytes:,} bytes ({asked.copies_per_slot} copies of a sequence's "
            f"{asked.bytes_per_seq:,} bytes of conv and recurrent state) beside {snapshots} "
            f"snapshots of {asked.bytes_per_seq:,} bytes; raise the budget"
        )
    return StatePlan(asked.bytes_per_seq, asked.copies_per_slot, slots, snapshots)


def check_states_fit(states: StatePlan, available_bytes: int) -> None:
    """That every slot and snapshot of ``states`` fits in what the process may allocate
    (beside a contiguous KV cache, which grows and has no budget)."""
    usable = max(available_bytes - STEP_RESERVE_BYTES, 0)
    if states.nbytes > usable:
        raise PlatformError(
            f"the state group ({states.describe()}) needs more than this process may "
            f"allocate on the device ({available_bytes / MIB:,.0f} MB, of which "
            f"{STEP_RESERVE_BYTES // MIB} MB are kept for each step's activations); lower "
            "MISTRALRS_PREFIX_CACHE_N, or run paged attention with a budget in MB "
            "(MISTRALRS_PAGED_ATTN_MEMORY_MB), which fits the slots to it"
        )


def _kv_layers(config: ModelConfig) -> str:
    """The pool's layers in words: their count and shape, each shape's where they differ."""
    counts: dict[tuple[tuple[int, int], int], int] = {}
    for shape, planes in zip(config.kv_shapes, config.kv_planes, strict=True):
        counts[(shape, planes)] = counts.get((shape, planes), 0) + 1
    return " + ".join(
        f"{count} layers x {heads} KV heads x {dim} dims"
        if planes == 2
        else f"{count} layers x a latent of {dim} dims"
        for ((heads, dim), planes), count in counts.items()
    )


def _given(value: float) -> str:
    """A budget as its variable was given: a whole number whole (1e+08 was 99999999)."""
    return str(value) if isinstance(value, int) else f"{value:g}"
