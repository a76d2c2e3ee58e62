"""The sliding layers' windowed pool through the Triton kernels on a GPU: tiny Gemma 3,
Gemma 2, Gemma 4 and gpt-oss (window 8, the pool shrunk to one window so that slots are
reclaimed and sequences preempted) give the greedy tokens of a pool without one, in the
model's dtype and as float8."""

import json
import shutil

import pytest

from spnl_backend import BackendSettings, load_backend
from spnl_backend.engine import build

pytestmark = pytest.mark.cuda

PROMPTS = [
    "The quick brown fox jumps over the lazy dog and runs far away into the woods.",
    "one two three four five six seven eight nine ten eleven twelve thirteen",
    "A B C",
]


def _windowed_copy(tiny, arch: str, root) -> str:
    """The tiny model with its sliding window set to 8 (where its config keeps it)."""
    path = root / arch
    shutil.copytree(tiny.hf(arch).path, path)
    config = json.loads((path / "config.json").read_text())
    for part in (config, config.get("text_config") or {}):
        if "sliding_window" in part:
            part["sliding_window"] = 8
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _tokens(path: str, windowed: bool, cache_type: str, monkeypatch) -> list[list[int]]:
    with monkeypatch.context() as patch:
        patch.setattr(build, "WINDOW_SEQS", 1)
        patch.setattr(build, "WINDOW_CHUNK_TOKENS", 8)
        if not windowed:
            patch.setattr(build, "_window_plan", lambda *args, **kwargs: None)
        settings = BackendSettings(
            device="cuda",
            paged_attn=True,
            paged_cache_type=cache_type,
            paged_attn_block_size=8,
            paged_attn_context_len=256,
        )
        with load_backend(path, settings=settings) as backend:
            info = backend.cache_info()
            assert info.kernels == "triton"
            assert (info.window_blocks is not None) == windowed
            return [backend.generate(p, max_tokens=40, temperature=0).token_ids for p in PROMPTS]


@pytest.mark.parametrize("cache_type", ["auto", "f8e4m3"])
@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "gemma4", "gpt_oss"])
def test_the_windowed_pool_gives_the_tokens_of_none_on_a_gpu(
    tiny, arch, cache_type, tmp_path, monkeypatch
):
    path = _windowed_copy(tiny, arch, tmp_path)
    on = _tokens(path, True, cache_type, monkeypatch)
    assert on == _tokens(path, False, cache_type, monkeypatch)
