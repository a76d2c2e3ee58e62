"""The MLPs of a dense layer: gated (and each expert's), or plain (an up projection, the
activation, a down projection); their activations and gating functions."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import ops
from ..kernels.cpu import CpuKernels
from ..kernels.cpu.abi import GATED_ACTS
from .config import ModelConfig
from .linear import Linear, project

Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> activation


class GatedMLP(nn.Module):
    """``down(glu(gate(x), up(x)))``; ``bias``: every projection biased (gpt-oss's
    experts). ``act`` is the gate's activation where the glu is ``act(gate) * up`` (what
    the native and fused kernels run), else None. ``native``: the compiled kernels, whose
    activation (SiLU or GELU-tanh) runs in float32 on the CPU, as the native layer blocks
    run it (`kernels.ops.gated_act`)."""

    def __init__(
        self,
        config: ModelConfig,
        inner: int | None = None,
        bias: bool = False,
        native: CpuKernels | None = None,
    ) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, inner or config.intermediate_size
        self.gate_proj = Linear(hidden, inner, bias=bias)
        self.up_proj = Linear(hidden, inner, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)
        self.act: Callable[[torch.Tensor], torch.Tensor] | None = None
        # The kernel's activation where the glu is its call (the native layer blocks' too).
        self.native_act: str | None = None
        if config.activation == "swiglu_oai":
            self.glu: Glu = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)
        elif config.activation in GATED_ACTS and native is not None:
            self.act, self.native_act = activation_fn(config.activation), config.activation
            self.glu = _native_glu(config.activation, native)
        else:
            self.act = activation_fn(config.activation)
            self.glu = _plain_glu(self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(self.glu(gate, up))


class PlainMLP(nn.Module):
    """``down(act(up(x)))``, its projections biased where ``bias`` (Phi-2's fc1/fc2,
    StarCoder2's c_fc/c_proj, GPT-NeoX's dense_h_to_4h/dense_4h_to_h, under the gated
    MLP's names of the two; Arcee's and Apertus's unbiased). An activation with learned
    scalars is a module of its own (``act_fn``)."""

    def __init__(self, config: ModelConfig, inner: int, bias: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.up_proj = Linear(hidden, inner, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)
        if config.activation == "xielu":
            self.act_fn = XIELU()
            self.act: Callable[[torch.Tensor], torch.Tensor] = self.act_fn
        else:
            self.act = activation_fn(config.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class XIELU(nn.Module):
    """xIELU (Apertus): ``ap * x^2 + beta * x`` for x > 0, else ``an * (expm1(min(x, eps))
    - x) + beta * x``, where ``ap = softplus(alpha_p)`` and ``an = beta + softplus(alpha_n)``;
    the four scalars learned per layer, stored as the checkpoint stores them."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.empty(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.empty(1), requires_grad=False)
        self.beta = nn.Parameter(torch.empty(()), requires_grad=False)
        self.eps = nn.Parameter(torch.empty(()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        linear = self.beta * x
        positive = alpha_p * x * x + linear
        negative = (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + linear
        return torch.where(x > 0, positive, negative)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's gating: the gate clamped above at ``limit`` and up to ``[-limit, limit]``
    (keeping both in the range the model was trained in), then
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def _plain_glu(act: Callable[[torch.Tensor], torch.Tensor]) -> Glu:
    return lambda gate, up: act(gate).mul_(up)


def _native_glu(kind: str, native: CpuKernels) -> Glu:
    return lambda gate, up: ops.gated_act(kind, gate, up, native)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def relu2(x: torch.Tensor) -> torch.Tensor:
    """ReLU squared (Primer's; transformers' ``relu2``)."""
    return F.relu(x).square()


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": gelu_tanh,
    "relu2": relu2,
}


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function of a `ModelConfig.activation` that is one (not gpt-oss's gating)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not a plain one: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]
