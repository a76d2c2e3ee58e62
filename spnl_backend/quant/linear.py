"""Layers that keep their weights in GGML blocks: projections and embeddings.

`QuantLinear` never holds a full-precision copy. On the CPU a few rows (decode, a decode
batch) go through the compiled kernels of `kernels.cpu`; many rows (prefill) dequantize
the matrix for that one product and use torch's GEMM (`CpuMatmuls`). Elsewhere, and
wherever the kernels are unavailable, the torch twin runs: dequantize, then `F.linear`.
Which of them a model uses is decided once, from the platform decisions
(`select_matmuls`).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from ..kernels.cpu import CpuKernels
from .ggml import dequantize
from .quantize import quantize


@dataclass
class QuantizedWeight:
    """A ``[rows, cols]`` matrix as GGML blocks: ``data`` is ``[rows, row_bytes]`` uint8."""

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]

    @classmethod
    def from_float(cls, weight: torch.Tensor, qtype: GGMLQuantizationType) -> "QuantizedWeight":
        return cls(quantize(weight, qtype), qtype, tuple(weight.shape))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        """The torch twin: the whole matrix in float32."""
        return dequantize(self.data.reshape(-1), self.qtype, self.shape)

    def rows(self, index: torch.Tensor | slice) -> "QuantizedWeight":
        data = self.data[index]
        return QuantizedWeight(data, self.qtype, (data.shape[0], self.shape[1]))

    def to(self, device: torch.device) -> "QuantizedWeight":
        return QuantizedWeight(self.data.to(device), self.qtype, self.shape)


# Rows up to which the Triton path fuses decoding into the product; more rows (a prefill)
# unpack the matrix once and take the float GEMM.
TRITON_FUSED_ROWS = 64
Matmuls = Callable[[torch.Tensor, list[QuantizedWeight], dict | None], torch.Tensor]

# Rows up to which the native int8 products are at least as fast as dequantize-then-GEMM
# (measured on the default model with AVX-512: the products re-read every weight block
# once per row group, the GEMM's cost is the unpack). Up to here each row's result is the
# same whatever the other rows, so a speculative verification of a few tokens computes
# each exactly as decoding it alone.
NATIVE_MAX_ROWS = 24
# Float32 elements of weight dequantized at a time: bounds the transient memory of a prefill
# (the 262k-row head of Gemma would otherwise take 671 MB at once).
DEQUANT_SLICE_ELEMENTS = 1 << 22


class CpuMatmuls:
    """``x @ W.T`` for several matrices of the same input (q/k/v, gate/up), side by side in
    one ``[T, sum of rows]`` float32 tensor, on the CPU's compiled kernels.

    A few rows go through one native call that reads, and quantizes, the activations once
    (``prepared`` keeps that call's arguments between steps); more rows dequantize the
    matrices slice by slice for torch's GEMM in ``gemm_dtype`` (bfloat16 where the CPU
    has it natively: 2.5x float32's speed, activations and weights rounded to 8 mantissa
    bits, sums in float32)."""

    def __init__(self, native: CpuKernels, gemm_dtype: torch.dtype) -> None:
        self.native, self.gemm_dtype = native, gemm_dtype
        self.max_rows = native.max_rows if native.exact else NATIVE_MAX_ROWS

    def __call__(
        self, x: torch.Tensor, weights: list[QuantizedWeight], prepared: dict | None = None
    ) -> torch.Tensor:
        if x.device.type != "cpu":
            return quantized_matmuls_ref(x, weights)
        x = x.float().contiguous()
        if x.shape[0] <= self.max_rows:
            key = tuple(id(w.data) for w in weights)
            prepared = {} if prepared is None else prepared
            if key not in prepared:
                prepared[key] = self.native.products(
                    [(w.qtype.value, w.data, w.shape[0]) for w in weights]
                )
            return prepared[key](x)
        return self._dequantized_gemm(x, weights)

    def _dequantized_gemm(self, x: torch.Tensor, weights: list[QuantizedWeight]) -> torch.Tensor:
        """Each matrix unpacked a slice of rows at a time, bounding the transient memory."""
        out = torch.empty((x.shape[0], sum(w.shape[0] for w in weights)), dtype=torch.float32)
        xg = x.to(self.gemm_dtype)
        column = 0
        for weight in weights:
            step = max(1, DEQUANT_SLICE_ELEMENTS // weight.shape[1])
            for start in range(0, weight.shape[0], step):
                part = weight.rows(slice(start, start + step))
                dense = self.native.dequantize(part.qtype.value, part.data, *part.shape)
                out[:, column : column + part.shape[0]] = F.linear(xg, dense.to(self.gemm_dtype))
                column += part.shape[0]
        return out


def quantized_matmuls_triton(
    x: torch.Tensor, weights: list[QuantizedWeight], prepared: dict | None = None
) -> torch.Tensor:
    """`quantized_matmuls` through the Triton kernels (CUDA, or the interpreter)."""
    from ..kernels.triton_quant import dequantize_triton, qmatmul_triton

    if x.shape[0] <= TRITON_FUSED_ROWS:
        parts = [qmatmul_triton(x, w.data, w.qtype, w.shape[0]) for w in weights]
    else:  # in the activations' dtype: bf16/fp16 GEMMs on the tensor cores
        parts = [
            F.linear(x, dequantize_triton(w.data, w.qtype, w.shape, x.dtype)).float()
            for w in weights
        ]
    return torch.cat(parts, dim=-1)


def quantized_matmuls_ref(
    x: torch.Tensor, weights: list[QuantizedWeight], prepared: dict | None = None
) -> torch.Tensor:
    """The torch twin: dequantize each matrix, then ``F.linear`` in float32."""
    return torch.cat([F.linear(x.float(), w.dequantize().to(x.device)) for w in weights], dim=-1)


def quantized_matmul_ref(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    return quantized_matmuls_ref(x, [weight])


def select_matmuls(kind: str, native: CpuKernels | None, gemm_dtype: str | None) -> Matmuls:
    """The quantized products for the platform's kernels (``PlatformDecisions.kernels``)."""
    if kind == "triton":
        return quantized_matmuls_triton
    if kind == "cpu" and native is not None:
        return CpuMatmuls(native, getattr(torch, gemm_dtype or "float32"))
    return quantized_matmuls_ref


class QuantLinear(nn.Module):
    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None = None,
        matmuls: Matmuls = quantized_matmuls_ref,
    ) -> None:
        super().__init__()
        self.weight_q, self.matmuls = weight, matmuls
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape
        self.prepared: dict = {}  # native calls this layer leads, by the weights they take

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return QuantLinear.apply_many(x, [self])[0]

    @staticmethod
    def apply_many(x: torch.Tensor, layers: list["QuantLinear"]) -> list[torch.Tensor]:
        """Several quantized projections of the same ``x`` in one pass."""
        flat = x.reshape(-1, layers[0].in_features)
        weights = [layer.weight_q for layer in layers]
        out = layers[0].matmuls(flat, weights, layers[0].prepared)
        parts = out.split([layer.out_features for layer in layers], dim=-1)
        return [_finish(part, layer, x) for part, layer in zip(parts, layers, strict=True)]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.weight_q.qtype.name}"


def _finish(out: torch.Tensor, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    if layer.bias is None and x.dtype == torch.float32 and x.dim() == 2:
        return out  # the common decode case: already what the caller wants
    out = out.to(x.dtype)
    if layer.bias is not None:
        out = out + layer.bias
    return out.reshape(*x.shape[:-1], layer.out_features)


class QuantEmbedding(nn.Module):
    """Token embeddings kept quantized; also the output projection of tied models."""

    def __init__(
        self, weight: QuantizedWeight, dtype: torch.dtype, matmuls: Matmuls = quantized_matmuls_ref
    ) -> None:
        super().__init__()
        self.weight_q, self.dtype, self.matmuls = weight, dtype, matmuls
        self.num_embeddings, self.embedding_dim = weight.shape
        self.prepared: dict = {}
        self.native: CpuKernels | None = None  # set by the loader where they run

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        native = self.native if ids.device.type == "cpu" else None
        if native is not None:
            rows = native.gather_rows(
                self.weight_q.qtype.value, self.weight_q.data, ids.reshape(-1), self.embedding_dim
            )
        else:
            rows = self.weight_q.rows(ids.reshape(-1)).dequantize()
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.matmuls(hidden, [self.weight_q], self.prepared)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.weight_q.qtype.name}"
