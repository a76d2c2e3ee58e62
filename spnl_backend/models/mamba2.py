"""A Mamba-2 layer (Granite 4.0-H; Falcon-H1's, beside attention): a selective state space
over a per-sequence state.

One projection gives the gate z, the convolution's inputs (x, B, C) and each head's step
dt. x, B and C go through a short causal depthwise convolution (SiLU after it); the SSD
scan (`kernels.ssd`) turns x, the discretised steps and each head's B and C (shared by the
heads of a group) into each token's output, to which the skip term D x is added; a
grouped RMS norm of the output gated by SiLU(z) (Falcon-H1: normed before the gate, or
only gated), and the output projection, finish it.
What a sequence carries from step to step is its state (`StateSegment`): the
convolution's last inputs and the SSM state, so chunked prefill and decode continue
where the last step stopped.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import ssd
from ..kernels.cpu import CpuKernels
from .config import Mamba2Config, ModelConfig
from .conv import CausalConv1d
from .layers import Mamba2Mixer
from .linear import Linear
from .step_attention import StepAttention, sequence_states


class GroupGatedRMSNorm(nn.Module):
    """The output times SiLU of its gate, then RMS-normed within each of ``groups`` equal
    parts (Mamba-2 norms after gating, each group of heads on its own); with
    ``before_gate`` (Falcon-H1) normed and weighted first, then gated."""

    def __init__(self, dim: int, groups: int, eps: float, before_gate: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.groups, self.eps, self.before_gate = groups, eps, before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x``, ``gate [T, dim]`` → ``[T, dim]`` in ``dtype`` (the model's)."""
        wide = _wide(x.dtype)
        if self.before_gate:
            h = self._normed(x.to(wide))
            return (self.weight.to(wide) * h * F.silu(gate.to(wide))).to(dtype)
        h = self._normed(x.to(wide) * F.silu(gate.to(wide)))
        return self.weight * h.to(dtype)

    def _normed(self, h: torch.Tensor) -> torch.Tensor:
        h = h.unflatten(-1, (self.groups, -1))
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)


class Mamba2(nn.Module):
    def __init__(
        self, config: ModelConfig, mixer: Mamba2Mixer, native: CpuKernels | None = None
    ) -> None:
        super().__init__()
        m: Mamba2Config = mixer.config
        self.m, self.state, self.native = m, mixer.state, native
        hidden = config.hidden_size
        self.in_proj = Linear(hidden, m.projection_size, bias=m.proj_bias)
        self.conv1d = CausalConv1d(m.conv_dim, m.conv_kernel, bias=m.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads))
        self.A_log = nn.Parameter(torch.empty(m.num_heads))
        self.D = nn.Parameter(torch.empty(m.num_heads))
        self.norm: GroupGatedRMSNorm | None = None  # (none: the gate alone)
        if m.norm != "none":
            before = m.norm == "before_gate"
            self.norm = GroupGatedRMSNorm(m.inner_size, m.n_groups, config.rms_norm_eps, before)
        self.out_proj = Linear(m.inner_size, hidden, bias=m.out_proj_bias)

    def forward(self, x: torch.Tensor, attention: StepAttention) -> torch.Tensor:
        """``x [T, hidden]`` (normed), the step's sequences packed → ``[T, hidden]``; each
        sequence's state (``attention.states``) carried on."""
        segments = sequence_states(attention)
        m, tokens, wide = self.m, x.shape[0], _wide(x.dtype)
        gate, inputs, dt = self.in_proj(x).split([m.inner_size, m.conv_dim, m.num_heads], dim=-1)
        dt = F.softplus(dt.to(wide) + self.dt_bias.to(wide)).clamp(*m.time_step_limit)
        out = torch.empty(tokens, m.num_heads, m.head_dim, dtype=wide, device=x.device)
        for seg in segments:
            rows = slice(seg.start, seg.start + seg.count)
            copies = seg.conv_copies(self.state)
            convolved = self.conv1d(inputs[rows], seg.state.conv[self.state], copies)
            recurrent = seg.state.recurrent[self.state]
            for local, at in seg.computed_pieces(self.state):
                out[at] = self._scan(convolved[local], dt[at], recurrent)
        if self.norm is None:
            y = (out.flatten(1) * F.silu(gate.to(wide))).to(x.dtype)
        else:
            y = self.norm(out.flatten(1), gate, x.dtype)
        return self.out_proj(y)

    def _scan(self, convolved: torch.Tensor, dt: torch.Tensor, state: torch.Tensor):
        """One sequence's convolved x, B, C and steps → its outputs ``[count, heads,
        head_dim]`` with the skip term, its SSM state carried on."""
        m, count = self.m, convolved.shape[0]
        groups = m.n_groups * m.state_size
        x, b, c = convolved.split([m.inner_size, groups, groups], dim=-1)
        x = x.reshape(count, m.num_heads, m.head_dim)
        heads_per_group = m.num_heads // m.n_groups
        b, c = (
            t.reshape(count, m.n_groups, m.state_size).repeat_interleave(heads_per_group, dim=1)
            for t in (b, c)
        )
        a = -self.A_log.to(x.dtype).exp()
        return (
            ssd.scan(x, dt, a, b, c, state, m.chunk_size, self.native)
            + x * self.D.to(x.dtype)[:, None]
        )


def _wide(dtype: torch.dtype) -> torch.dtype:
    """What the scan computes in: float32, or the model's dtype where wider."""
    return torch.promote_types(dtype, torch.float32)
