"""Self-attention over this rank's heads, through a step's KV cache (`StepAttention`)."""

import dataclasses

import torch
from torch import nn

from ..kernels import ops
from ..kernels.cpu import CpuKernels
from .collectives import Collectives
from .config import ModelConfig
from .layers import AttentionMixer
from .linear import Linear, project
from .norms import LayerNorm, RMSNorm, UnitRMSNorm, rms_norm_of
from .rope import RotaryTables
from .step_attention import AttentionSpec, StepAttention


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor parallelism:
    ``config`` and ``mixer`` are already this rank's share,
    `distributed.sharding.local_config`)."""

    def __init__(
        self,
        config: ModelConfig,
        mixer: AttentionMixer,
        tp: Collectives | None = None,
        native: CpuKernels | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = mixer.num_heads, mixer.num_kv_heads
        self.head_dim = mixer.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.output_gate = mixer.output_gate  # q_proj gives each head's query, then its gate
        gated = 2 if mixer.output_gate else 1
        # A layer reading another's K and V has no k or v projection (nor their norms).
        self.shared_kv, self.k_eq_v = mixer.spec.shared_kv, mixer.k_eq_v
        self.q_proj = Linear(config.hidden_size, gated * q_size, bias=mixer.qkv_bias)
        if not self.shared_kv:
            self.k_proj = Linear(config.hidden_size, kv_size, bias=mixer.qkv_bias)
        if not (self.shared_kv or self.k_eq_v):
            self.v_proj = Linear(config.hidden_size, kv_size, bias=mixer.qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=mixer.o_bias)
        self.v_norm = None
        if mixer.v_norm and not self.shared_kv:
            self.v_norm = UnitRMSNorm(self.head_dim, config.rms_norm_eps, native)
        if mixer.qk_norm == "full":  # OLMo: over the whole projections, before the heads
            self.q_norm = rms_norm_of(config, q_size, native)
            self.k_norm = rms_norm_of(config, kv_size, native)
        elif mixer.qk_norm in ("head", "rotated"):
            self.q_norm = rms_norm_of(config, self.head_dim, native)
            if not self.shared_kv:
                self.k_norm = rms_norm_of(config, self.head_dim, native)
        elif mixer.qk_norm == "layer":  # Cohere: a LayerNorm per head, a weight row per head
            self.q_norm = LayerNorm(
                (self.num_heads, self.head_dim), config.rms_norm_eps, bias=False
            )
            self.k_norm = LayerNorm(
                (self.num_kv_heads, self.head_dim), config.rms_norm_eps, bias=False
            )
        self.qk_norm, self.qk_norm_full = mixer.qk_norm == "head", mixer.qk_norm == "full"
        self.qk_norm_layer = mixer.qk_norm == "layer"
        # Llama 4: q and k normed without a weight after their rotation; the queries of a
        # layer that does not rotate scaled by a factor of their position.
        self.unit_norm = None
        if mixer.qk_norm == "unit":
            self.unit_norm = UnitRMSNorm(self.head_dim, config.rms_norm_eps, native)
        self.temperature = mixer.temperature
        self.qk_norm_rotated = mixer.qk_norm == "rotated"  # normed after the rotation
        self.clip_qkv, self.rope = mixer.clip_qkv, mixer.rope
        self._spec = mixer.spec
        if mixer.sinks:  # a weight: the loader replaces it, so the spec is made from it late
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self._made: tuple[tuple[int, int] | None, AttentionSpec] = (None, mixer.spec)

    @property
    def spec(self) -> AttentionSpec:
        """What the kernels take: the layer's description, with its sinks (float32) where
        it has them, made again only when the weight is replaced or moved."""
        sinks = getattr(self, "sinks", None)
        if sinks is None or sinks.is_meta:
            return self._made[1]
        made = (id(sinks), sinks.data_ptr())
        if self._made[0] != made:
            scoring = self._spec.scoring.with_sinks(sinks.detach())
            self._made = (made, dataclasses.replace(self._spec, scoring=scoring))
        return self._made[1]

    def forward(
        self, x: torch.Tensor, rotary: RotaryTables | None, attention: StepAttention
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v, gate = self._qkv_gate(x, rotary)
        out = attention.attend(q, k, v, self.spec).reshape(tokens, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def qkv(
        self, x: torch.Tensor, rotary: RotaryTables | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` (normed) → q ``[T, heads, d]``, k and v ``[T, kv_heads, d]``
        as the KV cache stores them (normed and rotated where the layer does; ``rotary``
        None for a layer that does not rotate)."""
        return self._qkv_gate(x, rotary)[:3]

    def _qkv_gate(self, x: torch.Tensor, rotary: RotaryTables | None):
        """`qkv`, and the output gate ``[T, heads * d]`` where the layer has one."""
        if self.temperature is None:
            return self._projected(x, rotary)
        # Llama 4: ``rotary`` carries the step's positions to a layer that does not rotate;
        # its queries are scaled by their factors (in float32, cast back, as the model does).
        if rotary is None or rotary.positions is None:
            raise ValueError("a layer with a query temperature needs the step's positions")
        positions = rotary.positions
        q, k, v, gate = self._projected(x, rotary if self.rope is not None else None)
        factors = self.temperature.factors(positions).view(-1, 1, 1)
        return (q * factors).to(q.dtype), k, v, gate

    def _projected(self, x: torch.Tensor, rotary: RotaryTables | None):
        """q, k, v and the gate, normed and rotated where the layer does."""
        if self.shared_kv:
            return self._q_alone(x, rotary), None, None, None
        if self.k_eq_v or self.v_norm is not None:
            return self._gemma4_qkv(x, rotary)
        tokens = x.shape[0]
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        gate = None
        if self.output_gate:  # per head: its query's dims, then its gate's
            both = q.view(tokens, self.num_heads, 2, self.head_dim)
            q, gate = both[:, :, 0].reshape(tokens, -1), both[:, :, 1].reshape(tokens, -1)
        if self.qk_norm_full and self.tp is not None:
            q, k = self._sharded_norm(self.q_norm, q), self._sharded_norm(self.k_norm, k)
        elif self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm_layer:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._normed_rotated(q, k, rotary)
        return q, k, v, gate

    def _q_alone(self, x: torch.Tensor, rotary: RotaryTables | None) -> torch.Tensor:
        """The queries of a layer that reads another's K and V: normed and rotated as that
        layer's keys were."""
        q = self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim)
        if self.qk_norm:
            q = ops.rms_norm_layer(q, self.q_norm)
        q = q if rotary is None else rotary.apply(q)
        if self.qk_norm_rotated:
            return ops.rms_norm_layer(q, self.q_norm)
        return q if self.unit_norm is None or rotary is None else self.unit_norm(q)

    def _gemma4_qkv(self, x: torch.Tensor, rotary: RotaryTables | None):
        """Gemma 4's q, k, v: the values from the k projection where it has no v_proj,
        taken before the keys' norm and rotation, and normed without a weight."""
        tokens = x.shape[0]
        if self.k_eq_v:
            q, k = project(x, self.q_proj, self.k_proj)
            v = k
        else:
            q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.v_norm is not None:
            v = self.v_norm(v)
        elif self.k_eq_v:  # the keys' rotation may run in place
            v = v.clone()
        q, k = self._normed_rotated(q, k, rotary)
        return q, k, v, None

    def _normed_rotated(
        self, q: torch.Tensor, k: torch.Tensor, rotary: RotaryTables | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys ``[T, heads, d]`` normed per head where the layer does, then
        rotated where it does (one fused step where both); or rotated, then normed
        (HunYuan's ``rotated`` norms)."""
        norms = (self.q_norm, self.k_norm) if self.qk_norm else None
        if self.unit_norm is not None and rotary is not None:  # rotated, then normed
            q, k = ops.qk_norm_rotate(q, k, None, rotary)
            return self.unit_norm(q), self.unit_norm(k)
        if rotary is not None:
            q, k = ops.qk_norm_rotate(q, k, norms, rotary)
        elif norms is not None:
            q, k = ops.rms_norm_layer(q, norms[0]), ops.rms_norm_layer(k, norms[1])
        if self.qk_norm_rotated:
            q, k = ops.rms_norm_layer(q, self.q_norm), ops.rms_norm_layer(k, self.k_norm)
        return q, k

    def _sharded_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """OLMoE's norm over a whole projection when each rank holds some of its heads:
        the squares summed over the ranks, a key head that several ranks hold (where there
        are fewer key heads than ranks) counted once."""
        tp = self.tp
        assert tp is not None
        replicas = tp.kv_replicas if norm is self.k_norm else 1
        squares = tp.all_reduce(x.float().pow(2).sum(-1, keepdim=True).contiguous()) / replicas
        count = x.shape[-1] * tp.world // replicas  # the whole projection's elements
        scale, eps = norm.float_norm(x)
        return (x.float() * torch.rsqrt(squares / count + eps) * scale).to(x.dtype)
