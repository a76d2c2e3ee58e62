"""Layer mapping (``MISTRALRS_DEVICE_LAYERS``): consecutive layers on each device, the
activations moved at the boundaries, each device's part of the KV pool holding its layers.
On the CPU the "devices" share one memory; the tokens must be those of one device."""

import pytest
from helpers import SHARED_PREFIX_PROMPTS, engine_internals

from spnl_backend import BackendSettings, SettingsError, load_backend


def _tokens(path, **extra):
    settings = BackendSettings(device="cpu", **extra)
    with load_backend(str(path), settings=settings) as backend:
        results = backend.generate(SHARED_PREFIX_PROMPTS, max_tokens=16, temperature=0)
        pool = engine_internals(backend).cache.cache
        parts = [part.shape[0] for part in pool.parts]
        windowed = backend.cache_info().window_blocks is not None
        return [r.token_ids for r in results], (parts, windowed)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe"])
def test_two_devices_give_one_devices_tokens(tiny, arch):
    path = tiny.hf(arch).path
    expected, whole = _tokens(path)
    mapped, parts = _tokens(path, device_layers="0:2;1:1")
    assert mapped == expected
    # a pool part per device, its layers in it (layer mapping keeps the sliding layers in
    # it, not a pool of their own); on one device Gemma 3's two sliding layers have theirs
    assert parts == ([2, 1], False)
    assert whole == (([2, 1], True) if arch == "gemma3" else ([3], False))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"device_layers": "0:2;1:2"}, "maps 4 layers .* but the model has 3"),
        ({"device_layers": "0:2;1:1", "mn_local_world_size": 2}, "runs in one process"),
        ({"device_layers": "0:2;1:1", "kv_cache_compression": "int8"}, "does not run with"),
        ({"device_layers": "0:2;1:1", "paged_attn": False}, "runs on the paged KV cache"),
    ],
)
def test_maps_that_do_not_fit_are_refused(tiny, extra, message):
    with pytest.raises(SettingsError, match=message):
        load_backend(str(tiny.hf("llama").path), settings=BackendSettings(device="cpu", **extra))
