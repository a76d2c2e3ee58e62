"""PIC attention in the kernel sets: the CPU set's key lists and the torch twin's mask
against plain attention under a dense mask written here, a plain sequence's rows the
same bits beside a PIC one, and the layout's numbering."""

import pytest
import torch
from paged_cases import paged_case, scoring_of, writes

from spnl_backend.kernels import cpu_kernel_set
from spnl_backend.kernels.cpu import cpu_kernels
from spnl_backend.kernels.metadata import PagedMetadata
from spnl_backend.kernels.paged_ref import paged_attention_ref, store_kv_ref
from spnl_backend.kernels.pic import PicKeys, key_rows
from spnl_backend.kernels.scoring import Scoring
from spnl_backend.pic.layout import PicLayout

BLOCK = 8
PIECES = [("cross", 5), ("plus", 9), ("plus", 3), ("plus", 8), ("cross", 6), ("plus", 4)]


@pytest.fixture(scope="module")
def native():
    kernels = cpu_kernels(checks=True)
    if kernels is None:
        pytest.skip("no C compiler for the native kernels")
    return kernels


def test_layout_numbers_both_schemes():
    pieces = [("cross", 3), ("plus", 2), ("plus", 4), ("cross", 2)]
    after = PicLayout.build(pieces, "after_prefix")
    local = PicLayout.build(pieces, "local")
    assert after.block_ids == (0, 0, 0, 1, 1, 2, 2, 2, 2, 0, 0)
    assert after.positions == (0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 8)
    assert local.positions == (0, 1, 2, 0, 1, 0, 1, 2, 3, 3, 4)
    assert (after.next_position, local.next_position) == (9, 5)
    assert after.first_plus == 3
    assert after.padded_slots(4) == 4 + 4 + 4 + 4
    assert after.position(12) == 10


def test_adjacent_cross_pieces_merge_and_empty_ones_are_refused():
    layout = PicLayout.build([("cross", 2), ("cross", 3), ("plus", 1)])
    assert [(s.kind, s.start, s.end) for s in layout.spans] == [("cross", 0, 5), ("plus", 5, 6)]
    with pytest.raises(ValueError, match="empty"):
        PicLayout.build([("plus", 0)])


def _dense(
    layout: PicLayout, queries: list[int], window: int | None, recomputed: frozenset = frozenset()
) -> torch.Tensor:
    """The rule written out token by token: a ``recomputed`` element token attends as a
    cross token (every key before it), its key still its element's."""
    seen = torch.zeros(len(queries), max(queries) + 1, dtype=torch.bool)
    for row, q in enumerate(queries):
        for k in range(q + 1):
            qb, kb = 0 if q in recomputed else layout.block_ids[q], layout.block_ids[k]
            near = window is None or layout.positions[q] - layout.positions[k] < window
            seen[row, k] = (qb == 0 or kb == 0 or qb == kb) and near
    return seen


def _pic_case(scheme: str, queries: list[int], dtype=torch.float32, seed=1):
    """A PIC sequence's keys scattered over a pool (in shuffled slots) and its queries."""
    gen = torch.Generator().manual_seed(seed)
    layout = PicLayout.build(PIECES, scheme)
    count = max(queries) + 1
    pool_k = torch.zeros(12, BLOCK, 2, 16, dtype=dtype)
    pool_v = torch.zeros_like(pool_k)
    slots = torch.randperm(12 * BLOCK, generator=gen)[:count]
    k = torch.randn(count, 2, 16, generator=gen)
    v = torch.randn(count, 2, 16, generator=gen)
    store_kv_ref(k, v, pool_k, pool_v, writes(slots, BLOCK))
    blocks, positions = layout.key_tensors(count)
    keys = PicKeys(slots, blocks, positions, torch.tensor(queries))
    q = torch.randn(len(queries), 4, 16, generator=gen)
    return layout, keys, q, pool_k, pool_v, k.to(dtype).float(), v.to(dtype).float()


def _expected(layout, keys, q, k, v, window, softcap, recomputed=frozenset()):
    seen = _dense(layout, keys.q_index.tolist(), window, recomputed)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * 0.25
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vv)


def _meta(keys: PicKeys, pool: torch.Tensor, plain: PagedMetadata | None = None):
    """The PIC sequence alone, or after the plain sequences of ``plain``."""
    count = keys.q_index.numel()
    table = torch.arange(pool.shape[0])[None]
    if plain is None:
        return PagedMetadata(table, [pool.shape[0] * BLOCK], [count], BLOCK, pic=[keys])
    width = max(plain.block_tables.shape[1], table.shape[1])
    tables = torch.nn.functional.pad(plain.block_tables, (0, width - plain.block_tables.shape[1]))
    return PagedMetadata(
        torch.cat([tables, torch.nn.functional.pad(table, (0, width - table.shape[1]))]),
        [*plain.seq_lens, pool.shape[0] * BLOCK],
        [*plain.query_lens, count],
        BLOCK,
        pic=[None] * len(plain.seq_lens) + [keys],
    )


QUERIES = {
    "prefill": list(range(35)),
    "elements": list(range(5, 25)),
    "decode": [34],
    "chunk": list(range(26, 35)),
}


@pytest.mark.parametrize("scheme", ["after_prefix", "local", "sequential"])
@pytest.mark.parametrize("queries", list(QUERIES))
@pytest.mark.parametrize(
    "options", [{}, {"sliding_window": 4}, {"softcap": 3.0}], ids=["plain", "window", "softcap"]
)
@pytest.mark.parametrize("pool", [torch.float32, torch.float16], ids=str)
def test_pic_attention_equals_the_dense_rule(native, scheme, queries, options, pool):
    layout, keys, q, pool_k, pool_v, k, v = _pic_case(scheme, QUERIES[queries], pool)
    expected = _expected(
        layout, keys, q, k, v, options.get("sliding_window"), options.get("softcap")
    )
    meta = _meta(keys, pool_k)
    twin = paged_attention_ref(q, pool_k, pool_v, meta, scoring_of(0.25, options))
    cpu = cpu_kernel_set(native).paged_attention(q, pool_k, pool_v, meta, scoring_of(0.25, options))
    torch.testing.assert_close(twin, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [{}, {"sliding_window": 3}], ids=["plain", "window"])
def test_queries_before_the_first_plus_list_their_keys_as_a_plain_prompt(native, options):
    """Their rows are the plain path's (every key from the start, the window as a first
    key), so their chunks, and bits, are a plain prompt's."""
    layout, keys, q, pool_k, pool_v, k, v = _pic_case("after_prefix", QUERIES["prefill"])
    keys.plain_until = layout.first_plus
    window = options.get("sliding_window")
    slots, lens, firsts = keys.rows(window)
    for row in range(layout.first_plus):
        assert lens[row] == row + 1
        assert slots[row, : row + 1].tolist() == keys.key_slots[: row + 1].tolist()
        assert firsts[row] == (max(row + 1 - window, 0) if window else 0)
    assert not firsts[layout.first_plus :].any()
    meta = _meta(keys, pool_k)
    cpu = cpu_kernel_set(native).paged_attention(q, pool_k, pool_v, meta, scoring_of(0.25, options))
    expected = _expected(layout, keys, q, k, v, window, None)
    torch.testing.assert_close(cpu, expected, atol=1e-5, rtol=1e-5)


def test_key_rows_list_each_querys_visible_slots_in_order():
    seen = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)
    rows, lens = key_rows(seen, torch.tensor([40, 41, 42, 43]))
    assert lens.tolist() == [3, 1, 4]
    assert rows[0, :3].tolist() == [40, 42, 43]
    assert rows[1, :1].tolist() == [43]
    assert rows[2].tolist() == [40, 41, 42, 43]


@pytest.mark.parametrize("options", [{}, {"sliding_window": 6}], ids=["plain", "window"])
def test_plain_rows_beside_a_pic_sequence_keep_their_bits(native, options):
    q_plain, pk, pv, plain_meta, _, _ = paged_case([40, 9], [9, 1], 2, 4, BLOCK, head_dim=16)
    _, keys, q_pic, _, _, _, _ = _pic_case("after_prefix", QUERIES["chunk"])
    # The PIC sequence's keys live in the same pool: written into the plain case's pool.
    pool_slots = torch.arange(pk.shape[0] * BLOCK)
    keys.key_slots = pool_slots[-keys.key_slots.numel() :]
    kernels = cpu_kernel_set(native)
    alone = kernels.paged_attention(q_plain, pk, pv, plain_meta, scoring_of(0.25, options))
    mixed = _meta(keys, pk, plain_meta)
    together = kernels.paged_attention(
        torch.cat([q_plain, q_pic]), pk, pv, mixed, scoring_of(0.25, options)
    )
    assert torch.equal(together[: q_plain.shape[0]], alone)


@pytest.mark.parametrize("queries", ["prefill", "decode", "chunk"])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 4}], ids=["plain", "window"])
def test_the_triton_kernel_reads_pic_keys(queries, options):
    """Interpreted on the CPU (compiled where a GPU runs the suite), beside a plain
    sequence whose rows must equal the kernel's without the PIC one."""
    pytest.importorskip("triton")
    from triton_support import load_kernels

    triton_attention = load_kernels().paged_attention
    layout, keys, q_pic, _, _, _, _ = _pic_case("after_prefix", QUERIES[queries])
    q_plain, pk, pv, plain_meta, _, _ = paged_case([40, 9], [9, 1], 2, 4, BLOCK, head_dim=16)
    keys.key_slots = torch.randperm(pk.shape[0] * BLOCK)[: keys.key_slots.numel()]
    pool_k, pool_v = pk.flatten(0, 1)[keys.key_slots], pv.flatten(0, 1)[keys.key_slots]
    expected = _expected(layout, keys, q_pic, pool_k, pool_v, options.get("sliding_window"), None)
    mixed = _meta(keys, pk, plain_meta)
    both = triton_attention(torch.cat([q_plain, q_pic]), pk, pv, mixed, scoring_of(0.25, options))
    alone = triton_attention(q_plain, pk, pv, plain_meta, scoring_of(0.25, options))
    torch.testing.assert_close(both[q_plain.shape[0] :], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(both[: q_plain.shape[0]], alone, atol=1e-6, rtol=1e-6)


# The first two tokens of every element (EPIC's link tokens), recomputed over all before.
RECOMPUTED = frozenset({5, 6, 14, 15, 17, 18, 31, 32})


def _recomputing(keys: PicKeys) -> None:
    blocks = keys.key_blocks[keys.q_index].clone()
    for row, index in enumerate(keys.q_index.tolist()):
        if index in RECOMPUTED:
            blocks[row] = 0
    keys.q_blocks = blocks


@pytest.mark.parametrize("scheme", ["after_prefix", "local", "sequential"])
@pytest.mark.parametrize("queries", ["prefill", "elements"])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 4}], ids=["plain", "window"])
def test_recomputed_element_tokens_see_every_key_before_them(native, scheme, queries, options):
    layout, keys, q, pool_k, pool_v, k, v = _pic_case(scheme, QUERIES[queries])
    _recomputing(keys)
    window = options.get("sliding_window")
    expected = _expected(layout, keys, q, k, v, window, None, RECOMPUTED)
    assert not torch.equal(expected, _expected(layout, keys, q, k, v, window, None))
    meta = _meta(keys, pool_k)
    twin = paged_attention_ref(q, pool_k, pool_v, meta, scoring_of(0.25, options))
    cpu = cpu_kernel_set(native).paged_attention(q, pool_k, pool_v, meta, scoring_of(0.25, options))
    torch.testing.assert_close(twin, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu, expected, atol=1e-5, rtol=1e-5)


def test_the_triton_kernel_reads_recomputed_queries():
    pytest.importorskip("triton")
    from triton_support import load_kernels

    triton_attention = load_kernels().paged_attention
    layout, keys, q, _, _, _, _ = _pic_case("after_prefix", QUERIES["prefill"])
    _recomputing(keys)
    q_plain, pk, pv, plain_meta, _, _ = paged_case([40, 9], [9, 1], 2, 4, BLOCK, head_dim=16)
    keys.key_slots = torch.randperm(pk.shape[0] * BLOCK)[: keys.key_slots.numel()]
    pool_k, pool_v = pk.flatten(0, 1)[keys.key_slots], pv.flatten(0, 1)[keys.key_slots]
    expected = _expected(layout, keys, q, pool_k, pool_v, None, None, RECOMPUTED)
    both = triton_attention(
        torch.cat([q_plain, q]), pk, pv, _meta(keys, pk, plain_meta), Scoring(0.25)
    )
    torch.testing.assert_close(both[q_plain.shape[0] :], expected, atol=1e-5, rtol=1e-5)
