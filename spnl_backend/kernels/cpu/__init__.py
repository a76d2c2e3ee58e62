"""The CPU's native kernels: C compiled for this machine at first use, called through ctypes.

``cpu_kernels.c`` holds the quantized matrix products and the small per-layer operations
of a decode step (RMSNorm, RoPE, KV store, paged decode attention), each the twin of a
torch reference elsewhere in the package. It is compiled with the system's C compiler
(``-O3 -march=native``, OpenMP where the compiler has it) into a per-user cache keyed by
the source, compiler and flags, so later processes load it in milliseconds. Without a
compiler everything falls back to the torch twins, with a warning that says why;
``SPNL_NATIVE=0`` asks for that fallback on purpose.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from ...log import get_logger

log = get_logger()

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# No fused multiply-add contraction: the element-wise kernels then round exactly as torch.
_BASE_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11", "-ffp-contract=off"]
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {  # name: (argument types, result type)
    "spnl_max_rows": ([], _I32),
    "spnl_has_int8": ([], _I32),
    "spnl_qmatmul": ([_I32, _P, _P, _I64, _I64, _P, _P, _P, _I64, _I32, _I32], _I32),
    "spnl_dequantize": ([_I32, _P, _I64, _I64, _P, _I32], _I32),
    "spnl_gather_rows": ([_I32, _P, _P, _I64, _I64, _P], _I32),
    "spnl_rms_norm": ([_P, _P, _P, _I64, _I64, _F32], None),
    "spnl_rope": ([_P, _P, _P, _I64, _I64, _I64, _I64], None),
    "spnl_store_kv": ([_P, _P, _P, _P, _P, _I64, _I64], None),
    "spnl_paged_decode": (
        [_P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _F32, _I64, _F32, _P, _I32],
        _I32,
    ),
    "spnl_coded_decode": (
        [
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
            _I64,
            _I64,
            _P,
            _I32,
            _I64,
            _P,
            _I32,
            _P,
            _I64,
            _P,
            _I64,
            _I64,
            _I64,
            _I64,
            _F32,
            _I64,
            _F32,
            _P,
            _I32,
        ],
        _I32,
    ),
}


@dataclass(frozen=True)
class CpuKernels:
    library: ctypes.CDLL
    max_rows: int
    path: Path
    # Float activations in the quantized products (slower; SPNL_EXACT_MATMUL=1).
    exact: bool = False

    def products(self, weights: list[tuple[int, torch.Tensor, int]]) -> "Products":
        """A prepared call for ``x @ W.T`` of each ``(qtype, W [n_out, row_bytes], n_out)``."""
        return Products(self, weights)

    def dequantize(self, qtype: int, weight: torch.Tensor, n_rows: int, k_in: int) -> torch.Tensor:
        out = torch.empty((n_rows, k_in), dtype=torch.float32)
        _check(
            self.library.spnl_dequantize(
                qtype, weight.data_ptr(), n_rows, k_in, out.data_ptr(), torch.get_num_threads()
            ),
            "dequantize",
        )
        return out

    def gather_rows(
        self, qtype: int, weight: torch.Tensor, ids: torch.Tensor, k_in: int
    ) -> torch.Tensor:
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty((ids.numel(), k_in), dtype=torch.float32)
        _check(
            self.library.spnl_gather_rows(
                qtype, weight.data_ptr(), ids.data_ptr(), ids.numel(), k_in, out.data_ptr()
            ),
            "gather_rows",
        )
        return out

    def rms_norm(self, x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        self.library.spnl_rms_norm(
            x.data_ptr(),
            scale.data_ptr(),
            out.data_ptr(),
            x.numel() // x.shape[-1],
            x.shape[-1],
            eps,
        )
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, head_dim]`` (contiguous) in place by ``[T, rotary]`` tables."""
        tokens, heads, head_dim = x.shape
        self.library.spnl_rope(
            x.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, head_dim, cos.shape[-1]
        )
        return x

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        key, value = key.contiguous(), value.contiguous()
        self.library.spnl_store_kv(
            key.data_ptr(),
            value.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            slots.data_ptr(),
            key.shape[0],
            key.shape[1] * key.shape[2],
        )

    def paged_decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        q = q.contiguous()
        seqs, heads, dim = q.shape
        out = torch.empty_like(q)
        _check(
            self.library.spnl_paged_decode(
                q.data_ptr(),
                key_cache.data_ptr(),
                value_cache.data_ptr(),
                slots.data_ptr(),
                slots.stride(0),
                lens.data_ptr(),
                seqs,
                heads,
                key_cache.shape[2],
                dim,
                scale,
                window or 0,
                softcap or 0.0,
                out.data_ptr(),
                torch.get_num_threads(),
            ),
            "paged_decode",
        )
        return out

    def coded_decode(
        self,
        q_rot: torch.Tensor,
        q: torch.Tensor,
        anchors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        key_pool: torch.Tensor,
        value_pool: torch.Tensor,
        key_format: tuple[torch.Tensor, int, int],
        value_format: tuple[torch.Tensor, int],
        slots: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """One query per sequence over PolarQuant records ``[slots, kv_heads, bytes]``;
        ``key_format`` is (codebook, bits, outliers), ``value_format`` (codebook, bits);
        ``anchors`` is (q . key centre and q . key anchor ``[seqs, heads]``, the value
        anchor less the value centre, rotated, ``[kv_heads, dim]``). Returns the rotated
        value sum without the values' centre."""
        q_rot, q = q_rot.contiguous(), q.contiguous()
        k_shift, k_anchor, v_anchor = (t.float().contiguous() for t in anchors)
        seqs, heads, dim = q.shape
        (k_lut, k_bits, outliers), (v_lut, v_bits) = key_format, value_format
        out = torch.empty_like(q)
        _check(
            self.library.spnl_coded_decode(
                q_rot.data_ptr(),
                q.data_ptr(),
                k_shift.data_ptr(),
                k_anchor.data_ptr(),
                v_anchor.data_ptr(),
                key_pool.data_ptr(),
                value_pool.data_ptr(),
                key_pool.shape[-1],
                value_pool.shape[-1],
                k_lut.data_ptr(),
                k_bits,
                outliers,
                v_lut.data_ptr(),
                v_bits,
                slots.data_ptr(),
                slots.stride(0),
                lens.data_ptr(),
                seqs,
                heads,
                key_pool.shape[-2],
                dim,
                scale,
                window or 0,
                softcap or 0.0,
                out.data_ptr(),
                torch.get_num_threads(),
            ),
            "coded_decode",
        )
        return out


class Products:
    """Several quantized products of one input, prepared once (the ctypes arrays), called
    every step: the activations are read, and on the int8 path quantized, once for all, and
    the results land side by side in one tensor."""

    def __init__(self, kernels: CpuKernels, weights: list[tuple[int, torch.Tensor, int]]) -> None:
        count = len(weights)
        self.kernels, self.count = kernels, count
        self.qtypes = (ctypes.c_int * count)(*(qtype for qtype, _, _ in weights))
        self.pointers = (ctypes.c_void_p * count)(*(w.data_ptr() for _, w, _ in weights))
        self.n_outs = (ctypes.c_int64 * count)(*(n for _, _, n in weights))
        self.widths = [n for _, _, n in weights]
        self.total = sum(self.widths)
        self.weights = [w for _, w, _ in weights]  # kept alive for the pointers

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [rows, k]`` (float32, contiguous) → ``[rows, total]``."""
        rows, k_in = x.shape
        out = torch.empty((rows, self.total), dtype=torch.float32)
        kernels = self.kernels
        _check(
            kernels.library.spnl_qmatmul(
                self.count,
                self.qtypes,
                x.data_ptr(),
                rows,
                k_in,
                self.pointers,
                self.n_outs,
                out.data_ptr(),
                self.total,
                torch.get_num_threads(),
                kernels.exact,
            ),
            "matmul",
        )
        return out


def _check(status: int, name: str) -> None:
    if status != 0:
        raise ValueError(f"the CPU kernel {name} rejected its arguments (status {status})")


@cache
def cpu_kernels() -> CpuKernels | None:
    """The compiled kernels, or None (logged) where they cannot be built or are turned off."""
    if os.environ.get("SPNL_NATIVE", "1") == "0":
        log.info("native.disabled", reason="SPNL_NATIVE=0")
        return None
    compiler = next(
        (c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None
    )
    if compiler is None:
        log.warning(
            "native.unavailable",
            reason="no C compiler (cc, gcc or clang) found; the CPU runs the slower torch kernels",
        )
        return None
    try:
        path = _build(compiler)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning(
            "native.unavailable",
            reason=f"compiling {SOURCE.name} failed",
            detail=str(detail)[-2000:],
        )
        return None
    return _load(path)


def _load(path: Path) -> CpuKernels:
    library = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    exact = os.environ.get("SPNL_EXACT_MATMUL", "0") == "1" or not library.spnl_has_int8()
    return CpuKernels(library, library.spnl_max_rows(), path, exact)


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    for flags in ([*_BASE_FLAGS, "-fopenmp"], _BASE_FLAGS):  # OpenMP where the compiler has it
        key = hashlib.sha256(source + " ".join([compiler, *flags, _cpu_identity()]).encode())
        target = _cache_dir() / key.hexdigest()[:24] / "libspnlcpu.so"
        if target.exists():
            return target
        try:
            _compile(compiler, flags, target)
            log.info("native.compiled", path=str(target), openmp="-fopenmp" in flags)
            return target
        except subprocess.CalledProcessError:
            if "-fopenmp" not in flags:
                raise
    raise AssertionError("unreachable")


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: a cache shared by machines with different CPUs
    (a network home) must not hand one's instructions to another."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags.strip()}"


def _compile(compiler: str, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        built.rename(target)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "spnl_backend" / "native"
