"""The sliding-window layers' own pool (`engine.window_pool`): a tiny Gemma 3 (two sliding
layers of window 8, one global) and Gemma 2 give the same greedy tokens with the windowed
pool as with every layer holding the whole context, across the window, in batches, in
chunks, under preemption and on prefix hits (one whose window was reclaimed); the pool is
smaller; the slot bookkeeping on its own; the budget and its messages."""

import json
import random
import shutil
from types import SimpleNamespace

import pytest
import torch
from helpers import PROMPT, SHARED_PREFIX_PROMPTS, engine_internals

from spnl_backend import BackendSettings, load_backend
from spnl_backend.engine import build
from spnl_backend.engine.block_manager import BlockManager
from spnl_backend.engine.budget import WindowPlan, plan_kv_cache
from spnl_backend.engine.paged import PagedCacheManager
from spnl_backend.engine.sequence import ScheduledSeq, Sequence
from spnl_backend.engine.window_pool import WindowSlots
from spnl_backend.errors import ContextLengthError
from spnl_backend.request import CacheRoom
from spnl_backend.results import read_results
from spnl_backend.sampling import SamplingParams
from spnl_backend.settings.backend_settings import KvBudget

BLOCK = 8


def _settings(**extra) -> BackendSettings:
    given = {
        "device": "cpu",
        "paged_attn": True,
        "paged_cache_type": "f32",
        "paged_attn_block_size": BLOCK,
        "paged_attn_context_len": 256,
    }
    return BackendSettings(**{**given, **extra})


SETTINGS = _settings()
LONG = PROMPT + " The dog sleeps in the sun while the fox runs away into the woods."


@pytest.fixture(params=["gemma3", "gemma2"])
def arch(request):
    return request.param


@pytest.fixture
def small_window_pool(monkeypatch):
    """A windowed pool sized for two sequences' windows beside a chunk of 8 tokens."""
    monkeypatch.setattr(build, "WINDOW_SEQS", 2)
    monkeypatch.setattr(build, "WINDOW_CHUNK_TOKENS", 8)


def _load(tiny, arch, windowed: bool, settings=SETTINGS):
    """The tiny model's backend, its sliding layers in a pool of their own or not."""
    with pytest.MonkeyPatch.context() as patch:
        if not windowed:
            patch.setattr(build, "_window_plan", lambda *args, **kwargs: None)
        return load_backend(str(tiny.hf(arch).path), settings=settings)


def _run(tiny, arch, windowed, prompts, max_tokens=24, batched_tokens=None):
    with _load(tiny, arch, windowed) as backend:
        info = backend.cache_info()
        assert (info.window_blocks is not None) == windowed
        if batched_tokens is not None:
            engine_internals(backend).scheduler.max_num_batched_tokens = batched_tokens
        results = backend.generate(prompts, max_tokens=max_tokens, temperature=0)
        stats = backend.stats()
        assert stats.cache_holders == 0
    return [r.token_ids for r in results], info


def test_a_batch_gives_the_same_tokens_from_a_smaller_pool(tiny, arch, small_window_pool):
    """Prompts longer than the window and shorter, generating across it, run together."""
    prompts = [LONG, *SHARED_PREFIX_PROMPTS]
    on, info = _run(tiny, arch, True, prompts)
    off, whole = _run(tiny, arch, False, prompts)
    assert on == off
    assert info.window_blocks == 2 * 2 + 1  # two sequences' windows, the chunk's block
    with _load(tiny, arch, True) as backend:
        nbytes = engine_internals(backend).runner.cache.cache.nbytes
    tokens, window_tokens = info.num_blocks * BLOCK, info.window_blocks * BLOCK
    per_layer = whole.bytes_per_token // 3  # two sliding layers, one global
    assert info.window_bytes_per_token == 2 * per_layer
    assert nbytes == tokens * per_layer + window_tokens * 2 * per_layer
    assert nbytes < tokens * whole.bytes_per_token


def test_chunks_across_the_window_give_the_same_tokens(tiny, arch, small_window_pool):
    """Prompt chunks of 5 tokens: each chunk's queries read the window before it from
    the windowed pool, stored by earlier steps."""
    prompts = [LONG, PROMPT]
    on, _ = _run(tiny, arch, True, prompts, batched_tokens=5)
    assert on == _run(tiny, arch, False, prompts, batched_tokens=5)[0]


def _tokens(tiny, arch, prompt: str) -> int:
    return len(tiny.hf(arch).tokenizer(prompt).input_ids)


def test_preemption_under_a_small_pool_gives_the_same_tokens(tiny, arch, monkeypatch):
    """A windowed pool for one sequence's window beside a chunk of 8 tokens, and a whole
    pool that holds two of the prompts: sequences wait, are preempted and recomputed."""
    monkeypatch.setattr(build, "WINDOW_SEQS", 1)
    monkeypatch.setattr(build, "WINDOW_CHUNK_TOKENS", 8)
    context = -(-(2 * _tokens(tiny, arch, LONG) + 32) // BLOCK) * BLOCK
    settings = _settings(paged_attn_context_len=context)
    prompts = [LONG, PROMPT, LONG + " Again.", PROMPT + " Once more."]
    found = []
    for windowed in (True, False):
        with _load(tiny, arch, windowed, settings) as backend:
            results = backend.generate(prompts, max_tokens=16, temperature=0)
            found.append(([r.token_ids for r in results], backend.stats().preemptions))
            if windowed:
                assert backend.cache_info().window_blocks == 2 + 1
    (on, preempted), (off, _) = found
    assert on == off
    assert preempted > 0


def test_prefix_hits_stop_where_the_window_was_reclaimed(tiny, arch, small_window_pool):
    """A prompt that extends a finished one reuses its blocks with every layer's K and V
    there; after other prompts took the windowed slots its blocks kept, the hit stops
    before the blocks whose window is gone, and the tokens are the same."""
    follow = LONG + " The fox comes back at night."
    others = ["def add(a, b):", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17"]
    found = {}
    for windowed in (True, False):
        with _load(tiny, arch, windowed) as backend:
            first = backend.generate(LONG, max_tokens=8, temperature=0)
            hit = backend.generate(follow, max_tokens=12, temperature=0)
            backend.generate(others, max_tokens=24, temperature=0)
            again = backend.generate(follow + " Again.", max_tokens=12, temperature=0)
            found[windowed] = (
                [r.token_ids for r in (first, hit, again)],
                [r.usage.cached_tokens for r in (hit, again)],
            )
    (on, on_cached), (off, off_cached) = found[True], found[False]
    assert on == off
    assert on_cached[0] == off_cached[0] > 0  # the window of the hit's end was still held
    assert on_cached[1] < off_cached[1]  # the others took the slots it kept


def test_window_slots_are_held_dropped_kept_and_reclaimed():
    slots = WindowSlots(num_slots=3, num_blocks=8, window=8, block_size=4)
    table = [5, 6, 7]
    slots.registered = {5, 7}.__contains__
    slots.start(1, [], 0)
    assert slots.missing(1, table, 3) == 3
    slots.extend(1, table, 3)
    assert [slots.slot_of[b] for b in table] == [0, 1, 2]
    assert slots.available == 0
    slots.advance(1, table, 12)  # position 12 reads from 5 on: not block 5
    assert slots.holders[5] == 0
    assert list(slots.kept) == [5]
    assert slots.available == 1
    assert slots.room(1, table, 12) == 3 + 1
    slots.finish(1, table)
    assert slots.slot_of[6] == -1
    assert list(slots.kept) == [5, 7]
    assert slots.available == 3
    assert not slots.has_window(table, 12)  # block 6 (positions 4..7) lost its K and V
    assert slots.has_window([5], 4)
    slots.start(2, [], 0)
    assert slots.missing(2, [1, 2], 2) == 2
    slots.extend(2, [1, 2], 2)  # the free slot, then the least recently kept one
    assert slots.slot_of[5] == -1
    assert list(slots.kept) == [7]
    assert slots.available == 1
    slots.finish(2, [1, 2])
    assert slots.available == 3
    assert slots.slot_of[1] == slots.slot_of[2] == -1
    assert slots.slot_table.tolist() == [*slots.slot_of, -1]  # the tensor kept in step


def test_a_retaken_block_gives_its_kept_slot_back():
    slots = WindowSlots(num_slots=2, num_blocks=4, window=4, block_size=4)
    slots.registered = {2}.__contains__
    slots.start(1, [], 0)
    slots.extend(1, [2], 1)
    slots.finish(1, [2])
    assert list(slots.kept) == [2]
    slots.forget(2)
    assert slots.slot_of[2] == -1
    assert len(slots.free) == 2
    assert not slots.kept
    assert slots.slot_table.tolist() == [-1] * 5


def test_the_native_layer_blocks_run_over_both_pools(tiny, arch, small_window_pool, block_runs):
    """The CPU's layer blocks (quantized projections, the default float16 pool) store and
    attend the sliding layers in their own pool: the per-op path's bits, and the bits of
    a pool without one."""
    settings = _settings(isq="Q8_0", paged_cache_type="auto")
    prompts = [LONG, PROMPT]
    found = []
    for windowed, blocks in ((True, True), (True, False), (False, True)):
        with _load(tiny, arch, windowed, settings) as backend:
            assert (backend.cache_info().window_blocks is not None) == windowed
            backend.model.model.use_layer_blocks = blocks
            runs = block_runs[0]
            results = backend.generate(prompts, max_tokens=24, temperature=0)
            assert (block_runs[0] > runs) == blocks
            found.append([r.token_ids for r in results])
    assert found[0] == found[1] == found[2]


def test_pic_prompts_pin_their_blocks_and_hit_with_the_same_tokens(tiny, arch, monkeypatch):
    """A PIC prompt's queries read any of its blocks: it keeps them all in the windowed
    pool, its hits (documents computed by an earlier prompt) give the tokens a pool
    without one gives, and one longer than the windowed pool is refused up front."""
    monkeypatch.setattr(build, "WINDOW_SEQS", 2)
    monkeypatch.setattr(build, "WINDOW_CHUNK_TOKENS", 160)  # a windowed pool of 24 blocks
    docs = [f" Document {i}: the fox and the dog met on day {i} near the river." for i in range(2)]
    pieces = [("cross", "Read these."), *[("plus", d) for d in docs], ("cross", " Who met?")]
    found = {}
    for windowed in (True, False):
        with _load(tiny, arch, windowed, _settings(paged_attn_context_len=256)) as backend:
            first = backend.generate(blocks=pieces, max_tokens=12, temperature=0)
            asked = [*pieces[:-1], ("cross", " Where was it?")]
            again = backend.generate(blocks=asked, max_tokens=12, temperature=0)
            found[windowed] = [first.token_ids, again.token_ids], again.usage.pic_hit_tokens
            if windowed:
                holds = backend.cache_info().window_blocks * BLOCK
                long = [("plus", " the fox" * holds)]
                with pytest.raises(ContextLengthError, match="sliding-window layers' own pool"):
                    backend.generate(blocks=long, max_tokens=1)
    assert found[True] == found[False]
    assert found[True][1] > 0


CONFIG = SimpleNamespace(max_position_embeddings=512, kv_shapes=((1, 64),) * 3, kv_planes=(2,) * 3)


def test_a_byte_budget_gives_the_global_layers_what_the_windowed_pool_leaves():
    window = WindowPlan(bytes_per_token=512, window=8, seqs=2, chunk_tokens=8)
    assert window.most_blocks(BLOCK) == 2 * (1 + 1) + 1
    budget = KvBudget("memory_mb", 1, explicit=True)
    plan = plan_kv_cache(CONFIG, budget, BLOCK, 768, 2**34, window=window)  # type: ignore[arg-type]
    assert plan.window_blocks == 5
    assert plan.num_blocks == 5 + (2**20 - 5 * BLOCK * 768) // (BLOCK * 256)
    assert plan.nbytes == plan.num_blocks * BLOCK * 256 + 5 * BLOCK * 512
    assert plan.nbytes <= 2**20 < plan.nbytes + BLOCK * 256
    small = plan_kv_cache(
        CONFIG, KvBudget("memory_mb", 0.02, explicit=True), BLOCK, 768, 2**34, window=window
    )  # type: ignore[arg-type]
    assert small.window_blocks == small.num_blocks == int(0.02 * 2**20) // (BLOCK * 768)


def test_a_budget_past_the_memory_is_shown_as_it_was_given():
    """A whole number of MB as written (it was shown as 1e+08), a fraction as a number."""
    from spnl_backend.errors import PlatformError

    for budget, shown in (
        (KvBudget("memory_mb", 99_999_999, explicit=True), "MEMORY_MB=99999999 needs"),
        (KvBudget("context_len", 123_456_792, explicit=True), "CONTEXT_LEN=123456792 needs"),
    ):
        with pytest.raises(PlatformError, match=shown):
            plan_kv_cache(CONFIG, budget, BLOCK, 768, 2**30)  # type: ignore[arg-type]


def test_a_prompt_too_long_is_told_what_both_pools_take():
    room = CacheRoom("context_len", BLOCK, 768, 512, window_bytes_per_token=512, window_tokens=40)
    assert room.nbytes(104) == 104 * 256 + 40 * 512
    says = room.remedy(100)
    assert "at least 104" in says
    assert "256 bytes per token, and the sliding-window layers' 512 for at most 40 tokens" in says
    room = CacheRoom("memory_mb", BLOCK, 768, 512, window_bytes_per_token=512, window_tokens=40)
    assert room.remedy(3000) == "the model's context holds 512; shorten it"
    assert "MEMORY_MB to at least 1 (104 tokens)" in room.remedy(100)


def test_rejected_ngram_proposals_leave_the_windowed_pool_as_found(tiny, arch, small_window_pool):
    """N-gram speculation (on by default) proposes past the window; a rejected proposal's
    blocks leave both pools, and the tokens are those of a pool without one."""
    prompt = "1 2 3 4 5 6 1 2 3 4 5 7 1 2 3 4 5 8 1 2 3 4 5 9 1 2 3 4 5"
    found = {}
    for windowed in (True, False):
        with _load(tiny, arch, windowed) as backend:
            result = backend.generate(prompt, max_tokens=48, temperature=0)
            found[windowed] = result.token_ids, result.usage
            assert backend.stats().cache_holders == 0
    (on, usage), (off, _) = found[True], found[False]
    assert on == off
    assert usage.draft_tokens > usage.accepted_tokens


def test_a_pool_too_small_for_windows_of_its_own_still_tells_a_long_prompt_both_pools(tiny, arch):
    """At a budget the windowed pool would not undercut it is off, yet the budget a too-long
    prompt is told to raise to is one where it is on: the message counts both pools."""
    with _load(tiny, arch, windowed=True, settings=_settings(paged_attn_context_len=64)) as b:
        assert b.cache_info().window_blocks is None
        with pytest.raises(ContextLengthError, match=r"sliding-window layers' .* for at most"):
            b.generate(" the fox" * 64, max_tokens=1)


def test_a_sequence_given_no_tokens_is_not_given_one_by_the_window():
    """`chunk` never exceeds the tokens the step offers: a prompt the step's prefill budget
    left none (0) stays out of the step rather than taking one token (and preempting
    another for it)."""
    blocks = BlockManager(16, BLOCK, enable_prefix_caching=False)
    window = WindowSlots(num_slots=4, num_blocks=16, window=8, block_size=BLOCK)
    manager = PagedCacheManager(None, blocks, None, window=window)  # type: ignore[arg-type]
    seq = Sequence(list(range(40)), SamplingParams(temperature=0.0), max_len=256)
    manager.admit(seq)
    assert manager.reserve(seq, 8)
    seq.num_computed_tokens = 8
    assert manager.chunk(seq, 0) == 0
    assert manager.chunk(seq, 3) == 3
    assert manager.chunk(seq, 32) == 24  # the window's block and three more


def _window_step(num_blocks: int, seqs: int = 1, width: int = 64) -> None:
    """A decode step's windowed metadata for ``seqs`` sequences of ``width`` blocks over a
    pool of ``num_blocks`` blocks: every entry is its block's windowed slot, as the slots'
    own tensor says (kept beside their list, so a step maps the tables it has, not the
    pool); `bench/window_step.py` times it."""
    blocks = BlockManager(num_blocks, BLOCK, enable_prefix_caching=False)
    window = WindowSlots(num_slots=2 * seqs, num_blocks=num_blocks, window=8, block_size=BLOCK)
    manager = PagedCacheManager(None, blocks, None, window=window)  # type: ignore[arg-type]
    manager.cache = SimpleNamespace(step=lambda kernels, meta, window_meta=None: window_meta)  # type: ignore[assignment]
    batch = []
    for _ in range(seqs):
        seq = Sequence(list(range(width * BLOCK)), SamplingParams(temperature=0.0), max_len=2**20)
        manager.admit(seq)
        seq.num_computed_tokens = seq.num_tokens - 1
        assert manager.reserve(seq, seq.num_tokens)
        batch.append(ScheduledSeq(seq, 1))
    meta = manager.attention(batch, torch.device("cpu"))
    assert window.slot_table.tolist() == [*window.slot_of, -1]
    for row, scheduled in enumerate(batch):
        table = manager.tables[scheduled.seq.seq_id].block_ids
        held = [(i, window.slot_of[b]) for i, b in enumerate(table) if window.slot_of[b] >= 0]
        assert held, "the block being written has a slot"
        for i, slot in held:
            assert int(meta.block_tables[row, i]) == slot
        assert int(meta.slot_mapping[row]) == window.slot_of[table[-1]] * BLOCK + BLOCK - 1


def test_a_steps_windowed_tables_are_each_blocks_slot_at_any_pool_size():
    """The windowed tables and slot mapping are each block's slot through the slots' own
    tensor, in a small pool, a large one (2**17 blocks) and for 16 sequences."""
    _window_step(2**10)
    _window_step(2**17)
    _window_step(2**14, seqs=16, width=1024)


def _traffic(backend, prompts: list[list[int]], max_tokens: int, n: int = 0) -> tuple:
    """Greedy results under a 7-token step budget: of ``prompts`` together; of each
    extended by what it gave (prefix hits, in reverse order); and, with ``n``, of ``n``
    completions each of the last two prompts."""
    engine_internals(backend).scheduler.max_num_batched_tokens = 7
    first = backend.generate(prompt_token_ids=prompts, max_tokens=max_tokens, temperature=0)
    longer = [p + r.token_ids[:5] + [9, 10] for p, r in zip(prompts, first, strict=True)]
    hits = backend.generate(prompt_token_ids=longer[::-1], max_tokens=max_tokens, temperature=0)
    several = []
    if n:
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        several = read_results(backend.submit(prompts[-2:], params, n=n), single=False)
    return first, hits, several


def _with_window(tiny, arch: str, window: int, root) -> str:
    """The tiny model with its sliding layers' window set to ``window``."""
    path = root / f"{arch}-window-{window}"
    if not path.exists():
        shutil.copytree(tiny.hf(arch).path, path)
        config = json.loads((path / "config.json").read_text())
        config["sliding_window"] = window
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _reads_only_mapped_blocks(monkeypatch) -> None:
    """Every step checks that each block its queries read through a sliding layer (the
    window before its first query on) has a windowed slot: none is read through the stale
    entry an unmapped block gets."""
    original = PagedCacheManager._window_meta

    def checked(self, meta, tables, device):
        window = self.window
        for table, seq_len, count in zip(tables, meta.seq_lens, meta.query_lens, strict=True):
            start = seq_len - count
            read = table[window.first_needed(start) : -(-seq_len // window.block_size)]
            assert all(window.slot_of[b] >= 0 for b in read), (start, read)
        return original(self, meta, tables, device)

    monkeypatch.setattr(PagedCacheManager, "_window_meta", checked)


def _all_let_go(backend) -> None:
    """Nothing holds cache, and every windowed slot is free or kept for a prefix block."""
    assert backend.stats().cache_holders == 0
    window = engine_internals(backend).scheduler.cache.window
    assert not window.holds
    assert not any(window.pins.values())
    assert not any(window.holders)
    kept = [window.slot_of[b] for b in window.kept]
    assert sorted([*window.free, *kept]) == list(range(window.num_slots))
    assert all(s < 0 or b in window.kept for b, s in enumerate(window.slot_of))


@pytest.mark.parametrize(
    ("arch", "block", "window", "cache", "seed"),
    [
        ("gemma3", 8, 8, "f32", 0),
        ("gemma2", 16, 12, "f16", 1),
        ("gemma3", 16, 40, "f8e4m3", 2),
        ("gemma2", 8, 17, "auto", 3),
    ],
)
def test_random_batches_under_a_tiny_windowed_pool(
    tiny, tmp_path_factory, monkeypatch, arch, block, window, cache, seed
):
    """Prompts at and around the window's and blocks' edges, random and repetitive (n-gram
    proposals, some rejected), in small step budgets, then extended (prefix hits) and as
    several completions, through a windowed pool for one sequence's window: constant
    preemption, the same tokens as without the pool, no stale block read, all let go."""
    rng = random.Random(seed)
    monkeypatch.setattr(build, "WINDOW_SEQS", 1)
    monkeypatch.setattr(build, "WINDOW_CHUNK_TOKENS", 1 + 7 * (seed % 2))
    _reads_only_mapped_blocks(monkeypatch)
    path = _with_window(tiny, arch, window, tmp_path_factory.mktemp("windows"))
    base = [rng.randrange(5, 200) for _ in range(120)]
    lengths = [1, block - 1, block, block + 1, window, window + 1, 2 * block, 90]
    prompts = [(base if i % 2 else base[:5] * 24)[:n] for i, n in enumerate(lengths)]
    extra = {"isq": "Q8_0"} if cache == "auto" else {}
    settings = _settings(paged_attn_block_size=block, paged_cache_type=cache, **extra)
    found = []
    for windowed in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            if not windowed:
                patch.setattr(build, "_window_plan", lambda *args, **kwargs: None)
            backend = load_backend(path, settings=settings)
        with backend:
            assert (backend.cache_info().window_blocks is not None) == windowed
            first, hits, several = _traffic(backend, prompts, max_tokens=24, n=3)
            found.append([r.token_ids for r in (*first, *hits, *several)])
            preempted = backend.stats().preemptions
            if windowed:
                _all_let_go(backend)
                assert preempted > 0
    assert found[0] == found[1]
