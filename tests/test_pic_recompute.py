"""Selective recomputation on PIC reuse (``MISTRALRS_PIC_RECOMPUTE``): the first tokens of
each element computed again with full attention, against a dense reference that says
which keys every token reads; hits against cold runs bit for bit; the pool's shared
blocks unchanged; under both position schemes and every reuse rule; and its counters."""

import pytest
import torch
from helpers import engine_internals
from pic_reference import recompute_reference_greedy, recomputed_order
from test_pic import DOCS, TOKENS, _fresh, _pieces, _run
from tiny_models import ARCHITECTURES

from spnl_backend.engine.pic_blocks import PicProgress
from spnl_backend.pic.layout import PicLayout

FLOATS = {"cpu_matmul": "float32", "paged_cache_type": "f32"}


@pytest.fixture(scope="module")
def trained(tiny):
    return str(tiny.trained().path)


def _plus(pieces) -> int:
    return sum(len(ids) for kind, ids in pieces if kind == "plus")


# ---- which tokens, in what order --------------------------------------------------------


def test_the_first_tokens_of_each_element_of_a_group_followed_by_more():
    layout = PicLayout.build(
        [("cross", 3), ("plus", 10), ("plus", 5), ("cross", 4), ("plus", 7)], recompute=0.2
    )
    # Two of ten, one of five; the last group ends the prompt: nothing reads it again.
    assert layout.recomputed == ((18, (3, 4, 13)),)
    assert PicLayout.build([("cross", 3), ("plus", 10), ("cross", 1)]).recomputed == ()
    order, copies, _ = recomputed_order(
        [("cross", 3), ("plus", 10), ("plus", 5), ("cross", 4)], 0.2
    )
    assert [i for i, c in zip(order, copies, strict=True) if c] == [3, 4, 13]


def test_a_group_is_recomputed_in_a_step_of_its_own_before_what_follows():
    """Cold: the group is computed, then (from a new step) its recomputed tokens, each
    written to the group's own run, then the tokens after it."""
    layout = PicLayout.build([("cross", 3), ("plus", 10), ("plus", 5), ("cross", 4)], recompute=0.2)
    progress = PicProgress(layout, 4)
    progress.plan(list(range(22)))
    progress.admit({}, 22)
    # 22 tokens computed and 3 recomputed: the count starts 3 below zero.
    assert (progress.start, progress.num_recomputed) == (-3, 3)
    assert progress.chunk(0, 25) == 18  # the step stops where the recomputation begins
    assert progress.chunk(18, 7) == 7
    assert progress.chunk(19, 6) == 6  # the recomputed tokens may be split over steps
    entries = progress.entries(18, 7)
    assert [(e.index, e.recomputed) for e in entries] == [
        (3, True),
        (4, True),
        (13, True),
        (18, False),
        (19, False),
        (20, False),
        (21, False),
    ]
    assert [progress.entry_slot(e) for e in entries[:4]] == [24, 25, 26, 28]
    before, after = progress.key_slots(22, 17), progress.key_slots(22, 18)
    changed = (before != after).nonzero().flatten().tolist()
    assert changed == [3, 4, 13]
    # The run: after the group's blocks (cross 0-3, elements 4-15 and 16-23), before the
    # cross span after it.
    assert after[[3, 4, 13]].tolist() == [24, 25, 26]
    assert progress.slot(18) == 28
    assert layout.padded_slots(4) == 32


# ---- the rule -----------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["after_prefix", "local", "sequential"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_recomputation_gives_the_dense_reference(tiny, arch, scheme):
    path = str(tiny.hf(arch).path)
    with _fresh(path, pic_positions=scheme, pic_recompute=0.25, **FLOATS) as backend:
        pieces = _pieces(backend, DOCS[:3])
        tokens, logits, usage = _run(backend, pieces)
        expected, expected_logits = recompute_reference_greedy(
            backend.model, pieces, scheme, 0.25, TOKENS
        )
    assert usage.pic_recomputed_tokens == len(
        recomputed_order([(kind, len(ids)) for kind, ids in pieces], 0.25)[2]
    )
    assert torch.allclose(logits, expected_logits, atol=1e-3, rtol=1e-3)
    assert tokens == expected


@pytest.mark.parametrize("select", ["first", "deviation"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_recomputation_gives_the_dense_reference_on_each_kernel_route(tiny, kernels, select, picks):
    """The torch twin's masks and the Triton kernel's key arrays (interpreted here,
    compiled on a GPU) read the same keys as the CPU's native key lists; the deviation
    probe runs on the same route."""
    if kernels == "triton":
        pytest.importorskip("triton")
    from spnl_backend.kernels import select_attention_kernels

    path = str(tiny.hf("gemma3").path)  # a sliding window and a softcap as well
    settings = {"pic_recompute": 0.25, "pic_recompute_select": select, **FLOATS}
    with _fresh(path, cpu_kernels="torch", **settings) as backend:
        if kernels == "triton":
            engine_internals(backend).cache.kernels = select_attention_kernels("triton")
        assert engine_internals(backend).cache.kernels.name == kernels
        pieces = _pieces(backend, DOCS[:2])
        tokens, logits, _ = _run(backend, pieces, tokens=4)
        expected, expected_logits = recompute_reference_greedy(
            backend.model, pieces, "after_prefix", 0.25, 4, dict(picks) or None
        )
    assert len(picks) == (select == "deviation")
    assert torch.allclose(logits, expected_logits, atol=1e-3, rtol=1e-3)
    assert tokens == expected


def test_recomputation_changes_what_follows_the_group(trained):
    with _fresh(trained, **FLOATS) as plain, _fresh(trained, pic_recompute=0.5, **FLOATS) as redo:
        _, off, _ = _run(plain, _pieces(plain, DOCS[:3]))
        _, on, usage = _run(redo, _pieces(redo, DOCS[:3]))
    assert usage.pic_recomputed_tokens > 0
    assert not torch.allclose(off, on, atol=1e-3)


# ---- reuse --------------------------------------------------------------------------------


@pytest.mark.parametrize("reuse", ["exact", "relaxed", "tokens"])
@pytest.mark.parametrize("scheme", ["after_prefix", "local", "sequential"])
def test_a_hit_equals_a_cold_run_bit_for_bit(trained, reuse, scheme):
    extra = {"pic_reuse": reuse, "pic_positions": scheme, "pic_recompute": 0.3}
    with _fresh(trained, **extra) as backend:
        pieces = _pieces(backend, DOCS[:3])
        cold_tokens, cold_logits, cold = _run(backend, pieces)
        warm_tokens, warm_logits, warm = _run(backend, pieces)
    assert (cold.pic_hit_tokens, warm.pic_miss_tokens) == (0, 0)
    assert warm.pic_hit_tokens == _plus(pieces)
    assert cold.pic_recomputed_tokens == warm.pic_recomputed_tokens > 0
    assert torch.equal(warm_logits, cold_logits)
    assert warm_tokens == cold_tokens


def test_shuffled_documents_hit_and_equal_a_cold_run(trained):
    with _fresh(trained, pic_recompute=0.3) as backend:
        _run(backend, _pieces(backend, DOCS[:3]))
        shuffled = _pieces(backend, [DOCS[2], DOCS[0], DOCS[1]])
        tokens, logits, usage = _run(backend, shuffled)
    with _fresh(trained, pic_recompute=0.3) as cold:
        cold_tokens, cold_logits, _ = _run(cold, shuffled)
    assert usage.pic_miss_tokens == 0
    assert torch.equal(logits, cold_logits)
    assert tokens == cold_tokens


def _pooled(backend) -> dict[int, torch.Tensor]:
    """Every registered block's K/V (all layers), by its key."""
    engine = engine_internals(backend)
    blocks = engine.cache.blocks
    storage = engine.cache.cache
    return {
        block.hash: storage.block_bytes(block_id).clone()
        for block_id, block in enumerate(blocks.blocks)
        if block.hash is not None
    }


@pytest.mark.parametrize("select", ["first", "deviation"])
def test_the_pools_shared_blocks_are_never_written(trained, select):
    """The pool's element blocks are the same bits with recomputation as without, and a
    request that recomputes what it reuses (or probes it) leaves them as they were."""
    redo_settings = {"pic_recompute": 0.5, "pic_recompute_select": select}
    with _fresh(trained, **redo_settings) as redo, _fresh(trained) as plain:
        pieces = _pieces(redo, DOCS[:3])
        _run(plain, pieces)
        _run(redo, pieces)
        before = _pooled(redo)
        _run(redo, pieces)  # every element a hit, its first tokens recomputed
        after = _pooled(redo)
        reference = _pooled(plain)
    shared = set(before) & set(reference)
    assert len(shared) >= _plus(pieces) // 16  # the elements' blocks, keyed alike
    assert all(torch.equal(before[key], reference[key]) for key in shared)
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_what_follows_a_recomputed_group_is_keyed_apart(trained):
    """The cross span after a group reads the recomputed keys: a pool filled without
    recomputation (or with another fraction) must not serve it."""
    with _fresh(trained) as backend:
        pieces = _pieces(backend, DOCS[:3])
        _run(backend, pieces)
        plain = set(_pooled(backend))
    with _fresh(trained, pic_recompute=0.5) as backend:
        _run(backend, pieces)
        redone = set(_pooled(backend))
    assert plain & redone  # the elements' blocks
    assert plain - redone  # what follows the group, keyed apart
    assert redone - plain


def test_counters_in_usage_stats_and_the_servers_usage(trained):
    with _fresh(trained, pic_recompute=0.3) as backend:
        pieces = _pieces(backend, DOCS[:3])
        _, _, usage = _run(backend, pieces)
        stats = backend.stats()
    lengths = [len(ids) for kind, ids in pieces if kind == "plus"]
    assert usage.pic_recomputed_tokens == sum(-(-3 * n // 10) for n in lengths)
    assert stats.pic_recomputed_tokens == usage.pic_recomputed_tokens


def test_the_server_reports_recomputed_tokens(trained):
    import httpx
    from live_server import MODEL, TEMPLATE, LiveServer

    from spnl_backend.pic.pieces import PLUS_MARKER

    with _fresh(trained, pic_recompute=0.3) as backend:
        backend.tokenizer.hf.chat_template = TEMPLATE
        server = LiveServer(backend)
        try:
            messages = [
                {"role": "system", "content": "Answer from the documents."},
                *[{"role": "user", "content": PLUS_MARKER + doc} for doc in DOCS[:2]],
                {"role": "user", "content": "What do they say?"},
            ]
            body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
            reply = server.post("/v1/chat/completions", body)
            assert reply.status_code == 200, reply.text
            details = reply.json()["usage"]["prompt_tokens_details"]
            metrics = httpx.get(server.url + "/metrics").text
        finally:
            server.stop()
    assert details["pic_recomputed_tokens"] > 0
    line = next(x for x in metrics.splitlines() if x.startswith("spnl_pic_recomputed_tokens_total"))
    assert float(line.split()[-1]) == details["pic_recomputed_tokens"]


def test_info_names_the_setting(monkeypatch, capsys):
    from spnl_backend.cli import main

    monkeypatch.setenv("MISTRALRS_PIC_RECOMPUTE", "0.15")
    main(["info"])
    assert "MISTRALRS_PIC_RECOMPUTE" in capsys.readouterr().out


def test_small_steps_split_the_recomputation_and_give_the_same_bits(trained):
    """With a step budget of 8 tokens the recomputed tokens spread over several steps
    (they count in it), none beside the group's first computation."""
    with _fresh(trained, pic_recompute=0.5) as backend:
        pieces = _pieces(backend, DOCS[:3])
        tokens, logits, usage = _run(backend, pieces)
    with _fresh(trained, pic_recompute=0.5) as small:
        engine_internals(small).scheduler.max_num_batched_tokens = 8
        small_tokens, small_logits, small_usage = _run(small, _pieces(small, DOCS[:3]))
    assert usage.pic_recomputed_tokens == small_usage.pic_recomputed_tokens > 8
    assert torch.equal(logits, small_logits)
    assert tokens == small_tokens


# ---- sequential positions ---------------------------------------------------------------


def test_every_token_recomputed_at_sequential_positions_is_the_plain_prompt(trained):
    """The plain prompt's positions, and every element token computed again over all
    that comes before it: what the plain prompt computes."""
    with _fresh(trained, pic_positions="sequential", pic_recompute=1.0, **FLOATS) as backend:
        pieces = _pieces(backend, DOCS[:3])
        tokens, logits, usage = _run(backend, pieces)
        ids = [t for _, part in pieces for t in part]
        plain = backend.generate(prompt_token_ids=ids, max_tokens=TOKENS, temperature=0)
        from helpers import greedy_with_logits

        _, plain_logits, _ = greedy_with_logits(backend, TOKENS, prompt_token_ids=ids)
    assert usage.pic_recomputed_tokens == _plus(pieces)
    assert torch.allclose(logits, plain_logits, atol=1e-3, rtol=1e-3)
    assert tokens == plain.token_ids


def test_sequential_positions_key_an_element_by_its_place_under_exact_reuse(trained):
    with _fresh(trained, pic_positions="sequential") as backend:
        pieces = _pieces(backend, DOCS[:3])
        _run(backend, pieces)
        _, _, again = _run(backend, pieces)
        swapped = _pieces(backend, [DOCS[1], DOCS[0], DOCS[2]])
        tokens, logits, moved = _run(backend, swapped)
    with _fresh(trained, pic_positions="sequential") as cold:
        cold_tokens, cold_logits, _ = _run(cold, swapped)
    assert again.pic_miss_tokens == 0
    # The first two changed places: computed again; the third stands where it stood.
    third = len(backend.tokenizer.encode_plain(DOCS[2]))
    assert moved.pic_hit_tokens == third
    assert torch.equal(logits, cold_logits)
    assert tokens == cold_tokens


def test_spnl_rule_at_sequential_positions_moves_a_hits_keys(trained):
    with _fresh(trained, pic_positions="sequential", pic_reuse="tokens") as backend:
        _run(backend, _pieces(backend, DOCS[:3]))
        swapped = _pieces(backend, [DOCS[1], DOCS[0], DOCS[2]])
        _, _, usage = _run(backend, swapped)
    assert usage.pic_miss_tokens == 0
    assert usage.pic_hit_tokens == _plus(swapped)
