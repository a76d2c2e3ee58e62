"""RMSNorm in the conventions the architectures use, and LayerNorm in theirs."""

import torch
from torch import nn

from ..kernels import ops
from ..kernels.cpu import CpuKernels
from .config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32.

    Gemma multiplies by ``(offset + w)`` in float32 before casting back (``in_float``);
    the Llama family casts back first and multiplies by ``w`` in the model's dtype.
    """

    def __init__(
        self,
        dim: int,
        eps: float,
        offset: float = 0.0,
        in_float: bool = False,
        native: CpuKernels | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps, self.offset, self.in_float = eps, offset, in_float
        self._scale: torch.Tensor | None = None  # (offset + w) in float32, made once
        self.native = native  # the model's compiled kernels (`KernelChoice.native`)

    def float_norm(self, x: torch.Tensor) -> ops.Norm:
        """``(scale, eps)`` of this norm for float32 ``x``, where both conventions agree."""
        if self._scale is None or self._scale.device != x.device:
            self._scale = (self.weight.float() + self.offset).contiguous()
        return self._scale, self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm_layer(x, self)


def rms_norm_of(config: ModelConfig, dim: int, native: CpuKernels | None) -> RMSNorm:
    """An RMSNorm of ``dim`` in ``config``'s convention."""
    return RMSNorm(dim, config.rms_norm_eps, config.norm_offset, config.norm_in_float, native)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, in float32 before casting back, with a weight and, where
    ``bias``, a bias (Phi-2, StarCoder2, GPT-NeoX; Cohere's has none). ``shape``: the
    weight's, its last dim the normed one (Cohere's q and k norms hold a row per head).
    ``offset``: the weight applied as ``(offset + w)`` (Nemotron's LayerNorm1p: 1);
    ``affine`` false: neither weight nor bias (OLMo's). No native kernel: the native layer
    blocks refuse a layer that has one."""

    def __init__(
        self,
        shape: int | tuple[int, ...],
        eps: float,
        bias: bool = True,
        offset: float = 0.0,
        affine: bool = True,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape)) if affine else None
        self.bias = nn.Parameter(torch.empty(shape)) if affine and bias else None
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        centred = h - h.mean(-1, keepdim=True)
        out = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            out = (self.weight.float() + self.offset) * out
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)


Norm = RMSNorm | LayerNorm


def norm_of(config: ModelConfig, dim: int, native: CpuKernels | None, kind: str = "rms") -> Norm:
    """A norm of ``dim`` of ``kind`` (`models.layers.NormKind`) in ``config``'s convention."""
    if kind in ("layer", "layer_no_bias", "layer_1p"):
        offset = 1.0 if kind == "layer_1p" else 0.0
        return LayerNorm(dim, config.rms_norm_eps, bias=kind != "layer_no_bias", offset=offset)
    if kind == "layer_plain":
        return LayerNorm(dim, config.rms_norm_eps, affine=False)
    return rms_norm_of(config, dim, native)


class UnitRMSNorm:
    """RMSNorm without a weight (Gemma 4's norm of the values), in float32 like Gemma's:
    a scale of ones made on the device it first meets (the model is built on the meta
    device, and nothing is loaded for it)."""

    def __init__(self, dim: int, eps: float, native: CpuKernels | None = None) -> None:
        self.dim, self.eps, self.native = dim, eps, native
        self._ones: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is not torch.float32:
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        if self._ones is None or self._ones.device != x.device:
            self._ones = torch.ones(self.dim, device=x.device)
        return ops.rms_norm(x, self._ones, self.eps, self.native)
