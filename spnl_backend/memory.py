"""Memory and byte arithmetic: the bytes a token's K and V take, growing a cache buffer,
how much this process may still take on its device, giving back what loading freed, and
host buffers on huge pages.

On the host what it may take is not the machine's free memory but the least of: what the kernel
reports available, what the process's cgroup (v1 or v2, as in a container) still allows,
and what its address-space and data limits (``ulimit -v``, ``ulimit -d``) leave.
"""

import ctypes
import math
import mmap
import os
import sys
from functools import cache
from pathlib import Path
from typing import Protocol

import torch

from .log import get_logger

try:
    import resource
except ImportError:  # Windows: no rlimits
    resource = None  # type: ignore[assignment]

log = get_logger()

MIB = 1 << 20
HUGE_PAGE_BYTES = 2 * MIB  # x86-64's and arm64's (4 KB granule) transparent huge page
# Host buffers from this size on (a huge page at least) are mapped on their own.
HUGE_PAGE_MIN_BYTES = HUGE_PAGE_BYTES
GROWTH_QUANTUM = 256  # tokens; a growing cache takes a multiple of this, at least doubling
_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


class KVShape(Protocol):
    """What sizes a KV cache: a `ModelConfig`, or anything with these three counts
    (``num_kv_layers``: the layers that keep K and V, `ModelConfig.num_kv_layers`). A
    `ModelConfig` also gives each layer's ``(kv_heads, head_dim)`` (``kv_shapes``), which
    may differ by layer (Gemma 4); without it every layer has the counts' shape."""

    num_kv_layers: int
    num_kv_heads: int
    head_dim: int


def kv_layer_shapes(shape: KVShape) -> tuple[tuple[int, int], ...]:
    """Each KV layer's ``(kv_heads, head_dim)``."""
    shapes = getattr(shape, "kv_shapes", None)
    if shapes is not None:
        return shapes
    return ((shape.num_kv_heads, shape.head_dim),) * shape.num_kv_layers


def kv_bytes_per_token(shape: KVShape, dtype: torch.dtype) -> int:
    """K and V of every layer for one token, in a plain cache of ``dtype``, each layer at
    its own size (a latent layer's one plane, `ModelConfig.kv_planes`): the one formula
    the budget, the paged pool, the compression methods and the benchmarks use."""
    shapes = kv_layer_shapes(shape)
    planes = getattr(shape, "kv_planes", None) or (2,) * len(shapes)
    per_layer = zip(planes, shapes, strict=True)
    return sum(count * heads * dim for count, (heads, dim) in per_layer) * dtype.itemsize


def host_tensor(shape: tuple[int, ...], dtype: torch.dtype, *, zeroed: bool = True) -> torch.Tensor:
    """A zero-filled host tensor (``zeroed=False``: one the caller overwrites whole, whose
    small allocations skip the fill). One of ``HUGE_PAGE_MIN_BYTES`` or more is an anonymous
    mapping of its own that starts on a huge-page boundary, its whole huge pages marked for
    transparent huge pages (Linux's MADV_HUGEPAGE, which the kernel honours where its THP
    setting is ``madvise`` or ``always``): the products and attention stream weights and
    caches with a 2 MB page per TLB entry instead of 4 KB (bench/decode.py: the default
    model decodes 11% faster at 2 threads). Its last part of a huge page stays on small
    pages, so that a huge page is never resident for less than its size. Elsewhere, or
    where the mapping is refused, torch's allocator."""
    nbytes = dtype.itemsize * math.prod(shape)
    if nbytes < HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype) if zeroed else torch.empty(shape, dtype=dtype)
    try:  # a huge page more than it needs: its start moves up to the next boundary
        region = mmap.mmap(
            -1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
    except OSError as exc:  # the allocator below raises its own error if memory is short
        log.debug("memory.mapping_refused", bytes=nbytes, reason=str(exc))
        return torch.zeros(shape, dtype=dtype)
    start = huge_page_offset(torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr())
    try:  # the pages before the start are never touched, so never resident
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    except OSError as exc:  # a kernel without transparent huge pages: small pages
        log.debug("memory.huge_pages_refused", bytes=nbytes, reason=str(exc))
    data = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=start)
    _fence(data.data_ptr() - start, start, nbytes, len(region))
    # The tensor holds the mapping; it is unmapped when the tensor's storage is freed.
    return data.view(dtype).view(shape)


def _fence(base: int, start: int, nbytes: int, length: int) -> None:
    """Make the mapping at ``base`` unreadable outside its tensor's pages (``nbytes`` from
    ``start``), as a mapping of the tensor's own size would be: a load past either end
    faults rather than reading the spare huge page's zeros."""
    libc = _libc()
    protect = getattr(libc, "mprotect", None) if libc is not None else None
    if protect is None:
        return
    end = -(-(start + nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
    for first, last in ((0, start), (end, length)):
        if last > first and protect(
            ctypes.c_void_p(base + first), ctypes.c_size_t(last - first), 0
        ):
            log.debug("memory.fence_refused", bytes=last - first)


def huge_page_offset(address: int) -> int:
    """Bytes from ``address`` up to the next huge-page boundary (0 on one)."""
    return -address % HUGE_PAGE_BYTES


def on_host_pages(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (on the host) copied into a `host_tensor` where that maps it on its own;
    else itself."""
    if tensor.device.type != "cpu" or tensor.nbytes < HUGE_PAGE_MIN_BYTES:
        return tensor
    return host_tensor(tuple(tensor.shape), tensor.dtype).copy_(tensor)


def grown(buffer: torch.Tensor, tokens: int, used: int, dim: int = 0) -> torch.Tensor:
    """``buffer`` with room for ``tokens`` along ``dim`` (a multiple of the growth quantum,
    at least double), its first ``used`` kept; itself if it has the room."""
    capacity = buffer.shape[dim]
    if tokens <= capacity:
        return buffer
    shape = list(buffer.shape)
    shape[dim] = max(2 * capacity, -(-tokens // GROWTH_QUANTUM) * GROWTH_QUANTUM)
    bigger = buffer.new_empty(shape)
    bigger.narrow(dim, 0, used).copy_(buffer.narrow(dim, 0, used))
    return bigger


def available_memory(device: torch.device) -> int:
    """Bytes this process can still allocate on ``device`` now."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    return host_available_memory()


def host_available_memory() -> int:
    limits = [_system_available(), cgroup_headroom(), _rlimit_headroom()]
    return max(0, min(limit for limit in limits if limit is not None))


def _system_available() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass  # not Linux: fall back to the free-page count below
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cgroup_headroom(
    root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> int | None:
    """Limit less usage of this process's memory cgroup and of each of its ancestors, the
    least of them; None where no cgroup limits memory."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    headrooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            files, base = ("memory.max", "memory.current"), root
        elif "memory" in controllers.split(","):
            files, base = ("memory.limit_in_bytes", "memory.usage_in_bytes"), root / "memory"
        else:
            continue
        headrooms += _headrooms(base, Path(path.lstrip("/")), files)
    return min(headrooms, default=None)


def _headrooms(base: Path, path: Path, files: tuple[str, str]) -> list[int]:
    found = []
    for directory in [base / path, *(base / parent for parent in path.parents)]:
        limit, usage = (_read_bytes(directory / name) for name in files)
        if limit is not None and usage is not None and limit < _UNLIMITED:
            found.append(limit - usage)
    return found


def _read_bytes(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 writes "max" for no limit


def _rlimit_headroom() -> int | None:
    """What ``ulimit -v`` and ``ulimit -d`` leave of this process's address space."""
    if resource is None:
        return None
    headrooms = []
    for limit, field in ((resource.RLIMIT_AS, "VmSize"), (resource.RLIMIT_DATA, "VmData")):
        soft, _ = resource.getrlimit(limit)
        used = _status_bytes(field)
        if soft != resource.RLIM_INFINITY and used is not None:
            headrooms.append(soft - used)
    return min(headrooms, default=None)


def resident_bytes() -> int:
    """The process's resident memory (Linux's VmRSS); 0 where there is no /proc."""
    return _status_bytes("VmRSS") or 0


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@cache
def _libc() -> ctypes.CDLL | None:
    """The C library the process already runs on (not `find_library`, which forks
    `ldconfig` from a process that may hold gigabytes)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS.split()]


def heap_in_use() -> int | None:
    """Bytes the C heap has handed out and not had back, over every arena (glibc's
    ``mallinfo2``: blocks in use plus the ones mapped on their own); what native code such
    as llguidance holds shows here, unlike in RSS, whatever trimming and fragmentation do.
    None where it cannot be read (another libc, macOS, Windows)."""
    libc = _libc()
    info = getattr(libc, "mallinfo2", None) if libc is not None else None
    if info is None:
        return None
    info.restype = _MallInfo2
    counts = info()
    return counts.uordblks + counts.hblkhd


def release_freed_memory() -> None:
    """Return the heap that loading freed (tokenizer parsing, conversion buffers) to the OS.

    glibc keeps freed blocks of its arenas for reuse, so a load that parsed a 30 MB
    tokenizer file leaves some 200 MB resident but unused; ``malloc_trim`` hands it back.
    Elsewhere (another libc, macOS, Windows) this does nothing.
    """
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        released = bool(trim(0))
        log.debug("memory.trimmed", released=released)
