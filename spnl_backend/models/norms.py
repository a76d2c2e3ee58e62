"""RMSNorm in the conventions the architectures use, and LayerNorm with a bias."""

import torch
import torch.nn.functional as F
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
    """A norm of ``dim`` in ``config``'s convention."""
    return RMSNorm(dim, config.rms_norm_eps, config.norm_offset, config.norm_in_float, native)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with a weight and a bias, computed as torch's (the
    models that use it are trained with ``nn.LayerNorm``); no native kernel, so what runs
    on the native layer blocks refuses a layer that has one."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


Norm = RMSNorm | LayerNorm


def norm_of(config: ModelConfig, dim: int, native: CpuKernels | None, kind: str = "rms") -> Norm:
    """A norm of ``dim`` of ``kind`` (`models.layers.NormKind`) in ``config``'s convention."""
    if kind == "layer":
        return LayerNorm(dim, config.rms_norm_eps)
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
