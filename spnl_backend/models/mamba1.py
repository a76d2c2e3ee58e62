"""A Mamba-1 layer (Jamba): a selective state space per channel over a per-sequence state.

One projection gives the channels' inputs x and the gate z. x goes through a short causal
depthwise convolution (SiLU after it); a second projection of the convolved x gives the
step's low-rank input, B and C (each RMS-normed in Jamba), and a third widens the step
to every channel (softplus of it plus a bias: dt). The selective scan
(`kernels.selective_scan`) turns x, dt, each channel's rates A and the token's B and C
into each token's output, to which the skip term D x is added; gated by SiLU(z), the
output projection finishes it. What a sequence carries from step to step is its state
(`StateSegment`): the convolution's last inputs and the SSM state.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import selective_scan
from ..kernels.cpu import CpuKernels
from .config import Mamba1Config, ModelConfig
from .conv import CausalConv1d
from .layers import Mamba1Mixer
from .linear import Linear
from .norms import RMSNorm
from .step_attention import StepAttention, sequence_states


class Mamba1(nn.Module):
    def __init__(
        self, config: ModelConfig, mixer: Mamba1Mixer, native: CpuKernels | None = None
    ) -> None:
        super().__init__()
        m: Mamba1Config = mixer.config
        self.m, self.state, self.native = m, mixer.state, native
        hidden, inner, eps = config.hidden_size, m.inner_size, config.rms_norm_eps
        self.in_proj = Linear(hidden, 2 * inner, bias=m.proj_bias)
        self.conv1d = CausalConv1d(inner, m.conv_kernel, bias=m.conv_bias)
        self.x_proj = Linear(inner, m.dt_rank + 2 * m.state_size, bias=False)
        self.dt_proj = Linear(m.dt_rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(inner, m.state_size))
        self.D = nn.Parameter(torch.empty(inner))
        self.out_proj = Linear(inner, hidden, bias=m.proj_bias)
        self.dt_layernorm = self.b_layernorm = self.c_layernorm = None
        if m.dt_norms:
            self.dt_layernorm = RMSNorm(m.dt_rank, eps, native=native)
            self.b_layernorm = RMSNorm(m.state_size, eps, native=native)
            self.c_layernorm = RMSNorm(m.state_size, eps, native=native)

    def forward(self, x: torch.Tensor, attention: StepAttention) -> torch.Tensor:
        """``x [T, hidden]`` (normed), the step's sequences packed → ``[T, hidden]``; each
        sequence's state (``attention.states``) carried on."""
        segments = sequence_states(attention)
        m, wide = self.m, _wide(x.dtype)
        inputs, gate = self.in_proj(x).chunk(2, dim=-1)
        convolved = torch.empty(x.shape[0], m.inner_size, dtype=wide, device=x.device)
        for seg in segments:  # each sequence's convolution, from its own last inputs
            rows = slice(seg.start, seg.start + seg.count)
            state = seg.state.conv[self.state]
            convolved[rows] = self.conv1d(inputs[rows], state, seg.conv_copies(self.state))
        dt, b, c = self._selection(convolved.to(x.dtype))
        a = -self.A_log.to(wide).exp()
        out = torch.empty_like(convolved)
        for seg in segments:
            recurrent = seg.state.recurrent[self.state]
            for _, at in seg.computed_pieces(self.state):
                out[at] = selective_scan.scan(
                    convolved[at], dt[at], a, b[at], c[at], recurrent, self.native
                )
        y = (out + convolved * self.D.to(wide)) * F.silu(gate.to(wide))
        return self.out_proj(y.to(x.dtype))

    def _selection(self, convolved: torch.Tensor):
        """The convolved channels' step (softplus, every channel), B and C, in float32 at
        least: what makes the scan selective."""
        m, wide = self.m, _wide(convolved.dtype)
        step, b, c = self.x_proj(convolved).split([m.dt_rank, m.state_size, m.state_size], -1)
        if self.dt_layernorm is not None:
            step, b, c = self.dt_layernorm(step), self.b_layernorm(b), self.c_layernorm(c)
        dt = self.dt_proj(step).to(wide)  # (its bias inside the softplus, as Mamba adds it)
        return F.softplus(dt), b.to(wide), c.to(wide)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """What the scan computes in: float32, or the model's dtype where wider."""
    return torch.promote_types(dtype, torch.float32)
