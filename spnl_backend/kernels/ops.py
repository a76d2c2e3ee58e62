"""Per-layer operations with a native CPU kernel: RMSNorm and RoPE.

Each runs the compiled kernel ``native`` (where the layer was given one) for float32 CPU
tensors and the torch reference (its twin) everywhere else.
"""

import torch

from .cpu import CpuKernels


def _native(x: torch.Tensor, native: CpuKernels | None) -> CpuKernels | None:
    if native is not None and x.device.type == "cpu" and x.dtype == torch.float32:
        return native
    return None


def rms_norm_ref(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


def rms_norm(
    x: torch.Tensor, scale: torch.Tensor, eps: float, native: CpuKernels | None = None
) -> torch.Tensor:
    """``x * rsqrt(mean(x²) + eps) * scale`` over the last dim (float32 ``scale``)."""
    native = _native(x, native)
    return native.rms_norm(x, scale, eps) if native else rms_norm_ref(x, scale, eps)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + swap_halves(x) * sin`` over the first ``rotary_dim`` dims of ``x [T, heads,
    head_dim]``; ``cos``/``sin`` are ``[T, 1, rotary_dim]``, the rest passes through."""
    rotary = cos.shape[-1]
    half = rotary // 2
    rot = x[..., :rotary]
    swapped = torch.cat([rot[..., half:], rot[..., :half]], dim=-1)
    rotated = rot * cos + swapped * sin
    if rotary == x.shape[-1]:
        return rotated
    return torch.cat([rotated, x[..., rotary:]], dim=-1)


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, native: CpuKernels | None = None
) -> torch.Tensor:
    """`rotate_ref`, but ``x`` may be rotated in place: use the result, not ``x``."""
    native = _native(x, native)
    if native is None:
        return rotate_ref(x, cos, sin)
    return native.rope_(x.contiguous(), cos.squeeze(1), sin.squeeze(1))
