"""A loaded model + settings + platform decisions → the engine, with its KV cache.

Paged attention gets a block pool sized by the KV budget (checked against free memory
before it is allocated) and block-level prefix caching; non-paged mode gets growing
per-sequence caches and sequence-level prefix caching. The two are exclusive, and the
log says which runs.
"""

import torch

from ..engine.block_manager import BlockManager
from ..engine.budget import MIB, available_memory, plan_kv_cache
from ..engine.engine import Engine, EngineConfig
from ..engine.kv_cache import ContiguousCacheManager
from ..engine.paged import PagedCacheManager, PagedKVCache
from ..kernels import select_kernels
from ..log import get_logger
from ..settings import BackendSettings, PlatformDecisions
from .build import LoadedModel

log = get_logger()


def build_engine(
    loaded: LoadedModel, settings: BackendSettings, decisions: PlatformDecisions
) -> Engine:
    config = loaded.config
    if decisions.paged_attn:
        cache = _paged_cache(loaded, settings, decisions)
        max_len = min(config.max_position_embeddings, cache.capacity_tokens)
    else:
        cache = ContiguousCacheManager(config, loaded.dtype, loaded.device, settings.prefix_cache_n)
        max_len = config.max_position_embeddings
    _log_prefix_caching(settings, decisions.paged_attn)
    engine_config = EngineConfig(
        max_model_len=max_len, eos_token_ids=frozenset(loaded.tokenizer.eos_token_ids)
    )
    return Engine(loaded.model, loaded.tokenizer, cache, engine_config, loaded.device)


def _paged_cache(
    loaded: LoadedModel, settings: BackendSettings, decisions: PlatformDecisions
) -> PagedCacheManager:
    fp8 = decisions.kv_cache_dtype == "float8_e4m3fn"
    cache_dtype = torch.float8_e4m3fn if fp8 else loaded.dtype
    plan = plan_kv_cache(
        loaded.config,
        settings.kv_budget,
        settings.paged_attn_block_size,
        cache_dtype,
        available_memory(loaded.device),
    )
    log.info(
        "kv_cache.budget",
        blocks=plan.num_blocks,
        block_size=plan.block_size,
        tokens=plan.num_tokens,
        mb=round(plan.nbytes / MIB, 1),
        cache_dtype=str(cache_dtype).removeprefix("torch."),
        budget=settings.kv_budget.kind,
    )
    cache = PagedKVCache(
        loaded.config, plan.num_blocks, plan.block_size, cache_dtype, loaded.device
    )
    blocks = BlockManager(plan.num_blocks, plan.block_size, settings.prefix_cache_enabled)
    return PagedCacheManager(cache, blocks, select_kernels(decisions.kernels))


def _log_prefix_caching(settings: BackendSettings, paged: bool) -> None:
    if not settings.prefix_cache_enabled:
        log.info("prefix_cache.disabled", reason="MISTRALRS_PREFIX_CACHE_N is 0 or false")
    elif paged:
        log.info("prefix_cache.enabled", level="block-level, paged attention")
    else:
        log.info(
            "prefix_cache.enabled",
            level="sequence-level, non-paged attention",
            sequences=settings.prefix_cache_n,
        )
