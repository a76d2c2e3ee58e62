"""Giving memory freed during loading back to the operating system."""

import ctypes
import ctypes.util
import sys
from functools import cache

import torch

from ..log import get_logger

log = get_logger()


@cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


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


_MADV_DONTNEED = 4
_PAGE = 4096


def release_file_pages(tensor: torch.Tensor) -> None:
    """Drop from this process the pages of a tensor that maps a file, once it is not needed.

    ISQ reads each float matrix from the mapped safetensors file and keeps only its
    quantized blocks; the file pages it touched would otherwise stay mapped, and counted
    as resident, until the whole file is closed, so peak memory would approach the float
    model's size. Only whole pages of a file mapping are dropped (reading them again
    would fault them back in from the file, unchanged); memory that is not a file's is
    left alone. Linux only; elsewhere a no-op.
    """
    libc = _libc()
    if libc is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if not _in_file_mapping(start, end):
        return
    first, last = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    if last > first:
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def _in_file_mapping(start: int, end: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= start and end <= high:
                path = fields[5].strip() if len(fields) == 6 else ""
                return path.startswith("/") and not path.endswith("(deleted)")
    return False
