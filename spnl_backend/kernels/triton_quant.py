"""Triton kernels for GGML-quantized weights (twins: `quant.ggml.dequantize` + `F.linear`).

Every format is decoded per element: the value at column ``k`` of a row reads its block's
scale(s) and its own bits straight from the packed bytes, so one code path serves any tile
shape and any of the eleven formats (a ``tl.constexpr`` picks the formula). The bytes a
tile re-reads (a block's scales) come from cache; the packed matrix is read from memory
once per output tile, which is what a decode-sized product is bound by.

`qmatmul_triton` fuses the decoding into the product for a few rows (decode, a decode
batch); `dequantize_triton` unpacks a whole matrix for the float GEMM of a prefill.
"""

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _i8(ptr, mask):
    byte = _u8(ptr, mask)
    return byte - ((byte >> 7) << 8)


@triton.jit
def _f16(ptr, mask):
    bits = _u8(ptr, mask) | (_u8(ptr + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k4_scale_min(scales, index, mask):
    """The 6-bit scale and min ``index`` (0..7) of a Q4_K/Q5_K block's 12 packed bytes."""
    low = index < 4
    first = _u8(scales + index, mask)  # index < 4: scale; else high bits of scale/min
    second = _u8(scales + index + 4, mask)
    before = _u8(scales + index - 4, mask & (index >= 4))
    scale = tl.where(low, first & 63, (second & 0xF) | ((before >> 6) << 4))
    minimum = tl.where(low, second & 63, (second >> 4) | ((first >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _decode(block, j, mask, QTYPE: tl.constexpr):
    """The float value of element ``j`` of the GGML block at byte pointer ``block``."""
    if QTYPE == 2:  # Q4_0: d, 16 bytes of nibbles (low: 0..15, high: 16..31)
        q = (_u8(block + 2 + (j % 16), mask) >> ((j // 16) * 4)) & 0xF
        return _f16(block, mask) * (q - 8).to(tl.float32)
    elif QTYPE == 3:  # Q4_1: d, m, nibbles
        q = (_u8(block + 4 + (j % 16), mask) >> ((j // 16) * 4)) & 0xF
        return _f16(block, mask) * q.to(tl.float32) + _f16(block + 2, mask)
    elif QTYPE == 6:  # Q5_0: d, 32 high bits, nibbles
        high = (_u8(block + 2 + j // 8, mask) >> (j % 8)) & 1
        q = ((_u8(block + 6 + (j % 16), mask) >> ((j // 16) * 4)) & 0xF) | (high << 4)
        return _f16(block, mask) * (q - 16).to(tl.float32)
    elif QTYPE == 7:  # Q5_1: d, m, 32 high bits, nibbles
        high = (_u8(block + 4 + j // 8, mask) >> (j % 8)) & 1
        q = ((_u8(block + 8 + (j % 16), mask) >> ((j // 16) * 4)) & 0xF) | (high << 4)
        return _f16(block, mask) * q.to(tl.float32) + _f16(block + 2, mask)
    elif QTYPE == 8:  # Q8_0: d, 32 int8
        return _f16(block, mask) * _i8(block + 2 + j, mask).to(tl.float32)
    elif QTYPE == 9:  # Q8_1: d, s (the block's sum, unused here), 32 int8
        return _f16(block, mask) * _i8(block + 4 + j, mask).to(tl.float32)
    elif QTYPE == 10:  # Q2_K: 16 scale/min nibbles, 64 bytes of 2-bit values, d, dmin
        half, within = j // 128, j % 128
        group, lane = within // 32, within % 32
        scale = _u8(block + half * 8 + group * 2 + lane // 16, mask)
        q = (_u8(block + 16 + half * 32 + lane, mask) >> (group * 2)) & 3
        d = _f16(block + 80, mask) * (scale & 0xF).to(tl.float32)
        return d * q.to(tl.float32) - _f16(block + 82, mask) * (scale >> 4).to(tl.float32)
    elif QTYPE == 11:  # Q3_K: 32 bytes of high-bit masks, 2-bit values, 12 scale bytes, d
        half, within = j // 128, j % 128
        group, lane = within // 32, within % 32
        index = half * 8 + group * 2 + lane // 16  # which of the 16 six-bit scales
        low = tl.where(
            index < 8,
            _u8(block + 96 + index % 8, mask) & 0xF,
            _u8(block + 96 + index % 8, mask) >> 4,
        )
        high = (_u8(block + 104 + index % 4, mask) >> ((index // 4) * 2)) & 3
        scale = (low | (high << 4)) - 32
        q = (_u8(block + 32 + half * 32 + lane, mask) >> (group * 2)) & 3
        has_high = (_u8(block + lane, mask) >> (half * 4 + group)) & 1
        value = q - 4 * (1 - has_high)
        return _f16(block + 108, mask) * scale.to(tl.float32) * value.to(tl.float32)
    elif QTYPE == 12:  # Q4_K: d, dmin, 12 scale bytes, 128 bytes of nibbles
        chunk, within = j // 64, j % 64
        scale, minimum = _k4_scale_min(block + 4, chunk * 2 + within // 32, mask)
        q = (_u8(block + 16 + chunk * 32 + within % 32, mask) >> ((within // 32) * 4)) & 0xF
        return _f16(block, mask) * scale * q.to(tl.float32) - _f16(block + 2, mask) * minimum
    elif QTYPE == 13:  # Q5_K: d, dmin, 12 scale bytes, 32 high-bit bytes, nibbles
        chunk, within = j // 64, j % 64
        scale, minimum = _k4_scale_min(block + 4, chunk * 2 + within // 32, mask)
        low = (_u8(block + 48 + chunk * 32 + within % 32, mask) >> ((within // 32) * 4)) & 0xF
        high = (_u8(block + 16 + within % 32, mask) >> (chunk * 2 + within // 32)) & 1
        q = low | (high << 4)
        return _f16(block, mask) * scale * q.to(tl.float32) - _f16(block + 2, mask) * minimum
    elif QTYPE == 39:  # MXFP4: an E8M0 exponent, nibbles (low: 0..15, high: 16..31)
        q = (_u8(block + 1 + (j % 16), mask) >> ((j // 16) * 4)) & 0xF
        m = q & 7  # ggml's doubled E2M1 magnitudes: 0 1 2 3 4 6 8 12
        doubled = tl.where(m < 4, m, tl.where(m < 6, 2 * m - 4, 4 * m - 16))
        doubled = tl.where(q >= 8, -doubled, doubled)
        e = _u8(block, mask)  # 2^(e - 128) by its bits, the two smallest as denormals
        bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
        return bits.to(tl.float32, bitcast=True) * doubled.to(tl.float32)
    else:  # Q6_K: 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, d
        half, within = j // 128, j % 128
        group, lane = within // 32, within % 32
        low = (_u8(block + half * 64 + (group % 2) * 32 + lane, mask) >> ((group // 2) * 4)) & 0xF
        high = (_u8(block + 128 + half * 32 + lane, mask) >> (group * 2)) & 3
        scale = _i8(block + 192 + half * 8 + group * 2 + lane // 16, mask)
        q = (low | (high << 4)) - 32
        return _f16(block + 208, mask) * scale.to(tl.float32) * q.to(tl.float32)


@triton.jit
def weight_tile(w_ptr, rows, cols, n_rows, k_in, row_bytes, QTYPE, QK, BYTES):
    """``W[rows, cols]`` in float32 (zero outside the matrix); `triton_moe` decodes its
    experts' tiles with it too."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < k_in)
    block = w_ptr + rows[:, None].to(tl.int64) * row_bytes + (cols[None, :] // QK) * BYTES
    return tl.where(mask, _decode(block, cols[None, :] % QK, mask, QTYPE), 0.0)


@triton.jit
def _qmatmul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    m_rows,
    n_rows,
    k_in,
    row_bytes,
    stride_x,
    stride_y,
    QTYPE: tl.constexpr,
    QK: tl.constexpr,
    BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # int64: every row count takes this kernel, rows x width may pass 2^31
    rows_m = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = weight_tile(w_ptr, rows_n, cols, n_rows, k_in, row_bytes, QTYPE, QK, BYTES)
        x_mask = (rows_m[:, None] < m_rows) & (cols[None, :] < k_in)
        x = tl.load(x_ptr + rows_m[:, None] * stride_x + cols[None, :], mask=x_mask, other=0.0)
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    y_mask = (rows_m[:, None] < m_rows) & (rows_n[None, :] < n_rows)
    tl.store(y_ptr + rows_m[:, None] * stride_y + rows_n[None, :], acc, mask=y_mask)


@triton.jit
def _dequantize_kernel(
    w_ptr,
    out_ptr,
    n_rows,
    k_in,
    row_bytes,
    QTYPE: tl.constexpr,
    QK: tl.constexpr,
    BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    w = weight_tile(w_ptr, rows, cols, n_rows, k_in, row_bytes, QTYPE, QK, BYTES)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < k_in)
    out = out_ptr + rows[:, None].to(tl.int64) * k_in + cols[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask)


# The formats `_decode` knows: the K-quants hold 256 weights a block, the others 32.
_BLOCK_SIZES = {
    2: 32,
    3: 32,
    6: 32,
    7: 32,
    8: 32,
    9: 32,
    10: 256,
    11: 256,
    12: 256,
    13: 256,
    14: 256,
    39: 32,
}


def block_format(qtype: GGMLQuantizationType, k_in: int, row_bytes: int) -> dict:
    """The block geometry `_decode` needs, from the packed rows themselves (a row is
    ``k_in`` weights' worth of whole blocks)."""
    block_size = _BLOCK_SIZES.get(int(qtype))
    if block_size is None or k_in % block_size or row_bytes % (k_in // block_size):
        raise ValueError(f"{qtype.name} rows of {k_in} weights in {row_bytes} bytes")
    return {"QTYPE": int(qtype), "QK": block_size, "BYTES": row_bytes * block_size // k_in}


def qmatmul_triton(
    x: torch.Tensor, data: torch.Tensor, qtype: GGMLQuantizationType, n_rows: int
) -> torch.Tensor:
    """``x [M, K] @ W.T`` in float32, for ``W [n_rows, K]`` packed as ``data [n_rows, bytes]``."""
    x = x.contiguous()
    m_rows, k_in = x.shape
    y = torch.empty((m_rows, n_rows), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n_rows, BLOCK_N), triton.cdiv(m_rows, BLOCK_M))
    _qmatmul_kernel[grid](
        x,
        data,
        y,
        m_rows,
        n_rows,
        k_in,
        data.shape[1],
        x.stride(0),
        y.stride(0),
        **block_format(qtype, k_in, data.shape[1]),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return y


def dequantize_triton(
    data: torch.Tensor,
    qtype: GGMLQuantizationType,
    shape: tuple[int, int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The matrix ``shape`` packed as ``data [rows, bytes]``, unpacked into ``dtype``."""
    n_rows, k_in = shape
    out = torch.empty(shape, dtype=dtype, device=data.device)
    grid = (triton.cdiv(n_rows, BLOCK_N), triton.cdiv(k_in, BLOCK_K))
    _dequantize_kernel[grid](
        data,
        out,
        n_rows,
        k_in,
        data.shape[1],
        **block_format(qtype, k_in, data.shape[1]),
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return out
