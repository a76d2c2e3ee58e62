"""The block pool's side of the KV tier (`kv_tier`): the blocks it registers written out,
and the blocks a lookup misses read back in before the lookup is made."""

import json
from pathlib import Path

from ..errors import RequestError
from ..loader.build import LoadedModel
from ..log import get_logger
from ..memory import MIB
from ..settings import BackendSettings
from .block_manager import BlockManager
from .cache import CacheInfo, CacheManager
from .kv_tier import KvTier, TierEntry
from .paged import PagedCacheManager, PagedKVStorage
from .tier_fingerprint import tier_fingerprint

log = get_logger()


class PoolTier:
    def __init__(self, tier: KvTier, cache: PagedKVStorage, blocks: BlockManager) -> None:
        self.tier, self.cache, self.blocks = tier, cache, blocks
        self.block_nbytes = int(cache.block_bytes(0).numel())

    def offer(self, block_ids: list[int]) -> None:
        """Registered blocks, copied now (the writer takes them later: by then the pool
        may have given the block to other tokens)."""
        for block_id in block_ids:
            block = self.blocks.blocks[block_id]
            if block.hash is None or block.hash in self.tier.written:
                continue
            payload = self.cache.block_bytes(block_id)
            self.tier.offer(TierEntry(block.hash, block.token_ids, block.position, payload))

    def promote(self, wanted: list[tuple[int, tuple[int, ...]]], prefix: bool) -> set[int]:
        """The blocks of ``wanted`` (digest and tokens, in order) that the pool lacks and
        the tier has, read into pool blocks and registered as cached blocks, so that the
        lookup that follows finds them: their ids. A ``prefix`` stops at the first block
        neither has (what follows it cannot be used). The blocks the pool had are held
        meanwhile, so that taking blocks for the others cannot evict them."""
        held, promoted = [], set()
        try:
            for digest, tokens in wanted:
                block_id = self.blocks.lookup(digest, tokens)
                if block_id is not None:
                    self.blocks.share(block_id)
                    held.append(block_id)
                    continue
                entry = None
                if self.blocks.num_available and self.tier.enabled:
                    entry = self.tier.fetch(digest, tokens, self.block_nbytes)
                if entry is None:
                    if prefix:
                        break
                    continue
                block_id = self.blocks.take()
                held.append(block_id)
                self.cache.load_block(block_id, entry.payload)
                if self.blocks.register(block_id, digest, tokens, entry.position):
                    promoted.add(block_id)
        finally:
            for block_id in held:
                self.blocks.unshare(block_id)
        return promoted


def attach_tier(
    loaded: LoadedModel,
    settings: BackendSettings,
    cache: CacheManager,
    info: CacheInfo,
    speculative: bool,
) -> KvTier | None:
    """The KV tier under ``cache``'s pool, in ``MISTRALRS_KV_TIER_DIR``; None, with a
    warning saying why, where it cannot be (the engine runs on without it)."""
    root = Path(settings.kv_tier_dir or "")
    reason = _unsupported(loaded, settings, cache, speculative)
    if reason is None:
        try:
            layout = cache.cache.tier_layout()  # type: ignore[union-attr]
        except ValueError as exc:
            reason = f"the pool's records cannot be shared: {exc}"
    if reason is not None:
        log.warning("kv_tier.off", reason=reason, directory=str(root))
        return None
    try:
        root.mkdir(parents=True, exist_ok=True)
        fingerprint = tier_fingerprint(
            loaded.source.path,
            loaded.config,
            _tokenizer_text(loaded),
            settings,
            info,
            layout,
            root,
        )
        tier = KvTier(root, settings.kv_tier_mb * MIB, fingerprint)
    except OSError as exc:
        log.warning("kv_tier.off", reason=f"{exc.strerror or exc}", directory=str(root))
        return None
    cache.tier = PoolTier(tier, cache.cache, cache.blocks)  # type: ignore[union-attr]
    log.info(
        "kv_tier.enabled",
        directory=str(tier.dir),
        budget_mb=settings.kv_tier_mb,
        entries=len(tier.written),
    )
    return tier


def _unsupported(
    loaded: LoadedModel, settings: BackendSettings, cache: CacheManager, speculative: bool
) -> str | None:
    if not isinstance(cache, PagedCacheManager):
        return "paged attention is off, and the tier keeps the block pool's blocks"
    if not settings.prefix_cache_enabled:
        return "prefix caching is off (MISTRALRS_PREFIX_CACHE_N=0): no block is reused"
    if speculative:
        return "a speculative draft keeps a cache of its own beside the pool"
    if loaded.model.tp is not None:
        return "under tensor parallelism each rank holds a share of every block"
    return None


def _tokenizer_text(loaded: LoadedModel) -> str:
    try:
        return loaded.tokenizer.definition()
    except RequestError:  # no fast tokenizer: its vocabulary and special tokens instead
        hf = loaded.tokenizer.hf
        return json.dumps([sorted(hf.get_vocab().items()), hf.all_special_tokens])
