"""Kernels: Triton and C kernels beside their torch reference twins, chosen in one place.

- `dispatch`: the one decision, from the platform decisions (`choose_kernels`);
- `thresholds`: the row counts at which a kernel set switches arithmetic;
- `sets`: the paged-attention kernel sets (torch, CPU, Triton), one signature;
- `matmuls`: the quantized products (CPU, Triton, torch);
- `cpu`: the compiled C kernels; `ops`: the per-layer operations over them;
- `*_ref`: the torch twins; `triton_*`: the Triton kernels; `metadata`: a step's layout.
"""

from .dispatch import KernelChoice, choose_kernels, native_kernels, select_attention_kernels
from .sets import TORCH_ATTENTION, AttentionKernels, check_step_slots, cpu_kernel_set, decode_rows

__all__ = [
    "TORCH_ATTENTION",
    "AttentionKernels",
    "KernelChoice",
    "check_step_slots",
    "choose_kernels",
    "cpu_kernel_set",
    "decode_rows",
    "native_kernels",
    "select_attention_kernels",
]
