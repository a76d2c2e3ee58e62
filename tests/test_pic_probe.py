"""CacheBlend's pick of the recomputed tokens (``MISTRALRS_PIC_RECOMPUTE_SELECT=deviation``):
the probe's deviations against a dense reference written from the rule, the engine's
output against the dense recompute reference with the tokens it picked, cold runs against
hits bit for bit, and the setting."""

import math

import pytest
import torch
from helpers import engine_internals
from pic_reference import probe_deviations, recompute_reference_greedy
from test_pic import DOCS, TOKENS, _fresh, _pieces, _run
from tiny_models import ARCHITECTURES

from spnl_backend.engine import pic_probe
from spnl_backend.engine.pic_blocks import Entry, PicProgress
from spnl_backend.engine.pic_probe import most_deviating
from spnl_backend.pic.layout import PicLayout

FLOATS = {"cpu_matmul": "float32", "paged_cache_type": "f32"}
DEVIATION = {"pic_recompute_select": "deviation", **FLOATS}


@pytest.fixture(scope="module")
def trained(tiny):
    return str(tiny.trained().path)


def _group(pieces) -> tuple[int, int]:
    """The first group's first token and end."""
    start, first = 0, None
    for kind, ids in pieces:
        if kind == "plus" and first is None:
            first = start
        if kind == "cross" and first is not None:
            return first, start
        start += len(ids)
    raise AssertionError("no group followed by cross tokens")


def _count(pieces, fraction: float) -> int:
    return sum(math.ceil(fraction * len(ids)) for kind, ids in pieces if kind == "plus")


# ---- the pick ------------------------------------------------------------------------------


def test_the_most_deviating_rows_in_row_order_earlier_first_on_a_tie():
    deviations = torch.tensor([0.5, 2.0, 0.5, 3.0, 0.5])
    assert most_deviating(deviations, 2) == [1, 3]
    assert most_deviating(deviations, 3) == [0, 1, 3]  # the tie at 0.5: row 0
    assert most_deviating(torch.tensor([1.0, float("nan"), 2.0]), 1) == [1]
    assert most_deviating(torch.zeros(4), 2) == [0, 1]


def test_a_pick_takes_the_planned_tokens_ranks_and_run_slots():
    layout = PicLayout.build(
        [("cross", 3), ("plus", 10), ("plus", 5), ("cross", 4)],
        recompute=0.2,
        recompute_select="deviation",
    )
    progress = PicProgress(layout, 4)
    progress.plan(list(range(22)))
    progress.admit({}, 22)
    assert progress.probes_due(17) == []
    assert progress.probes_due(18) == [18]
    progress.choose(18, [6, 9, 15])
    assert progress.unchosen == set()
    assert progress.probes_due(18) == []
    entries = progress.entries(18, 4)
    assert entries == [Entry(6, True), Entry(9, True), Entry(15, True), Entry(18)]
    assert [progress.entry_slot(e) for e in entries[:3]] == [24, 25, 26]
    before, after = progress.key_slots(22, 17), progress.key_slots(22, 18)
    assert (before != after).nonzero().flatten().tolist() == [6, 9, 15]
    with pytest.raises(ValueError, match="3 distinct tokens in prompt order"):
        progress.choose(18, [9, 6, 15])


def test_the_first_tokens_need_no_probe():
    layout = PicLayout.build([("cross", 3), ("plus", 10), ("cross", 4)], recompute=0.2)
    progress = PicProgress(layout, 4)
    progress.plan(list(range(17)))
    progress.admit({}, 17)
    assert progress.unchosen == set()
    assert progress.probes_due(13) == []


@pytest.mark.parametrize("scheme", ["after_prefix", "sequential"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_probe_gives_the_reference_deviations(tiny, arch, scheme, monkeypatch):
    """Cold, under exact reuse the pool holds the PIC mask's keys: the probe's deviations
    are the dense reference's (small passes, so the group takes several)."""
    monkeypatch.setattr(pic_probe, "PROBE_ROWS", 7)
    seen = []
    original = pic_probe.group_deviations

    def keep(model, probe, device):
        seen.append(original(model, probe, device))
        return seen[-1]

    monkeypatch.setattr(pic_probe, "group_deviations", keep)
    path = str(tiny.hf(arch).path)
    with _fresh(path, pic_positions=scheme, pic_recompute=0.25, **DEVIATION) as backend:
        pieces = _pieces(backend, DOCS[:3])
        _run(backend, pieces, tokens=1)
        expected = probe_deviations(backend.model, pieces, scheme, *_group(pieces))
    (found,) = seen
    assert found.shape == expected.shape
    assert torch.allclose(found, expected, rtol=1e-3, atol=1e-5)
    assert expected.max() > 0  # the group's tokens do see more when recomputed


# ---- what the engine computes --------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["after_prefix", "local", "sequential"])
def test_recomputing_the_pick_gives_the_dense_reference(trained, scheme, picks):
    with _fresh(trained, pic_positions=scheme, pic_recompute=0.25, **DEVIATION) as backend:
        pieces = _pieces(backend, DOCS[:3])
        tokens, logits, usage = _run(backend, pieces)
        (end, chosen), *_ = picks
        expected, expected_logits = recompute_reference_greedy(
            backend.model, pieces, scheme, 0.25, TOKENS, {end: chosen}
        )
        first, _ = _group(pieces)
        deviations = probe_deviations(backend.model, pieces, scheme, first, end)
    assert len(picks) == 1
    assert usage.pic_recomputed_tokens == _count(pieces, 0.25)
    assert chosen == [first + row for row in most_deviating(deviations, len(chosen))]
    assert chosen != [i for i in range(first, end)][: len(chosen)]  # not merely the first
    assert torch.allclose(logits, expected_logits, atol=1e-3, rtol=1e-3)
    assert tokens == expected


@pytest.mark.parametrize("reuse", ["exact", "relaxed", "tokens"])
def test_a_hit_picks_and_computes_what_a_cold_run_does(trained, reuse, picks):
    """The probe reads the pool: the same pick and the same bits whether the documents
    were computed in this request or reused from another."""
    with _fresh(trained, pic_recompute=0.25, pic_reuse=reuse, **DEVIATION) as backend:
        pieces = _pieces(backend, DOCS[:3])
        cold_tokens, cold_logits, _ = _run(backend, pieces)
        warm_tokens, warm_logits, usage = _run(backend, pieces)
    assert usage.pic_hit_tokens > 0
    assert picks[0] == picks[1]
    assert warm_tokens == cold_tokens
    assert torch.equal(warm_logits, cold_logits)


def test_a_pick_in_small_steps_gives_the_same_bits(trained, picks):
    with _fresh(trained, pic_recompute=0.25, **DEVIATION) as whole:
        _, expected, _ = _run(whole, _pieces(whole, DOCS[:3]), tokens=2)
    with _fresh(trained, pic_recompute=0.25, **DEVIATION) as small:
        engine_internals(small).scheduler.max_num_batched_tokens = 8
        _, found, _ = _run(small, _pieces(small, DOCS[:3]), tokens=2)
    assert picks[0] == picks[1]
    assert torch.equal(found, expected)


def test_what_follows_a_picked_group_is_keyed_apart_from_the_first_tokens():
    pieces = [("cross", 3), ("plus", 10), ("plus", 5), ("cross", 4)]
    tokens = list(range(22))
    keys = []
    for select in ("first", "deviation"):
        layout = PicLayout.build(pieces, recompute=0.2, recompute_select=select)
        progress = PicProgress(layout, 4)
        keys.append([block.digest for block in progress.plan(tokens)])
    assert keys[0][:-1] == keys[1][:-1]  # the group's own blocks are pooled as before
    assert keys[0][-1] != keys[1][-1]


# ---- the setting ---------------------------------------------------------------------------


def test_the_layout_names_the_selections_it_takes():
    with pytest.raises(ValueError, match="recompute selection 'random'"):
        PicLayout.build([("plus", 3), ("cross", 1)], recompute_select="random")
