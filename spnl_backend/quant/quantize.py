"""Quantization to the GGML block formats, vectorised over blocks in torch.

Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 follow ggml's reference code exactly (so the bytes
equal gguf-py's); Q8_1 is ggml's activation format; the K-quants follow llama.cpp's
reference quantizers (``quantize_row_q*_K_ref``): per sub-block scale (and min)
searches weighted by the values, then scales quantized to 6 or 4 bits, then the
values requantized against the rounded scales. Loops run over the few search steps or
positions of a block, never over blocks.
"""

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType as Q

from .ggml import QK_K, ggml_format

_EPS = 1e-15  # llama.cpp's GROUP_MAX_EPS


QUANTIZE_SLICE_ELEMENTS = 1 << 20


def quantize(weight: torch.Tensor, qtype: Q) -> torch.Tensor:
    """A float matrix ``[rows, cols]`` → its blocks, ``[rows, cols / block * type_size]`` uint8."""
    fmt = ggml_format(qtype)
    rows, cols = weight.shape
    if cols % fmt.block_size:
        raise ValueError(
            f"rows of {cols} values do not split into {qtype.name} blocks of {fmt.block_size}"
        )
    row_bytes = cols // fmt.block_size * fmt.type_size
    out = torch.empty((rows, row_bytes), dtype=torch.uint8, device=weight.device)
    # Blocks are independent: a slice of rows at a time bounds the search's temporaries
    # (the K-quants' hold many copies of their input) without changing a byte.
    step = max(1, QUANTIZE_SLICE_ELEMENTS // cols)
    for start in range(0, rows, step):
        blocks = weight[start : start + step].detach().float().reshape(-1, fmt.block_size)
        out[start : start + step] = QUANTIZERS[qtype](blocks).reshape(-1, row_bytes)
    return out


def _half(values: torch.Tensor) -> torch.Tensor:
    """float32 ``[n]`` → little-endian float16 bytes ``[n, 2]``."""
    return values.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def _half_value(values: torch.Tensor) -> torch.Tensor:
    """What a float32 becomes after a round trip through float16."""
    return values.to(torch.float16).float()


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[n, 32]`` values < 16 → 16 bytes: value i low, value i + 16 high."""
    return (q[:, :16] | (q[:, 16:] << 4)).to(torch.uint8)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``[n, 8k]`` bits → ``[n, k]`` bytes, least significant bit first."""
    weights = (1 << torch.arange(8, dtype=torch.int32)).view(1, 1, 8)
    return (bits.view(bits.shape[0], -1, 8).int() * weights).sum(-1).to(torch.uint8)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, 1, d))


def _ratio(levels: int, peak: torch.Tensor) -> torch.Tensor:
    """``levels / peak``, or 0 where the peak is not positive (as llama.cpp computes it)."""
    return torch.where(peak > 0, levels / torch.where(peak > 0, peak, 1), 0.0)


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (computed as ggml's reference does)."""
    a = x.abs()
    floored = torch.floor(a)
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored)))


def _absmax_signed(x: torch.Tensor) -> torch.Tensor:
    """Per row, the value of largest magnitude with its sign (the first such)."""
    return torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))


# ---- the 32-value formats -------------------------------------------------------------------


def _quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(-1, keepdim=True) / 127
    q = _round_away(x * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_half(d.squeeze(-1)), q], dim=1)


def _quantize_q8_1(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(-1, keepdim=True) / 127
    q = _round_away(x * _inverse(d))
    s = q.sum(-1) * d.squeeze(-1)
    return torch.cat([_half(d.squeeze(-1)), _half(s), q.to(torch.int8).view(torch.uint8)], dim=1)


def _symmetric(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0/Q5_0: d = max / -levels/2, values shifted to 0..levels-1."""
    half = levels // 2
    d = _absmax_signed(x) / -half
    q = torch.trunc(x * _inverse(d) + (half + 0.5)).clamp(0, levels - 1).to(torch.int32)
    return d.squeeze(-1), q


def _affine(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1/Q5_1: d = (max - min) / (levels - 1), values above the min."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = (hi - lo) / (levels - 1)
    q = torch.trunc((x - lo) * _inverse(d) + 0.5).clamp(0, levels - 1).to(torch.int32)
    return d.squeeze(-1), lo.squeeze(-1), q


def _quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    d, q = _symmetric(x, 16)
    return torch.cat([_half(d), _pack_nibbles(q)], dim=1)


def _quantize_q4_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, q = _affine(x, 16)
    return torch.cat([_half(d), _half(lo), _pack_nibbles(q)], dim=1)


def _quantize_q5_0(x: torch.Tensor) -> torch.Tensor:
    d, q = _symmetric(x, 32)
    return torch.cat([_half(d), _pack_bits(q >> 4), _pack_nibbles(q & 0xF)], dim=1)


def _quantize_q5_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, q = _affine(x, 32)
    return torch.cat([_half(d), _half(lo), _pack_bits(q >> 4), _pack_nibbles(q & 0xF)], dim=1)


# ---- llama.cpp's scale searches -------------------------------------------------------------


def _scale_min_search(
    x: torch.Tensor,
    weights: torch.Tensor,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    use_mad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``make_qkx2_quants`` over groups ``[g, n]``: the affine (scale, min) that minimises
    the weighted error, trying ``nstep`` stretches of the min-max range.

    Returns ``(scale [g], -min [g], levels [g, n])``.
    """
    lo = x.amin(-1).clamp(max=0)
    hi = x.amax(-1)
    flat = hi <= lo
    sum_w = weights.sum(-1)
    sum_x = (weights * x).sum(-1)

    def error(scale: torch.Tensor, minimum: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        diff = scale.unsqueeze(-1) * levels + minimum.unsqueeze(-1) - x
        return (weights * (diff.abs() if use_mad else diff * diff)).sum(-1)

    def levels_for(stretch: float, minimum: torch.Tensor) -> torch.Tensor:
        span = torch.where(hi > minimum, hi - minimum, torch.ones_like(hi))
        iscale = (stretch + nmax) / span
        return torch.round(iscale.unsqueeze(-1) * (x - minimum.unsqueeze(-1))).clamp(0, nmax)

    best_levels = levels_for(0.0, lo)
    best_scale = torch.where(flat, 1.0, hi - lo) / nmax
    best_min = lo
    best_error = error(best_scale, best_min, best_levels)
    for step in range(nstep + 1):
        # Like llama.cpp, each stretch starts from the best minimum found so far.
        levels = levels_for(rmin + rdelta * step, best_min)
        sum_l = (weights * levels).sum(-1)
        sum_l2 = (weights * levels * levels).sum(-1)
        sum_xl = (weights * levels * x).sum(-1)
        det = sum_w * sum_l2 - sum_l * sum_l
        safe_det = torch.where(det > 0, det, torch.ones_like(det))
        scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        minimum = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        positive = minimum > 0
        minimum = torch.where(positive, torch.zeros_like(minimum), minimum)
        scale = torch.where(positive, sum_xl / torch.where(sum_l2 > 0, sum_l2, 1), scale)
        err = error(scale, minimum, levels)
        better = (det > 0) & (err < best_error)
        best_levels = torch.where(better.unsqueeze(-1), levels, best_levels)
        best_scale = torch.where(better, scale, best_scale)
        best_min = torch.where(better, minimum, best_min)
        best_error = torch.where(better, err, best_error)
    best_scale = torch.where(flat, torch.zeros_like(best_scale), best_scale)
    best_levels = torch.where(flat.unsqueeze(-1), torch.zeros_like(best_levels), best_levels)
    return best_scale, -best_min, best_levels


def _symmetric_search(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qx_quants`` (rmse type 1) over groups ``[g, n]``: the scale that minimises the
    error weighted by x², trying 18 nearby stretches. Returns ``(scale, levels + nmax)``."""
    peak = _absmax_signed(x).squeeze(-1)
    tiny = peak.abs() < _EPS
    safe_peak = torch.where(tiny, torch.ones_like(peak), peak)
    weights = x * x

    def attempt(stretch: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        iscale = -(nmax + stretch) / safe_peak
        levels = torch.round(iscale.unsqueeze(-1) * x).clamp(-nmax, nmax - 1)
        return levels, (weights * x * levels).sum(-1), (weights * levels * levels).sum(-1)

    best_levels, sum_lx, sum_l2 = attempt(0.0)
    scale = torch.where(sum_l2 > 0, sum_lx / torch.where(sum_l2 > 0, sum_l2, 1), 0.0)
    best = scale * sum_lx
    for step in (*range(-9, 0), *range(1, 10)):
        levels, slx, sl2 = attempt(0.1 * step)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        best_levels = torch.where(better.unsqueeze(-1), levels, best_levels)
        scale = torch.where(better, slx / torch.where(sl2 > 0, sl2, 1), scale)
        best = torch.where(better, scale * slx, best)
    scale = torch.where(tiny, torch.zeros_like(scale), scale)
    best_levels = torch.where(tiny.unsqueeze(-1), torch.full_like(best_levels, -nmax), best_levels)
    return scale, (best_levels + nmax).to(torch.int32)


def _rmse_refine(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_q3_quants`` with rmse: start from the max-based scale, then move single
    values to the level that improves the x²-weighted fit, up to five sweeps."""
    peak = _absmax_signed(x).squeeze(-1)
    tiny = peak.abs() < _EPS
    iscale = -nmax / torch.where(tiny, torch.ones_like(peak), peak)
    levels = torch.round(iscale.unsqueeze(-1) * x).clamp(-nmax, nmax - 1)
    weights = x * x
    sum_lx = (weights * x * levels).sum(-1)
    sum_l2 = (weights * levels * levels).sum(-1)
    for _ in range(5):
        for i in range(x.shape[-1]):
            w, xi, li = weights[:, i], x[:, i], levels[:, i]
            slx = sum_lx - w * xi * li
            sl2 = sum_l2 - w * li * li
            new = torch.round(xi * sl2 / torch.where(slx > 0, slx, 1)).clamp(-nmax, nmax - 1)
            slx_new, sl2_new = slx + w * xi * new, sl2 + w * new * new
            accept = (
                (slx > 0)
                & (new != li)
                & (sl2_new > 0)
                & (slx_new * slx_new * sum_l2 > sum_lx * sum_lx * sl2_new)
            )
            levels[:, i] = torch.where(accept, new, li)
            sum_lx = torch.where(accept, slx_new, sum_lx)
            sum_l2 = torch.where(accept, sl2_new, sum_l2)
    scale = torch.where(tiny | (sum_l2 == 0), 0.0, sum_lx / torch.where(sum_l2 > 0, sum_l2, 1))
    levels = torch.where(tiny.unsqueeze(-1), torch.full_like(levels, -nmax), levels)
    return scale, (levels + nmax).to(torch.int32)


# ---- the K-quants ---------------------------------------------------------------------------


def _requantize(
    x: torch.Tensor,
    d: torch.Tensor,
    offset: torch.Tensor | None,
    lo: int,
    hi: int,
    fallback: torch.Tensor,
) -> torch.Tensor:
    """Values against the rounded sub-block scales; sub-blocks with a zero scale keep
    the search's levels (as llama.cpp's reference does)."""
    safe = torch.where(d == 0, torch.ones_like(d), d).unsqueeze(-1)
    shifted = x if offset is None else x + offset.unsqueeze(-1)
    levels = torch.round(shifted / safe).clamp(lo, hi).to(torch.int32)
    return torch.where((d == 0).unsqueeze(-1), fallback, levels)


def _sub_block_weights(x: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's importance: the RMS of the sub-block plus each value's magnitude."""
    return (x * x).mean(-1, keepdim=True).sqrt() + x.abs()


def _pack_scales_k4(sc: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """8 six-bit scales and 8 six-bit mins → 12 bytes (the layout `_k4_scales_mins` reads)."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    last = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    upper = (sc[:, 4:] & 0xF) | ((mins[:, 4:] & 0xF) << 4)
    return torch.cat([first, last, upper], dim=1).to(torch.uint8)


def _k4_common(
    x: torch.Tensor, nmax: int, rmin: float, nstep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: header bytes (d, dmin, scales) and the levels of 8 sub-blocks of 32."""
    n = x.shape[0]
    sub = x.view(n * 8, 32)
    scales, mins, levels = _scale_min_search(
        sub, _sub_block_weights(sub), nmax, rmin, 0.1, nstep, use_mad=False
    )
    scales, mins = scales.view(n, 8), mins.view(n, 8)
    max_scale, max_min = scales.amax(-1), mins.amax(-1)
    ls = torch.round(_ratio(63, max_scale).unsqueeze(-1) * scales).clamp(max=63).int()
    lm = torch.round(_ratio(63, max_min).unsqueeze(-1) * mins).clamp(max=63).int()
    d, dmin = max_scale / 63, max_min / 63
    sub_d = (_half_value(d).unsqueeze(-1) * ls).view(-1)
    sub_m = (_half_value(dmin).unsqueeze(-1) * lm).view(-1)
    levels = _requantize(sub, sub_d, sub_m, 0, nmax, levels.int())
    header = torch.cat([_half(d), _half(dmin), _pack_scales_k4(ls, lm)], dim=1)
    return header, levels.view(n, QK_K)


def _quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    header, levels = _k4_common(x, 15, -1.0, 20)
    chunks = levels.view(-1, 4, 2, 32)
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).to(torch.uint8).reshape(-1, 128)
    return torch.cat([header, qs], dim=1)


def _quantize_q5_k(x: torch.Tensor) -> torch.Tensor:
    header, levels = _k4_common(x, 31, -0.5, 15)
    n = levels.shape[0]
    chunks = (levels & 0xF).view(n, 4, 2, 32)
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).to(torch.uint8).reshape(n, 128)
    high = (levels >> 4).view(n, 8, 32)  # bit s of qh[j] is the high bit of sub-block s
    qh = (high << torch.arange(8, dtype=torch.int32).view(1, 8, 1)).sum(1).to(torch.uint8)
    return torch.cat([header, qh, qs], dim=1)


def _quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    sub = x.view(n * 16, 16)
    scales, levels = _symmetric_search(sub, 32)
    scales = scales.view(n, 16)
    peak = _absmax_signed(scales).squeeze(-1)
    empty = peak.abs() < _EPS
    iscale = -128 / torch.where(empty, torch.ones_like(peak), peak)
    d = torch.where(empty, torch.zeros_like(peak), 1 / iscale)
    sc = torch.round(iscale.unsqueeze(-1) * scales).clamp(max=127)
    sc = torch.where(empty.unsqueeze(-1), torch.zeros_like(sc), sc).int()
    sub_d = (_half_value(d).unsqueeze(-1) * sc).view(-1)
    levels = (_requantize(sub, sub_d, None, -32, 31, levels - 32) + 32).view(n, 2, 4, 32)
    low = levels & 0xF
    ql = (
        torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], dim=2)
        .to(torch.uint8)
        .reshape(n, 128)
    )
    high = (levels >> 4) << torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(1, 1, 4, 1)
    qh = high.sum(2).to(torch.uint8).reshape(n, 64)
    scale_bytes = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([ql, qh, scale_bytes, _half(d)], dim=1)


def _pack_crumbs(levels: torch.Tensor) -> torch.Tensor:
    """``[n, 256]`` 2-bit values → 64 bytes: byte l of half h holds h*128 + 32j + l at bit 2j."""
    n = levels.shape[0]
    parts = levels.view(n, 2, 4, 32) << torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(
        1, 1, 4, 1
    )
    return parts.sum(2).to(torch.uint8).reshape(n, 64)


def _quantize_q3_k(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    sub = x.view(n * 16, 16)
    scales, levels = _rmse_refine(sub, 4)
    scales = scales.view(n, 16)
    peak = _absmax_signed(scales).squeeze(-1)
    empty = peak == 0
    iscale = -32 / torch.where(empty, torch.ones_like(peak), peak)
    stored = torch.round(iscale.unsqueeze(-1) * scales).clamp(-32, 31).int() + 32
    stored = torch.where(empty.unsqueeze(-1), torch.zeros_like(stored), stored)
    d = torch.where(empty, torch.zeros_like(peak), 1 / iscale)
    sub_d = _half_value(d).unsqueeze(-1) * torch.where(empty.unsqueeze(-1), 0, stored - 32)
    levels = _requantize(sub, sub_d.view(-1), None, -4, 3, levels - 4).view(n, QK_K) + 4
    high = (levels > 3).int()
    hmask = (high.view(n, 8, 32) << torch.arange(8, dtype=torch.int32).view(1, 8, 1)).sum(1)
    low = _pack_crumbs(levels - 4 * high)
    scale_low = (stored[:, :8] & 0xF) | ((stored[:, 8:] & 0xF) << 4)
    scale_high = (
        (stored >> 4).view(n, 4, 4) << torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(1, 4, 1)
    ).sum(1)
    scale_bytes = torch.cat([scale_low, scale_high], dim=1).to(torch.uint8)
    return torch.cat([hmask.to(torch.uint8), low, scale_bytes, _half(d)], dim=1)


def _quantize_q2_k(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    sub = x.view(n * 16, 16)
    scales, mins, levels = _scale_min_search(sub, sub.abs(), 3, -0.5, 0.1, 15, use_mad=True)
    scales, mins = scales.view(n, 16), mins.view(n, 16)
    max_scale, max_min = scales.amax(-1), mins.amax(-1)
    ls = torch.round(_ratio(15, max_scale).unsqueeze(-1) * scales).int()
    lm = torch.round(_ratio(15, max_min).unsqueeze(-1) * mins).int()
    d = torch.where(max_scale > 0, max_scale / 15, 0.0)
    dmin = torch.where(max_min > 0, max_min / 15, 0.0)
    sub_d = (_half_value(d).unsqueeze(-1) * ls).view(-1)
    sub_m = (_half_value(dmin).unsqueeze(-1) * lm).view(-1)
    levels = _requantize(sub, sub_d, sub_m, 0, 3, levels.int()).view(n, QK_K)
    scale_bytes = (ls | (lm << 4)).to(torch.uint8)
    return torch.cat([scale_bytes, _pack_crumbs(levels), _half(d), _half(dmin)], dim=1)


QUANTIZERS: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q4_0: _quantize_q4_0,
    Q.Q4_1: _quantize_q4_1,
    Q.Q5_0: _quantize_q5_0,
    Q.Q5_1: _quantize_q5_1,
    Q.Q8_0: _quantize_q8_0,
    Q.Q8_1: _quantize_q8_1,
    Q.Q2_K: _quantize_q2_k,
    Q.Q3_K: _quantize_q3_k,
    Q.Q4_K: _quantize_q4_k,
    Q.Q5_K: _quantize_q5_k,
    Q.Q6_K: _quantize_q6_k,
}
