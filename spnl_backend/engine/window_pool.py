"""The sliding-window layers' own, smaller pool: a slot there for each block of the shared
block table that some sequence still attends to through those layers.

Every sequence keeps the one block table (`block_manager`); the windowed KV group holds
K and V only for blocks in some sequence's window. ``slot_of[block]`` is the block's slot
in the windowed group's tensors (-1: none), so the windowed layers' block tables and slot
mapping are the sequence's own with every entry mapped through it. A query at position
``p`` reads keys from ``p - window + 1`` on (`kernels.scoring`), so a block wholly before
the window of a sequence's next token is no longer read by it: its hold is dropped, and a
block no sequence holds gives its slot back (to the free slots, or, where the block is a
registered prefix block, to a least-recently-used list a prefix hit may still reclaim it
from). A block whose contents change (taken for new content) loses its slot first.
A PIC sequence's queries read keys of any of its blocks (its elements' positions
overlap), so it pins every block it takes, for its life, instead.
"""

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class WindowHold:
    """A sequence's holds: the blocks of its table from ``first`` on have a windowed slot
    it holds."""

    first: int = 0
    count: int = 0  # blocks held: table[first : first + count]


class WindowSlots:
    """Slots of the windowed group's pool for the blocks of the shared pool."""

    def __init__(self, num_slots: int, num_blocks: int, window: int, block_size: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a windowed pool needs at least one block, not {num_slots}")
        self.num_slots, self.window, self.block_size = num_slots, window, block_size
        self.slot_of = [-1] * num_blocks
        # ``slot_of`` as a tensor, kept in step with it (a step maps its block tables through
        # it without copying the whole list), and a last -1 for a table's padding (-1).
        self.slot_table = torch.full((num_blocks + 1,), -1, dtype=torch.long)
        self.holders = [0] * num_blocks
        self.free: deque[int] = deque(range(num_slots))
        self.kept: OrderedDict[int, None] = OrderedDict()  # unheld blocks keeping a slot, LRU first
        self.holds: dict[int, WindowHold] = {}
        self.pins: dict[int, list[int]] = {}  # a PIC sequence's blocks, each held
        # Whether a block is a registered prefix block (asked when no sequence holds it
        # any more: its slot is then kept, LRU, for a later hit); the block manager's
        # answer, given by the cache manager.
        self.registered: Callable[[int], bool] = lambda block_id: False

    @property
    def available(self) -> int:
        """Slots that can be handed out now: free, or kept by a block no sequence holds."""
        return len(self.free) + len(self.kept)

    def first_needed(self, num_computed: int) -> int:
        """The first block the queries from position ``num_computed`` on read."""
        return max(num_computed - self.window + 1, 0) // self.block_size

    def has_window(self, table: list[int], num_tokens: int) -> bool:
        """Whether every block a query at position ``num_tokens`` reads (the window before
        it) has a slot: where a prefix hit of ``num_tokens`` tokens may stop."""
        last = -(-num_tokens // self.block_size)
        return all(self.slot_of[b] >= 0 for b in table[self.first_needed(num_tokens) : last])

    # ---- a sequence's holds ---------------------------------------------------------------

    def start(self, seq_id: int, table: list[int], num_computed: int) -> None:
        """A sequence admitted with ``table`` (its prefix hit, ``num_computed`` tokens):
        hold the hit's blocks its next query reads (they have slots: `has_window`)."""
        first = min(self.first_needed(num_computed), len(table))
        self.holds[seq_id] = WindowHold(first, 0)
        self.extend(seq_id, table, len(table))

    def advance(self, seq_id: int, table: list[int], num_computed: int) -> None:
        """Drop the holds on blocks before the window of position ``num_computed``."""
        hold = self.holds[seq_id]
        first = self.first_needed(num_computed)
        while hold.count and hold.first < first:
            self._unhold(table[hold.first])
            hold.first += 1
            hold.count -= 1
        if not hold.count:
            hold.first = max(hold.first, first)

    def room(self, seq_id: int, table: list[int], num_computed: int) -> int:
        """How many blocks of its table the sequence could hold now: what it holds from the
        window of position ``num_computed`` on, the available slots, and those dropping
        the blocks before that window would free (no other sequence holding them)."""
        hold = self.holds[seq_id]
        first = self.first_needed(num_computed)
        held_end = hold.first + hold.count
        dropped = range(hold.first, min(first, held_end))
        freed = sum(1 for i in dropped if self.holders[table[i]] == 1)
        return max(held_end, first) + self.available + freed

    def extend(self, seq_id: int, table: list[int], num_blocks: int) -> None:
        """Hold (taking slots where needed) the table's blocks up to ``num_blocks``."""
        hold = self.holds[seq_id]
        while hold.first + hold.count < num_blocks:
            self._hold(table[hold.first + hold.count])
            hold.count += 1

    def missing(self, seq_id: int, table: list[int], num_blocks: int) -> int:
        """Of the `available` slots, those `extend` to ``num_blocks`` would take: one for
        each block no sequence holds yet (new, or keeping a slot), whichever it is."""
        hold = self.holds[seq_id]
        start = hold.first + hold.count
        return sum(
            1 for i in range(start, num_blocks) if i >= len(table) or not self.holders[table[i]]
        )

    def shrink(self, seq_id: int, table: list[int], num_blocks: int) -> None:
        """Drop the holds on the table's blocks from ``num_blocks`` on (they leave it)."""
        hold = self.holds.get(seq_id)
        if hold is None:
            return
        while hold.count and hold.first + hold.count > num_blocks:
            index = hold.first + hold.count - 1
            self._unhold(table[index])
            hold.count -= 1

    def finish(self, seq_id: int, table: list[int]) -> None:
        """A sequence lets go of all its holds."""
        self.shrink(seq_id, table, 0)
        self.holds.pop(seq_id, None)
        self.unpin(seq_id, list(self.pins.get(seq_id, ())))
        self.pins.pop(seq_id, None)

    def pin(self, seq_id: int, block_id: int) -> None:
        """Hold ``block_id`` (taking a slot where it has none) for a PIC sequence's life."""
        self._hold(block_id)
        self.pins.setdefault(seq_id, []).append(block_id)

    def unpin(self, seq_id: int, blocks: list[int]) -> None:
        """Drop a PIC sequence's pins on ``blocks``."""
        pinned = self.pins.get(seq_id, [])
        for block_id in blocks:
            pinned.remove(block_id)
            self._unhold(block_id)

    # ---- slots ----------------------------------------------------------------------------

    def forget(self, block_id: int) -> None:
        """Block ``block_id`` is taken for new content: its slot (if kept) is freed."""
        slot = self.slot_of[block_id]
        if slot < 0:
            return
        if self.holders[block_id]:
            raise AssertionError(f"block {block_id} is retaken while its window slot is held")
        del self.kept[block_id]
        self.free.append(slot)
        self._set(block_id, -1)

    def reset(self) -> None:
        """Free the slots of every block no sequence holds (the prefix cache is cleared)."""
        for block_id in list(self.kept):
            self.forget(block_id)

    def _hold(self, block_id: int) -> None:
        if self.slot_of[block_id] >= 0:
            if self.holders[block_id] == 0:
                del self.kept[block_id]
        else:
            if self.free:
                slot = self.free.popleft()
            else:
                evicted, _ = self.kept.popitem(last=False)
                slot = self.slot_of[evicted]
                self._set(evicted, -1)
            self._set(block_id, slot)
        self.holders[block_id] += 1

    def _unhold(self, block_id: int) -> None:
        self.holders[block_id] -= 1
        if self.holders[block_id]:
            return
        if self.registered(block_id):
            self.kept[block_id] = None
        else:
            self.free.append(self.slot_of[block_id])
            self._set(block_id, -1)

    def _set(self, block_id: int, slot: int) -> None:
        self.slot_of[block_id] = slot
        self.slot_table[block_id] = slot
