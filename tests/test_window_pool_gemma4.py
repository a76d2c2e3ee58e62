"""Gemma 4's sliding layers in a pool of their own (`engine.window_pool`): its KV layers
differ in shape (the tiny model's sliding layers 2 KV heads x 16, its global one 1 x 32)
and its last layers read earlier layers' K and V (a sliding one reading a sliding layer's,
through the windowed pool, a global one a global layer's), yet it gives the same greedy
tokens as with every layer holding the whole context: across the window, in a batch,
under preemption, on prefix hits; its pool is smaller; and where the windowed pool would
not be exact (a layer reading a sliding layer's K and V further back than its window, the
KV tier) it is refused with the reason."""

import copy
import dataclasses
import logging
import random
from types import SimpleNamespace

import pytest
import torch
from helpers import PROMPT, SHARED_PREFIX_PROMPTS, engine_internals
from test_window_pool import (
    BLOCK,
    LONG,
    _all_let_go,
    _reads_only_mapped_blocks,
    _settings,
    _traffic,
)

from spnl_backend import load_backend
from spnl_backend.engine import build
from spnl_backend.engine.paged import kv_windows

ARCH = "gemma4"


def _load(tiny, windowed: bool, settings=None):
    with pytest.MonkeyPatch.context() as patch:
        if not windowed:
            patch.setattr(build, "_window_plan", lambda *args, **kwargs: None)
        return load_backend(str(tiny.hf(ARCH).path), settings=settings or _settings())


def _layer_bytes(config, dtype_bytes: int = 4) -> list[int]:
    """Each KV pool layer's K and V bytes per token (an f32 pool)."""
    return [2 * heads * dim * dtype_bytes for heads, dim in config.kv_shapes]


def test_the_tiny_model_has_what_the_pool_must_handle(tiny):
    """Two shapes, shared readers of a sliding and a global layer: what the tests cover."""
    with _load(tiny, windowed=True) as backend:
        config = backend.model.config
        assert not config.uniform_kv
        assert kv_windows(config) == [8, 8, None]
        assert config.kv_shapes == ((2, 16), (2, 16), (1, 32))
        readers = [s.attention.spec for s in config.layers if s.attention.spec.shared_kv]
        assert [(r.layer, r.scoring.window) for r in readers] == [(1, 8), (2, None)]


def test_a_batch_gives_the_same_tokens_from_a_smaller_pool(tiny, monkeypatch):
    """Prompts longer than the window and shorter, generating across it, run together
    through a windowed pool for two sequences' windows; no stale block is read."""
    monkeypatch.setattr(build, "WINDOW_SEQS", 2)
    monkeypatch.setattr(build, "WINDOW_CHUNK_TOKENS", 8)
    _reads_only_mapped_blocks(monkeypatch)
    prompts = [LONG, *SHARED_PREFIX_PROMPTS]
    found = {}
    for windowed in (True, False):
        with _load(tiny, windowed) as backend:
            info = backend.cache_info()
            assert (info.window_blocks is not None) == windowed
            results = backend.generate(prompts, max_tokens=24, temperature=0)
            found[windowed] = [r.token_ids for r in results], info
            if windowed:
                _all_let_go(backend)
                config = backend.model.config
                nbytes = engine_internals(backend).runner.cache.cache.nbytes
    (on, info), (off, whole) = found[True], found[False]
    assert on == off
    assert info.window_blocks == 2 * 2 + 1  # two sequences' windows, the chunk's block
    sliding, _, full = _layer_bytes(config)
    assert info.window_bytes_per_token == 2 * sliding
    assert whole.bytes_per_token == 2 * sliding + full
    tokens, window_tokens = info.num_blocks * BLOCK, info.window_blocks * BLOCK
    assert nbytes == tokens * full + window_tokens * 2 * sliding
    assert nbytes < tokens * whole.bytes_per_token


def _tokens(tiny, prompt: str) -> int:
    return len(tiny.hf(ARCH).tokenizer(prompt).input_ids)


def test_preemption_under_a_small_pool_gives_the_same_tokens(tiny, monkeypatch):
    """A windowed pool for one sequence's window beside a chunk of 8 tokens, and a whole
    pool that holds two of the prompts, in steps of 7 tokens: sequences wait, are
    preempted and recomputed, slots are reclaimed."""
    monkeypatch.setattr(build, "WINDOW_SEQS", 1)
    monkeypatch.setattr(build, "WINDOW_CHUNK_TOKENS", 8)
    _reads_only_mapped_blocks(monkeypatch)
    context = -(-(2 * _tokens(tiny, LONG) + 32) // BLOCK) * BLOCK
    settings = _settings(paged_attn_context_len=context)
    prompts = [LONG, PROMPT, LONG + " Again.", PROMPT + " Once more."]
    found = []
    for windowed in (True, False):
        with _load(tiny, windowed, settings) as backend:
            engine_internals(backend).scheduler.max_num_batched_tokens = 7
            results = backend.generate(prompts, max_tokens=16, temperature=0)
            found.append(([r.token_ids for r in results], backend.stats().preemptions))
            if windowed:
                assert backend.cache_info().window_blocks == 2 + 1
                _all_let_go(backend)
    (on, preempted), (off, _) = found
    assert on == off
    assert preempted > 0


def test_prefix_hits_stop_where_the_window_was_reclaimed(tiny, monkeypatch):
    """A prompt extending a finished one hits its blocks; after other prompts took the
    windowed slots those blocks kept, a rerun's hit stops before the blocks whose window
    is gone; the tokens are those of a pool without one."""
    monkeypatch.setattr(build, "WINDOW_SEQS", 2)
    monkeypatch.setattr(build, "WINDOW_CHUNK_TOKENS", 8)
    _reads_only_mapped_blocks(monkeypatch)
    follow = LONG + " The fox comes back at night."
    others = ["def add(a, b):", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17"]
    found = {}
    for windowed in (True, False):
        with _load(tiny, windowed) as backend:
            first = backend.generate(LONG, max_tokens=8, temperature=0)
            hit = backend.generate(follow, max_tokens=12, temperature=0)
            backend.generate(others, max_tokens=24, temperature=0)
            again = backend.generate(follow + " Again.", max_tokens=12, temperature=0)
            found[windowed] = (
                [r.token_ids for r in (first, hit, again)],
                [r.usage.cached_tokens for r in (hit, again)],
            )
            if windowed:
                _all_let_go(backend)
    (on, on_cached), (off, off_cached) = found[True], found[False]
    assert on == off
    assert on_cached[0] == off_cached[0] > 0  # the window of the hit's end was still held
    assert on_cached[1] < off_cached[1]  # the others took the slots it kept


@pytest.mark.parametrize(("cache", "seed"), [("f32", 0), ("f16", 1), ("f8e4m3", 2), ("auto", 3)])
def test_random_batches_under_a_tiny_windowed_pool(tiny, monkeypatch, cache, seed):
    """Prompts at and around the window's and blocks' edges, random and repetitive (n-gram
    proposals, some rejected), in steps of 7 tokens, then extended (prefix hits) and as
    several completions, through a windowed pool for one sequence's window: constant
    preemption, the same tokens as without the pool, no stale block read, all let go."""
    rng = random.Random(seed)
    monkeypatch.setattr(build, "WINDOW_SEQS", 1)
    monkeypatch.setattr(build, "WINDOW_CHUNK_TOKENS", 1 + 7 * (seed % 2))
    _reads_only_mapped_blocks(monkeypatch)
    base = [rng.randrange(5, 200) for _ in range(80)]
    lengths = [1, BLOCK - 1, BLOCK + 1, 2 * BLOCK, 60]
    prompts = [(base if i % 2 else base[:5] * 16)[:n] for i, n in enumerate(lengths)]
    extra = {"isq": "Q8_0"} if cache == "auto" else {}  # the CPU's float16 pool, natively
    settings = _settings(paged_cache_type=cache, **extra)
    found = []
    for windowed in (True, False):
        with _load(tiny, windowed, settings) as backend:
            assert (backend.cache_info().window_blocks is not None) == windowed
            first, hits, several = _traffic(backend, prompts, max_tokens=16, n=2)
            found.append([r.token_ids for r in (*first, *hits, *several)])
            if windowed:
                _all_let_go(backend)
                assert backend.stats().preemptions > 0
    assert found[0] == found[1]


def _refusals(caplog) -> list[str]:
    return [
        r.spnl_fields["reason"]
        for r in caplog.records
        if getattr(r, "spnl_event", None) == "kv_cache.window_pool_off"
    ]


def test_the_kv_tier_still_refuses_the_windowed_pool(tiny, tmp_path, caplog):
    """The KV tier stores and loads blocks of every layer: no windowed pool, said why."""
    caplog.set_level(logging.INFO, logger="spnl_backend")
    with _load(tiny, True, _settings(kv_tier_dir=str(tmp_path / "tier"))) as backend:
        assert backend.cache_info().window_blocks is None
    assert _refusals(caplog) == ["the KV tier (MISTRALRS_KV_TIER_DIR) stores blocks of every layer"]


def _widened(config, place: int):
    """``config`` with its first layer reading place ``place``'s K and V attending to
    every position."""
    layers = list(config.layers)
    index = next(
        i
        for i, s in enumerate(layers)
        if s.attention.spec.shared_kv and s.attention.spec.layer == place
    )
    spec = layers[index].attention.spec
    wide = dataclasses.replace(spec, scoring=dataclasses.replace(spec.scoring, window=None))
    mixer = dataclasses.replace(layers[index].attention, spec=wide)
    layers[index] = dataclasses.replace(layers[index], mixer=mixer)
    changed = copy.copy(config)
    changed.__dict__["layers"] = tuple(layers)  # the cached description, replaced
    return changed


def test_a_reader_past_its_sources_window_is_refused(tiny, caplog):
    """A layer reading a sliding layer's K and V over the whole context would read blocks
    the windowed pool let go: refused, said why. (No Gemma 4 config describes one: its
    shared layers read a layer of their own type; here the tiny model's reader of a
    sliding layer is made global.) The model as it is gets the pool."""
    caplog.set_level(logging.INFO, logger="spnl_backend")
    with _load(tiny, True) as backend:
        config, model = backend.model.config, backend.model
        caplog.clear()  # the load's own events
        plans = []
        for changed in (config, _widened(config, place=1)):
            loaded = SimpleNamespace(config=changed, model=model)
            plans.append(build._window_plan(loaded, _settings(), "target", torch.float32, False))
    assert plans[0] is not None
    assert plans[0].window == 8
    assert plans[1] is None
    assert _refusals(caplog) == [
        "a layer reads a sliding layer's K and V further back than its window"
    ]
