"""torch's own CPU operations on one thread, for the thread that calls this alone.

The compute of a step runs on the native kernels' pool (`kernels.cpu`, pool.c), sized by
the platform. The step's torch operations (activations between the layer blocks,
sampling, products of float weights) would otherwise run on torch's OpenMP team, whose
barriers wait for every thread of the team: with other work on the cores one descheduled
thread holds each operation up for a time slice, and two pools of threads contend for the
same cores. torch's thread count is the process's (`torch.set_num_threads` would change
the host's too), but OpenMP keeps the count each thread's parallel regions take per
thread: setting it on the engine's thread leaves every other thread as it was. One
thread also makes those operations' sums the same whatever the machine's thread count.
MKL, which torch calls for some element-wise functions (its vector math: cos, exp), keeps
a count of its own, which a host's `torch.set_num_threads` sets for the whole process: its
thread-local count is set too (else every step's RoPE angles start an MKL team of the
host's size, whose spinning threads take the cores from the pool's: a third slower).
"""

import ctypes
import re
from pathlib import Path

import torch

from ..log import get_logger

log = get_logger()

_RUNTIMES = re.compile(r"lib(g|i|)omp[^/]*\.(so[.0-9]*|dylib)$")


def torch_on_this_thread_alone() -> bool:
    """Make the calling thread's torch operations single-threaded (its OpenMP thread
    count 1); False where torch's runtime cannot be found (then nothing changes)."""
    setter = _omp_set_num_threads()
    if setter is None:
        log.debug("threads.torch_unchanged", reason="no OpenMP runtime of torch's found")
        return False
    torch.zeros(1 << 16).sum()  # torch sets a thread's count on its first parallel work
    setter(1)
    mkl_local = _mkl_set_num_threads_local()
    if mkl_local is not None:
        mkl_local(1)
    return True


def _mkl_set_num_threads_local():
    """MKL's per-thread count setter, where torch carries MKL (linked into its CPU
    library) or the process has loaded it; else None."""
    libraries = [Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"]
    libraries += [Path(p) for p in _loaded(re.compile(r"libmkl_rt[^/]*\.so[.0-9]*$"))]
    for path in libraries:
        try:
            return ctypes.CDLL(str(path)).MKL_Set_Num_Threads_Local  # the C API: by value
        except (OSError, AttributeError):
            continue
    return None


def _omp_set_num_threads():
    for path in _loaded_runtimes():
        try:
            return ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


def _loaded(pattern: re.Pattern[str]) -> list[str]:
    """The libraries this process has loaded whose paths match (Linux's map of it)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
        return [line.split()[-1] for line in lines if pattern.search(line.split()[-1])]
    except (OSError, IndexError):
        return []


def _loaded_runtimes() -> list[str]:
    """The OpenMP runtimes this process has loaded (Linux's map of it), else those beside
    torch's libraries."""
    found = _loaded(_RUNTIMES)
    if not found:
        beside = (Path(torch.__file__).parent / "lib").glob("*")
        found = [str(path) for path in beside if _RUNTIMES.search(path.name)]
    return list(dict.fromkeys(found))
