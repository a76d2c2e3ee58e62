"""The CPU's native kernels: C compiled for this machine at first use, called through ctypes.

One C file per kernel family, each kernel the twin of a torch reference elsewhere in the
package: ``quant_matmul.c`` (the quantized matrix products, dequantization),
``layer_ops.c`` (RMSNorm, alone or with the residual add; q/k norms with RoPE),
``paged_attention.c`` (KV store, paged decode attention), ``coded_decode.c`` (decode
attention over compressed KV), ``moe.c`` (a mixture-of-experts layer: routing, the experts'
grouped products, their weighted sum; bound in `kernels.cpu.moe`), ``lora.c`` (the LoRA
adapters' products over a step's rows grouped by adapter; bound in `kernels.cpu.lora`),
``state_layers.c`` (the state layers' recurrences token by token: the gated delta rule,
Mamba-2's SSD scan) and
``layer_blocks.c`` (a decoder layer as two calls of the kernels above, whose twin is the
per-op path of `models.decoder`); ``common.h`` declares
their entry points and argument structs, which `abi` mirrors in ctypes. They
are compiled with the system's C compiler (``-O3 -march=native``, OpenMP where the compiler
has it) into one library in a per-user cache keyed by the sources, compiler and flags, so
later processes load it in milliseconds. Without a compiler everything falls back to the
torch twins, with a warning that says why; ``MISTRALRS_CPU_KERNELS=torch`` asks for that
fallback on purpose.

Every wrapper checks what the C code relies on (dtypes, contiguity, shapes, extents)
before calling it, and the C code checks the extents it is given: a violation is a
`KernelArgumentError`. The indices the attention kernels follow (block tables, slots,
outlier positions) are data, not extents: the engine checks each step's once before any
kernel runs (`kernels.sets.check_step_slots`), and ``MISTRALRS_NATIVE_CHECKS`` builds a
second library that checks every one itself. A caller of these methods outside the
engine, with the plain build, must pass indices inside the pool. A prepared `Products`
keeps its weights' addresses: the weights must not be replaced while it is in use.

The package: `build` (the compiler, the cache, loading), `abi` (the ctypes mirror of
``common.h``), `checks` (what each call relies on), `wrappers` (`CpuKernels`, `Products`:
the calls); `moe` and `layer_blocks` bind the MoE layer and the layer blocks.
"""

from .abi import MAX_HEAD_DIM, Group, LayerArgs, MoeArgs, ProductsArgs, StepArgs
from .build import built_before, cpu_kernels, load_cpu_kernels
from .checks import (
    POOL_DTYPES,
    KernelArgumentError,
    check_keys,
    check_status,
    pool_row,
    require,
)
from .wrappers import CpuKernels, Products, scoring_args

__all__ = [
    "MAX_HEAD_DIM",
    "POOL_DTYPES",
    "CpuKernels",
    "Group",
    "KernelArgumentError",
    "LayerArgs",
    "MoeArgs",
    "Products",
    "ProductsArgs",
    "StepArgs",
    "built_before",
    "check_keys",
    "check_status",
    "cpu_kernels",
    "load_cpu_kernels",
    "pool_row",
    "require",
    "scoring_args",
]
