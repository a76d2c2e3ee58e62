"""Loaded models + settings + platform decisions → the engine, with its KV caches.

Paged attention gets a block pool sized by the KV budget (checked against free memory
before it is allocated) and block-level prefix caching; non-paged mode gets growing
per-sequence caches and sequence-level prefix caching. The two are exclusive, and the
log says which runs. A compression method (``MISTRALRS_KV_CACHE_COMPRESSION``) stores
its records in the pool, or, for a method without a block-pool form, in protocol caches
per sequence (non-paged). A speculative draft gets a cache of its own of the same kind,
holding as many tokens as the target's.
"""

import dataclasses

import torch

from ..compression import (
    CompressedKVCache,
    Compressor,
    KVGeometry,
    ResizableKVCache,
    get_compressor,
)
from ..errors import PlatformError, SettingsError
from ..kernels import AttentionKernels
from ..loader.lora import read_adapter
from ..loader.model import LoadedModel
from ..log import get_logger
from ..memory import MIB, available_memory, kv_bytes_per_token
from ..models.config import ModelConfig
from ..settings import BackendSettings, PlatformDecisions
from ..settings.backend_settings import KvBudget, env_name
from ..settings.effects import given_pic_settings
from ..settings.speculation import SpeculationChoice, choose_speculation
from ..settings.values import lora_adapter_list
from .adapters import AdapterRegistry
from .block_manager import BlockManager
from .budget import (
    WINDOW_CHUNK_TOKENS,
    WINDOW_SEQS,
    KVCachePlan,
    StatePlan,
    WindowPlan,
    check_states_fit,
    plan_kv_cache,
)
from .cache import CacheInfo, CacheManager
from .calibration import KVStatistics, kv_statistics
from .compressed import CodedPagedKVCache, ProtocolKV
from .engine import MAX_NUM_SEQS, Engine, EngineConfig
from .kv_cache import ContiguousCacheManager, SequenceStore, plain_stores
from .kv_shift import KeyShift
from .ngram import NgramRunner
from .paged import PagedCacheManager, PagedKVCache, PagedKVStorage, kv_windows
from .pool_tier import attach_tier
from .runner import ModelRunner, Runner
from .speculative import Drafter, SpeculativeCache, SpeculativeRunner
from .state_cache import (
    RULE_CHUNK,
    StateCache,
    StatefulCacheManager,
    copies_per_slot,
    state_bytes_per_seq,
    state_shapes,
)
from .suffix import SuffixRunner
from .window_pool import WindowSlots

log = get_logger()


def build_engine(
    loaded: LoadedModel,
    settings: BackendSettings,
    decisions: PlatformDecisions,
    draft: LoadedModel | None = None,
) -> Engine:
    for model in (loaded, draft):
        if model is not None:
            _refuse_for_state_layers(model, settings)
    _refuse_for_kv_groups(loaded, settings)
    for model in (loaded, draft):
        if model is not None:
            _refuse_for_transformers_code(model, settings)
    _refuse_for_chunked_attention(loaded, settings)
    adapters, no_adapters = _adapter_registry(loaded, settings, draft)
    settings = _prefix_caching_for(loaded.config, settings, decisions.paged_attn)
    if (
        loaded.model.tp is not None
        and settings.pic_recompute
        and (settings.pic_recompute_select == "deviation")
    ):
        raise SettingsError(
            f"{env_name('pic_recompute_select')}=deviation probes a layer on one rank's "
            "model and does not run with tensor parallelism: use first (the default), or "
            "one device"
        )
    # Where speculation may run: the states after each of a step's last rows, to go back
    # to after rejected proposals (planned in the state budget; auto may still resolve to
    # none below, once the cache says whether it can drop tokens).
    trail_rows = settings.speculative_gamma + 1 if _may_speculate(loaded, settings) else 0
    cache, max_len, info = _cache(
        loaded, settings, decisions, settings.kv_budget, "target", trail_rows
    )
    _log_prefix_caching(settings, decisions.paged_attn)
    settings, speculation = _resolved_speculation(loaded, settings, info)
    runner: Runner = ModelRunner(loaded.model, cache, loaded.device)
    if isinstance(cache, StatefulCacheManager) and speculation.method is None:
        cache.states.trail_rows = 0  # no rejections to go back from
    if settings.speculative in ("ngram", "suffix"):
        runner = _lookup_runner(loaded, settings, cache, max_len)
    if draft is not None:
        tokens = cache.capacity_tokens or settings.kv_budget.value
        budget = KvBudget("context_len", tokens, explicit=settings.kv_budget.explicit)
        slots = info.state_slots or MAX_NUM_SEQS  # a view per target sequence at most
        draft_cache, draft_len, _ = _cache(
            draft, settings, decisions, budget, "draft", trail_rows, slots
        )
        drafter = Drafter(
            draft.model,
            SpeculativeCache(cache, draft_cache),
            draft.device,
            draft_len,
            vocab_size=loaded.config.vocab_size,
        )
        runner = SpeculativeRunner(loaded.model, drafter, settings.speculative_gamma, loaded.device)
    engine_config = EngineConfig(
        max_model_len=max_len,
        eos_token_ids=frozenset(loaded.tokenizer.eos_token_ids),
        prefix_caching=settings.prefix_cache_enabled,
    )
    engine = Engine(runner, loaded.tokenizer, engine_config, info)
    engine.adapters, engine.no_adapters = adapters, no_adapters
    engine.speculation_why = speculation.why
    if settings.kv_tier_dir is not None:
        tier = attach_tier(loaded, settings, cache, info, speculative=draft is not None)
        if tier is not None:
            engine.on_close.append(tier.close)
    return engine


def build_cache(
    loaded: LoadedModel, settings: BackendSettings, decisions: PlatformDecisions
) -> tuple[CacheManager, CacheInfo]:
    """The cache the engine would build for ``loaded``, alone: what a tensor-parallel
    rank other than 0 builds over its share, at the same point of its load as rank 0
    (a calibrated pool's forward pass is one of the group's)."""
    settings = _prefix_caching_for(loaded.config, settings, decisions.paged_attn)
    cache, _, info = _cache(loaded, settings, decisions, settings.kv_budget, "target", 0)
    return cache, info


def _refuse_for_state_layers(loaded: LoadedModel, settings: BackendSettings) -> None:
    """What a model with state layers cannot run with yet, refused at load by name."""
    config = loaded.config
    if not config.num_state_layers:
        return
    asked = {
        "MISTRALRS_KV_TIER_DIR": settings.kv_tier_dir is not None,
        "layer mapping (MISTRALRS_DEVICE_LAYERS)": loaded.model.model.layer_spans is not None,
    }
    layers = f"{config.num_state_layers} state layers (Gated DeltaNet, Mamba-2, Mamba-1)"
    why = (
        f"the {config.architecture} model has {layers}, whose per-sequence state this does "
        "not carry yet"
    )
    _refuse(asked, why)
    pic = {f"{env_name(f)}={getattr(settings, f)}": True for f in given_pic_settings(settings)}
    why = (
        f"PIC prompts cannot run on the {config.architecture} model: its {layers} hold the "
        "whole context in order, and a block computed elsewhere cannot be placed into them"
    )
    _refuse(pic, why)


def _refuse_for_transformers_code(loaded: LoadedModel, settings: BackendSettings) -> None:
    """What a model on transformers' modeling code (`loader.transformers_path`) does not
    run with: adapters on our projections, PIC's moved keys and layer probes."""
    if loaded.implementation != "transformers":
        return
    asked = {
        "MISTRALRS_LORA_ADAPTERS": settings.lora_adapters is not None,
        **{f"{env_name(f)}={getattr(settings, f)}": True for f in given_pic_settings(settings)},
    }
    why = (
        f"the {loaded.config.architecture} model runs on transformers' modeling code "
        f"(MISTRALRS_MODEL_IMPL; {loaded.implementation_why}), which has neither our "
        "projections' adapters nor PIC's rotations and probes"
    )
    _refuse(asked, why)


def _refuse_for_kv_groups(loaded: LoadedModel, settings: BackendSettings) -> None:
    """What a model whose KV layers differ in shape or are shared (Gemma 4) cannot run
    with: what sees the pool as one shape, or a layer's K and V beside it."""
    config = loaded.config
    if config.uniform_kv:
        return
    if 1 in config.kv_planes:
        _refuse_for_latent(loaded, settings)
        return
    asked = {
        f"{env_name('kv_cache_compression')}={settings.kv_cache_compression}": (
            get_compressor(settings.kv_cache_compression) is not None
        ),
        "layer mapping (MISTRALRS_DEVICE_LAYERS)": loaded.model.model.layer_spans is not None,
    }
    why = (
        f"the {config.architecture} model's KV layers differ in shape ({_shapes(config)}) "
        "or are read by later layers, which this does not handle yet"
    )
    _refuse(asked, why)


def _refuse_for_chunked_attention(loaded: LoadedModel, settings: BackendSettings) -> None:
    """What a model whose layers attend within chunks of absolute positions (Llama 4)
    cannot run with: a compressed cache (its kernels have no chunks) and PIC (a block
    computed at other positions falls into other chunks)."""
    config = loaded.config
    if not config.chunked_attention:
        return
    asked = {
        f"{env_name('kv_cache_compression')}={settings.kv_cache_compression}": (
            get_compressor(settings.kv_cache_compression) is not None
        ),
    }
    asked |= {f"{env_name(f)}={getattr(settings, f)}": True for f in given_pic_settings(settings)}
    why = (
        f"the {config.architecture} model attends within chunks of absolute positions, "
        "which compressed caches do not attend in, and which a PIC block computed at other "
        "positions would cross"
    )
    _refuse(asked, why)


def _refuse_for_latent(loaded: LoadedModel, settings: BackendSettings) -> None:
    """What a model whose KV layers keep one latent per token (DeepSeek's multi-head latent
    attention) cannot run with: what takes K and V per head from the pool."""
    asked = {
        f"{env_name('kv_cache_compression')}={settings.kv_cache_compression}": (
            get_compressor(settings.kv_cache_compression) is not None
        ),
        f"{env_name('paged_cache_type')}=f8e4m3": settings.paged_cache_type == "f8e4m3",
        "layer mapping (MISTRALRS_DEVICE_LAYERS)": loaded.model.model.layer_spans is not None,
        "tensor parallelism": loaded.model.tp is not None,
    }
    why = (
        f"the {loaded.config.architecture} model's attention keeps one latent per token "
        "(multi-head latent attention), not K and V per head, and this takes those"
    )
    _refuse(asked, why)


def _may_speculate(loaded: LoadedModel, settings: BackendSettings) -> bool:
    """Whether speculation may run, before the cache says whether it can drop tokens."""
    return _choice(loaded, settings, None).method is not None


def _resolved_speculation(
    loaded: LoadedModel, settings: BackendSettings, info: CacheInfo
) -> tuple[BackendSettings, SpeculationChoice]:
    """``settings`` with MISTRALRS_SPECULATIVE_METHOD resolved (auto made the method that
    runs, `settings.speculation`), and the choice; said in the log. Decided once the
    target's cache is built, since whether it can drop rejected tokens is known then."""
    choice = _choice(loaded, settings, info.rolls_back)
    log.info("speculative.method", method=choice.method or "none", why=choice.why)
    return settings.model_copy(update={"speculative_method": choice.method or "none"}), choice


def _choice(
    loaded: LoadedModel, settings: BackendSettings, rolls_back: bool | None
) -> SpeculationChoice:
    return choose_speculation(
        settings,
        tensor_parallel=loaded.model.tp is not None,
        state_layers=bool(loaded.config.num_state_layers),
        cache_rolls_back=rolls_back,
    )


def _lookup_runner(
    loaded: LoadedModel, settings: BackendSettings, cache: CacheManager, max_len: int
) -> NgramRunner:
    """The runner that proposes without a draft model: n-gram lookup in each sequence's
    own tokens, and for suffix, in the store the requests share too."""
    sizes = (settings.speculative_ngram_min, settings.speculative_ngram_max)
    model, device, vocab = loaded.model, loaded.device, loaded.config.vocab_size
    gamma = settings.speculative_gamma
    log.info(
        f"speculative.{settings.speculative}", gamma=gamma, ngram_min=sizes[0], ngram_max=sizes[1]
    )
    if settings.speculative == "suffix":
        budget = settings.speculative_suffix_tokens
        return SuffixRunner(model, cache, device, gamma, sizes, vocab, max_len, budget)
    return NgramRunner(model, cache, device, gamma, sizes, vocab, max_len)


def _adapter_registry(
    loaded: LoadedModel, settings: BackendSettings, draft: LoadedModel | None
) -> tuple[AdapterRegistry | None, str | None]:
    """The model's LoRA adapters: those MISTRALRS_LORA_ADAPTERS names read and held (before
    the KV budget is taken from what memory is left), room for more loaded at run time;
    or, where the model takes none, why not."""
    model = loaded.model
    # Speculation takes adapters: its verifying pass runs each sequence's own, and a
    # draft model's tokens are only proposals (it runs the base). Under tensor
    # parallelism the adapters' shares are tested without speculation only. (Auto without
    # a draft is None here, and resolves to none under tensor parallelism for this reason:
    # `settings.speculation`.)
    speculating = settings.speculative in ("ngram", "suffix") or draft is not None
    refused = {
        "speculative decoding under tensor parallelism": speculating and model.tp is not None
    }
    named = lora_adapter_list(settings.lora_adapters)
    if loaded.implementation == "transformers":  # refused at load (`_refuse_for_transformers_code`)
        return None, "the model runs on transformers' modeling code, which has no adapters here"
    if loaded.config.folded_multipliers is not None:
        why = (
            f"the {loaded.config.architecture} model's multipliers are folded into its "
            "projections' weights, and an adapter's product beside them would miss them"
        )
        _refuse({"MISTRALRS_LORA_ADAPTERS": bool(named)}, why)
        return None, why
    why = "LoRA adapters run without speculative decoding under tensor parallelism, so far"
    if any(refused.values()):
        _refuse(
            {f"MISTRALRS_LORA_ADAPTERS with {k}": v and bool(named) for k, v in refused.items()},
            why,
        )
        on = ", ".join(k for k, v in refused.items() if v)
        return None, f"{why}: this model runs with {on}"
    registry = AdapterRegistry(model, read_adapter, settings.lora_max_loaded)
    for name, path in named:
        registry.add(read_adapter(name, path, model), ())
    return registry, None


def _refuse(asked: dict[str, bool], why: str) -> None:
    """The first setting ``asked`` for (by name) that the model cannot run with, refused."""
    for what, is_set in asked.items():
        if is_set:
            raise SettingsError(f"{what}: {why}; leave it unset for this model")


def _shapes(config: ModelConfig) -> str:
    return ", ".join(f"{h} KV heads x {d}" for h, d in sorted(set(config.kv_shapes)))


def _prefix_caching_for(
    config: ModelConfig, settings: BackendSettings, paged: bool
) -> BackendSettings:
    """``settings``, without prefix caching for a model with state layers on the contiguous
    cache: a hit needs each state at its end, kept only at the paged pool's block
    boundaries (`engine.state_cache`); said in the log."""
    if not (config.num_state_layers and settings.prefix_cache_enabled) or paged:
        return settings
    log.warning(
        "prefix_cache.off",
        architecture=config.architecture,
        reason="the model has state layers, whose snapshots for prefix hits need paged "
        "attention (MISTRALRS_PAGED_ATTN)",
    )
    return settings.model_copy(update={"prefix_cache_n": 0})


def _cache(
    loaded: LoadedModel,
    settings: BackendSettings,
    decisions: PlatformDecisions,
    budget: KvBudget,
    role: str,
    trail_rows: int,
    slots: int = MAX_NUM_SEQS,
) -> tuple[CacheManager, int, CacheInfo]:
    """One model's cache manager, the longest sequence it can hold, and what it is (with
    the state group beside the KV cache where the model has state layers: at most
    ``slots`` of them, fewer where the budget says so)."""
    cache, max_len, info, plan = _kv_cache(
        loaded, settings, decisions, budget, role, trail_rows, slots
    )
    config = loaded.config
    latent = 1 in config.kv_planes
    info = dataclasses.replace(
        info,
        uniform_kv=config.uniform_kv,
        latent_kv=latent,
        chunked_attention=config.chunked_attention,
    )
    if plan is None:
        return cache, max_len, info
    paged = cache if isinstance(cache, PagedCacheManager) else None
    states = StateCache(
        loaded.config,
        loaded.dtype,
        loaded.device,
        piece=paged.block_size if paged else RULE_CHUNK,
        max_snapshots=plan.snapshots,
        slots=plan.slots,
    )
    states.trail_rows = trail_rows
    info = dataclasses.replace(
        info,
        state_bytes_per_seq=plan.bytes_per_seq,
        state_copies_per_slot=plan.copies_per_slot,
        state_slots=plan.slots,
        state_snapshots=plan.snapshots,
        state_bytes=plan.nbytes,
    )
    log.info(
        "state_cache.plan",
        model=role,
        slots=plan.slots,
        snapshots=plan.snapshots,
        bytes_per_seq=plan.bytes_per_seq,
        copies_per_slot=plan.copies_per_slot,
        mb=round(plan.nbytes / MIB, 2),
    )
    return StatefulCacheManager(cache, states, paged), max_len, info


def _asked_states(
    loaded: LoadedModel, settings: BackendSettings, paged: bool, trail_rows: int, slots: int
) -> StatePlan | None:
    """The most a model's state group may hold: ``slots`` slots, and on the paged pool
    with prefix caching the MISTRALRS_PREFIX_CACHE_N snapshots; None without state layers."""
    config = loaded.config
    if not config.num_state_layers:
        return None
    snapshots = settings.prefix_cache_n if paged and settings.prefix_cache_enabled else 0
    return StatePlan(
        state_bytes_per_seq(state_shapes(config), loaded.dtype),
        copies_per_slot(snapshots > 0, trail_rows),
        slots,
        snapshots,
    )


def _kv_cache(
    loaded: LoadedModel,
    settings: BackendSettings,
    decisions: PlatformDecisions,
    budget: KvBudget,
    role: str,
    trail_rows: int,
    slots: int,
) -> tuple[CacheManager, int, CacheInfo, StatePlan | None]:
    config = loaded.config
    compressor = get_compressor(settings.kv_cache_compression)
    if compressor is not None:
        _refuse_sinks(loaded, compressor)
    paged = loaded.kernels.pages(compressor)
    fp8_pool = paged and decisions.kv_cache_dtype == "float8_e4m3fn"
    calibrated = fp8_pool or (compressor is not None and compressor.calibrated)
    stats = kv_statistics(loaded, role) if calibrated else None
    geometry = _geometry(loaded, stats)
    states = _asked_states(loaded, settings, paged, trail_rows, slots)
    if not paged:
        if states is not None:
            check_states_fit(states, available_memory(loaded.device))
        cache, info = _contiguous_cache(
            loaded, settings, compressor, geometry, role, _cache_dtype(loaded, decisions)
        )
        return cache, config.max_position_embeddings, info, states
    pool, info, states = _paged_cache(
        loaded, settings, decisions, budget, role, compressor, geometry, states
    )
    return pool, min(config.max_position_embeddings, pool.capacity_tokens), info, states


def _geometry(loaded: LoadedModel, stats: KVStatistics | None) -> KVGeometry:
    c = loaded.config
    return KVGeometry(
        c.num_kv_layers,
        c.num_kv_heads,
        c.head_dim,
        loaded.dtype,
        loaded.device,
        kv_means=None if stats is None else stats.means,
        kv_absmax=None if stats is None else stats.absmax,
        native=loaded.native,
    )


def _cache_dtype(loaded: LoadedModel, decisions: PlatformDecisions) -> torch.dtype:
    """How K and V are stored: the platform's choice, or the model's dtype (auto)."""
    if decisions.kv_cache_dtype == "auto":
        return loaded.dtype
    return getattr(torch, decisions.kv_cache_dtype)


def _contiguous_cache(
    loaded: LoadedModel,
    settings: BackendSettings,
    compressor: Compressor | None,
    geometry: KVGeometry,
    role: str,
    cache_dtype: torch.dtype,
) -> tuple[ContiguousCacheManager, CacheInfo]:
    if compressor is None:
        new_store = plain_stores(
            loaded.config,
            cache_dtype,
            loaded.device,
            loaded.native,
            settings.batch_invariant,
        )
        per_token = kv_bytes_per_token(loaded.config, cache_dtype)
        info = CacheInfo("contiguous", None, None, None, cache_dtype, per_token, None, None)
        return ContiguousCacheManager(new_store, settings.prefix_cache_n), info

    def new_store() -> SequenceStore:
        return ProtocolKV(_made_cache(compressor, geometry), compressor.name)

    prefix_cache_n = settings.prefix_cache_n
    rolls_back = isinstance(new_store().cache, ResizableKVCache)  # type: ignore[attr-defined]
    if not rolls_back:
        _refuse_draft_without_truncate(settings, compressor)
        if prefix_cache_n:
            log.warning(
                "kv_compression.prefix_cache_off",
                method=compressor.name,
                reason="its caches cannot copy a prefix (no truncate/copy_prefix)",
            )
        prefix_cache_n = 0
    log.info("kv_compression.enabled", model=role, method=compressor.name, mode="non-paged")
    per_token = compressor.bytes_per_token(geometry)  # None: a plugin's own records
    dtype = None if per_token is None else torch.uint8
    info = CacheInfo("contiguous", None, None, None, dtype, per_token, compressor.name, None)
    info = dataclasses.replace(info, rolls_back=rolls_back)
    return ContiguousCacheManager(new_store, prefix_cache_n), info


def _made_cache(compressor: Compressor, geometry: KVGeometry) -> CompressedKVCache:
    """A sequence's cache from the method's factory; a factory that fails, or returns
    something other than a `CompressedKVCache`, is an error naming the method."""
    try:
        cache = compressor.make_cache(geometry)
    except Exception as exc:
        raise SettingsError(
            f"{env_name('kv_cache_compression')}={compressor.name}: the method's make_cache "
            f"failed ({type(exc).__name__}: {exc}); fix or remove the method"
        ) from exc
    if not isinstance(cache, CompressedKVCache):
        raise SettingsError(
            f"{env_name('kv_cache_compression')}={compressor.name}: the method's make_cache "
            f"returned a {type(cache).__name__}, not a CompressedKVCache"
        )
    return cache


def _refuse_sinks(loaded: LoadedModel, compressor: Compressor) -> None:
    """A compressed cache attends through the protocol's own softmax, which has no place
    for a sink's share of the denominator: such a model would attend wrongly, so it is
    refused rather than run."""
    attention = [a for layer in loaded.config.layers if (a := layer.attention) is not None]
    if any(a.sinks for a in attention):
        raise SettingsError(
            f"{env_name('kv_cache_compression')}={compressor.name} cannot run this "
            f"{loaded.config.architecture} model: its attention has sinks (a learned logit "
            "per head in the softmax), which compressed caches do not take; use no compression"
        )


def _refuse_draft_without_truncate(settings: BackendSettings, compressor: Compressor) -> None:
    """Speculation asked for (a method, or a draft) on caches that cannot drop tokens,
    refused; auto without a draft resolves to none here (`settings.speculation`)."""
    if settings.speculative is not None:
        raise SettingsError(
            f"{env_name('kv_cache_compression')}={compressor.name} cannot be combined with "
            f"speculative decoding ({settings.speculative}): its caches cannot drop rejected "
            "draft tokens (no truncate); use a built-in method or no speculation"
        )


def _paged_cache(
    loaded: LoadedModel,
    settings: BackendSettings,
    decisions: PlatformDecisions,
    budget: KvBudget,
    role: str,
    compressor: Compressor | None,
    geometry: KVGeometry,
    states: StatePlan | None,
) -> tuple[PagedCacheManager, CacheInfo, StatePlan | None]:
    cache_dtype = _cache_dtype(loaded, decisions)
    pair = compressor.make_codecs(geometry) if compressor and compressor.make_codecs else None
    if pair is None:
        per_token = kv_bytes_per_token(loaded.config, cache_dtype)
    else:
        per_token = pair.bytes_per_token(loaded.config.num_kv_layers, loaded.config.num_kv_heads)
    window = _window_plan(loaded, settings, role, cache_dtype, coded=pair is not None)

    def planned(window: WindowPlan | None) -> KVCachePlan:
        return plan_kv_cache(
            loaded.config,
            budget,
            settings.paged_attn_block_size,
            per_token,
            _available(loaded) - _adapter_room(loaded, settings),
            states,
            window,
        )

    plan = planned(window)
    if plan.window_blocks is not None and plan.window_blocks >= plan.num_blocks:
        log.info("kv_cache.window_pool_off", model=role, reason="it would be no smaller")
        plan = planned(None)
    log.info(
        "kv_cache.budget",
        model=role,
        blocks=plan.num_blocks,
        block_size=plan.block_size,
        tokens=plan.num_tokens,
        window_blocks=plan.window_blocks,
        mb=round(plan.nbytes / MIB, 1),
        cache_dtype=compressor.name if compressor else str(cache_dtype).removeprefix("torch."),
        budget=settings.kv_budget.kind,
    )
    cache: PagedKVStorage
    try:
        if pair is None:
            cache = PagedKVCache(
                loaded.config,
                plan.num_blocks,
                plan.block_size,
                cache_dtype,
                loaded.device,
                kv_absmax=geometry.kv_absmax,
                layer_spans=loaded.model.model.layer_spans,
                window_blocks=plan.window_blocks,
            )
        else:
            cache = CodedPagedKVCache(
                loaded.config, plan.num_blocks, plan.block_size, pair, loaded.device
            )
            log.info("kv_compression.enabled", model=role, method=compressor.name, mode="paged")
    except (RuntimeError, MemoryError) as exc:  # an allocator's refusal, not a crash
        raise _allocation_failed(plan, settings, exc) from None
    blocks = BlockManager(plan.num_blocks, plan.block_size, settings.prefix_cache_enabled)
    slots = None
    if plan.window_blocks is not None and window is not None:
        slots = WindowSlots(plan.window_blocks, plan.num_blocks, window.window, plan.block_size)
    info = CacheInfo(
        "paged",
        plan.num_tokens,
        plan.block_size,
        plan.num_blocks,
        cache_dtype if pair is None else torch.uint8,
        per_token,
        compressor.name if compressor else None,
        _kernels_name(loaded.kernels.attention, coded=pair is not None),
        window_blocks=plan.window_blocks,
        # Where the pool is off only for being no smaller at this budget, a larger one
        # (the remedy a too-long prompt is told) would have it: its figures stay.
        window_bytes_per_token=window.bytes_per_token if window else None,
        window_most_tokens=window.most_blocks(plan.block_size) * plan.block_size
        if window
        else None,
    )
    # Moving a block's keys happens in this process's pool alone: not under tensor
    # parallelism, whose other ranks hold pools of their own; and layer by layer of one
    # shape (PIC refuses KV groups).
    shift = None
    if isinstance(cache, PagedKVCache) and loaded.model.tp is None and loaded.config.uniform_kv:
        shift = KeyShift(loaded.config, cache.move_blocks)
    manager = PagedCacheManager(cache, blocks, loaded.kernels.attention, shift, slots)
    return manager, info, plan.states


def _window_plan(
    loaded: LoadedModel, settings: BackendSettings, role: str, dtype: torch.dtype, coded: bool
) -> WindowPlan | None:
    """The sliding-window layers' own pool, where the model has such layers and nothing
    asked for needs every layer to hold the whole context; else None, said in the log."""
    config = loaded.config
    windows = kv_windows(config)
    sliding = {w for w in windows if w is not None}
    if not sliding:
        return None
    why = _window_pool_refusal(loaded, settings, role, coded, sliding, windows)
    if why is not None:
        log.info("kv_cache.window_pool_off", model=role, reason=why)
        return None
    per_layer = [2 * heads * dim * dtype.itemsize for heads, dim in config.kv_shapes]
    windowed = sum(b for b, w in zip(per_layer, windows, strict=True) if w is not None)
    (window,) = sliding
    return WindowPlan(windowed, window, WINDOW_SEQS, WINDOW_CHUNK_TOKENS)


def _window_pool_refusal(
    loaded: LoadedModel,
    settings: BackendSettings,
    role: str,
    coded: bool,
    sliding: set[int],
    windows: list[int | None],
) -> str | None:
    """Why the sliding-window layers cannot have a pool of their own here, or None."""
    config = loaded.config
    reasons = {
        "its sliding layers have several windows": len(sliding) > 1,
        "every layer slides (nothing to size the block table by)": None not in windows,
        "its layers keep one latent per token (the windowed pool is sized for K and V)": (
            1 in config.kv_planes
        ),
        "a layer reads a sliding layer's K and V further back than its window": (
            _reads_past_window(config, windows)
        ),
        "it has state layers": bool(config.num_state_layers),
        "its KV cache is compressed": coded,
        "layer mapping (MISTRALRS_DEVICE_LAYERS) splits the pool": (
            loaded.model.model.layer_spans is not None
        ),
        "tensor parallelism shards the pool": loaded.model.tp is not None,
        "PIC's deviation probes read one layer's whole pool": (
            settings.pic_recompute > 0 and settings.pic_recompute_select == "deviation"
        ),
        "the KV tier (MISTRALRS_KV_TIER_DIR) stores blocks of every layer": (
            settings.kv_tier_dir is not None
        ),
        "a draft model's cache keeps its own counts of the target's tokens": role == "draft",
    }
    return next((why for why, refused in reasons.items() if refused), None)


def _reads_past_window(config: ModelConfig, windows: list[int | None]) -> bool:
    """Whether a layer attending over another's K and V (Gemma 4's shared layers) reads a
    sliding layer's further back than its window: the windowed pool, which keeps each
    block only while that window reads it, would have let those blocks go."""
    for spec in config.layers:
        attention = spec.attention
        if attention is None or not attention.spec.shared_kv:
            continue
        source = windows[attention.spec.layer]
        reach = attention.spec.scoring.window
        if source is not None and (reach is None or reach > source):
            return True
    return False


def _adapter_room(loaded: LoadedModel, settings: BackendSettings) -> int:
    """Memory kept beside the KV cache for LoRA adapters held later, up to
    MISTRALRS_LORA_MAX_LOADED, each the size of the largest held at start (those are held
    already: free memory counts them)."""
    held = loaded.model.adapters
    if not settings.lora_max_loaded or held is None or not len(held):
        return 0
    largest = max(adapter.nbytes for _, adapter in held.by_name.values())
    return max(settings.lora_max_loaded - len(held), 0) * largest


def _available(loaded: LoadedModel) -> int:
    """What the pool may take: the device's free memory, or under layer mapping what the
    tightest device allows for the whole pool, each holding its layers' share."""
    devices = loaded.model.model.layer_devices
    if devices is None or len(set(devices)) == 1:
        return available_memory(loaded.device)
    return min(
        available_memory(device) * len(devices) // devices.count(device) for device in set(devices)
    )


def _kernels_name(attention: AttentionKernels, coded: bool) -> str:
    """The set a pool attends through; a compressed pool decodes its records itself, on
    the compiled CPU kernels where the set has them, else in torch."""
    if coded:
        return "cpu" if attention.native is not None else "torch"
    return attention.name


def _allocation_failed(
    plan: KVCachePlan, settings: BackendSettings, exc: BaseException
) -> PlatformError:
    budget = settings.kv_budget
    variable = env_name(f"paged_attn_{budget.kind}")
    return PlatformError(
        f"allocating the KV cache for {variable}={budget.value:g} ({plan.nbytes / MIB:,.0f} "
        f"MB, {plan.num_tokens:,} tokens) failed: {str(exc).splitlines()[0]}; lower the budget"
    )


def _log_prefix_caching(settings: BackendSettings, paged: bool) -> None:
    if not settings.prefix_cache_enabled:
        log.info("prefix_cache.disabled", reason="MISTRALRS_PREFIX_CACHE_N is 0 or false")
    elif paged:
        log.info("prefix_cache.enabled", granularity="block-level, paged attention")
    else:
        log.info(
            "prefix_cache.enabled",
            granularity="sequence-level, non-paged attention",
            sequences=settings.prefix_cache_n,
        )
