"""The block pool of the paged KV cache, with block-level prefix caching.

Blocks are either referenced (in some sequence's block table), cached (unreferenced
but holding the K/V of a full block whose hash is known), or free. Taking a block
prefers a free one and otherwise evicts the least recently used cached block; both
are O(1). A full block's hash chains its parent's: ``hash(parent_hash, tokens)``,
so equal hashes mean equal prefixes, and a new request reuses the longest chain of
cached blocks its prompt starts with. Shared blocks are full, hence never written (a PIC
element's partial last block is shared too: nothing follows it in its block, see
`engine.pic_blocks`).
"""

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

_NO_PARENT = 0
UNTAKEN = -1  # a block table entry whose block is not taken yet (PIC sequences' misses)


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """A stable 64-bit hash of a block's tokens and its parent's hash (not Python's salted
    `hash`, so equal prefixes hash equally across processes)."""
    digest = hashlib.blake2b(struct.pack(f"<Q{len(tokens)}i", parent, *tokens), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


POOL = "pool"  # where a block is held: the block pool, which requests read directly
TIER = "tier"  # the KV tier on disk (`kv_tier`), read back into the pool before use


class BlockEvents(Protocol):
    """Told what the prefix cache and the KV tier offer and forget (`server.kv_events`
    publishes it), on the engine's thread or the tier's writer: each call must return at
    once. ``medium`` is `POOL` or `TIER`."""

    def stored(
        self,
        digest: int,
        parent: int | None,
        tokens: tuple[int, ...],
        pic: bool,
        medium: str = POOL,
    ) -> None:
        """A block registered: its key, its parent's (None: a chain's first, or a PIC
        block's, whose key does not chain the prompt before it) and its tokens."""

    def removed(self, digest: int, medium: str = POOL) -> None:
        """A registered block forgotten (evicted for new content)."""

    def cleared(self) -> None:
        """Every registered block forgotten at once (`BlockManager.reset_cache`)."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered
    token_ids: tuple[int, ...] = ()  # the tokens its hash covers (checked on every hit)
    position: int | None = None  # a PIC block's first position (its keys' rotation)
    parent: int | None = None  # the key its key chains, where known (for `BlockEvents`)


@dataclass
class BlockTable:
    """A sequence's blocks, and the hashes of those that are full and registered."""

    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.cached_ids: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.hash_to_id: dict[int, int] = {}
        self.events: BlockEvents | None = None  # told of registrations and evictions
        # Told of a block taken for new content, before it is handed out (a windowed pool
        # drops the slot it kept for the block's old content).
        self.on_take: Callable[[int], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now: free, or cached and evictable."""
        return len(self.free_ids) + len(self.cached_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix caching -------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int], root: int = _NO_PARENT) -> list[int]:
        """Ids of the cached blocks that hold the longest full-block prefix of ``token_ids``
        (its chain started at ``root``: a LoRA adapter's, or none)."""
        if not self.enable_prefix_caching:
            return []
        matched = []
        for digest, tokens in self.prefix_keys(token_ids, root):
            block_id = self.lookup(digest, tokens)
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def lookup(self, digest: int, tokens: tuple[int, ...]) -> int | None:
        """The block registered under ``digest``, if it holds exactly ``tokens``."""
        block_id = self.hash_to_id.get(digest)
        if block_id is None or self.blocks[block_id].token_ids != tokens:
            return None
        return block_id

    def register(
        self,
        block_id: int,
        digest: int,
        tokens: tuple[int, ...],
        position: int | None = None,
        parent: int | None = None,
    ) -> bool:
        """Offer a computed block to later lookups (unless one is registered already);
        whether it was. ``position``: a PIC block's first position; ``parent``: the key
        this one chains (told to `events`)."""
        block = self.blocks[block_id]
        if block.hash is None and digest not in self.hash_to_id:
            block.hash, block.token_ids, block.position = digest, tokens, position
            block.parent = parent
            self.hash_to_id[digest] = block_id
            if self.events is not None:
                self.events.stored(digest, parent, tokens, position is not None)
            return True
        return False

    def reset_cache(self) -> int:
        """Forget every cached block (prefix and PIC): unreferenced ones become free, those
        sequences hold are freed when they let go of them. How many were forgotten."""
        cached = [block for block in self.blocks if block.hash is not None]
        for block in cached:
            self._forget(block, announce=False)
        if self.events is not None:
            self.events.cleared()
        self.free_ids.extend(self.cached_ids)
        self.cached_ids.clear()
        return len(cached)

    def register_full_blocks(
        self, table: BlockTable, token_ids: list[int], num_computed: int, root: int = _NO_PARENT
    ) -> list[int]:
        """Hash the blocks that ``num_computed`` tokens have filled (the chain started at
        ``root``), so others may share them; the ids of those newly registered."""
        if not self.enable_prefix_caching:
            return []
        full = min(num_computed, len(token_ids)) // self.block_size
        registered = []
        while len(table.hashes) < min(full, len(table.block_ids)):
            index = len(table.hashes)
            tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            parent = table.hashes[-1] if table.hashes else None
            digest = block_hash(root if parent is None else parent, tokens)
            table.hashes.append(digest)
            if self.register(table.block_ids[index], digest, tokens, parent=parent):
                registered.append(table.block_ids[index])
        return registered

    def prefix_keys(
        self, token_ids: list[int], root: int = _NO_PARENT
    ) -> list[tuple[int, tuple[int, ...]]]:
        """The digest and tokens of every full block of ``token_ids``, in order, the chain
        started at ``root`` (a LoRA adapter's own: its K/V is never another's)."""
        keys, parent = [], root
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            tokens = tuple(token_ids[start : start + self.block_size])
            parent = block_hash(parent, tokens)
            keys.append((parent, tokens))
        return keys

    # ---- taking and returning blocks ------------------------------------------------------

    def share(self, block_id: int) -> None:
        """Reference a cached block (a prefix hit)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.cached_ids[block_id]
        block.ref_count += 1

    def unshare(self, block_id: int) -> None:
        """Drop one reference taken with `share` (a cached block goes back to the cache)."""
        self._drop(self.blocks[block_id])

    def take(self) -> int:
        """A block for new content: a free one, else the least recently used cached one."""
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            block_id, _ = self.cached_ids.popitem(last=False)
            self._forget(self.blocks[block_id])
        if self.on_take is not None:
            self.on_take(block_id)
        self.blocks[block_id].ref_count = 1
        return block_id

    def release(self, table: BlockTable) -> None:
        """Drop a sequence's references; its tail blocks become the first to be evicted."""
        self.truncate(table, 0)

    def truncate(self, table: BlockTable, num_blocks: int) -> None:
        """Drop the references to the blocks after the first ``num_blocks`` of ``table``."""
        for block_id in reversed(table.block_ids[num_blocks:]):
            if block_id != UNTAKEN:
                self._drop(self.blocks[block_id])
        del table.block_ids[num_blocks:]
        del table.hashes[num_blocks:]

    def _drop(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is None:
                self.free_ids.append(block.block_id)
            else:
                self.cached_ids[block.block_id] = None

    def _forget(self, block: Block, announce: bool = True) -> None:
        if block.hash is not None and self.hash_to_id.get(block.hash) == block.block_id:
            del self.hash_to_id[block.hash]
            if announce and self.events is not None:
                self.events.removed(block.hash)
        block.hash, block.token_ids, block.position, block.parent = None, (), None, None
