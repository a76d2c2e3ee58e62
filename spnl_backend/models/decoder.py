"""A decoder layer: attention and MLP (or experts), each behind a norm, added to the
residual stream."""

import torch
from torch import nn

from ..kernels import ops
from ..kernels.dispatch import TORCH_CHOICE, KernelChoice
from .attention import Attention
from .collectives import Collectives
from .config import ModelConfig
from .mlp import GatedMLP
from .moe import SparseMoE
from .norms import RMSNorm, rms_norm_of
from .rope import RotaryTables
from .step_attention import StepAttention


class DecoderLayer(nn.Module):
    """Pre-norm residual block; Gemma adds norms after attention and MLP ("sandwich").
    With tensor parallelism (``tp``) its attention and MLP each give this rank's part of
    their output (its heads, its rows of the MLP), summed over the ranks before the add."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        tp: Collectives | None = None,
        kernels: KernelChoice = TORCH_CHOICE,
    ) -> None:
        super().__init__()
        self.tp = tp
        native, hidden = kernels.native, config.hidden_size
        self.self_attn = Attention(config, layer, tp, native)
        moe = config.is_moe_layer(layer)
        self.mlp: nn.Module = SparseMoE(config, kernels) if moe else GatedMLP(config)
        self.input_layernorm = rms_norm_of(config, hidden, native)
        self.post_attention_layernorm = rms_norm_of(config, hidden, native)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = rms_norm_of(config, hidden, native)
            self.post_feedforward_layernorm = rms_norm_of(config, hidden, native)

    def forward(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        rotary: RotaryTables,
        attention: StepAttention,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` the residual stream, ``h`` its normed copy (this layer's input norm) →
        the new residual stream and its norm by ``next_norm`` (the next layer's input norm
        or the final one). Each residual add and the norm after it are one step
        (`ops.add_rms_norm_layer`); ``x`` may be updated in place."""
        attn = self._summed(self.self_attn(h, rotary, attention))
        add_norm = ops.add_rms_norm_layer
        if not self.sandwich:
            x, h = add_norm(x, attn, None, self.post_attention_layernorm)
            return add_norm(x, self._summed(self.mlp(h)), None, next_norm)
        x, h = add_norm(x, attn, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        return add_norm(x, self._summed(self.mlp(h)), self.post_feedforward_layernorm, next_norm)

    def _summed(self, part: torch.Tensor) -> torch.Tensor:
        return part if self.tp is None else self.tp.all_reduce(part)
