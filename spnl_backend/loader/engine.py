"""Loaded models + settings + platform decisions → the engine, with its KV caches.

Paged attention gets a block pool sized by the KV budget (checked against free memory
before it is allocated) and block-level prefix caching; non-paged mode gets growing
per-sequence caches and sequence-level prefix caching. The two are exclusive, and the
log says which runs. A speculative draft gets a cache of its own of the same kind,
holding as many tokens as the target's.
"""

import torch

from ..engine.block_manager import BlockManager
from ..engine.budget import MIB, available_memory, plan_kv_cache
from ..engine.engine import Engine, EngineConfig
from ..engine.kv_cache import ContiguousCacheManager
from ..engine.paged import PagedCacheManager, PagedKVCache
from ..engine.runner import ModelRunner, Runner
from ..engine.scheduler import CacheManager
from ..engine.speculative import Drafter, SpeculativeCache, SpeculativeRunner
from ..kernels import select_kernels
from ..log import get_logger
from ..settings import BackendSettings, PlatformDecisions
from ..settings.model import KvBudget
from .build import LoadedModel

log = get_logger()


def build_engine(
    loaded: LoadedModel,
    settings: BackendSettings,
    decisions: PlatformDecisions,
    draft: LoadedModel | None = None,
) -> Engine:
    cache, max_len = _cache(loaded, settings, decisions, settings.kv_budget, "target")
    _log_prefix_caching(settings, decisions.paged_attn)
    runner: Runner = ModelRunner(loaded.model, cache, loaded.device)
    if draft is not None:
        tokens = cache.capacity_tokens or settings.kv_budget.value
        budget = KvBudget("context_len", tokens, explicit=settings.kv_budget.explicit)
        draft_cache, draft_len = _cache(draft, settings, decisions, budget, "draft")
        drafter = Drafter(
            draft.model, SpeculativeCache(cache, draft_cache), draft.device, draft_len
        )
        runner = SpeculativeRunner(loaded.model, drafter, settings.speculative_gamma, loaded.device)
    engine_config = EngineConfig(
        max_model_len=max_len, eos_token_ids=frozenset(loaded.tokenizer.eos_token_ids)
    )
    return Engine(runner, loaded.tokenizer, engine_config)


def _cache(
    loaded: LoadedModel,
    settings: BackendSettings,
    decisions: PlatformDecisions,
    budget: KvBudget,
    role: str,
) -> tuple[CacheManager, int]:
    """One model's cache manager, and the longest sequence it can hold."""
    config = loaded.config
    if not decisions.paged_attn:
        cache = ContiguousCacheManager(config, loaded.dtype, loaded.device, settings.prefix_cache_n)
        return cache, config.max_position_embeddings
    paged = _paged_cache(loaded, settings, decisions, budget, role)
    return paged, min(config.max_position_embeddings, paged.capacity_tokens)


def _paged_cache(
    loaded: LoadedModel,
    settings: BackendSettings,
    decisions: PlatformDecisions,
    budget: KvBudget,
    role: str,
) -> PagedCacheManager:
    fp8 = decisions.kv_cache_dtype == "float8_e4m3fn"
    cache_dtype = torch.float8_e4m3fn if fp8 else loaded.dtype
    plan = plan_kv_cache(
        loaded.config,
        budget,
        settings.paged_attn_block_size,
        cache_dtype,
        available_memory(loaded.device),
    )
    log.info(
        "kv_cache.budget",
        model=role,
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
