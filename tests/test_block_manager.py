"""Properties of the block pool and its prefix cache, under random workloads."""

from hypothesis import given, settings
from hypothesis import strategies as st

from spnl_backend.engine.block_manager import BlockManager, BlockTable, block_hash

BLOCK = 4
NUM_BLOCKS = 12

# A workload: each step either admits a sequence (tokens drawn from a tiny alphabet, so
# prefixes repeat), grows a live sequence by some tokens, or releases one.
step = st.one_of(
    st.tuples(st.just("admit"), st.lists(st.integers(0, 2), min_size=1, max_size=14)),
    st.tuples(st.just("grow"), st.integers(0, 5), st.integers(1, 6)),
    st.tuples(st.just("release"), st.integers(0, 5)),
)


class Model:
    """Drives a BlockManager the way the paged cache manager does."""

    def __init__(self) -> None:
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=True)
        self.live: list[tuple[BlockTable, list[int]]] = []

    def admit(self, tokens: list[int]) -> None:
        hits = self.blocks.match_prefix(tokens)
        if len(hits) * BLOCK >= len(tokens):
            hits = hits[:-1]
        for block_id in hits:
            self.blocks.share(block_id)
        table = BlockTable(list(hits), [self.blocks.blocks[b].hash for b in hits])
        if self._reserve(table, len(tokens)):
            self.blocks.register_full_blocks(table, tokens, len(tokens))
            self.live.append((table, tokens))
        else:
            self.blocks.release(table)

    def grow(self, which: int, count: int) -> None:
        if not self.live:
            return
        table, tokens = self.live[which % len(self.live)]
        new = tokens + [(len(tokens) + i) % 3 for i in range(count)]
        if self._reserve(table, len(new)):
            tokens[:] = new
            self.blocks.register_full_blocks(table, tokens, len(tokens))

    def release(self, which: int) -> None:
        if self.live:
            table, _ = self.live.pop(which % len(self.live))
            self.blocks.release(table)

    def _reserve(self, table: BlockTable, num_tokens: int) -> bool:
        needed = self.blocks.blocks_for(num_tokens) - len(table.block_ids)
        if needed > self.blocks.num_available:
            return False
        table.block_ids.extend(self.blocks.take() for _ in range(max(needed, 0)))
        return True

    def check(self) -> None:
        manager = self.blocks
        referenced: dict[int, int] = {}
        for table, tokens in self.live:
            for block_id in table.block_ids:
                referenced[block_id] = referenced.get(block_id, 0) + 1
            parent = 0
            for index, digest in enumerate(table.hashes):
                chunk = tuple(tokens[index * BLOCK : (index + 1) * BLOCK])
                assert digest == block_hash(parent, chunk)
                parent = digest
        free, cached = set(manager.free_ids), set(manager.cached_ids)
        assert not free & cached
        assert len(free) + len(cached) + len(referenced) == NUM_BLOCKS
        for block in manager.blocks:
            assert block.ref_count >= 0
            assert block.ref_count == referenced.get(block.block_id, 0)
            assert not (block.ref_count and (block.block_id in free or block.block_id in cached))
            if block.block_id in cached:
                assert block.hash is not None
        for digest, block_id in manager.hash_to_id.items():
            block = manager.blocks[block_id]
            assert block.hash == digest
            assert len(block.token_ids) == BLOCK


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=40))
def test_invariants_hold_under_any_workload(steps):
    model = Model()
    for operation, *args in steps:
        getattr(model, operation)(*args)
        model.check()


@settings(max_examples=200, deadline=None)
@given(st.lists(step, max_size=40), st.lists(st.integers(0, 2), min_size=1, max_size=14))
def test_a_hit_holds_exactly_the_tokens_it_matched(steps, prompt):
    model = Model()
    for operation, *args in steps:
        getattr(model, operation)(*args)
    hits = model.blocks.match_prefix(prompt)
    for index, block_id in enumerate(hits):
        assert model.blocks.blocks[block_id].token_ids == tuple(
            prompt[index * BLOCK : (index + 1) * BLOCK]
        )


def test_eviction_is_least_recently_used_and_tail_first():
    manager = BlockManager(6, BLOCK, enable_prefix_caching=True)
    older = BlockTable([manager.take(), manager.take()])
    manager.register_full_blocks(older, list(range(8)), 8)
    newer = BlockTable([manager.take(), manager.take()])
    manager.register_full_blocks(newer, list(range(100, 108)), 8)
    first_older, tail_older = older.block_ids
    first_newer, tail_newer = newer.block_ids
    manager.release(older)
    manager.release(newer)
    taken = [manager.take() for _ in range(6)]
    # free blocks first, then cached ones: older sequence before newer, tail before prefix
    assert taken[2:] == [tail_older, first_older, tail_newer, first_newer]


def test_a_hit_refreshes_a_cached_block():
    manager = BlockManager(3, BLOCK, enable_prefix_caching=True)
    a, b = BlockTable([manager.take()]), BlockTable([manager.take()])
    a_id, b_id = a.block_ids[0], b.block_ids[0]
    manager.register_full_blocks(a, [1, 1, 1, 1], 4)
    manager.register_full_blocks(b, [2, 2, 2, 2], 4)
    manager.release(a)
    manager.release(b)  # least recently used first: a, b
    (hit,) = manager.match_prefix([1, 1, 1, 1, 9])
    manager.share(hit)
    manager.release(BlockTable([hit]))  # a was used again: now b, a
    assert hit == a_id
    assert [manager.take() for _ in range(3)] == [2, b_id, a_id]


def test_without_prefix_caching_nothing_is_shared():
    manager = BlockManager(4, BLOCK, enable_prefix_caching=False)
    table = BlockTable([manager.take()])
    manager.register_full_blocks(table, [1, 2, 3, 4], 4)
    manager.release(table)
    assert manager.match_prefix([1, 2, 3, 4, 5]) == []
    assert len(manager.free_ids) == 4
