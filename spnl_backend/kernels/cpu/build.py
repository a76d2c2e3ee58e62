"""Building the C kernels: compiled with the system's C compiler (``-O3 -march=native``,
OpenMP's simd pragmas and link-time optimisation where the compiler has them) into one
library in a per-user cache keyed by the sources, headers, compiler, flags and CPU, so
later processes load it in milliseconds; loaded with every signature set and every struct
of the mirror checked against the library's."""

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from ...log import get_logger
from ...settings.paths import cache_dir
from ...settings.platform import cpuinfo_lines, cpuinfo_value, find_c_compiler
from .abi import SIGNATURES, STRUCTS
from .wrappers import CpuKernels

log = get_logger()

HERE = Path(__file__).parent
# The translation units, linked into one library; the cache key also covers every header.
SOURCES = tuple(
    HERE / name
    for name in (
        "quant_matmul.c",
        "layer_ops.c",
        "paged_attention.c",
        "coded_decode.c",
        "moe.c",
        "lora.c",
        "layer_blocks.c",
        "state_layers.c",
        "pool.c",
        "build_info.c",
    )
)
HEADERS = tuple(sorted(HERE.glob("*.h")))
# No fused multiply-add contraction: the element-wise kernels then round exactly as torch.
_BASE_FLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=256",
    "-fPIC",
    "-shared",
    "-std=gnu11",
    "-ffp-contract=off",
]
_CHECK_FLAGS = ["-DSPNL_CHECKS"]
# Macros measured faster on a CPU than quant_int8.h's defaults (which were measured on a
# Zen 5), by /proc/cpuinfo's (vendor_id, cpu family). Zen 4 (AMD family 25, its AVX-512
# two passes of 256 bits): the one-row Q4_K and Q6_K products read from memory 1.29x and
# 1.33x faster asking for each group's own lines than 8 KiB ahead, which overruns what its
# hardware prefetchers already fetch (bench/read_gap.py --variant, 2026-11-30). Zen 3
# shares the family but not AVX-512, where the macro's kernels are.
_TUNING = {("AuthenticAMD", "25"): ["-DROW1_PREFETCH=0"]}


def cpu_kernels(checks: bool = False) -> CpuKernels | None:
    """The compiled kernels built by the compiler found on this machine (as `info` shows),
    or None (logged) where there is none or the build fails."""
    compiler = find_c_compiler()
    if compiler is None:
        log.warning(
            "native.unavailable",
            reason="no C compiler (cc, gcc or clang) found; the CPU runs the slower torch kernels",
        )
        return None
    return load_cpu_kernels(compiler, checks)


@cache
def load_cpu_kernels(compiler: str, checks: bool = False) -> CpuKernels | None:
    """The kernels compiled by ``compiler`` (with every index checked where ``checks``),
    or None, with a warning that says why, where the build fails."""
    try:
        path = _build(compiler, checks)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning(
            "native.unavailable",
            reason=f"compiling {', '.join(path.name for path in SOURCES)} failed",
            detail=str(detail)[-2000:],
        )
        return None
    try:
        return _load(path)
    except _MismatchedBuildError as exc:
        log.warning("native.unavailable", reason=str(exc))
        return None


class _MismatchedBuildError(Exception):
    """The library's argument structs are not the ones this module mirrors."""


def _load(path: Path) -> CpuKernels:
    library = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    for name, struct in STRUCTS.items():  # a mirror out of step would pass garbage
        if getattr(library, name)() != ctypes.sizeof(struct):
            raise _MismatchedBuildError(
                f"{struct.__name__} does not match its C struct in common.h ({path})"
            )
    has_int8 = bool(library.spnl_has_int8())
    return CpuKernels(
        library,
        path,
        exact=not has_int8,
        checks=bool(library.spnl_full_checks()),
        has_int8=has_int8,
    )


def built_before(compiler: str, checks: bool = False) -> bool:
    """Whether this machine's cache holds a build of these sources by ``compiler`` (so
    loading them compiles nothing)."""
    try:
        return any(target.exists() for _, target in _targets(compiler, checks))
    except (OSError, subprocess.CalledProcessError):  # no key for this CPU: loading says why
        return False


def _targets(compiler: str, checks: bool) -> list[tuple[list[str], Path]]:
    """Each way to build, best first: its flags and where its build is cached."""
    source = _source_digest()
    base = [*_BASE_FLAGS, *tuning_flags(), *(_CHECK_FLAGS if checks else [])]
    # Link-time optimisation and OpenMP's simd pragmas where the compiler has them (the
    # threads are pool.c's, not OpenMP's runtime). Link-time optimisation changes no
    # result (no fast-math, no contraction) but the speed: GCC 12 runs the one-row k-quant
    # products 40% faster with it (bench/cpu_products.py).
    candidates = [[*base, "-flto", "-fopenmp-simd"], [*base, "-fopenmp-simd"], base]
    return [(flags, _target(source, compiler, flags)) for flags in candidates]


def _build(compiler: str, checks: bool) -> Path:
    targets = _targets(compiler, checks)
    base = targets[-1][0]
    for _, target in targets:  # a build made before, the first that the compiler took
        if target.exists():
            return target
    for flags, target in targets:
        try:
            _compile(compiler, flags, target)
            log.info(
                "native.compiled",
                path=str(target),
                openmp_simd="-fopenmp-simd" in flags,
                lto="-flto" in flags,
            )
            return target
        except subprocess.CalledProcessError:
            if flags is base:
                raise
    raise AssertionError("unreachable")


def _target(source: bytes, compiler: str, flags: list[str]) -> Path:
    key = hashlib.sha256(source + " ".join([compiler, *flags, _cpu_identity(compiler)]).encode())
    return cache_dir("native") / key.hexdigest()[:24] / "libspnlcpu.so"


def _source_digest() -> bytes:
    """Every source and header, each by name and content: a change to any one rebuilds."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        text = path.read_bytes()
        digest.update(f"{path.name} {len(text)}\n".encode() + text)
    return digest.digest()


def tuning_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The macros `_TUNING` gives this CPU (none where it lists no measurement)."""
    lines = cpuinfo_lines("vendor_id", "cpu family", path=cpuinfo) or {}
    cpu = tuple(cpuinfo_value(lines.get(key, "")) for key in ("vendor_id", "cpu family"))
    return list(_TUNING.get(cpu, []))


def _cpu_identity(compiler: str) -> str:
    """What ``-march=native`` compiles for: a cache shared by machines with different CPUs
    (a network home) must not hand one's instructions to another. The CPU's flags where
    /proc/cpuinfo has them; elsewhere (macOS, a container that hides it) the macros the
    compiler defines for this CPU, which name every instruction set it may use."""
    lines = cpuinfo_lines("flags", "Features") or {}
    flags = lines.get("flags") or lines.get("Features", "")
    machine = f"{platform.machine()} {platform.processor()}"
    return f"{machine} {flags.strip()}" if flags else f"{machine} {_native_macros(compiler)}"


@cache
def _native_macros(compiler: str) -> str:
    """The macros ``compiler -march=native`` predefines, sorted (an error where it cannot
    say: the build could not be keyed by its CPU, so none is built or loaded)."""
    done = subprocess.run(
        [compiler, "-march=native", "-dM", "-E", "-x", "c", os.devnull],
        check=True,
        capture_output=True,
        text=True,
    )
    return " ".join(sorted(line.removeprefix("#define ") for line in done.stdout.splitlines()))


def _compile(compiler: str, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", str(built), "-lm", "-pthread"],
            check=True,
            capture_output=True,
            text=True,
        )
        built.rename(target)
