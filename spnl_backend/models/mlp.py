"""The gated MLP of a dense layer (and of each expert)."""

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .linear import Linear, project


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig, inner: int | None = None) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, inner or config.intermediate_size
        self.gate_proj = Linear(hidden, inner, bias=False)
        self.up_proj = Linear(hidden, inner, bias=False)
        self.down_proj = Linear(inner, hidden, bias=False)
        self.act = F.silu if config.activation == "silu" else gelu_tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(self.act(gate).mul_(up))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")
