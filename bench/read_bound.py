"""The read bandwidth that bounds decode, measured one way for every bench.

A decode token streams each weight once from memory, far more bytes than the caches hold,
so its bound is the weight bytes over the rate the machine reads a buffer much larger than
the last-level cache. That rate is measured by bench/read_bound.c (plain vector loads, each
thread one contiguous slice, as many threads as asked), compiled at run time by the system's
C compiler into a temporary folder; the buffer sits on the huge pages the weights sit on;
the best of several passes. Only where no compiler is found, a torch sum over the same size
(the median of its runs) stands in: at 2 threads it reads less than the products do, so a
bound from it is low. Each figure says which of the two measured it (``method``).
"""

import ctypes
import sys
from collections.abc import Callable
from pathlib import Path

import harness

SOURCE = Path(__file__).resolve().parent / "read_bound.c"
FLAGS = ["-O3", "-march=native", "-pthread"]
NATIVE = "bench/read_bound.c"
TORCH_SUM = "a torch sum, no C compiler found"
GIB = 2**30
L3_MULTIPLE = 4  # the buffer is at least this many times the machine's L3
WHOLE, EACH = 0, 1  # read_bound.c's modes: each thread a slice of all, or of each tensor


def build_reader() -> ctypes.CDLL | None:
    """bench/read_bound.c compiled for this machine by the compiler the library's kernels
    use; None where there is none. A failed compile raises with the compiler's message."""
    library = harness.compile_shared(SOURCE, FLAGS)
    if library is None:
        return None
    library.spnl_bench_read.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_int64),
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_uint64),
    ]
    library.spnl_bench_read.restype = ctypes.c_int
    return library


def reader(
    library: ctypes.CDLL, spans: list[tuple[int, int]], threads: int, mode: int
) -> Callable[[], int]:
    """A call reading every ``(address, bytes)`` span once on ``threads`` threads, which
    returns the XOR of every 8-byte word read (so each byte's load is kept)."""
    ptrs = (ctypes.c_void_p * len(spans))(*(address for address, _ in spans))
    sizes = (ctypes.c_int64 * len(spans))(*(n for _, n in spans))
    checksum = ctypes.c_uint64()

    def read() -> int:
        error = library.spnl_bench_read(ptrs, sizes, len(spans), threads, mode, checksum)
        if error:
            raise OSError(error, f"read_bound.c could not start {threads} threads")
        return checksum.value

    return read


def l3_bytes(root: Path = Path("/sys/devices/system/cpu")) -> int:
    """The machine's level-3 cache, every instance once (by the CPUs that share it); 0
    where the system does not say."""
    instances: dict[str, int] = {}
    for cache in root.glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (cache / "level").read_text().strip() != "3":
                continue
            size = (cache / "size").read_text().strip()
            shared = (cache / "shared_cpu_list").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        instances[shared] = int(size.rstrip("KMG")) * units.get(size[-1], 1)
    return sum(instances.values())


def buffer_bytes(gib: float = 1.0) -> int:
    """``gib`` GiB, or more where the L3 would hold a sizeable part of it."""
    return max(int(gib * GIB), L3_MULTIPLE * l3_bytes())


def native_gb_s(library: ctypes.CDLL, threads: int, nbytes: int, repeats: int = 7) -> float:
    """The best of ``repeats`` passes of read_bound.c over ``nbytes`` (after one untimed
    pass that also faults the pages in), on the huge pages the library puts weights on."""
    import torch

    from spnl_backend.memory import host_tensor

    buffer = host_tensor((nbytes,), torch.uint8, zeroed=False)
    buffer.fill_(0x5A)  # written: untouched pages would all read the one zero page
    read = reader(library, [(buffer.data_ptr(), nbytes)], threads, WHOLE)
    read()
    best = min(harness.seconds(read) for _ in range(repeats))
    return nbytes / best / 1e9


def torch_sum_gb_s(threads: int, nbytes: int, repeats: int = 7) -> float:
    """The median read bandwidth of a torch sum over ``nbytes`` of float32."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(nbytes // 4, dtype=torch.float32)
    return data.numel() * 4 / harness.median_seconds(data.sum, repeats) / 1e9


def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 7) -> dict:
    """``{"gb_s": ..., "method": NATIVE or TORCH_SUM}`` at ``threads`` threads."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, not {threads}")
    nbytes = buffer_bytes(gib)
    library = build_reader()
    if library is None:
        print("read_bound: no C compiler found; the bound is a torch sum", file=sys.stderr)
        return {"gb_s": torch_sum_gb_s(threads, nbytes, repeats), "method": TORCH_SUM}
    return {"gb_s": native_gb_s(library, threads, nbytes, repeats), "method": NATIVE}
