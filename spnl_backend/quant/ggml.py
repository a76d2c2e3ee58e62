"""GGML block formats: their layouts and vectorised torch dequantization.

Each quantized type packs a fixed number of weights (the block size) into a fixed
number of bytes. The dequantizers take ``[n_blocks, type_size]`` uint8 tensors and
return ``[n_blocks, block_size]`` float32, multiplying in the same order as ggml's
reference code so the results match it bit for bit.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256


@dataclass(frozen=True)
class GGMLFormat:
    qtype: GGMLQuantizationType
    block_size: int
    type_size: int

    @property
    def name(self) -> str:
        return self.qtype.name

    def nbytes(self, n_elements: int) -> int:
        return n_elements // self.block_size * self.type_size


# ggml's block_q8_1 holds two float16s and 32 int8s (36 bytes); gguf-py 0.19 still lists
# an older 40-byte layout.
_SIZES = {**GGML_QUANT_SIZES, GGMLQuantizationType.Q8_1: (32, 36)}


def ggml_format(qtype: GGMLQuantizationType) -> GGMLFormat:
    block_size, type_size = _SIZES[qtype]
    return GGMLFormat(qtype, block_size, type_size)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian float16 at byte ``start`` of every block, as float32 ``[n, 1]``."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Low nibbles of all bytes, then high nibbles: ``[..., k]`` → ``[..., 2k]``."""
    return torch.cat([packed & 0xF, packed >> 4], dim=-1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """Every bit of ``[n, k]`` bytes, least significant first: ``[n, 8k]``."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(1)


def _bit_planes(packed: torch.Tensor) -> torch.Tensor:
    """Bit ``b`` of each of ``[n, 32]`` bytes, as plane ``b``: ``[n, 8, 32]``."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device).view(1, 8, 1)
    return (packed.unsqueeze(1) >> shifts) & 1


def _crumbs(packed: torch.Tensor, count: int) -> torch.Tensor:
    """2-bit fields at shifts 0, 2, 4, 6 of ``[n, g, 32]`` bytes: ``[n, g, count, 32]``."""
    shifts = torch.arange(0, 2 * count, 2, dtype=torch.uint8, device=packed.device)
    return (packed.unsqueeze(2) >> shifts.view(1, 1, count, 1)) & 3


def _dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:18]).float() - 8
    return q * d


def _dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:20]).float()
    return q * d + m


def _dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 6:22]) | (_bits(blocks[:, 2:6]) << 4)
    return (q.float() - 16) * d


def _dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 8:24]) | (_bits(blocks[:, 4:8]) << 4)
    return q.float() * d + m


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return blocks[:, 2:34].contiguous().view(torch.int8).float() * d


def _dequantize_q8_1(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return blocks[:, 4:36].contiguous().view(torch.int8).float() * d


def _dequantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * (scales & 0xF).float()).unsqueeze(-1)
    ml = (dmin * (scales >> 4).float()).unsqueeze(-1)
    q = _crumbs(blocks[:, 16:80].reshape(n, 2, 32), 4).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """16 signed 6-bit scales: low nibbles in bytes 0-7, high crumbs in bytes 8-11."""
    low = _nibbles(packed[:, 0:8])
    high = _crumbs(packed[:, 8:12].unsqueeze(1), 4).flatten(1)
    return (low | (high << 4)).float() - 32


def _dequantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks, 108)
    dl = (d * _q3_k_scales(blocks[:, 96:108])).unsqueeze(-1)
    low = _crumbs(blocks[:, 32:96].reshape(n, 2, 32), 4)
    high_bit = _bit_planes(blocks[:, 0:32])
    q = low.reshape(n, 8, 32).to(torch.int8) - ((1 - high_bit) << 2).to(torch.int8)
    return (dl * q.reshape(n, 16, 16).float()).reshape(n, QK_K)


def _k4_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 6-bit scales and 8 6-bit mins of Q4_K/Q5_K, packed into 12 bytes."""
    first, last, upper = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([first & 63, (upper & 0xF) | ((first >> 6) << 4)], dim=1)
    mins = torch.cat([last & 63, (upper >> 4) | ((last >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k4_scales_mins(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return ((d * scales).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)).reshape(n, QK_K)


def _dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k4_scales_mins(blocks[:, 4:16])
    low = _nibbles(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    q = (low | (_bit_planes(blocks[:, 16:48]) << 4)).float()
    return ((d * scales).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)).reshape(n, QK_K)


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 2, 32)
    low = torch.cat([ql & 0xF, ql >> 4], dim=2)  # [n, half, 4 groups, 32]
    high = _crumbs(blocks[:, 128:192].reshape(n, 2, 32), 4)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(blocks, 208)
    return ((d * scales).unsqueeze(-1) * q).reshape(n, QK_K)


# MXFP4 (OCP microscaling): 32 E2M1 values (1 sign, 2 exponent, 1 mantissa bit) sharing an
# E8M0 scale (a power of two, 2^(e - 127)). ggml stores the E2M1 values doubled, as int8,
# and halves the scale to match: value j in the low nibble of byte j, j + 16 in its high.
_E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
MXFP4_NAN_SCALE = 0xFF  # E8M0's one non-number


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """``2^(e - 128)`` of uint8 exponents, as float32 with ggml's bits (the two smallest
    as denormals)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _dequantize_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    d = e8m0_half(blocks[:, 0]).unsqueeze(-1)
    values = torch.tensor(_E2M1_DOUBLED, dtype=torch.float32, device=blocks.device)
    return values[_nibbles(blocks[:, 1:17]).long()] * d


def mxfp4_from_microscaling(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's MXFP4 tensors (``*_blocks [..., groups, 16]``: values 2i and 2i + 1 in the
    low and high nibble of byte i; ``*_scales [..., groups]``: the E8M0 exponents) as
    ggml's blocks ``[..., groups * 17]`` of the same values (the exponent byte as it is:
    ggml's doubled values under its halved scale are the same numbers)."""
    values = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2)  # [..., g, 32]
    packed = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), packed], dim=-1).flatten(-2)


DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q4_0: _dequantize_q4_0,
    GGMLQuantizationType.Q4_1: _dequantize_q4_1,
    GGMLQuantizationType.Q5_0: _dequantize_q5_0,
    GGMLQuantizationType.Q5_1: _dequantize_q5_1,
    GGMLQuantizationType.Q8_0: _dequantize_q8_0,
    GGMLQuantizationType.Q8_1: _dequantize_q8_1,
    GGMLQuantizationType.Q2_K: _dequantize_q2_k,
    GGMLQuantizationType.Q3_K: _dequantize_q3_k,
    GGMLQuantizationType.Q4_K: _dequantize_q4_k,
    GGMLQuantizationType.Q5_K: _dequantize_q5_k,
    GGMLQuantizationType.Q6_K: _dequantize_q6_k,
    GGMLQuantizationType.MXFP4: _dequantize_mxfp4,
}
FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
SUPPORTED_TYPES = tuple(FLOAT_TYPES) + tuple(DEQUANTIZERS)
# Where each format keeps its float16 scales in a block: d, and dmin (or Q8_1's sum s).
SCALE_OFFSETS = {
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,),
    GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q8_1: (0, 2),
    GGMLQuantizationType.Q2_K: (80, 82),
    GGMLQuantizationType.Q3_K: (108,),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}
_F16_EXPONENT = 0x7C  # in the high byte; all ones: infinity or NaN


def nonfinite_scales(data: torch.Tensor, qtype: GGMLQuantizationType) -> int:
    """How many float16 scales in the blocks of ``data`` (uint8, whole blocks) are NaN or
    infinite. Every other field is a small integer, so a block dequantizes to finite
    values exactly when its scales are finite: this checks a quantized tensor without
    dequantizing it, reading the high byte of each scale through a strided view. (In
    numpy: a reduction this small costs less than torch's per-op thread dispatch.)"""
    blocks = data.detach().cpu().numpy().reshape(-1, ggml_format(qtype).type_size)
    if qtype == GGMLQuantizationType.MXFP4:  # an exponent byte, not a float16
        return int(np.count_nonzero(blocks[:, 0] == MXFP4_NAN_SCALE))
    return sum(
        int(np.count_nonzero((blocks[:, offset + 1] & _F16_EXPONENT) == _F16_EXPONENT))
        for offset in SCALE_OFFSETS[qtype]
    )


def dequantize(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Raw bytes of one tensor → float32 tensor of ``shape`` (rows last-dim contiguous)."""
    if qtype in FLOAT_TYPES:
        return raw.view(FLOAT_TYPES[qtype]).float().reshape(shape)
    fmt = ggml_format(qtype)
    blocks = raw.reshape(-1, fmt.type_size)
    return DEQUANTIZERS[qtype](blocks).reshape(shape)
