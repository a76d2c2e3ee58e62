"""The block pool's side of the KV tier (`kv_tier`): the blocks it registers written out,
and the blocks a lookup misses read back in before the lookup is made."""

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
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


READ_AHEAD_BYTES = 256 * MIB  # blocks read ahead and not yet taken, at most
READERS = 2  # threads reading ahead: their checksums free the GIL and take both cores
SPARE_BYTES = 32 * MIB  # read buffers kept, their pages faulted in at start, for reuse


class PoolTier:
    """Reads are started when a request arrives (`read_ahead`), on a reader thread, so
    that they overlap the steps before its admission; `promote` takes what they read (or
    waits for a read under way) and reads itself what was not read ahead."""

    def __init__(self, tier: KvTier, cache: PagedKVStorage, blocks: BlockManager) -> None:
        self.tier, self.cache, self.blocks = tier, cache, blocks
        self.block_nbytes = int(cache.block_bytes(0).numel())
        self._reads: OrderedDict[int, Future[TierEntry | None]] = OrderedDict()
        self._most_reads = max(1, READ_AHEAD_BYTES // self.block_nbytes)
        self._reader = ThreadPoolExecutor(READERS, thread_name_prefix="kv-tier-read")
        self._spares: list[bytearray] = []  # read buffers to reuse (`KvTier.fetch`)
        self._spares_lock = threading.Lock()
        self._reader.submit(self._fault_in_spares)

    def _fault_in_spares(self) -> None:
        """Buffers for a first request's reads, written once so their pages are there."""
        size = self.tier.entry_size(self.blocks.block_size, self.block_nbytes)
        for _ in range(max(1, SPARE_BYTES // size)):
            buffer = bytearray(size)
            buffer[::4096] = b"\1" * len(buffer[::4096])
            self._give_back(buffer)

    def _give_back(self, buffer: bytearray | None) -> None:
        with self._spares_lock:
            if buffer is not None and len(self._spares) * len(buffer) < SPARE_BYTES:
                self._spares.append(buffer)

    def _spare(self) -> bytearray | None:
        with self._spares_lock:
            return self._spares.pop() if self._spares else None

    def read_ahead(self, wanted: list[tuple[int, tuple[int, ...]]]) -> None:
        """Start reading the blocks of ``wanted`` the pool lacks, at most
        `READ_AHEAD_BYTES` of them waiting (a prefix's blocks past one the tier lacks are
        read too, and left: the readers do not wait for each other)."""
        if not self.tier.enabled:
            return
        keys = [
            (digest, tokens)
            for digest, tokens in wanted
            if not self._reading(digest) and self.blocks.lookup(digest, tokens) is None
        ]
        while self._reads and len(self._reads) + len(keys) > self._most_reads:
            self._reads.popitem(last=False)  # the oldest, whose request never came in
        keys = keys[: self._most_reads]
        if not keys:
            return
        for digest, tokens in keys:
            future: Future[TierEntry | None] = Future()
            self._reads[digest] = future
            self._reader.submit(self._read, digest, tokens, future)

    def _reading(self, digest: int) -> bool:
        """Whether a read of the block is under way or has found it (a read that found
        nothing is done again: another process may have written it since)."""
        future = self._reads.get(digest)
        return future is not None and (not future.done() or future.result() is not None)

    def _read(self, digest: int, tokens: tuple[int, ...], future: Future) -> None:
        buffer = self._spare()
        try:
            entry = self.tier.fetch(digest, tokens, self.block_nbytes, buffer)
        except Exception:  # the tier is best effort: a failed read is a miss
            entry = None
        if entry is None or entry.buffer is not buffer:
            self._give_back(buffer)  # not read into
        future.set_result(entry)

    def _entry(self, digest: int, tokens: tuple[int, ...]) -> TierEntry | None:
        """The block's entry: read ahead (waited for, if under way), else read now."""
        future = self._reads.pop(digest, None)
        if future is not None:
            entry = future.result()
            return entry if entry is not None and entry.tokens == tokens else None
        return self.tier.fetch(digest, tokens, self.block_nbytes)

    def close(self) -> None:
        """Stop reading ahead; write what is queued."""
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._reads.clear()
        self.tier.close()

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
                    entry = self._entry(digest, tokens)
                if entry is None:
                    if prefix:
                        break
                    continue
                block_id = self.blocks.take()
                held.append(block_id)
                self.cache.load_block(block_id, entry.payload)
                self._give_back(entry.buffer)
                if self.blocks.register(block_id, digest, tokens, entry.position):
                    promoted.add(block_id)
        finally:
            for block_id in held:
                self.blocks.unshare(block_id)
            for digest, _ in wanted:  # what was read ahead for this request is taken or moot
                self._reads.pop(digest, None)
        return promoted


def attach_tier(
    loaded: LoadedModel,
    settings: BackendSettings,
    cache: CacheManager,
    info: CacheInfo,
    speculative: bool,
) -> "PoolTier | None":
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
    pool_tier = PoolTier(tier, cache.cache, cache.blocks)  # type: ignore[union-attr]
    cache.tier = pool_tier  # type: ignore[union-attr]
    log.info(
        "kv_tier.enabled",
        directory=str(tier.dir),
        budget_mb=settings.kv_tier_mb,
        entries=len(tier.written),
    )
    return pool_tier


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
