"""Platform detection: what this machine has, and what the backend will do on it.

`probe_platform()` gathers the facts (OS, GPUs, Triton); `decide_platform()`
turns facts and settings into `PlatformDecisions`, a pure function so that tests
can fake any machine. The loader consumes the decisions; nothing else detects.
"""

import importlib.metadata
import importlib.util
import math
import os
import platform as _platform
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ..errors import PlatformError, SettingsError
from ..log import get_logger
from .backend_settings import BackendSettings
from .effects import ineffective_settings
from .values import MAX_THREADS

log = get_logger()

DeviceType = Literal["cpu", "cuda", "mps"]

# Paged attention on by default where mistral.rs turns it on (CUDA), and on the CPU,
# where bench/paged.py measured it as fast for one sequence and faster for batches.
_PAGED_BY_DEFAULT: dict[DeviceType, bool] = {"cuda": True, "mps": False, "cpu": True}
_FP8_NATIVE_CAPABILITY = (8, 9)
_BF16_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class CudaDevice:
    index: int
    name: str
    capability: tuple[int, int]
    total_memory: int


@dataclass(frozen=True)
class PlatformProbe:
    """The facts about a machine that the decisions depend on."""

    os: str
    torch_version: str
    cuda_devices: tuple[CudaDevice, ...] = ()
    mps_available: bool = False
    mps_bf16: bool = False
    mps_fp8: bool = False
    cpu_capability: str = ""
    triton_version: str | None = None
    triton_error: str | None = "not installed"
    triton_interpret: bool = False
    c_compiler: str | None = None  # what builds the CPU's native kernels
    cpu_int8: bool = False  # x86 with AVX2: the native int8 products compile
    cpu_bf16_gemm: bool = False  # oneDNN runs bfloat16 GEMMs in hardware (AVX512-BF16, AMX)
    cpus_allowed: int = 1  # the CPUs this process may run on (its affinity)
    cpu_quota: float | None = None  # its cgroup's CPU limit in CPUs (None: unlimited)
    omp_num_threads: str | None = None  # OMP_NUM_THREADS as set


@dataclass(frozen=True)
class PlatformDecisions:
    """What the backend does on this machine; the one object the loader consumes."""

    os: str
    device: str
    device_type: DeviceType
    device_name: str
    paged_attn: bool
    paged_attn_supported: bool
    paged_attn_reason: str
    kernels: Literal["triton", "cpu", "torch"]
    kernels_reason: str
    triton_importable: bool
    triton_usable: bool
    fp8_kv: Literal["native", "emulated"] | None
    kv_cache_dtype: "KvCacheDtype"
    bf16: bool
    dtype: Literal["auto", "float32", "float16", "bfloat16"]
    torch_version: str
    # The CPU's arithmetic where the native kernels run (None elsewhere): activations of the
    # quantized products of a few rows, and the GEMM dtype of products of many rows.
    cpu_matmul: Literal["int8", "float32"] | None = None
    cpu_gemm: Literal["float32", "bfloat16"] | None = None  # None: none (batch invariance)
    batch_invariant: bool = True
    native_checks: bool = False
    c_compiler: str | None = None
    cpu_kernels_required: bool = False  # MISTRALRS_CPU_KERNELS=native: no fallback
    notes: tuple[str, ...] = field(default=())
    cuda_device_count: int = 0  # visible CUDA GPUs (tensor parallelism spans them)
    threads: int = 1  # the native kernels' pool (the CPU's compute threads)
    threads_reason: str = ""

    def resolve_dtype(self, config_dtype: str | None = None) -> str:
        """The compute dtype: the setting, else the model's own where the device runs it well.

        CPU computes in float32: torch's half-precision CPU paths are slower and
        less exact. Accelerators keep a half-precision config dtype they support.
        """
        if self.dtype != "auto":
            return self.dtype
        if self.device_type == "cpu":
            return "float32"
        if config_dtype == "float16" or (config_dtype == "bfloat16" and self.bf16):
            return config_dtype
        return "bfloat16" if self.bf16 else "float16"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def probe_platform() -> PlatformProbe:
    """Look at this machine."""
    cuda_devices = _cuda_devices()
    interpret = os.environ.get("TRITON_INTERPRET", "") == "1"
    triton_version, triton_error = _probe_triton(load=bool(cuda_devices) or interpret)
    mps = _mps_available()
    return PlatformProbe(
        os=_platform.system().lower(),
        torch_version=torch.__version__,
        cuda_devices=cuda_devices,
        mps_available=mps,
        mps_bf16=mps and _mps_supports(torch.bfloat16),
        mps_fp8=mps and _mps_supports(torch.float8_e4m3fn),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        triton_version=triton_version,
        triton_error=triton_error,
        triton_interpret=interpret,
        c_compiler=find_c_compiler(),
        cpu_int8=_cpu_has_avx2(),
        cpu_bf16_gemm=_bf16_gemm_in_hardware(),
        cpus_allowed=_cpus_allowed(),
        cpu_quota=_cgroup_cpu_quota(),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS") or None,
    )


def detect_platform(settings: BackendSettings) -> PlatformDecisions:
    """Probe this machine and decide; logs ``platform.detected``, and warns of each setting
    that the decisions leave without effect (``settings.no_effect``)."""
    decisions = decide_platform(settings, probe_platform())
    log.info(
        "platform.detected",
        device=decisions.device,
        paged_attn=decisions.paged_attn,
        kernels=decisions.kernels,
        fp8_kv=decisions.fp8_kv,
        bf16=decisions.bf16,
    )
    for note in decisions.notes:
        log.warning("platform.note", note=note)
    for variable, reason in ineffective_settings(settings, decisions):
        log.warning("settings.no_effect", variable=variable, reason=reason)
    return decisions


def decide_platform(settings: BackendSettings, probe: PlatformProbe) -> PlatformDecisions:
    """Turn the settings and the machine's facts into decisions (pure; raises PlatformError)."""
    device, device_type, device_name = _choose_device(settings.device, probe)
    paged, paged_supported, paged_reason = _decide_paged(settings.paged_attn, probe.os, device_type)
    triton_usable = probe.triton_version is not None and (
        device_type == "cuda" or probe.triton_interpret
    )
    kernels, kernels_reason, notes = _decide_kernels(
        device_type, triton_usable, probe, settings.cpu_kernels
    )
    cpu_matmul, cpu_gemm = _decide_cpu_arithmetic(kernels == "cpu", settings, probe)
    threads, threads_reason = _decide_threads(settings.num_threads, probe)
    fp8 = _fp8_support(device, device_type, probe)
    bf16 = _bf16_support(device, device_type, probe)
    _check_cache_type(settings.paged_cache_type, paged, fp8, device, kernels)
    _check_dtype(settings.dtype, bf16, device)
    return PlatformDecisions(
        os=probe.os,
        device=device,
        device_type=device_type,
        device_name=device_name,
        paged_attn=paged,
        paged_attn_supported=paged_supported,
        paged_attn_reason=paged_reason,
        kernels=kernels,
        kernels_reason=kernels_reason,
        triton_importable=probe.triton_version is not None,
        triton_usable=triton_usable,
        fp8_kv=fp8,
        kv_cache_dtype=_kv_cache_dtype(settings.paged_cache_type, kernels),
        bf16=bf16,
        dtype=settings.dtype,
        torch_version=probe.torch_version,
        cpu_matmul=cpu_matmul,
        cpu_gemm=cpu_gemm,
        batch_invariant=settings.batch_invariant,
        native_checks=settings.native_checks and kernels == "cpu",
        c_compiler=probe.c_compiler if kernels == "cpu" else None,
        cpu_kernels_required=settings.cpu_kernels == "native",
        notes=notes,
        cuda_device_count=len(probe.cuda_devices),
        threads=threads,
        threads_reason=threads_reason,
    )


def _decide_threads(requested: int | str, probe: PlatformProbe) -> tuple[int, str]:
    """The pool's size: the setting, else OMP_NUM_THREADS (honoured, as torch honours it),
    else the CPUs the process may use: its affinity, within its cgroup's quota."""
    if requested != "auto":
        return int(requested), f"MISTRALRS_NUM_THREADS={requested}"
    if probe.omp_num_threads is not None:
        first = probe.omp_num_threads.split(",")[0].strip()
        if not first.isdecimal() or not 0 < int(first) <= MAX_THREADS:
            raise SettingsError(
                f"OMP_NUM_THREADS={probe.omp_num_threads!r}: expected a whole number from 1 to "
                f"{MAX_THREADS} (or unset it and set MISTRALRS_NUM_THREADS)"
            )
        return int(first), f"OMP_NUM_THREADS={probe.omp_num_threads}"
    allowed = (
        f"{probe.cpus_allowed} CPU{'s' if probe.cpus_allowed != 1 else ''} this process may run on"
    )
    if probe.cpu_quota is not None and probe.cpu_quota < probe.cpus_allowed:
        quota = max(1, math.ceil(probe.cpu_quota - 1e-9))
        return quota, f"its cgroup's CPU quota of {probe.cpu_quota:g} ({allowed})"
    return min(probe.cpus_allowed, MAX_THREADS), allowed


def _cpus_allowed() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on macOS or Windows
        return os.cpu_count() or 1


def _cgroup_cpu_quota() -> float | None:
    """The CPUs this process's cgroup may use (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``),
    None where there is no limit or no cgroup to read."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        v1 = Path("/sys/fs/cgroup/cpu")
        quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
        period_us = int((v1 / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def _choose_device(requested: str, probe: PlatformProbe) -> tuple[str, DeviceType, str]:
    kind, _, index_text = requested.partition(":")
    if kind == "auto":
        kind = "cuda" if probe.cuda_devices else "mps" if probe.mps_available else "cpu"
    if kind == "cpu":
        return "cpu", "cpu", f"CPU ({probe.cpu_capability or 'unknown ISA'})"
    if kind == "mps":
        if not probe.mps_available:
            raise PlatformError(
                f"MISTRALRS_DEVICE={requested!r} asks for Apple Metal (MPS), "
                f"but torch {probe.torch_version} reports it unavailable on "
                f"this {probe.os} machine; use cpu or auto"
            )
        return "mps", "mps", "Apple Metal (MPS)"
    index = int(index_text or 0)
    if index >= len(probe.cuda_devices):
        seen = ", ".join(f"cuda:{d.index} ({d.name})" for d in probe.cuda_devices) or "none"
        raise PlatformError(
            f"MISTRALRS_DEVICE={requested!r} asks for CUDA device {index}, but "
            f"torch {probe.torch_version} sees: {seen}; use cpu or auto"
        )
    gpu = probe.cuda_devices[index]
    return f"cuda:{index}", "cuda", gpu.name


def _decide_paged(
    requested: bool | str, os_name: str, device_type: DeviceType
) -> tuple[bool, bool, str]:
    if os_name == "windows":
        if requested is True:
            raise PlatformError(
                "MISTRALRS_PAGED_ATTN=true, but paged attention is not "
                "supported on Windows (as in mistral.rs); unset it or set false"
            )
        return False, False, "not supported on Windows"
    if requested is False:
        return False, True, "disabled by MISTRALRS_PAGED_ATTN"
    if requested is True:
        return True, True, "enabled by MISTRALRS_PAGED_ATTN"
    on = _PAGED_BY_DEFAULT[device_type]
    return on, True, f"auto: {'on' if on else 'off'} by default on {device_type}"


def _decide_kernels(
    device_type: DeviceType, triton_usable: bool, probe: PlatformProbe, cpu_kernels: str
) -> tuple[Literal["triton", "cpu", "torch"], str, tuple[str, ...]]:
    if device_type == "cpu":
        return _decide_cpu_kernels(cpu_kernels, probe.c_compiler)
    if device_type != "cuda":
        return "torch", f"torch reference kernels on {device_type}", ()
    if triton_usable:
        return "triton", f"Triton {probe.triton_version} on CUDA", ()
    reason = f"Triton unusable ({probe.triton_error}); torch reference kernels on CUDA"
    return "torch", reason, (reason + "; install it with: pip install 'spnl-backend[triton]'",)


def _decide_cpu_kernels(
    requested: str, compiler: str | None
) -> tuple[Literal["cpu", "torch"], str, tuple[str, ...]]:
    if requested == "torch":
        return "torch", "torch reference kernels on the CPU (MISTRALRS_CPU_KERNELS=torch)", ()
    if compiler is not None:
        return "cpu", f"native C kernels compiled for this CPU by {compiler}", ()
    if requested == "native":
        raise PlatformError(
            "MISTRALRS_CPU_KERNELS=native, but no C compiler (cc, gcc or clang, or $CC) "
            "was found to build them; install one, or use auto or torch"
        )
    reason = "no C compiler (cc, gcc or clang) found; torch reference kernels on the CPU"
    return "torch", reason, (reason + " (slower); install a C compiler for the native ones",)


def _decide_cpu_arithmetic(
    native: bool, settings: BackendSettings, probe: PlatformProbe
) -> tuple[Literal["int8", "float32"] | None, Literal["float32", "bfloat16"] | None]:
    """Activations of the native quantized products, and the dtype of the many-row GEMMs:
    int8 where AVX2 compiles it; GEMMs only without batch invariance, then bfloat16 where
    they run in hardware, unless float32 activations were asked for (then float32)."""
    if not native:
        return None, None
    matmul = settings.cpu_matmul
    if matmul == "int8" and not probe.cpu_int8:
        raise PlatformError(
            "MISTRALRS_CPU_MATMUL=int8 needs an x86 CPU with AVX2, which this one is not "
            f"({probe.cpu_capability or 'unknown ISA'}); use auto or float32"
        )
    if matmul == "auto":
        matmul = "int8" if probe.cpu_int8 else "float32"
    gemm = settings.cpu_gemm
    if settings.batch_invariant:
        return matmul, None  # type: ignore[return-value]
    if gemm == "auto":
        gemm = "bfloat16" if probe.cpu_bf16_gemm and matmul == "int8" else "float32"
    return matmul, gemm  # type: ignore[return-value]


def _fp8_support(
    device: str, device_type: DeviceType, probe: PlatformProbe
) -> Literal["native", "emulated"] | None:
    if device_type == "cuda":
        capability = probe.cuda_devices[int(device.split(":")[1])].capability
        return "native" if capability >= _FP8_NATIVE_CAPABILITY else "emulated"
    if device_type == "mps":
        return "emulated" if probe.mps_fp8 else None
    return "emulated"


def _bf16_support(device: str, device_type: DeviceType, probe: PlatformProbe) -> bool:
    if device_type == "cuda":
        return probe.cuda_devices[int(device.split(":")[1])].capability >= _BF16_CAPABILITY
    if device_type == "mps":
        return probe.mps_bf16
    return True


# How K and V are stored ("auto": in the model's dtype).
KvCacheDtype = Literal["auto", "float8_e4m3fn", "float16", "float32"]
_CACHE_DTYPES: dict[str, KvCacheDtype] = {
    "f8e4m3": "float8_e4m3fn",
    "f16": "float16",
    "f32": "float32",
}


def _kv_cache_dtype(cache_type: str, kernels: str) -> KvCacheDtype:
    """The KV storage dtype; auto is float16 where the native CPU kernels attend (they
    widen it exactly as they read it), else the model's own."""
    if cache_type == "auto":
        return "float16" if kernels == "cpu" else "auto"
    return _CACHE_DTYPES[cache_type]


def _check_cache_type(
    cache_type: str, paged: bool, fp8: str | None, device: str, kernels: str
) -> None:
    if cache_type in ("f16", "f32") and kernels == "triton":
        raise PlatformError(
            f"MISTRALRS_PAGED_CACHE_TYPE={cache_type!r}: the Triton kernels on {device} "
            "store K and V in the model's dtype (auto) or as f8e4m3; use one of those"
        )
    if cache_type != "f8e4m3":
        return
    if not paged:
        raise PlatformError(
            "MISTRALRS_PAGED_CACHE_TYPE='f8e4m3' needs paged attention, which "
            "is off here; set MISTRALRS_PAGED_ATTN=true or use the auto cache type"
        )
    if fp8 is None:
        raise PlatformError(
            f"MISTRALRS_PAGED_CACHE_TYPE='f8e4m3': torch cannot store float8 "
            f"on {device}; use the auto cache type"
        )


def _check_dtype(dtype: str, bf16: bool, device: str) -> None:
    if dtype == "bfloat16" and not bf16:
        raise PlatformError(
            f"MISTRALRS_DTYPE='bfloat16', but {device} does not support "
            "bfloat16; use float16, float32 or auto"
        )


def _probe_triton(load: bool) -> tuple[str | None, str | None]:
    """Triton's version, or why there is none. Imported only where it could run (``load``:
    a CUDA device or TRITON_INTERPRET=1): elsewhere its import costs a quarter of a second
    and 70 MB of resident library for nothing, so its installed metadata answers."""
    if not load and (installed := _installed_triton()) is not None:
        return installed
    try:
        import triton
    except ImportError:
        return None, "not installed"
    except Exception as exc:  # a broken install: report why rather than crash `info`
        return None, f"import failed: {type(exc).__name__}: {exc}"
    return triton.__version__, None


def _installed_triton() -> tuple[str | None, str | None] | None:
    """Triton's version from its package metadata; None where only an import can say."""
    if importlib.util.find_spec("triton") is None:
        return None, "not installed"
    try:
        return importlib.metadata.version("triton"), None
    except importlib.metadata.PackageNotFoundError:  # importable, but not an installed dist
        return None


def find_c_compiler() -> str | None:
    """The compiler the native kernels are built with: $CC, else cc, gcc or clang."""
    candidates = (os.environ.get("CC"), "cc", "gcc", "clang")
    return next((c for c in candidates if c and shutil.which(c)), None)


def cpuinfo_lines(*keys: str, path: str = "/proc/cpuinfo") -> dict[str, str] | None:
    """The first line of ``path`` that starts with each of ``keys`` (a key absent: not in
    the dict), or None where it cannot be read (macOS, a container that hides it). Bytes
    that are not UTF-8 are read past."""
    found: dict[str, str] = {}
    try:
        with open(path, errors="replace") as info:
            for line in info:
                key = next((k for k in keys if k not in found and line.startswith(k)), None)
                if key is not None:
                    found[key] = line
                    if len(found) == len(keys):
                        break
    except OSError:
        return None
    return found


def cpuinfo_value(line: str) -> str:
    """The value of a /proc/cpuinfo line (``name : value``)."""
    return line.partition(":")[2].strip()


def _cpu_has_avx2() -> bool:
    """Whether ``-march=native`` compiles the int8 products here (x86 with AVX2)."""
    if _platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return False
    lines = cpuinfo_lines("flags")
    if lines is None:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return "avx2" in lines.get("flags", "").split()


def _bf16_gemm_in_hardware() -> bool:
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(torch.backends.mkldnn.is_available() and probe is not None and probe())


def _cuda_devices() -> tuple[CudaDevice, ...]:
    if not torch.cuda.is_available():
        return ()
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            CudaDevice(index, props.name, (props.major, props.minor), props.total_memory)
        )
    return tuple(devices)


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def _mps_supports(dtype: torch.dtype) -> bool:
    try:
        torch.zeros(1, dtype=dtype, device="mps")
    except (RuntimeError, TypeError):
        return False
    return True
