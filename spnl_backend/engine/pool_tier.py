"""The block pool's side of the KV tier (`kv_tier`): the blocks it registers written out,
and the blocks a lookup misses read back in before the lookup is made."""

import json
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, TimeoutError
from dataclasses import replace
from pathlib import Path

from ..errors import RequestError
from ..loader.model import LoadedModel
from ..log import get_logger
from ..memory import MIB
from ..settings import BackendSettings
from ..signals import leave_interrupts_to_the_main_thread
from .block_manager import BlockManager
from .cache import CacheInfo, CacheManager
from .kv_tier import KvTier, TierEntry
from .paged import PagedCacheManager, PagedKVStorage
from .tier_fingerprint import tier_fingerprint

log = get_logger()


READ_AHEAD_BYTES = 256 * MIB  # blocks read ahead and not yet taken, at most
READERS = 2  # threads reading ahead: their checksums free the GIL and take both cores
SPARE_BYTES = 32 * MIB  # read buffers kept, their pages faulted in at start, for reuse
READ_WAIT_S = 10.0  # a read not done by then (a stuck disk or mount) is a miss


class PoolTier:
    """Reads are started when a request arrives (`read_ahead`), on reader threads, so
    that they overlap the steps before its admission; `promote` takes what they read,
    waiting at most `READ_WAIT_S` for a read under way. Every read happens on a reader
    thread (daemons: a read that never returns holds up neither the engine nor the
    process's exit)."""

    def __init__(self, tier: KvTier, cache: PagedKVStorage, blocks: BlockManager) -> None:
        self.tier, self.cache, self.blocks = tier, cache, blocks
        self.block_nbytes = int(cache.block_bytes(0).numel())
        self._reads: OrderedDict[int, Future[TierEntry | None]] = OrderedDict()
        self._most_reads = max(1, READ_AHEAD_BYTES // self.block_nbytes)
        self._spares: list[bytearray] = []  # read buffers to reuse (`KvTier.fetch`)
        self._spares_lock = threading.Lock()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._readers = [
            threading.Thread(target=self._read_loop, name=f"kv-tier-read-{i}", daemon=True)
            for i in range(READERS)
        ]
        for reader in self._readers:
            reader.start()
        self._tasks.put(self._fault_in_spares)

    # ---- reading ahead --------------------------------------------------------------------

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
            self._forget(next(iter(self._reads)))  # the oldest, whose request never came in
        for digest, tokens in keys[: self._most_reads]:
            self._reads[digest] = self._submit(digest, tokens)

    def _submit(self, digest: int, tokens: tuple[int, ...]) -> "Future[TierEntry | None]":
        future: Future[TierEntry | None] = Future()
        self._tasks.put(lambda: self._read(digest, tokens, future))
        return future

    def _reading(self, digest: int) -> bool:
        """Whether a read of the block is under way or has found it (a read that found
        nothing is done again: another process may have written it since)."""
        future = self._reads.get(digest)
        return future is not None and (not future.done() or future.result() is not None)

    def _forget(self, digest: int) -> None:
        """Drop a read ahead: cancelled if it has not started (a reader then skips it)."""
        future = self._reads.pop(digest, None)
        if future is not None and future.cancel() is False and future.done():
            entry = future.result()
            self._give_back(entry.buffer if entry is not None else None)

    def _read_loop(self) -> None:
        leave_interrupts_to_the_main_thread()
        while True:
            task = self._tasks.get()
            if task is None:
                return
            task()

    def _read(self, digest: int, tokens: tuple[int, ...], future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return  # dropped before it started
        buffer = self._spare()
        try:
            entry = self.tier.fetch(digest, tokens, self.block_nbytes, buffer)
        except Exception:  # the tier is best effort: a failed read is a miss
            entry = None
        if entry is None or entry.buffer is not buffer:
            self._give_back(buffer)  # not read into
        future.set_result(entry)

    def _entry(self, digest: int, tokens: tuple[int, ...]) -> TierEntry | None:
        """The block's entry: read ahead, or read now (on a reader thread either way),
        waited for at most `READ_WAIT_S`."""
        future = self._reads.pop(digest, None) or self._submit(digest, tokens)
        try:
            entry = future.result(timeout=READ_WAIT_S)
        except TimeoutError:
            future.cancel()
            return None
        return entry if entry is not None and entry.tokens == tokens else None

    # ---- spare buffers --------------------------------------------------------------------

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

    # ---- the engine's calls ---------------------------------------------------------------

    def close(self) -> None:
        """Stop reading, waiting up to `READ_WAIT_S` for a read under way; write what is
        queued. A reader left running at the interpreter's exit is ended as it takes the
        GIL back, which aborts the process if that happens inside torch's C++ frames, so
        only a read stuck longer than that (a hung mount) is left to its daemon thread."""
        for digest in list(self._reads):
            self._forget(digest)
        for _ in self._readers:
            self._tasks.put(None)
        give_up = time.monotonic() + READ_WAIT_S
        for reader in self._readers:
            reader.join(max(0.0, give_up - time.monotonic()))
        stuck = [reader.name for reader in self._readers if reader.is_alive()]
        if stuck:
            log.warning("kv_tier.reader_stuck", threads=stuck, waited_s=READ_WAIT_S)
        self.tier.close()

    def offer(self, block_ids: list[int]) -> None:
        """Registered blocks, copied now (the writer takes them later: by then the pool
        may have given the block to other tokens)."""
        for block_id in block_ids:
            block = self.blocks.blocks[block_id]
            if block.hash is None or block.hash in self.tier.written:
                continue
            payload = self.cache.block_bytes(block_id)
            entry = TierEntry(block.hash, block.token_ids, block.position, payload)
            self.tier.offer(replace(entry, parent=block.parent))  # parent: told to events

    def promote(self, wanted: list[tuple[int, tuple[int, ...]]], prefix: bool) -> set[int]:
        """The blocks of ``wanted`` (digest and tokens, in order) that the pool lacks and
        the tier has, read into pool blocks and registered as cached blocks, so that the
        lookup that follows finds them: their ids. A ``prefix`` stops at the first block
        neither has (what follows it cannot be used). Every block of ``wanted`` the pool
        has is held first, so that taking blocks for the others cannot evict it."""
        held = []
        in_pool = [self.blocks.lookup(digest, tokens) for digest, tokens in wanted]
        for block_id in in_pool:
            if block_id is not None:
                self.blocks.share(block_id)
                held.append(block_id)
        promoted: set[int] = set()
        try:
            for index, ((digest, tokens), block_id) in enumerate(zip(wanted, in_pool, strict=True)):
                if block_id is not None:
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
                # a prefix block chains the one before it; a PIC block's parent is unknown here
                parent = wanted[index - 1][0] if prefix and index else None
                if self.blocks.register(block_id, digest, tokens, entry.position, parent):
                    promoted.add(block_id)
        finally:
            for block_id in held:
                self.blocks.unshare(block_id)
            for digest, _ in wanted:  # what was read ahead for this request is taken or moot
                self._forget(digest)
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
            loaded.dtype,
            loaded.device.type,
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
