"""Rotary position embeddings: the inverse frequencies of each scaling rule, and their use."""

import math

import torch
from torch import nn

from ..kernels import ops
from ..kernels.cpu import CpuKernels
from .config import RopeConfig


def _base_inv_freq(rope: RopeConfig) -> torch.Tensor:
    exponents = torch.arange(0, rope.rotary_dim, 2, dtype=torch.int64).float() / rope.rotary_dim
    return 1.0 / (rope.theta**exponents)


def _proportional(rope: RopeConfig) -> torch.Tensor:
    """Gemma 4's global rope: the first pairs turn at the rates a full-width rope gives
    them, the others stand still (their dims pass unrotated)."""
    turning = int(rope.partial_rotary_factor * rope.rotary_dim // 2)
    inv_freq = _base_inv_freq(rope)
    inv_freq[turning:] = 0.0
    return inv_freq / rope.factor


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    old_len = rope.original_max_position
    low_wavelen, high_wavelen = old_len / rope.low_freq_factor, old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    dim, base = rope.rotary_dim, rope.theta
    if rope.attention_factor is not None:
        attention = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention = _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(
            rope.factor, rope.mscale_all_dim
        )
    else:
        attention = _yarn_mscale(rope.factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention)


def _longrope_attention(rope: RopeConfig, max_position: int) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor
    factor = rope.factor if rope.factor != 1.0 else max_position / rope.original_max_position
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(rope.original_max_position))


def inv_freq_and_scale(
    rope: RopeConfig, max_position: int, long: bool = False
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim / 2], attention_scaling)`` for one rope configuration."""
    inv_freq = _base_inv_freq(rope)
    if rope.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.kind == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.kind == "llama3":
        return _llama3(rope, inv_freq), 1.0
    if rope.kind == "proportional":
        return _proportional(rope), 1.0
    if rope.kind == "yarn":
        return _yarn(rope)
    if rope.kind == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        exponents = torch.arange(0, rope.rotary_dim, 2, dtype=torch.int64).float() / rope.rotary_dim
        inv = 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
        return inv, _longrope_attention(rope, max_position)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin for token positions, applied NeoX-style (rotate halves) to the first dims."""

    def __init__(
        self, rope: RopeConfig, max_position: int, native: CpuKernels | None = None
    ) -> None:
        super().__init__()
        self.rotary_dim = rope.rotary_dim
        self.native = native  # the model's compiled kernels (`KernelChoice.native`)
        # Computed on the CPU even while the model is built on the meta device.
        with torch.device("cpu"):
            inv_freq, self.scaling = inv_freq_and_scale(rope, max_position)
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            # LongRoPE switches to its long factors past the original context.
            self.long_from = rope.original_max_position if rope.kind == "longrope" else None
            if self.long_from is not None:
                long_inv_freq, _ = inv_freq_and_scale(rope, max_position, long=True)
                self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> "RotaryTables":
        """The rotation of each of ``positions [T]``, ready to apply in ``dtype``."""
        position = positions.float().unsqueeze(-1)
        freqs = position * self.inv_freq
        if self.long_from is not None:
            long = (positions >= self.long_from).unsqueeze(-1)
            freqs = torch.where(long, position * self.long_inv_freq, freqs)
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling != 1.0:  # a product by 1.0 changes no bit: each op skipped is
            cos, sin = cos * self.scaling, sin * self.scaling  # a decode step's saving
        cos, sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
        if cos.dtype != dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return RotaryTables(cos.unsqueeze(1), sin.unsqueeze(1), self.native, positions)


class RotaryTables:
    """cos/sin of one step's positions over the rotated dims, laid out for rotate-half:
    ``x * [cos, cos] + [x2, x1] * [-sin, sin]`` is HF's ``x * cos + rotate_half(x) * sin``
    term for term. Built once per step, applied by every layer; ``positions [T]``: the
    step's positions they were made for (what a layer's position-dependent parts read,
    Llama 4's query temperature)."""

    def __init__(
        self,
        cos: torch.Tensor,
        sin: torch.Tensor,
        native: CpuKernels | None = None,
        positions: torch.Tensor | None = None,
    ) -> None:
        self.cos, self.sin = cos, sin  # [T, 1, rotary_dim]
        self.rotary_dim = cos.shape[-1]
        self.native = native
        self.positions = positions

    def to(self, device: torch.device) -> "RotaryTables":
        """The same tables on ``device`` (a layer-mapping boundary)."""
        positions = None if self.positions is None else self.positions.to(device)
        return RotaryTables(self.cos.to(device), self.sin.to(device), self.native, positions)

    def apply_qk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys normed per head by ``norms = (q scale, k scale, eps)`` where
        given, then rotated, in one call where it runs natively (possibly in place; use
        the result)."""
        return ops.qk_norm_rope(q, k, norms, self.cos, self.sin, self.native)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, head_dim]`` with torch (the float32 CPU path rotates
        through `apply_qk`); dims past ``rotary_dim`` pass through."""
        return ops.rotate_ref(x, self.cos, self.sin)
