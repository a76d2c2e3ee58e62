"""RMSNorm in the conventions the architectures use."""

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
    """A norm of ``dim`` in ``config``'s convention."""
    return RMSNorm(dim, config.rms_norm_eps, config.norm_offset, config.norm_in_float, native)
