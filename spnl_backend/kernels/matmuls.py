"""Products of activations with matrices kept in GGML blocks: the kernel paths.

For several matrices of the same input (q/k/v, gate/up) at once, each path returns
``x @ W.T`` side by side in one ``[T, sum of rows]`` float32 tensor. On the CPU every row
count goes through the compiled kernels of `kernels.cpu`, so a row's result never depends
on the rows beside it; only where batch invariance was turned off do many rows (prefill)
dequantize the matrix and take torch's GEMM instead (`CpuMatmuls`). On CUDA the Triton
kernels run; elsewhere the torch twin: dequantize, then ``F.linear``. `kernels.dispatch`
picks one per model.
"""

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from .cpu import CpuKernels
from .thresholds import NATIVE_MAX_ROWS, TRITON_FUSED_ROWS


class PackedWeight(Protocol):
    """A ``[rows, cols]`` matrix as GGML blocks (`quant.linear.QuantizedWeight`)."""

    data: torch.Tensor  # [rows, row_bytes] uint8
    qtype: GGMLQuantizationType
    shape: tuple[int, int]

    @property
    def native_format(self) -> int: ...  # the format number the CPU kernels take ``data`` as

    def rows(self, index: torch.Tensor | slice) -> "PackedWeight": ...

    def as_rows(self) -> "PackedWeight": ...  # as GGML stores it (not the CPU's tiles)

    def dequantize(self) -> torch.Tensor: ...

    def to(self, device: torch.device) -> "PackedWeight": ...


Matmuls = Callable[[torch.Tensor, list["PackedWeight"], dict | None], torch.Tensor]

# Float32 elements of weight dequantized at a time: bounds the transient memory of a prefill
# (the 262k-row head of Gemma would otherwise take 671 MB at once).
DEQUANT_SLICE_ELEMENTS = 1 << 22


class CpuMatmuls:
    """``x @ W.T`` for several matrices of the same input (q/k/v, gate/up), side by side in
    one ``[T, sum of rows]`` float32 tensor, on the CPU's compiled kernels.

    The rows go through one native call that reads, and quantizes, the activations once
    (``prepared`` keeps that call's arguments between steps), whatever their number: each
    row is computed as it would be alone. With a ``gemm_dtype`` (batch invariance turned
    off) more than `NATIVE_MAX_ROWS` rows instead dequantize the matrices slice by slice
    for torch's GEMM in that dtype (bfloat16 where the CPU has it natively: activations
    and weights rounded to 8 mantissa bits, sums in float32)."""

    def __init__(self, native: CpuKernels, gemm_dtype: torch.dtype | None = None) -> None:
        self.native, self.gemm_dtype = native, gemm_dtype
        self.max_rows = None if gemm_dtype is None else NATIVE_MAX_ROWS

    def __call__(
        self, x: torch.Tensor, weights: list[PackedWeight], prepared: dict | None = None
    ) -> torch.Tensor:
        if x.device.type != "cpu":
            return quantized_matmuls_ref(x, weights)
        x = x.float().contiguous()
        if self.max_rows is None or x.shape[0] <= self.max_rows:
            key = tuple(id(w.data) for w in weights)
            prepared = {} if prepared is None else prepared
            if key not in prepared:
                prepared[key] = self.native.products(
                    [(w.native_format, w.data, w.shape[0]) for w in weights]
                )
            return prepared[key](x)
        return self._dequantized_gemm(x, weights)

    def _dequantized_gemm(self, x: torch.Tensor, weights: list[PackedWeight]) -> torch.Tensor:
        """Each matrix unpacked a slice of rows at a time, bounding the transient memory."""
        out = torch.empty((x.shape[0], sum(w.shape[0] for w in weights)), dtype=torch.float32)
        xg = x.to(self.gemm_dtype)
        column = 0
        for weight in weights:
            # whole tiles of 16 rows: a tiled matrix's slices stay tiles (`quant.tiles`)
            step = max(16, DEQUANT_SLICE_ELEMENTS // weight.shape[1] // 16 * 16)
            for start in range(0, weight.shape[0], step):
                part = weight.rows(slice(start, start + step))
                dense = self.native.dequantize(part.native_format, part.data, *part.shape)
                out[:, column : column + part.shape[0]] = F.linear(xg, dense.to(self.gemm_dtype))
                column += part.shape[0]
        return out


def quantized_matmuls_triton(
    x: torch.Tensor, weights: list[PackedWeight], prepared: dict | None = None
) -> torch.Tensor:
    """The products through the Triton kernels (CUDA, or the interpreter), fused for every
    row count: the fixed tiles make each row's sums independent of the others."""
    from .triton_quant import qmatmul_triton

    weights = [w.as_rows() for w in weights]  # tiles are the CPU kernels' alone
    return torch.cat([qmatmul_triton(x, w.data, w.qtype, w.shape[0]) for w in weights], dim=-1)


def quantized_matmuls_triton_fastest(
    x: torch.Tensor, weights: list[PackedWeight], prepared: dict | None = None
) -> torch.Tensor:
    """Without batch invariance: many rows (a prefill) unpack each matrix once and take the
    GEMM in the activations' dtype, on the tensor cores."""
    from .triton_quant import dequantize_triton, qmatmul_triton

    weights = [w.as_rows() for w in weights]  # tiles are the CPU kernels' alone
    if x.shape[0] <= TRITON_FUSED_ROWS:
        parts = [qmatmul_triton(x, w.data, w.qtype, w.shape[0]) for w in weights]
    else:  # in the activations' dtype: bf16/fp16 GEMMs on the tensor cores
        parts = [
            F.linear(x, dequantize_triton(w.data, w.qtype, w.shape, x.dtype)).float()
            for w in weights
        ]
    return torch.cat(parts, dim=-1)


def quantized_matmuls_ref(
    x: torch.Tensor, weights: list[PackedWeight], prepared: dict | None = None
) -> torch.Tensor:
    """The torch twin: dequantize each matrix, then ``F.linear`` in float32."""
    return torch.cat([F.linear(x.float(), w.dequantize().to(x.device)) for w in weights], dim=-1)


def quantized_matmul_ref(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    return quantized_matmuls_ref(x, [weight])


def int8_activations_ref(x: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """The twin of the activation rounding in the native int8 products: ``x [rows, k]`` as
    the kernels quantize it for weights of ``qtype``, back in float32. The k-quants take
    blocks of 256 whose largest magnitude maps to 127, scale ``1 / (127 / max)``; the
    32-value formats blocks of 32 rounded by ``127 / max |x|``, scale ``max |x| / 127``
    rounded to float16. Rounding is to the nearest integer, ties to even."""
    block = 256 if qtype.name.endswith("_K") else 32
    blocks = x.float().reshape(x.shape[0], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    safe = torch.where(amax > 0, amax, 1.0)
    # tensor by tensor: a number over a tensor is taken as a reciprocal times the number
    ratio = torch.full_like(safe, 127.0) / safe
    values = torch.round(blocks * ratio)
    if block == 256:
        scale = torch.ones_like(ratio) / ratio
    else:
        scale = (safe / torch.full_like(safe, 127.0)).half().float()
    # blocks too small for a finite ratio (below 127 / float max) are 0, as in the kernels
    return torch.where((amax > 0) & ratio.isfinite(), values * scale, 0.0).reshape(x.shape)
