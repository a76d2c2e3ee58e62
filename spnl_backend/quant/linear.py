"""Layers that keep their weights in GGML blocks: projections and embeddings.

`QuantLinear` never holds a full-precision copy: its products run on the kernel path
that `kernels.dispatch` chose for the model (`kernels.matmuls`).
"""

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType
from torch import nn

from ..kernels.dispatch import TORCH_CHOICE, KernelChoice
from ..kernels.lora_ref import LoraSite
from ..kernels.matmuls import Matmuls, quantized_matmuls_ref
from . import tiles
from .ggml import dequantize
from .quantize import quantize


@dataclass
class QuantizedWeight:
    """A ``[rows, cols]`` matrix as GGML blocks: ``data`` is ``[rows, row_bytes]`` uint8;
    where ``tiled``, Q4_K's or Q6_K's rows reordered in tiles of 16 for the CPU's products
    (`quant.tiles`), which every method here reads through."""

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    tiled: bool = False

    def __post_init__(self) -> None:
        if self.tiled and self.qtype not in tiles.BLOCK_BYTES:
            raise ValueError(
                f"{self.qtype.name} has no tiles; tiled weights are "
                + ", ".join(q.name for q in tiles.BLOCK_BYTES)
            )

    @classmethod
    def from_float(cls, weight: torch.Tensor, qtype: GGMLQuantizationType) -> "QuantizedWeight":
        return cls(quantize(weight, qtype), qtype, tuple(weight.shape))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def native_format(self) -> int:
        """The format number the compiled CPU kernels take these bytes as."""
        return tiles.tiled_format(self.qtype) if self.tiled else self.qtype.value

    def as_rows(self) -> "QuantizedWeight":
        """The matrix as GGML stores it (itself where it is not tiled)."""
        if not self.tiled:
            return self
        return QuantizedWeight(tiles.untile(self.data, self.qtype), self.qtype, self.shape)

    def as_tiles(self, native) -> "QuantizedWeight":
        """The matrix in tiles (`quant.tiles.tileable` says where that is worth it), made
        by ``native``'s kernels in a buffer of its own."""
        if self.tiled:
            return self
        data = native.tile(self.qtype, self.data, self.shape[1])
        return QuantizedWeight(data, self.qtype, self.shape, tiled=True)

    def tile_in_place(self, native) -> None:
        """This weight's own bytes made tiles by ``native``'s kernels, without a second copy:
        only for a weight that alone holds its bytes (`loader.tiling`), since whatever else
        read them would then read tiles as rows."""
        if not self.tiled:
            native.tile(self.qtype, self.data, self.shape[1], in_place=True)
            self.tiled = True

    def dequantize(self) -> torch.Tensor:
        """The torch twin: the whole matrix in float32."""
        return dequantize(self.as_rows().data.reshape(-1), self.qtype, self.shape)

    def rows(self, index: torch.Tensor | slice) -> "QuantizedWeight":
        """Some of the rows. Of tiles, a slice that starts and ends on tiles stays tiles
        (its last rows past the tiles only where the matrix's are); anything else, rows."""
        if self.tiled and not _whole_tiles(index, self.shape[0]):
            return self.as_rows().rows(index)
        data = self.data[index]
        return QuantizedWeight(data, self.qtype, (data.shape[0], self.shape[1]), self.tiled)

    def to(self, device: torch.device) -> "QuantizedWeight":
        """On ``device``: tiles only on the host, where their kernels are."""
        weight = self if torch.device(device).type == "cpu" else self.as_rows()
        return QuantizedWeight(weight.data.to(device), self.qtype, self.shape, weight.tiled)


def _whole_tiles(index: torch.Tensor | slice, rows: int) -> bool:
    """Whether ``index`` takes whole tiles of a tiled matrix of ``rows`` (and then, only
    at the end, its rows past the tiles)."""
    if not isinstance(index, slice) or index.step not in (None, 1):
        return False
    start, stop, _ = index.indices(rows)
    return start % tiles.TILE_ROWS == 0 and (stop % tiles.TILE_ROWS == 0 or stop == rows)


@dataclass
class QuantizedExperts:
    """One projection of every expert as GGML blocks of one type, for the fused
    mixture-of-experts kernel: ``data`` is ``[experts, rows, row_bytes]`` uint8, ``shape``
    one expert's matrix (its weights' rows one after another: gate, then up)."""

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]

    @staticmethod
    def stackable(experts: list[list[QuantizedWeight]]) -> bool:
        """Whether the weights share one type and width, and the experts one row count
        (and are rows: a stack is rows, `quant.tiles` are not)."""
        first = experts[0][0]
        if any(w.tiled for weights in experts for w in weights):
            return False
        same = all(
            w.qtype == first.qtype and w.shape[1] == first.shape[1]
            for weights in experts
            for w in weights
        )
        return same and len({sum(w.shape[0] for w in weights) for weights in experts}) == 1

    @classmethod
    def stack(cls, experts: list[list[QuantizedWeight]]) -> "QuantizedExperts":
        """Each expert's weights moved into one stack, and left as views of it. The stack is
        allocated whole and the old blocks go as nothing refers to them any more (where
        they are slices of one tensor, a GGUF's, only once the last expert has moved): at
        most this projection's experts twice, never the model's. Check `stackable` first."""
        first = experts[0][0]
        rows = sum(w.shape[0] for w in experts[0])
        row_bytes = first.data.reshape(first.shape[0], -1).shape[1]
        data = torch.empty(
            (len(experts), rows, row_bytes), dtype=torch.uint8, device=first.data.device
        )
        for i, weights in enumerate(experts):
            start = 0
            for w in weights:
                end = start + w.shape[0]
                data[i, start:end] = w.data.reshape(w.shape[0], row_bytes)
                w.data = data[i, start:end]
                start = end
        return cls(data, first.qtype, (rows, first.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The torch twin: every expert's matrix in float32, ``[experts, rows, cols]``."""
        return dequantize(self.data.reshape(-1), self.qtype, (len(self.data), *self.shape))


class QuantLinear(nn.Module):
    lora: LoraSite | None = None  # LoRA adapters' products, added row by row

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
        flat = x.reshape(-1, self.in_features)
        return _finish(self.matmuls(flat, [self.weight_q], self.prepared), self, x)

    @staticmethod
    def apply_many(x: torch.Tensor, layers: list["QuantLinear"]) -> list[torch.Tensor]:
        """Several quantized projections of the same ``x`` in one pass."""
        flat = x.reshape(-1, layers[0].in_features)
        weights = [layer.weight_q for layer in layers]
        out = layers[0].matmuls(flat, weights, layers[0].prepared)
        # the tensor method itself: Tensor.split's Python wrapper costs more than the views
        parts = out.split_with_sizes([layer.out_features for layer in layers], dim=-1)
        return [_finish(part, layer, x) for part, layer in zip(parts, layers, strict=True)]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.weight_q.qtype.name}"


def _finish(out: torch.Tensor, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    if layer.lora is not None:
        out = layer.lora.add(x, out)
    if layer.bias is None and out.dtype is x.dtype and x.dim() == 2:
        return out  # the common decode case (float32 rows): already what the caller wants
    out = out.to(x.dtype)
    if layer.bias is not None:
        out = out + layer.bias
    return out.reshape(*x.shape[:-1], layer.out_features)


class QuantEmbedding(nn.Module):
    """Token embeddings kept quantized; also the output projection of tied models."""

    def __init__(
        self, weight: QuantizedWeight, dtype: torch.dtype, kernels: KernelChoice = TORCH_CHOICE
    ) -> None:
        super().__init__()
        self.weight_q, self.dtype, self.kernels = weight, dtype, kernels
        self.num_embeddings, self.embedding_dim = weight.shape
        self.prepared: dict = {}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.kernels.embedding_rows(self.weight_q, ids.reshape(-1))
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.kernels.matmuls(hidden, [self.weight_q], self.prepared)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.weight_q.qtype.name}"
