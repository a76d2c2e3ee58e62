"""The one kernel decision: from the platform decisions to the kernels a model runs on.

`choose_kernels` is called once per loaded model. It loads the compiled CPU kernels where
the platform chose them, and picks the paged-attention set (`kernels.sets`) and the
quantized products (`kernels.matmuls`) to match. The model receives the `KernelChoice`
when it is built and asks it, per step, which path a tensor takes: every eligibility rule
(float32 on the CPU, the products' row limit, the native MoE layer's expert count, the
pool a compression method needs) is one of its methods, so the models, the caches and the
engine never decide again. The row counts at which a set switches arithmetic live in
`kernels.thresholds`.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal

import torch

from ..compressors import Compressor
from ..errors import PlatformError
from ..log import get_logger
from ..settings import PlatformDecisions
from . import ops
from .cpu import CpuKernels, load_cpu_kernels
from .cpu.lora import lora_add_native
from .cpu.moe import MAX_EXPERTS, Biases, NativeMoe, Weight
from .lora_ref import LoraAdd, lora_add_ref
from .matmuls import (
    CpuMatmuls,
    Matmuls,
    PackedWeight,
    quantized_matmuls_ref,
    quantized_matmuls_triton,
    quantized_matmuls_triton_fastest,
)
from .sets import TORCH_ATTENTION, AttentionKernels, cpu_kernel_set, triton_kernel_set

log = get_logger()


@dataclass(frozen=True)
class KernelChoice:
    """What one model runs on: the compiled CPU kernels (None: their torch twins or
    Triton), the paged-attention set and the quantized products; and, as its methods,
    where each of them may run. The default is the torch twins throughout."""

    native: CpuKernels | None = None
    attention: AttentionKernels = TORCH_ATTENTION
    matmuls: Matmuls = quantized_matmuls_ref
    # Mixture-of-experts layers, float or GGML-quantized, in one fused kernel (Triton's,
    # on CUDA), or None.
    fused_moe: Callable | None = None
    # The rows up to which the native products compute each row as it would be alone
    # (None: every row count, batch invariance); more take torch's GEMM.
    native_max_rows: int | None = None
    paged: bool = False  # the platform's paged attention
    triton: bool = False  # the platform's kernels are Triton's (CUDA)

    def native_for(self, x: torch.Tensor) -> CpuKernels | None:
        """The compiled kernels where ``x`` runs on them: float32 on the CPU."""
        return ops.native_for(self.native, x)

    def native_rows(self, x: torch.Tensor) -> CpuKernels | None:
        """`native_for`, where the products also compute each of ``x``'s rows alone."""
        limit = self.native_max_rows
        return self.native_for(x) if limit is None or len(x) <= limit else None

    def layer_blocks(self, x: torch.Tensor) -> CpuKernels | None:
        """The compiled kernels where a step over ``x`` may run as the native layer blocks
        (`models.native_blocks`): float32 on the CPU, every row count on the per-row
        products (the blocks call no GEMM)."""
        return self.native_for(x) if self.native_max_rows is None else None

    def moe_layer(
        self,
        router: torch.Tensor,
        experts: list[tuple[Weight, Weight, Weight]],
        top_k: int,
        renormalize: bool,
        biases: Biases | None = None,
        clamped: tuple[float, float] | None = None,
    ) -> NativeMoe | None:
        """A MoE layer of quantized experts (SiLU-gated, or by gpt-oss's clamped SwiGLU
        where ``clamped = (alpha, limit)``; biased where ``biases``) as one native call,
        where the compiled kernels run and take its experts; else None (the torch path)."""
        if self.native is None or len(experts) > MAX_EXPERTS:
            return None
        return NativeMoe(self.native, router, experts, top_k, renormalize, biases, clamped)

    def lora_add(self, x: torch.Tensor, out: torch.Tensor) -> LoraAdd:
        """The segmented LoRA product for a projection's input ``x`` and base output
        ``out`` (`kernels.lora_ref`): the C kernel for float32 on the CPU, Triton's on
        CUDA where the platform runs Triton, else the torch twin."""
        native = self.native_for(x)
        if native is not None and out.dtype is torch.float32:
            return partial(lora_add_native, native)
        if self.triton and x.is_cuda:
            from .triton_lora import lora_add_triton

            return lora_add_triton
        return lora_add_ref

    def embedding_rows(self, weight: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` of a quantized embedding, in float32: gathered and decoded by
        the compiled kernels on the CPU, else decoded by the torch twin."""
        if self.native is None or not ids.is_cpu:
            return weight.rows(ids).dequantize()
        return self.native.gather_rows(weight.native_format, weight.data, ids, weight.shape[1])

    def pages(self, compressor: Compressor | None) -> bool:
        """Whether a model's cache is the paged pool: where the platform chose paged
        attention and the compression method, if any, has a block-pool form
        (``make_codecs``); one without runs a cache per sequence."""
        if self.paged and compressor is not None and compressor.make_codecs is None:
            log.warning(
                "kv_compression.paged_fallback",
                method=compressor.name,
                reason="the method has no block-pool form (make_codecs); its caches run per "
                "sequence, in non-paged mode",
            )
            return False
        return self.paged


# The torch twins everywhere: what a model built without a choice runs on.
TORCH_CHOICE = KernelChoice()


def choose_kernels(decisions: PlatformDecisions) -> KernelChoice:
    native = native_kernels(decisions)
    # Without paged attention no kernel set runs: Triton's then need not load.
    attention = (
        select_attention_kernels(decisions.kernels, native, decisions.batch_invariant)
        if decisions.paged_attn
        else TORCH_ATTENTION
    )
    matmuls = select_matmuls(
        decisions.kernels, native, decisions.cpu_gemm, decisions.batch_invariant
    )
    max_rows = matmuls.max_rows if isinstance(matmuls, CpuMatmuls) else None
    choice = KernelChoice(
        native,
        attention,
        matmuls,
        _fused_moe(decisions.kernels),
        max_rows,
        decisions.paged_attn,
        decisions.kernels == "triton",
    )
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


def select_attention_kernels(
    kind: Literal["torch", "cpu", "triton"],
    native: CpuKernels | None = None,
    batch_invariant: bool = True,
) -> AttentionKernels:
    """The kernel set for the platform's decision (``PlatformDecisions.kernels``), over the
    compiled CPU kernels ``native`` where they run."""
    if kind == "cpu" and native is not None:
        return cpu_kernel_set(native, batch_invariant)
    if kind in ("torch", "cpu"):
        return TORCH_ATTENTION
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
