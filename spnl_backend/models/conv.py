"""The short causal depthwise convolution that state layers run their inputs through
(Gated DeltaNet, Mamba-2, Mamba-1), continued across steps from a sequence's conv state."""

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn


class CausalConv1d(nn.Module):
    """``weight [channels, 1, kernel]`` (the checkpoints' layout) and an optional bias per
    channel; SiLU after."""

    def __init__(self, channels: int, kernel: int, bias: bool = False) -> None:
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None

    def forward(
        self,
        inputs: torch.Tensor,
        state: torch.Tensor,
        copies: Mapping[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One sequence's ``[count, channels]`` inputs, after the ``kernel - 1`` that its
        ``state`` keeps (updated to the last ones) → the convolved ``[count, channels]``
        in float32 at least; ``copies``: where the state after so many rows goes too."""
        joined = torch.cat([state.to(inputs.dtype), inputs])
        for after, copy in (copies or {}).items():
            copy.copy_(joined[after : after + self.kernel - 1])
        state.copy_(joined[-(self.kernel - 1) :])
        wide = torch.promote_types(inputs.dtype, torch.float32)
        windows = joined.to(wide).unfold(0, self.kernel, 1)  # [count, channels, kernel]
        out = (windows * self.weight.to(wide).squeeze(1)).sum(-1)
        if self.bias is not None:
            out = out + self.bias.to(wide)
        return F.silu(out)
