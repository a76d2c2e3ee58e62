"""Per-vector codecs: a ``[tokens, heads, dim]`` tensor ↔ fixed-size byte records.

Every token's K (or V) of one head becomes ``record_bytes`` bytes, so records fit a
growing per-sequence buffer and a paged block pool alike. A codec may store vectors in a
rotated domain (``rotation``, orthogonal, ``x @ rotation``); attention then runs there,
with the query rotated the same way and the output rotated back. Documented error bounds
are tested in tests/test_compression.py.
"""

from typing import Protocol

import torch

from ..kernels.attention_ref import raw_scores
from ..kernels.paged_ref import FP8_MAX, fp8_scale

FP8 = torch.float8_e4m3fn


class VectorCodec(Protocol):
    record_bytes: int
    rotation: torch.Tensor | None

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, dim]`` → uint8 records ``[T, heads, record_bytes]``."""
        ...

    def decode(self, layer: int, records: torch.Tensor) -> torch.Tensor:
        """Records → float32 ``[T, heads, dim]`` in the codec's domain (what values are
        summed in)."""
        ...

    def dequantize(self, layer: int, records: torch.Tensor) -> torch.Tensor:
        """Records → float32 ``[T, heads, dim]`` in the model's domain."""
        ...

    def scores(self, layer: int, q: torch.Tensor, records: torch.Tensor) -> torch.Tensor:
        """Raw products of queries ``[nq, heads, dim]`` (model domain) with the stored keys:
        float32 ``[heads, nq, T]``, corrections included."""
        ...

    def logit_bias(self, layer: int, q: torch.Tensor, records: torch.Tensor) -> torch.Tensor | None:
        """The part of `scores` that `dequantize` does not carry (None for most codecs)."""
        ...

    def fork(self) -> "VectorCodec":
        """A codec that reads this one's records (shares its state as it is now)."""
        ...


class DenseCodec:
    """What a codec whose `decode` is the whole vector gets for free."""

    rotation: torch.Tensor | None = None

    def decode(self, layer: int, records: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, layer: int, records: torch.Tensor) -> torch.Tensor:
        x = self.decode(layer, records)
        return x if self.rotation is None else x @ self.rotation.T

    def scores(self, layer: int, q: torch.Tensor, records: torch.Tensor) -> torch.Tensor:
        q = q.float() if self.rotation is None else q.float() @ self.rotation
        return raw_scores(q, self.decode(layer, records))

    def logit_bias(self, layer: int, q: torch.Tensor, records: torch.Tensor) -> torch.Tensor | None:
        return None


def float_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` → its float32 bytes ``[..., 4n]``."""
    return x.float().contiguous().view(torch.uint8)


def bytes_float(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., n]`` codes below ``2**bits`` → ``[..., n * bits / 8]`` bytes: each group
    of 8 codes is one little-endian ``bits * 8``-bit word, code i at bit ``bits * i``."""
    if bits == 8:
        return codes.to(torch.uint8)
    groups = codes.to(torch.int64).unflatten(-1, (-1, 8))
    shifts = torch.arange(8, device=codes.device) * bits
    word = (groups << shifts).sum(-1, keepdim=True)
    out = (word >> (torch.arange(bits, device=codes.device) * 8)) & 0xFF
    return out.to(torch.uint8).flatten(-2)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack_bits`, as int64 codes."""
    if bits == 8:
        return packed.to(torch.int64)
    groups = packed.to(torch.int64).unflatten(-1, (-1, bits))
    word = (groups << (torch.arange(bits, device=packed.device) * 8)).sum(-1, keepdim=True)
    codes = (word >> (torch.arange(8, device=packed.device) * bits)) & ((1 << bits) - 1)
    return codes.flatten(-2)


class Fp8Codec(DenseCodec):
    """float8_e4m3fn with one scale per layer (per tensor): from the layer's largest
    magnitude on the reference text where the engine measured it (`KVGeometry.kv_absmax`),
    else from the first K/V stored.

    Error: ``|x - x'| <= 2**-4 * |x| + 2**-10 * scale`` while ``|x| <= 448 * scale``
    (3 mantissa bits, round to nearest; subnormals below ``2**-6 * scale``); larger
    values are clamped.
    """

    def __init__(self, num_layers: int, head_dim: int, absmax: list[float] | None = None) -> None:
        self.record_bytes = head_dim
        self.scales: list[float | None] = (
            [None] * num_layers if absmax is None else [fp8_scale(torch.tensor(m)) for m in absmax]
        )

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        scale = self.scales[layer]
        if scale is None:
            scale = self.scales[layer] = fp8_scale(x)
        scaled = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX)
        return scaled.to(FP8).view(torch.uint8)

    def decode(self, layer: int, records: torch.Tensor) -> torch.Tensor:
        scale = self.scales[layer] or 1.0
        return records.contiguous().view(FP8).float() * scale

    def fork(self) -> "Fp8Codec":
        twin = Fp8Codec(len(self.scales), self.record_bytes)
        twin.scales = list(self.scales)
        return twin


class Int8Codec(DenseCodec):
    """Symmetric int8 with a float32 scale per token and head (``absmax / 127``).

    Error: ``|x - x'| <= absmax / 254`` for every element of a vector.
    """

    def __init__(self, head_dim: int) -> None:
        self.head_dim = head_dim
        self.record_bytes = head_dim + 4

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        scale = x.abs().amax(-1, keepdim=True) / 127.0
        codes = torch.round(x / scale.clamp_min(1e-30)).clamp(-127, 127).to(torch.int8)
        return torch.cat([codes.view(torch.uint8), float_bytes(scale)], dim=-1)

    def decode(self, layer: int, records: torch.Tensor) -> torch.Tensor:
        codes = records[..., : self.head_dim].contiguous().view(torch.int8)
        return codes.float() * bytes_float(records[..., self.head_dim :])

    def fork(self) -> "Int8Codec":
        return self
