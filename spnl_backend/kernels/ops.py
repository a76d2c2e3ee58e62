"""Per-layer operations with a native CPU kernel: RMSNorm, alone or fused with its
neighbours (the residual add before it; for queries and keys, the rotation after it).

Each runs the compiled kernel ``native`` (where the layer was given one) for float32 CPU
tensors and the torch reference (its twin) everywhere else.
"""

import torch

from .cpu import CpuKernels


def _native(x: torch.Tensor, native: CpuKernels | None) -> CpuKernels | None:
    if native is not None and x.is_cpu and x.dtype is torch.float32:
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


# A norm given as (float32 scale, eps).
Norm = tuple[torch.Tensor, float]


def add_rms_norm_ref(
    x: torch.Tensor, delta: torch.Tensor, delta_norm: Norm | None, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta))``, ``delta`` normed first where ``delta_norm``."""
    if delta_norm is not None:
        delta = rms_norm_ref(delta, *delta_norm)
    x = x + delta
    return x, rms_norm_ref(x, scale, eps)


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    delta_norm: Norm | None,
    scale: torch.Tensor,
    eps: float,
    native: CpuKernels | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_ref` in one native call, which updates ``x`` in place (use the result)."""
    native = _native(x, native)
    if native is None or delta.dtype is not torch.float32 or not x.is_contiguous():
        return add_rms_norm_ref(x, delta, delta_norm, scale, eps)
    return x, native.add_rms_norm(x, delta, delta_norm, scale, eps)


def qk_norm_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head of ``q`` and ``k`` normed by ``norms = (q scale, k scale, eps)`` where
    given, then both rotated (`rotate_ref`, tables ``[T, 1, rotary_dim]``)."""
    if norms is not None:
        q_scale, k_scale, eps = norms
        q, k = rms_norm_ref(q, q_scale, eps), rms_norm_ref(k, k_scale, eps)
    return rotate_ref(q, cos, sin), rotate_ref(k, cos, sin)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    native: CpuKernels | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`qk_norm_rope_ref`, in place in one native call where ``q`` and ``k`` allow it (use
    the result)."""
    native = _native(q, native)
    if native is None or k.dtype is not torch.float32 or not _heads_consecutive(q, k):
        return qk_norm_rope_ref(q, k, norms, cos, sin)
    native.qk_norm_rope_(q, k, norms, cos.squeeze(1), sin.squeeze(1))
    return q, k


def _heads_consecutive(*tensors: torch.Tensor) -> bool:
    return all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in tensors)
