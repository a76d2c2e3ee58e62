"""The KV tier: pool blocks kept on disk, so that reuse outlives the pool and the process.

Every block the pool registers (a full prefix block, or a PIC element's closed block) is
copied on the engine's thread and written by a writer thread to
``<dir>/<fingerprint>/<key>.kv``: a header, then the block's bytes as the pool holds them
(every layer's K and V, or a compressed pool's records). A lookup that misses the pool
asks the tier; an entry read back is checked against everything that makes it the same
block, and anything else is a miss:

- the fingerprint (`tier_fingerprint`: weights, architecture, tokenizer, cache dtype and
  codec, block size, positions' scheme), also the directory's name;
- the key (the pool's digest) and the block's tokens, compared as the pool compares them;
- the payload's length and CRC-32.

An entry is written under a temporary name and renamed into place, so a reader sees a
whole entry or none: several processes share a directory (each its own pool), and a
writer killed mid-write leaves only a temporary file, which no reader opens. A read
touches the entry's modification time; once the directory passes its byte budget, the
entries least recently written or read are removed first. A disk that is full or cannot
be written turns the tier off, with one warning; nothing the tier does fails a request.

`KvTier.events`, where set, is told (on the writer's thread) of each entry this process
writes and each entry it removes, as the `block_manager.TIER` medium.
"""

import contextlib
import errno
import os
import queue
import secrets
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG

import torch

from ..log import get_logger
from ..signals import leave_interrupts_to_the_main_thread
from .block_manager import TIER, BlockEvents

log = get_logger()

MAGIC = b"SPNLKV2\n"
_HEAD = struct.Struct("<8s32sQqI")  # magic, fingerprint, key, position (-1: none), tokens
_TAIL = struct.Struct("<QI")  # payload bytes, CRC-32
SUFFIX = ".kv"
WRITE_QUEUE = 256  # blocks waiting for the writer; more are dropped (counted), not waited on
STALE_TEMP_S = 600.0  # a temporary file this old was left by a writer that died
EVICT_TO = 0.9  # of the budget, once past it
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_OFF_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}


@dataclass
class TierCounters:
    hits: int = 0  # blocks read back into the pool
    misses: int = 0  # lookups with no entry
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0  # entries removed to stay within the budget
    dropped: int = 0  # blocks not written: the writer was behind
    rejected: dict[str, int] = field(default_factory=dict)  # entries refused, by reason


@dataclass(frozen=True)
class TierStats:
    """The tier's counters since the engine was built, and what it is doing now."""

    enabled: bool  # False once a full or read-only disk turned it off
    hits: int
    misses: int
    bytes_read: int
    bytes_written: int
    evictions: int
    dropped: int
    rejected: dict[str, int]
    write_queue: int
    entries: int  # on disk, as far as this process knows


def tier_stats(pool_tier: object) -> TierStats | None:
    """The stats of a pool's tier (`pool_tier.PoolTier`), None where it has none."""
    tier = getattr(pool_tier, "tier", None)
    return tier.stats() if isinstance(tier, KvTier) else None


@dataclass(frozen=True)
class TierEntry:
    """One block as the tier stores it."""

    key: int  # the pool's digest
    tokens: tuple[int, ...]
    position: int | None  # a PIC block's first position
    payload: torch.Tensor  # uint8, the pool's bytes for the block
    buffer: bytearray | None = None  # the memory a read payload views (to read into again)
    parent: int | None = None  # the key its key chains, where known (told to events only)


class KvTier:
    def __init__(self, directory: Path, budget_bytes: int, fingerprint: bytes) -> None:
        self.root = Path(directory)
        self.dir = self.root / fingerprint.hex()[:32]
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint
        self.counters = TierCounters()
        self.enabled = True
        self._lock = threading.Lock()
        self.written: set[int] = set()  # keys on disk, as far as this process knows
        self.events: BlockEvents | None = None  # told of entries written and removed
        self._queue: queue.Queue[TierEntry | None] = queue.Queue(WRITE_QUEUE)
        self._used = 0  # bytes on disk, from the last scan plus what was written since
        self.dir.mkdir(parents=True, exist_ok=True)
        self._scan(remove_stale=True)
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier", daemon=True)
        self._writer.start()

    # ---- the engine's side ---------------------------------------------------------------

    def offer(self, entry: TierEntry) -> None:
        """Queue a block for writing; never blocks (a full queue drops it)."""
        if not self.enabled or entry.key in self.written:
            return
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            with self._lock:
                self.counters.dropped += 1

    def fetch(
        self, key: int, tokens: tuple[int, ...], nbytes: int, buffer: bytearray | None = None
    ) -> TierEntry | None:
        """The entry for ``key`` holding exactly ``tokens`` and ``nbytes`` of payload, or
        None (no entry, or one refused: counted by reason, and removed). Only a regular
        file of exactly that entry's size is read (a FIFO, a device, a link or a file of
        another size is refused before anything is allocated for it). ``buffer``: memory
        to read into where it is that size (a fresh one's pages are faulted in as it is
        first written: a third of a read's time)."""
        if not self.enabled:
            return None
        path = self._path(key)
        expected = self.entry_size(len(tokens), nbytes)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
        except FileNotFoundError:
            self._count(misses=1)
            return None
        except OSError as exc:
            self._reject("unreadable", path, exc)
            return None
        try:
            stat = os.fstat(fd)
            if not S_ISREG(stat.st_mode) or stat.st_size != expected:
                reason = "size" if S_ISREG(stat.st_mode) else "not_a_file"
                self._reject(reason, path)
                return None
            data = buffer if buffer is not None and len(buffer) == expected else bytearray(expected)
            got = _read_into(fd, data)  # the payload's tensor shares this memory
        except OSError as exc:
            self._reject("unreadable", path, exc)
            return None
        finally:
            os.close(fd)
        entry, reason = self._parse(data, got, key, tokens, nbytes)
        if entry is None:
            self._reject(reason, path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # read: the last to go
        self.written.add(key)
        self._count(hits=1, bytes_read=got)
        return entry

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def stats(self) -> TierStats:
        with self._lock:
            c = self.counters
            counts = (c.hits, c.misses, c.bytes_read, c.bytes_written, c.evictions, c.dropped)
            rejected = dict(c.rejected)
        return TierStats(self.enabled, *counts, rejected, self.queue_depth, len(self.written))

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    # ---- entries -------------------------------------------------------------------------

    @staticmethod
    def entry_size(tokens: int, nbytes: int) -> int:
        """The bytes of an entry of ``tokens`` tokens and ``nbytes`` of payload."""
        return _HEAD.size + 4 * tokens + _TAIL.size + nbytes

    def _path(self, key: int) -> Path:
        return self.dir / f"{key:016x}{SUFFIX}"

    def encode(self, entry: TierEntry) -> tuple[bytes, memoryview]:
        """The entry's header and its payload's bytes."""
        position = -1 if entry.position is None else entry.position
        head = _HEAD.pack(MAGIC, self.fingerprint, entry.key, position, len(entry.tokens))
        tokens = struct.pack(f"<{len(entry.tokens)}i", *entry.tokens)
        payload = memoryview(entry.payload.numpy()).cast("B")
        checksum = zlib.crc32(payload, zlib.crc32(head + tokens))  # the header's fields too
        return head + tokens + _TAIL.pack(payload.nbytes, checksum), payload

    def _parse(
        self, data: bytearray, got: int, key: int, tokens: tuple[int, ...], nbytes: int
    ) -> tuple[TierEntry | None, str]:
        """The entry in ``data[:got]``, else None and why."""
        if got < _HEAD.size:
            return None, "truncated"
        magic, fingerprint, stored_key, position, count = _HEAD.unpack_from(data)
        if magic != MAGIC:
            return None, "format"
        if fingerprint != self.fingerprint:
            return None, "fingerprint"
        if stored_key != key or count != len(tokens):
            return None, "key"
        tail_at = _HEAD.size + 4 * count
        if got < tail_at + _TAIL.size:
            return None, "truncated"
        if struct.unpack_from(f"<{count}i", data, _HEAD.size) != tokens:
            return None, "key"
        length, checksum = _TAIL.unpack_from(data, tail_at)
        start = tail_at + _TAIL.size
        view = memoryview(data)
        payload = view[start:got]
        if len(payload) != length or length != nbytes:
            return None, "truncated" if len(payload) < length else "size"
        if zlib.crc32(payload, zlib.crc32(view[:tail_at])) != checksum:
            return None, "checksum"
        tensor = torch.frombuffer(data, dtype=torch.uint8, offset=start, count=length)
        entry = TierEntry(key, tokens, None if position < 0 else position, tensor, data)
        return entry, ""

    # ---- the writer's side ---------------------------------------------------------------

    def _write_loop(self) -> None:
        leave_interrupts_to_the_main_thread()
        while True:
            entry = self._queue.get()
            try:
                if entry is None:
                    return
                if self.enabled:
                    self._write(entry)
            except Exception as exc:  # the tier is best effort: a failure turns it off
                self._turn_off(f"{type(exc).__name__}: {exc}")
            finally:
                self._queue.task_done()

    def _write(self, entry: TierEntry) -> None:
        path = self._path(entry.key)
        if entry.key in self.written or path.exists():  # another process wrote it first
            if entry.key not in self.written:
                self.written.add(entry.key)
                self._stored(entry)  # on disk here all the same
            return
        head, payload = self.encode(entry)
        size = len(head) + payload.nbytes
        if size > self.budget_bytes:
            self._reject("over_budget", path)
            return
        temp = self.dir / f".{entry.key:016x}.{secrets.token_hex(8)}.tmp"
        try:
            # Created here, never an existing file or a link someone placed under the name.
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as file:
                file.write(head)
                file.write(payload)
                file.flush()
                os.fsync(file.fileno())  # whole on disk before it has its name
            os.replace(temp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temp.unlink()
            if exc.errno in _OFF_ERRNOS:
                self._turn_off(f"{path.parent}: {exc.strerror}")
                return
            raise
        self.written.add(entry.key)
        self._count(bytes_written=size)
        self._stored(entry)
        self._used += size
        if self._used > self.budget_bytes:
            self._scan()

    def _scan(self, remove_stale: bool = False) -> None:
        """Measure the directory; past the budget, remove the least recently used entries
        down to `EVICT_TO` of it, so that the writes that follow do not each rescan a
        full directory (and, at start, temporary files a dead writer left)."""
        entries, now = [], time.time()
        with os.scandir(self.dir) as listing:
            for item in listing:
                with contextlib.suppress(OSError):
                    stat = item.stat()
                    if item.name.endswith(".tmp"):
                        if remove_stale and now - stat.st_mtime > STALE_TEMP_S:
                            os.unlink(item.path)
                        continue
                    if item.name.endswith(SUFFIX):
                        entries.append((stat.st_mtime, stat.st_size, item.path, item.name))
        entries.sort()
        used = sum(size for _, size, _, _ in entries)
        known = {int(name[: -len(SUFFIX)], 16) for *_, name in entries if _is_key(name)}
        target = self.budget_bytes if used <= self.budget_bytes else self.budget_bytes * EVICT_TO
        for _, size, path, name in entries:
            if used <= target:
                break
            with contextlib.suppress(OSError):
                os.unlink(path)
                used -= size
                self._count(evictions=1)
                if _is_key(name):
                    key = int(name[: -len(SUFFIX)], 16)
                    known.discard(key)
                    self._removed(key)
        self.written, self._used = known, used

    # ---- bookkeeping ---------------------------------------------------------------------

    def _count(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self.counters, name, getattr(self.counters, name) + amount)

    def _reject(self, reason: str, path: Path, exc: OSError | None = None) -> None:
        """Count a refused entry; one that is there and is not this block is removed (and
        its key forgotten), so that the block is written again."""
        with self._lock:
            self.counters.rejected[reason] = self.counters.rejected.get(reason, 0) + 1
        log.debug("kv_tier.rejected", reason=reason, entry=path.name, error=exc and str(exc))
        if reason not in ("unreadable", "over_budget") and path.parent == self.dir:
            with contextlib.suppress(OSError, ValueError):
                os.unlink(path)
                key = int(path.name[: -len(SUFFIX)], 16)
                self.written.discard(key)
                self._removed(key)

    def _stored(self, entry: TierEntry) -> None:
        if self.events is not None:
            pic = entry.position is not None
            self.events.stored(entry.key, entry.parent, entry.tokens, pic, TIER)

    def _removed(self, key: int) -> None:
        if self.events is not None:
            self.events.removed(key, TIER)

    def _turn_off(self, why: str) -> None:
        if self.enabled:
            self.enabled = False
            log.warning("kv_tier.disabled", reason=why, directory=str(self.dir))


def _is_key(name: str) -> bool:
    stem = name[: -len(SUFFIX)]
    return len(stem) == 16 and all(c in "0123456789abcdef" for c in stem)


def _read_into(fd: int, data: bytearray) -> int:
    """Bytes read into ``data`` from ``fd``, until it is full or the file ends."""
    view, got = memoryview(data), 0
    while got < len(data):
        count = os.readv(fd, [view[got:]])
        if count == 0:
            break
        got += count
    return got
