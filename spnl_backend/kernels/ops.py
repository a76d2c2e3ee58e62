"""Per-layer operations with a native CPU kernel: RMSNorm, alone or fused with its
neighbours (the residual add before it; for queries and keys, the rotation after it), and
a gated MLP's activation.

Each runs the compiled kernel ``native`` (where the layer was given one) for float32 CPU
tensors and the torch reference (its twin) everywhere else. The layers' forms
(`rms_norm_layer`, `add_rms_norm_layer`, `qk_norm_rotate`) also choose the arithmetic by
dtype: in float32 the conventions agree and the fused calls run; in a narrower dtype the
model's own order of rounding is kept.
"""

from typing import Protocol

import torch
import torch.nn.functional as F

from .cpu import CpuKernels
from .cpu.abi import GATED_ACTS


def native_for(native: CpuKernels | None, x: torch.Tensor) -> CpuKernels | None:
    """``native`` where ``x`` runs on the compiled kernels: float32 on the CPU (the one
    place this rule is written; `KernelChoice.native_for` and the codecs' decode ask it)."""
    if native is not None and x.is_cpu and x.dtype is torch.float32:
        return native
    return None


def rms_norm_ref(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


def rms_norm(
    x: torch.Tensor, scale: torch.Tensor, eps: float, native: CpuKernels | None = None
) -> torch.Tensor:
    """``x * rsqrt(mean(x²) + eps) * scale`` over the last dim (float32 ``scale``)."""
    native = native_for(native, x)
    return native.rms_norm(x, scale, eps) if native else rms_norm_ref(x, scale, eps)


def gated_act_ref(kind: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up``: SiLU, or GELU's tanh approximation (``kind`` gelu_tanh)."""
    act = F.silu(gate) if kind == "silu" else F.gelu(gate, approximate="tanh")
    return act.mul_(up)


def gated_act(
    kind: str, gate: torch.Tensor, up: torch.Tensor, native: CpuKernels | None = None
) -> torch.Tensor:
    """`gated_act_ref` (``kind``: one of `GATED_ACTS`), in one native call over the pool's
    threads for float32 CPU tensors: the layer blocks call the same kernel, so both paths
    round it alike."""
    native = native_for(native, gate)
    if native is None or up.dtype is not torch.float32 or kind not in GATED_ACTS:
        return gated_act_ref(kind, gate, up)
    inner = gate.shape[-1]
    if not inner or not gate.numel():
        return gated_act_ref(kind, gate, up)
    flat = [t.reshape(-1, inner) for t in (gate, up)]  # views where the strides allow
    flat = [t if t.stride(-1) == 1 else t.contiguous() for t in flat]
    return native.gated_act(kind, *flat).reshape(gate.shape)


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
    native = native_for(native, x)
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
    native = native_for(native, q)
    if native is None or k.dtype is not torch.float32 or not _heads_consecutive(q, k):
        return qk_norm_rope_ref(q, k, norms, cos, sin)
    native.qk_norm_rope_(q, k, norms, cos.squeeze(1), sin.squeeze(1))
    return q, k


def _heads_consecutive(*tensors: torch.Tensor) -> bool:
    return all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in tensors)


class NormLayer(Protocol):
    """An RMSNorm layer as these operations read it (`models.norms.RMSNorm`)."""

    weight: torch.Tensor
    eps: float
    offset: float
    in_float: bool
    native: CpuKernels | None

    def float_norm(self, x: torch.Tensor) -> Norm: ...


class Rotation(Protocol):
    """One step's rotary tables (`models.rope.RotaryTables`)."""

    def apply(self, x: torch.Tensor) -> torch.Tensor: ...

    def apply_qk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm_layer(x: torch.Tensor, layer: NormLayer) -> torch.Tensor:
    """``layer``'s norm of ``x``. In float32 both conventions agree: one op (`rms_norm`).
    Otherwise the rows are normed in float32; Gemma then multiplies by ``(offset + w)`` in
    float32 before casting back (``in_float``), the Llama family casts back first and
    multiplies by ``w`` in the model's dtype."""
    if x.dtype is torch.float32:
        return rms_norm(x, *layer.float_norm(x), layer.native)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + layer.eps)
    if layer.in_float:
        return (h * (layer.weight.float() + layer.offset)).to(x.dtype)
    return layer.weight * h.to(x.dtype)


def add_rms_norm_layer(
    x: torch.Tensor, delta: torch.Tensor, delta_norm: NormLayer | None, norm: NormLayer
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + delta_norm(delta)`` (or ``x + delta``) and its norm by ``norm``: one native
    call on the CPU in float32 (`add_rms_norm`, which updates ``x`` in place)."""
    if x.dtype is not torch.float32 or delta.dtype is not torch.float32:
        x = x + (delta if delta_norm is None else rms_norm_layer(delta, delta_norm))
        return x, rms_norm_layer(x, norm)
    pre = None if delta_norm is None else delta_norm.float_norm(delta)
    return add_rms_norm(x, delta, pre, *norm.float_norm(x), norm.native)


def qk_norm_rotate(
    q: torch.Tensor,
    k: torch.Tensor,
    norms: tuple[NormLayer, NormLayer] | None,
    rotation: Rotation,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys ``[T, heads, head_dim]`` normed per head by ``norms`` where given,
    then rotated: in float32 one fused call (`qk_norm_rope`, native on the CPU; possibly in
    place, use the result), otherwise layer by layer in the model's dtype."""
    if q.dtype is not torch.float32:
        if norms is not None:
            q, k = rms_norm_layer(q, norms[0]), rms_norm_layer(k, norms[1])
        return rotation.apply(q), rotation.apply(k)
    fused = None
    if norms is not None:
        q_scale, eps = norms[0].float_norm(q)
        fused = (q_scale, norms[1].float_norm(k)[0], eps)
    return rotation.apply_qk(q, k, fused)
