"""A Gated DeltaNet layer (Qwen3.5): linear attention over a per-sequence state.

Its q, k and v come from one projection through a short causal depthwise convolution
(SiLU after it); q and k are L2-normed per head, the decay ``g`` and write strength
``beta`` come from two small projections; the gated delta rule (`kernels.delta_rule`)
turns them into each token's output, which a per-head RMS norm gated by SiLU(z) and the
output projection finish. What a sequence carries from step to step is its state
(`StateSegment`): the convolution's last inputs and the recurrent state, so chunked
prefill and decode continue where the last step stopped.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import delta_rule
from ..kernels.cpu import CpuKernels
from .config import DeltaNetConfig, ModelConfig
from .conv import CausalConv1d
from .layers import DeltaNetMixer
from .linear import Linear
from .step_attention import StepAttention, sequence_states

_L2_EPS = 1e-6  # as the reference implementations norm q and k


class GatedRMSNorm(nn.Module):
    """RMS norm of each head's output (``weight [head_v_dim]``), times SiLU of its gate."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        wide = _wide(x.dtype)
        h = x.to(wide)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.to(wide))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(
        self, config: ModelConfig, mixer: DeltaNetMixer, native: CpuKernels | None = None
    ) -> None:
        super().__init__()
        d: DeltaNetConfig = mixer.config
        self.d, self.state, self.native = d, mixer.state, native
        hidden = config.hidden_size
        self.in_proj_qkv = Linear(hidden, d.conv_dim, bias=False)
        self.in_proj_z = Linear(hidden, d.value_dim, bias=False)
        self.in_proj_b = Linear(hidden, d.num_v_heads, bias=False)
        self.in_proj_a = Linear(hidden, d.num_v_heads, bias=False)
        self.conv1d = CausalConv1d(d.conv_dim, d.conv_kernel)
        self.A_log = nn.Parameter(torch.empty(d.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(d.num_v_heads))
        self.norm = GatedRMSNorm(d.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(d.value_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, attention: StepAttention) -> torch.Tensor:
        """``x [T, hidden]`` (normed), the step's sequences packed → ``[T, hidden]``; each
        sequence's state (``attention.states``) carried on."""
        segments = sequence_states(attention)
        d, tokens, wide = self.d, x.shape[0], _wide(x.dtype)
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x).view(tokens, d.num_v_heads, d.head_v_dim)
        beta = self.in_proj_b(x).to(wide).sigmoid()
        decay_rate = -self.A_log.to(wide).exp()
        g = decay_rate * F.softplus(self.in_proj_a(x).to(wide) + self.dt_bias.to(wide))
        out = torch.empty(tokens, d.num_v_heads, d.head_v_dim, dtype=wide, device=x.device)
        for seg in segments:
            rows = slice(seg.start, seg.start + seg.count)
            qkv = self.conv1d(mixed[rows], seg.state.conv[self.state], seg.conv_copies(self.state))
            recurrent = seg.state.recurrent[self.state]
            for local, at in seg.computed_pieces(self.state):
                out[at] = self._rule(qkv[local], g[at], beta[at], recurrent)
        core = self.norm(out.to(x.dtype), z).reshape(tokens, d.value_dim)
        return self.out_proj(core)

    def _rule(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
    ) -> torch.Tensor:
        d, count = self.d, qkv.shape[0]
        q, k, v = qkv.split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        q = _l2_normed(q.reshape(count, d.num_k_heads, d.head_k_dim)) * d.head_k_dim**-0.5
        k = _l2_normed(k.reshape(count, d.num_k_heads, d.head_k_dim))
        v = v.reshape(count, d.num_v_heads, d.head_v_dim)
        group = d.num_v_heads // d.num_k_heads  # each key head serves this many value heads
        if d.v_heads_tiled:  # a GGUF's order: value head h reads key head h % num_k_heads
            q, k = q.repeat(1, group, 1), k.repeat(1, group, 1)
        else:
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        return delta_rule.rule(q, k, v, g, beta, state, self.native)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """What the rule computes in: float32, or the model's dtype where wider."""
    return torch.promote_types(dtype, torch.float32)


def _l2_normed(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)
