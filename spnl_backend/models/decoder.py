"""A decoder layer: its mixer and its MLP (or experts), each beside norms where its
`LayerSpec` places them, added to the residual stream (scaled first where the spec says)."""

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import ops
from ..kernels.dispatch import TORCH_CHOICE, KernelChoice
from .attention import Attention
from .collectives import Collectives
from .config import ModelConfig
from .deltanet import GatedDeltaNet
from .layers import DeltaNetMixer, Mamba1Mixer, Mamba2Mixer, MoeFFN, ParallelMixer
from .linear import Linear, rows_alone
from .mamba1 import Mamba1
from .mamba2 import Mamba2
from .mla import LatentAttention
from .mlp import GatedMLP, PlainMLP, gelu_tanh
from .moe import SparseMoE
from .norms import Norm, RMSNorm, norm_of
from .per_layer import add_gated, gate_weights
from .rope import RotaryTables
from .step_attention import StepAttention


class DecoderLayer(nn.Module):
    """One layer as ``config.layers[layer]`` describes it. Its norms: ``pre`` (an input
    norm and one before the MLP), ``sandwich`` (Gemma: also one after attention and one
    after the MLP), ``post`` (OLMo 2: only those after; the stream enters un-normed, so
    ``input_layernorm`` is None), ``parallel`` (GPT-NeoX: attention and MLP both read the
    layer's input, through the input norm and ``post_attention_layernorm``, their outputs
    added at once), ``shared`` (Phi-2, Cohere: as parallel, both through the input norm). With
    tensor parallelism (``tp``) its attention and MLP each give this rank's part of their
    output, summed over the ranks before the add."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        tp: Collectives | None = None,
        kernels: KernelChoice = TORCH_CHOICE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.spec = spec = config.layers[layer]
        native, hidden = kernels.native, config.hidden_size
        # The mixer under its checkpoint name: linear_attn, mamba or self_attn (Falcon-H1:
        # self_attn and mamba side by side).
        state, attention = spec.state_mixer, spec.attention
        if isinstance(state, DeltaNetMixer):
            self.linear_attn = GatedDeltaNet(config, state, native)
        elif isinstance(state, Mamba2Mixer):
            self.mamba: Mamba1 | Mamba2 = Mamba2(config, state, native)
        elif isinstance(state, Mamba1Mixer):
            self.mamba = Mamba1(config, state, native)
        if attention is not None and attention.latent is not None:
            self.self_attn = LatentAttention(config, attention, native)
        elif attention is not None:
            self.self_attn = Attention(config, attention, tp, native)
        if isinstance(spec.ffn, MoeFFN):
            self.mlp: nn.Module = SparseMoE(config, kernels)
        elif spec.ffn.gated:
            self.mlp = GatedMLP(config, spec.ffn.intermediate_size, spec.ffn.bias, native)
        else:
            self.mlp = PlainMLP(config, spec.ffn.intermediate_size, spec.ffn.bias)
        # A shared expert beside the routed ones, and the projection that gates it.
        self.shared_mlp: GatedMLP | None = None
        self.shared_mlp_gate: Linear | None = None
        if isinstance(spec.ffn, MoeFFN) and spec.ffn.moe.shared_intermediate_size:
            self.shared_mlp = GatedMLP(config, spec.ffn.moe.shared_intermediate_size)
            if spec.ffn.moe.shared_gate:
                self.shared_mlp_gate = Linear(hidden, 1, bias=False)
        self.norms = spec.norms
        kind = spec.norm
        self.input_layernorm: Norm | None = None
        if spec.norms != "post":
            self.input_layernorm = norm_of(config, hidden, native, kind)
        self.post_attention_layernorm: Norm | None = None
        if spec.norms != "shared":
            self.post_attention_layernorm = norm_of(config, hidden, native, kind)
        if spec.norms == "sandwich":
            self.pre_feedforward_layernorm = norm_of(config, hidden, native, kind)
        if spec.norms in ("sandwich", "post"):
            self.post_feedforward_layernorm = norm_of(config, hidden, native, kind)
        if spec.per_layer_input:
            for name, module in gate_weights(config, native).items():
                setattr(self, name, module)
            self.per_layer_act = gelu_tanh if config.activation == "gelu_tanh" else F.silu
        if spec.output_scale:
            self.layer_scalar = nn.Parameter(torch.empty(1))

    @property
    def has_tail(self) -> bool:
        """Whether something follows the MLP's residual add (Gemma 4's per-layer input
        and output scale), so the next norm cannot be fused into that add."""
        return bool(self.spec.per_layer_input or self.spec.output_scale)

    @property
    def sandwich(self) -> bool:
        return self.norms == "sandwich"

    def input_norm(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.input_layernorm is None else self.input_layernorm(x)

    def forward(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        rotary: RotaryTables | None,
        attention: StepAttention,
        next_norm: Norm | None,
        per_layer: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` the residual stream, ``h`` its copy by this layer's input norm → the new
        residual stream and its copy by ``next_norm`` (the next layer's input norm or the
        final one; None: the stream itself). Each residual add and the norm after it are
        one step (`ops.add_rms_norm_layer`); ``x`` may be updated in place. ``per_layer``:
        this layer's per-layer input ``[T, width]`` where it takes one (Gemma 4)."""
        attn = self._scaled(self._summed(self._mix(h, rotary, attention)))
        if self.norms in ("parallel", "shared"):  # the MLP reads the layer's input too
            mlp_in = h if self.norms == "shared" else self.post_attention_layernorm(x)
            mlp = self._scaled(self._summed(self._ffn(mlp_in)))
            return self._mlp_out(x, attn + mlp, None, next_norm, per_layer)
        if self.norms == "pre":
            x, h = _add(x, attn, None, self.post_attention_layernorm)
            mlp = self._scaled(self._summed(self._ffn(h)))
            return self._mlp_out(x, mlp, None, next_norm, per_layer)
        if self.norms == "sandwich":
            x, h = _add(x, attn, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        else:
            x, h = _add(x, attn, self.post_attention_layernorm, None)
        mlp = self._scaled(self._summed(self._ffn(h)))
        return self._mlp_out(x, mlp, self.post_feedforward_layernorm, next_norm, per_layer)

    def _mlp_out(
        self,
        x: torch.Tensor,
        mlp: torch.Tensor,
        mlp_norm: Norm | None,
        next_norm: Norm | None,
        per_layer: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP's output added, then Gemma 4's tail where the layer has one."""
        if not self.has_tail:
            return _add(x, mlp, mlp_norm, next_norm)
        x, _ = _add(x, mlp, mlp_norm, None)
        if per_layer is not None:
            gate, up = self.per_layer_input_gate, self.per_layer_projection
            norm, act = self.post_per_layer_input_norm, self.per_layer_act
            x = add_gated(x, per_layer, gate, up, norm, act)
        if self.spec.output_scale:
            x = x * self.layer_scalar
        return x, x if next_norm is None else next_norm(x)

    def _mix(
        self, h: torch.Tensor, rotary: RotaryTables | None, attention: StepAttention
    ) -> torch.Tensor:
        mixer = self.spec.mixer
        if isinstance(mixer, ParallelMixer):  # both on the same input, summed
            return self._state_mix(h, attention) + self.self_attn(h, rotary, attention)
        if self.spec.state_mixer is not None:
            return self._state_mix(h, attention)
        return self.self_attn(h, rotary, attention)

    def _state_mix(self, h: torch.Tensor, attention: StepAttention) -> torch.Tensor:
        if isinstance(self.spec.state_mixer, DeltaNetMixer):
            return self.linear_attn(h, attention)
        return self.mamba(h, attention)

    def _ffn(self, h: torch.Tensor) -> torch.Tensor:
        out = self.mlp(h)
        if self.shared_mlp is None:
            return out
        shared = self.shared_mlp(h)
        if self.shared_mlp_gate is not None:
            shared = torch.sigmoid(rows_alone(self.shared_mlp_gate, h)) * shared
        return out + shared

    def _scaled(self, part: torch.Tensor) -> torch.Tensor:
        scale = self.spec.residual_scale
        return part if scale is None else part * scale

    def _summed(self, part: torch.Tensor) -> torch.Tensor:
        return part if self.tp is None else self.tp.all_reduce(part)


def _add(
    x: torch.Tensor, delta: torch.Tensor, delta_norm: Norm | None, norm: Norm | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + delta_norm(delta)`` and its copy by ``norm`` (the stream itself where None):
    one step where the norms are RMSNorms (`ops.add_rms_norm_layer`)."""
    if isinstance(norm, RMSNorm) and (delta_norm is None or isinstance(delta_norm, RMSNorm)):
        return ops.add_rms_norm_layer(x, delta, delta_norm, norm)
    x = x + (delta if delta_norm is None else delta_norm(delta))
    return x, x if norm is None else norm(x)
