"""The one kernel decision: from the platform decisions to the kernels a model runs on.

`choose_kernels` is called once per loaded model. It loads the compiled CPU kernels where
the platform chose them, and picks the paged-attention set (`kernels.sets`) and the
quantized products (`kernels.matmuls`) to match; the models, the caches and the engine
take what it chose and never decide again. The row counts at which a set switches
arithmetic live in `kernels.thresholds`.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch

from ..errors import PlatformError
from ..log import get_logger
from ..settings import PlatformDecisions
from .cpu import CpuKernels, load_cpu_kernels
from .matmuls import (
    CpuMatmuls,
    Matmuls,
    quantized_matmuls_ref,
    quantized_matmuls_triton,
    quantized_matmuls_triton_fastest,
)
from .sets import TORCH_KERNELS, Kernels, cpu_kernel_set, triton_kernel_set

log = get_logger()


@dataclass(frozen=True)
class KernelChoice:
    """What one model runs on: the compiled CPU kernels (None: their torch twins or
    Triton), the paged-attention set and the quantized products."""

    native: CpuKernels | None
    attention: Kernels
    matmuls: Matmuls
    # Mixture-of-experts layers, float or GGML-quantized, in one fused kernel (Triton's,
    # on CUDA), or None.
    fused_moe: Callable | None = None


def choose_kernels(decisions: PlatformDecisions) -> KernelChoice:
    native = native_kernels(decisions)
    # Without paged attention no kernel set runs: Triton's then need not load.
    attention = (
        select_kernels(decisions.kernels, native, decisions.batch_invariant)
        if decisions.paged_attn
        else TORCH_KERNELS
    )
    matmuls = select_matmuls(
        decisions.kernels, native, decisions.cpu_gemm, decisions.batch_invariant
    )
    choice = KernelChoice(native, attention, matmuls, _fused_moe(decisions.kernels))
    log.debug("kernels.selected", kernels=attention.name, native=native is not None)
    return choice


def _fused_moe(kernels: str) -> Callable | None:
    if kernels != "triton":
        return None
    from .triton_moe import fused_moe_triton

    return fused_moe_triton


def native_kernels(decisions: PlatformDecisions) -> CpuKernels | None:
    """The compiled CPU kernels as the platform decided them (None: the torch twins run).

    A compiler that was found but fails to build them falls back to the twins with a
    warning, unless ``MISTRALRS_CPU_KERNELS=native`` asked for them."""
    if decisions.kernels != "cpu" or decisions.c_compiler is None:
        return None
    native = load_cpu_kernels(decisions.c_compiler, decisions.native_checks)
    if native is None:
        if decisions.cpu_kernels_required:
            raise PlatformError(
                f"MISTRALRS_CPU_KERNELS=native, but {decisions.c_compiler} could not build "
                "them (the log's native.unavailable event says why); use auto or torch"
            )
        return None
    if decisions.cpu_matmul == "int8" and not native.has_int8:
        raise PlatformError("the native kernels were built without the int8 products")
    return replace(native, exact=decisions.cpu_matmul == "float32", threads=decisions.threads)


def select_kernels(
    kind: Literal["torch", "cpu", "triton"],
    native: CpuKernels | None = None,
    batch_invariant: bool = True,
) -> Kernels:
    """The kernel set for the platform's decision (``PlatformDecisions.kernels``), over the
    compiled CPU kernels ``native`` where they run."""
    if kind == "cpu" and native is not None:
        return cpu_kernel_set(native, batch_invariant)
    if kind in ("torch", "cpu"):
        return TORCH_KERNELS
    return triton_kernel_set()


def select_matmuls(
    kind: str, native: CpuKernels | None, gemm_dtype: str | None, batch_invariant: bool = True
) -> Matmuls:
    """The quantized products for the platform's kernels (``PlatformDecisions.kernels``)."""
    if kind == "triton":
        return quantized_matmuls_triton if batch_invariant else quantized_matmuls_triton_fastest
    if kind == "cpu" and native is not None:  # no GEMM dtype: batch invariance decided
        return CpuMatmuls(native, getattr(torch, gemm_dtype) if gemm_dtype else None)
    return quantized_matmuls_ref
