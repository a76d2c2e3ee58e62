"""The sliding-window layers' own pool across the families with such layers beside global
ones (`engine.window_pool`; Gemma 2 and 3 in tests/test_window_pool.py): with the pool
shrunk to one sequence's window, in small steps, batched, preempted and on prefix hits,
greedy tokens equal those of a pool where every layer holds the whole context, from the
checkpoint and from GGUFs (Cohere 2's by llama.cpp's converter, gpt-oss's); the families
it must stay off for say why in the log (or, chunked attention, have no sliding layer)."""

import random

import pytest
from gguf import GGMLQuantizationType
from test_window_pool import (
    _all_let_go,
    _reads_only_mapped_blocks,
    _settings,
    _traffic,
    _with_window,
)
from tiny_models import build_hf_model

from spnl_backend import load_backend
from spnl_backend.engine import build
from spnl_backend.engine.paged import kv_windows

WINDOW = 8
# Families whose tiny config slides on some layers only as it stands (window 8), and
# those whose checkpoints turn sliding on by keys of their own: Qwen2 from layer
# ``max_window_layers`` on, Qwen2-MoE on even layers below it, SmolLM3 on its NoPE layers.
ON = {
    "gpt_oss": {},
    "cohere2": {},
    "exaone4": {},
    "ministral": {},
    "olmo2": {},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen2_moe": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 3},
    "smollm3": {"use_sliding_window": True, "sliding_window": WINDOW},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family's tiny model with its sliding keys, built once."""
    root, built = tmp_path_factory.mktemp("window-families"), {}

    def model(arch: str, overrides: dict | None = None):
        if arch not in built:
            built[arch] = build_hf_model(arch, root / arch, overrides=overrides)
        return built[arch]

    return model


def _backend(path, windowed: bool, settings):
    with pytest.MonkeyPatch.context() as patch:
        if not windowed:
            patch.setattr(build, "_window_plan", lambda *args, **kwargs: None)
        return load_backend(str(path), settings=settings)


def _same_tokens_from_a_tiny_windowed_pool(
    path, monkeypatch, seed: int = 0, window: int = WINDOW, block: int = 8, **extra
) -> None:
    """Prompts at and around the window's and blocks' edges in a batch, in steps of 7
    tokens, through a windowed pool for one sequence's window (constant preemption), then
    extended (prefix hits): the tokens of a pool without one, no unmapped block read, every
    slot let go."""
    rng = random.Random(seed)
    monkeypatch.setattr(build, "WINDOW_SEQS", 1)
    monkeypatch.setattr(build, "WINDOW_CHUNK_TOKENS", 8)
    _reads_only_mapped_blocks(monkeypatch)
    base = [rng.randrange(5, 200) for _ in range(80)]
    lengths = [1, window - 1, window, window + 1, block + 1, 2 * window + 3, 80]
    prompts = [(base if i % 2 else base[:5] * 16)[:n] for i, n in enumerate(lengths)]
    found = []
    for windowed in (True, False):
        backend = _backend(path, windowed, _settings(paged_attn_block_size=block, **extra))
        with backend:
            windows = kv_windows(backend.model.config)
            assert set(windows) == {None, window}  # sliding layers beside global ones
            assert (backend.cache_info().window_blocks is not None) == windowed
            first, hits, _ = _traffic(backend, prompts, max_tokens=16)
            found.append([r.token_ids for r in (*first, *hits)])
            if windowed:
                _all_let_go(backend)
                assert backend.stats().preemptions > 0
                assert sum(r.usage.cached_tokens for r in hits) > 0
    assert found[0] == found[1]


@pytest.mark.parametrize("arch", list(ON))
def test_a_family_gives_the_same_tokens_from_a_tiny_windowed_pool(models, monkeypatch, arch):
    _same_tokens_from_a_tiny_windowed_pool(models(arch, ON[arch] or None).path, monkeypatch)


def test_gpt_oss_gives_the_same_tokens_from_a_float16_windowed_pool(models, monkeypatch):
    """Its sinks read beside a window in the pool's own float16 pages."""
    path = models("gpt_oss").path
    _same_tokens_from_a_tiny_windowed_pool(path, monkeypatch, seed=2, paged_cache_type="f16")


@pytest.mark.parametrize(("window", "block", "seed"), [(12, 16, 4), (17, 8, 5), (5, 16, 6)])
def test_gpt_oss_at_other_windows_and_blocks(tiny, tmp_path, monkeypatch, window, block, seed):
    """A window that is not the block size, longer than one block or shorter."""
    path = _with_window(tiny, "gpt_oss", window, tmp_path)
    _same_tokens_from_a_tiny_windowed_pool(path, monkeypatch, seed, window, block)


@pytest.mark.parametrize("arch", ["ministral", "gpt_oss"])
def test_quantized_layers_over_a_default_windowed_pool(models, monkeypatch, block_runs, arch):
    """Q8_0 projections over the default float16 pool: Ministral's through the native
    layer blocks (which store and attend its sliding layers in their own pool), gpt-oss's
    per op (its sinks and expert biases)."""
    path = models(arch, ON[arch] or None).path
    extra = {"isq": "Q8_0", "paged_cache_type": "auto"}
    _same_tokens_from_a_tiny_windowed_pool(path, monkeypatch, seed=3, **extra)
    assert (block_runs[0] > 0) == (arch == "ministral")


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [("cohere2", GGMLQuantizationType.F32), ("gpt_oss", GGMLQuantizationType.Q8_0)],
)
def test_a_gguf_gives_the_same_tokens_from_a_tiny_windowed_pool(tiny, monkeypatch, arch, qtype):
    """Cohere 2's file by llama.cpp's converter (its window kept, its pattern the file's
    default: every fourth layer global, as the tiny checkpoint's); gpt-oss's quantized,
    its alternation the file's default (every second layer global)."""
    _same_tokens_from_a_tiny_windowed_pool(tiny.gguf(arch, qtype), monkeypatch, seed=1)


@pytest.fixture
def refusals(monkeypatch):
    """The reasons `kv_cache.window_pool_off` gave."""
    said: list[str] = []
    original = build.log.info

    def heard(event, *args, **fields):
        if event == "kv_cache.window_pool_off":
            said.append(fields["reason"])
        return original(event, *args, **fields)

    monkeypatch.setattr(build.log, "info", heard)
    return said


@pytest.mark.parametrize(
    ("arch", "overrides"), [("mistral", None), ("starcoder2", {"sliding_window": WINDOW})]
)
def test_a_family_whose_every_layer_slides_is_refused_the_pool(models, refusals, arch, overrides):
    with _backend(models(arch, overrides).path, True, _settings()) as backend:
        assert kv_windows(backend.model.config) == [WINDOW] * backend.model.config.num_layers
        assert backend.cache_info().window_blocks is None
    assert refusals == ["every layer slides (nothing to size the block table by)"]


def test_llama4s_chunked_layers_are_no_window(models, refusals, monkeypatch):
    """A chunked layer's query at p reads from the start of its chunk (`Scoring.chunk`),
    not the last ``window`` positions: its scoring has no window, so the layers are no
    sliding layers to the pool, which stays off without a refusal (as for a model with
    none), even where the windowed pool is small enough to be taken."""
    monkeypatch.setattr(build, "WINDOW_SEQS", 1)
    monkeypatch.setattr(build, "WINDOW_CHUNK_TOKENS", 8)
    with _backend(models("llama4").path, True, _settings()) as backend:
        config = backend.model.config
        assert "chunked" in config.layer_types
        assert kv_windows(config) == [None] * config.num_layers
        assert backend.cache_info().window_blocks is None
    assert refusals == []
