"""What the server reports of the sliding-window layers' own pool: its gauges, and the
KV usage routers read, which is the fuller pool's (a request needs room in both)."""

import dataclasses
from types import SimpleNamespace

import pytest
from helpers import PROMPT
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_window_pool import LONG, _load

from spnl_backend.engine import build
from spnl_backend.engine.cache import PoolUsage
from spnl_backend.engine.loop import STREAM_BUFFER
from spnl_backend.server import router_info
from spnl_backend.server.metrics import ServerMetrics

NAMED = (("model_name", "tiny"),)


def _scrape(stats) -> dict[tuple[str, tuple], float]:
    """The metrics a server reporting ``stats`` for one unnamed engine publishes."""
    metrics = ServerMetrics()
    metrics.model_name = "tiny"
    metrics.watch(lambda: [(None, stats)])
    text = generate_latest(metrics.registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _window_figures(scraped) -> tuple[float, float, float]:
    return tuple(scraped[f"spnl_kv_window_blocks_{n}", ()] for n in ("used", "free", "cached"))


@pytest.fixture(scope="module")
def windowed(tiny):
    with pytest.MonkeyPatch.context() as patch:
        # a windowed pool for two sequences' windows beside a chunk of 8 tokens
        patch.setattr(build, "WINDOW_SEQS", 2)
        patch.setattr(build, "WINDOW_CHUNK_TOKENS", 8)
        backend = _load(tiny, "gemma3", True)
    assert backend.cache_info().window_blocks is not None
    yield backend
    backend.close()


def test_a_running_request_holds_windowed_blocks_on_the_gauges(windowed):
    window = windowed.cache_info().window_blocks
    # more tokens than a stream buffers unread: it pauses, holding its window, however
    # fast the engine runs
    stream = windowed.stream(LONG, max_tokens=STREAM_BUFFER + 40, temperature=0)
    try:
        next(stream)
        scraped = _scrape(windowed.stats())
    finally:
        stream.close()
    used, free, cached = _window_figures(scraped)
    assert used > 0
    assert used + free == window
    assert 0 <= cached <= free
    held = scraped["spnl_kv_blocks_used", ()]
    blocks = held + scraped["spnl_kv_blocks_free", ()]
    usage = scraped["vllm:kv_cache_usage_perc", NAMED]
    assert usage == pytest.approx(max(held / blocks, used / window))
    assert scraped["vllm:gpu_cache_usage_perc", NAMED] == usage


def test_the_stream_above_runs_to_its_length(windowed):
    """The prompt above generates past the stream's buffer (no early end to race)."""
    (result,) = windowed.generate([LONG], max_tokens=STREAM_BUFFER + 40, temperature=0)
    assert len(result.token_ids) == STREAM_BUFFER + 40


def test_a_finished_request_leaves_its_prefix_kept_in_the_windowed_pool(windowed):
    windowed.generate([LONG], max_tokens=4, temperature=0)
    stats = windowed.stats()
    pool = stats.pool
    used, free, cached = _window_figures(_scrape(stats))
    assert (used, cached) == (0, pool.window_cached)
    assert free == pool.window_blocks
    assert cached > 0  # the prompt's registered blocks keep their windowed slots


def _usage_stats(windowed, pool: PoolUsage):
    return dataclasses.replace(windowed.stats(), pool=pool)


def test_the_usage_routers_read_is_the_fuller_pools(windowed):
    """A windowed pool at 4 of 5 blocks beside a global one at 10 of 100: routers see 0.8."""
    pool = PoolUsage(100, 10, 3, window_blocks=5, window_in_use=4, window_cached=1)
    scraped = _scrape(_usage_stats(windowed, pool))
    assert scraped["vllm:kv_cache_usage_perc", NAMED] == pytest.approx(0.8)
    assert scraped["vllm:gpu_cache_usage_perc", NAMED] == pytest.approx(0.8)
    assert scraped["spnl_kv_blocks_used", ()] == 10  # the global pool's own figures stay
    assert _window_figures(scraped) == (4, 1, 1)
    fake = SimpleNamespace(stats=lambda: _usage_stats(windowed, pool))
    fake.cache_info = windowed.cache_info
    (load,) = router_info.load([fake])
    block = windowed.cache_info().block_size
    assert load["num_tokens"] == 80 * block  # 0.8 of the global pool's 100 blocks
    # the global pool fuller: its own figures, as without a windowed pool
    pool = dataclasses.replace(pool, in_use=90)
    scraped = _scrape(_usage_stats(windowed, pool))
    assert scraped["vllm:kv_cache_usage_perc", NAMED] == pytest.approx(0.9)
    (load,) = router_info.load([fake])
    assert load["num_tokens"] == 90 * block


def test_windowed_shares_round_up_to_global_blocks():
    pool = PoolUsage(10, 0, 0, window_blocks=3, window_in_use=1, window_cached=0)
    assert pool.load_blocks() == 4  # a third of 10 blocks, rounded up: never shown as room
    assert pool.usage == pytest.approx(1 / 3)


def test_without_a_windowed_pool_nothing_changes(tiny):
    pool = PoolUsage(100, 10, 3)
    assert (pool.usage, pool.load_blocks()) == (0.1, 10)
    assert PoolUsage(0, 0, 0).usage is None
    with _load(tiny, "gemma3", False) as backend:
        backend.generate([PROMPT], max_tokens=2, temperature=0)
        stats = backend.stats()
        scraped = _scrape(stats)
        (load,) = router_info.load([backend])
        block = backend.cache_info().block_size
    assert stats.pool.window_blocks is None
    assert not [name for name, _ in scraped if name.startswith("spnl_kv_window_")]
    held, blocks = stats.pool.in_use, stats.pool.blocks
    assert scraped["spnl_kv_blocks_used", ()] == held
    assert scraped["spnl_kv_blocks_free", ()] == blocks - held
    assert scraped["vllm:kv_cache_usage_perc", NAMED] == held / blocks
    assert load["num_tokens"] == held * block
