"""The inspection API (`Backend.stats`, `cache_info`, `model`) reports what the engine
holds and runs on: what host applications and a server's metrics read."""

import dataclasses

import pytest
import torch
from helpers import PROMPT, SHARED_PREFIX_PROMPTS

from spnl_backend import BackendSettings, RequestAbortedError, load_backend
from spnl_backend.compression.sizes import method_bytes_per_token
from spnl_backend.memory import MIB, kv_bytes_per_token
from spnl_backend.quant.linear import QuantLinear

PROMPTS = SHARED_PREFIX_PROMPTS


def load(tiny, **settings):
    settings = BackendSettings(device="cpu", **settings)
    return load_backend(str(tiny.hf("llama").path), settings=settings)


def model_dtype(backend) -> torch.dtype:
    return next(backend.model.parameters()).dtype


def test_a_paged_cache_reports_its_context_budget(tiny):
    backend = load(
        tiny,
        paged_attn=True,
        paged_attn_block_size=8,
        paged_attn_context_len=256,
        cpu_kernels="torch",
    )
    info = backend.cache_info()
    assert info.kind == "paged"
    assert (info.capacity_tokens, info.block_size, info.num_blocks) == (256, 8, 32)
    assert info.dtype == model_dtype(backend)
    assert info.bytes_per_token == kv_bytes_per_token(backend.model_config, info.dtype)
    assert (info.compression, info.kernels) == (None, "torch")
    assert backend.stats().pool.blocks == info.num_blocks
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.kind = "contiguous"  # type: ignore[misc]


def test_a_paged_cache_reports_its_memory_budget(tiny):
    info = load(
        tiny, paged_attn=True, paged_attn_block_size=16, paged_attn_memory_mb=1
    ).cache_info()
    per_block = info.block_size * info.bytes_per_token
    assert info.num_blocks * info.block_size == info.capacity_tokens
    assert info.num_blocks * per_block <= MIB < (info.num_blocks + 1) * per_block


def test_a_contiguous_cache_has_no_pool(tiny):
    backend = load(tiny, paged_attn=False)
    info = backend.cache_info()
    assert info.kind == "contiguous"
    assert (info.capacity_tokens, info.block_size, info.num_blocks, info.kernels) == (None,) * 4
    assert info.dtype == torch.float16  # the CPU's auto cache type, as in paged mode
    assert info.bytes_per_token == kv_bytes_per_token(backend.model_config, info.dtype)
    assert info.compression is None
    assert backend.stats().pool is None


def test_the_fp8_cache_type_from_the_environment_shows(tiny, monkeypatch):
    monkeypatch.setenv("MISTRALRS_DEVICE", "cpu")
    monkeypatch.setenv("MISTRALRS_PAGED_ATTN", "true")
    path = str(tiny.hf("llama").path)
    plain = load_backend(path).cache_info()
    monkeypatch.setenv("MISTRALRS_PAGED_CACHE_TYPE", "f8e4m3")
    fp8 = load_backend(path).cache_info()
    assert plain.dtype != torch.float8_e4m3fn
    assert (fp8.kind, fp8.dtype) == ("paged", torch.float8_e4m3fn)
    assert fp8.bytes_per_token * plain.dtype.itemsize == plain.bytes_per_token


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_compression_shows_its_method_and_record_size(tiny, paged):
    backend = load(tiny, paged_attn=paged, kv_cache_compression="tq4")
    info = backend.cache_info()
    assert (info.kind, info.compression) == ("paged" if paged else "contiguous", "tq4")
    assert info.dtype == torch.uint8
    assert info.bytes_per_token == method_bytes_per_token("tq4", backend.model_config)
    assert info.bytes_per_token < kv_bytes_per_token(backend.model_config, torch.float16)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_prefix_cache_counters_follow_each_requests_usage(tiny, paged):
    backend = load(tiny, paged_attn=paged, paged_attn_block_size=8)
    before = backend.stats()
    assert (before.prefix_cache_queries, before.prefix_cache_hits) == (0, 0)
    first = backend.generate(PROMPT, max_tokens=4, temperature=0)
    again = backend.generate(PROMPT, max_tokens=4, temperature=0)
    stats = backend.stats()
    assert again.usage.cached_tokens > 0 == first.usage.cached_tokens
    assert stats.prefix_cache_queries == first.usage.prompt_tokens + again.usage.prompt_tokens
    assert stats.prefix_cache_hits == again.usage.cached_tokens


def test_prefix_cache_hits_stay_zero_without_one(tiny):
    backend = load(tiny, paged_attn=True, prefix_cache_n=0)
    results = [backend.generate(PROMPT, max_tokens=2, temperature=0) for _ in range(2)]
    stats = backend.stats()
    assert stats.prefix_cache_queries == sum(r.usage.prompt_tokens for r in results)
    assert stats.prefix_cache_hits == 0


def test_a_preempted_request_is_counted_once(tiny):
    """Recomputing a preempted sequence is not a new prefix-cache query."""
    backend = load(tiny, paged_attn=True, paged_attn_block_size=8, paged_attn_context_len=120)
    results = backend.generate(PROMPTS, max_tokens=16, temperature=0)
    stats = backend.stats()
    assert stats.preemptions > 0
    assert stats.prefix_cache_queries == sum(r.usage.prompt_tokens for r in results)
    assert stats.prefix_cache_hits == sum(r.usage.cached_tokens for r in results)
    assert (stats.running, stats.waiting, stats.cache_holders, stats.pool.in_use) == (0, 0, 0, 0)


def test_the_model_is_the_loaded_module(tiny):
    plain = load(tiny)
    quantized = load(tiny, isq="Q8_0")
    assert isinstance(plain.model, torch.nn.Module)
    assert plain.model.config == plain.model_config
    assert not any(isinstance(m, QuantLinear) for m in plain.model.modules())
    assert any(isinstance(m, QuantLinear) for m in quantized.model.modules())


def test_a_closed_backend_has_nothing_to_inspect(tiny):
    backend = load(tiny)
    backend.close()
    for inspect in (backend.stats, backend.cache_info, lambda: backend.model):
        with pytest.raises(RequestAbortedError, match="closed"):
            inspect()


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_the_cache_type_sets_how_k_and_v_are_stored(tiny, paged):
    """float16 by default where the native CPU kernels attend; f32 and f16 on request."""
    stored = {
        cache_type: load(tiny, paged_attn=paged, paged_cache_type=cache_type).cache_info()
        for cache_type in ("auto", "f16", "f32")
    }
    assert [info.dtype for info in stored.values()] == [torch.float16] * 2 + [torch.float32]
    assert stored["f32"].bytes_per_token == 2 * stored["auto"].bytes_per_token
    on_torch = load(tiny, paged_attn=paged, cpu_kernels="torch", paged_cache_type="f16")
    assert on_torch.cache_info().dtype == torch.float16  # the torch twins store it too
    result = on_torch.generate("The capital", max_tokens=4, temperature=0)
    assert result.usage.completion_tokens == 4
