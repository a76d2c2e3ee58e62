"""The building blocks every architecture shares: norms, linears, gated MLP, attention."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import ops
from ..kernels.cpu import CpuKernels
from ..kernels.cpu.moe import NativeMoe
from ..kernels.dispatch import TORCH_CHOICE, KernelChoice
from ..kernels.moe_ref import Experts
from ..kernels.sets import NativeKeys
from ..quant.linear import QuantizedExperts, QuantLinear
from .config import ModelConfig
from .rope import RotaryTables


@dataclass(frozen=True)
class AttentionSpec:
    """What a layer's attention needs besides q, k, v: fixed per layer."""

    layer: int
    scale: float
    num_kv_groups: int
    sliding_window: int | None = None
    softcap: float | None = None


class AttentionBackend(Protocol):
    """The KV-cache interface the model calls: store this step's K/V, attend over the cache.

    ``q [T, heads, head_dim]``, ``k`` and ``v [T, kv_heads, head_dim]`` for the T
    tokens of this step, packed sequence after sequence; returns ``[T, heads, head_dim]``.
    """

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor: ...

    def native_keys(
        self, windows: tuple[int, ...]
    ) -> tuple[NativeKeys, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """The step's keys and each layer's (key, value) pool where the native layer blocks
        may run the step (`models.native_blocks`: the paged pool on the CPU's kernels), else
        None; ``windows``: the model's sliding windows."""
        ...


class WithoutLayerBlocks:
    """An attention backend whose steps never run as the native layer blocks (their keys
    are not in the paged pool): every step takes the per-op path."""

    def native_keys(self, windows: tuple[int, ...]) -> None:
        return None


class Collectives(Protocol):
    """A tensor-parallel group as the model uses it (`distributed.parallel`): this rank's
    place, the sum of a tensor over the ranks, every rank's columns side by side, and the
    hooks where the first rank tells the others which step to run with it."""

    rank: int
    world: int
    kv_replicas: int  # ranks that hold each key/value head (1 unless fewer heads than ranks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_max(self, x: torch.Tensor) -> torch.Tensor: ...
    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor: ...
    def before_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> None: ...
    def before_logits(self, hidden: torch.Tensor) -> None: ...


def shard_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s share of ``size`` rows split ``world`` ways:
    equal shares of ``ceil(size / world)``, the last one shorter where it does not divide."""
    share = -(-size // world)
    return min(size, rank * share), min(size, (rank + 1) * share)


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


class Linear(nn.Linear):
    """The projection layers' type: the seam where quantized layers replace float ones."""


def project(x: torch.Tensor, *layers: nn.Module) -> list[torch.Tensor]:
    """Several projections of the same input; quantized ones share one pass over it."""
    if all(isinstance(layer, QuantLinear) for layer in layers):
        return QuantLinear.apply_many(x, list(layers))
    return [layer(x) for layer in layers]


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


# (x, w13 [E, 2I, H], w2 [E, H, I], topk ids [T, k], topk weights [T, k]) -> [T, H]; the
# experts float tensors or `QuantizedExperts` (GGML blocks)
FusedMoe = Callable[[torch.Tensor, Experts, Experts, torch.Tensor, torch.Tensor], torch.Tensor]
Stacked = tuple[torch.Tensor, torch.Tensor] | tuple[QuantizedExperts, QuantizedExperts]


class SparseMoE(nn.Module):
    """A router and its experts (`MoeConfig`): each token runs through its ``top_k``
    experts, weighted by the router's probabilities. Tokens are grouped by expert, so a
    step reads each chosen expert's weights once for all its tokens and never reads an
    idle expert's. A token's sum runs over its experts in id order, each expert's rows
    computed as the dense projections compute any rows: its output does not depend on
    what else shares the step."""

    def __init__(self, config: ModelConfig, kernels: KernelChoice = TORCH_CHOICE) -> None:
        super().__init__()
        self.kernels = kernels
        moe = config.moe
        assert moe is not None
        self.top_k, self.renormalize, self.float_weights = (
            moe.top_k,
            moe.renormalize,
            moe.float_weights,
        )
        self.gate = Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(config, moe.intermediate_size) for _ in range(moe.num_experts)
        )
        # The layer on the CPU's native kernels (`kernels.cpu.moe`), made on first use
        # where the experts run there (None: they do not).
        self._native: NativeMoe | None = None
        self._native_made = False
        # A fused kernel (`kernels.triton_moe` on CUDA, the choice's `fused_moe`), taken
        # on first use by `use_fused`; its experts then live stacked, each expert's weights
        # views of them.
        self.fused: FusedMoe | None = None
        self._stacked: Stacked | None = None
        self._fused_tried = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts ``[T, top_k]`` and their weights (float32 where the
        architecture weighs in float32, else ``x``'s dtype)."""
        probs = torch.softmax(self._router_logits(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights if self.float_weights else weights.to(x.dtype)

    def _router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router's logits, each row computed alone (a matrix-vector product): a
        float GEMM rounds differently with the number of rows, and a token's experts must
        not depend on what shares its step. A quantized router's rows already are."""
        if isinstance(self.gate, QuantLinear):
            return self.gate(x)
        weight = self.gate.weight
        if not len(x):
            return x @ weight.T
        return torch.stack([torch.mv(weight, row) for row in x])

    def use_fused(self, fused: "FusedMoe") -> None:
        """Run the experts through ``fused``: their weights stacked once, float ones into
        ``[E, 2I, H]`` (gate rows, then up) and ``[E, H, I]``, quantized ones as the same
        stacks of GGML blocks (`QuantizedExperts`), each expert's projections left as views
        of them (no second copy). Experts that do not stack (float beside quantized, GGML
        types that differ within a projection, a gelu MLP) keep the per-expert path."""
        if self._stacked is None:
            self._stacked = self._stack()
        if self._stacked is not None:
            self.fused = fused

    def _stack(self) -> Stacked | None:
        layers = [p for e in self.experts for p in (e.gate_proj, e.up_proj, e.down_proj)]
        quantized = {isinstance(layer, QuantLinear) for layer in layers}
        if self.experts[0].act is not F.silu or len(quantized) > 1:
            return None  # the kernels' activation is SiLU; one kind of weight per stack
        return self._stack_quantized() if quantized == {True} else self._stack_float()

    def _stack_float(self) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            w13 = torch.stack(
                [torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts]
            )
            w2 = torch.stack([e.down_proj.weight for e in self.experts])
            inner = w13.shape[1] // 2
            for i, e in enumerate(self.experts):
                e.gate_proj.weight = nn.Parameter(w13[i, :inner], requires_grad=False)
                e.up_proj.weight = nn.Parameter(w13[i, inner:], requires_grad=False)
                e.down_proj.weight = nn.Parameter(w2[i], requires_grad=False)
        return w13, w2

    def _stack_quantized(self) -> tuple[QuantizedExperts, QuantizedExperts] | None:
        gate_up = [[e.gate_proj.weight_q, e.up_proj.weight_q] for e in self.experts]
        down = [[e.down_proj.weight_q] for e in self.experts]
        if not (QuantizedExperts.stackable(gate_up) and QuantizedExperts.stackable(down)):
            return None
        for e in self.experts:  # native calls kept for the blocks that are about to move
            for layer in (e.gate_proj, e.up_proj, e.down_proj):
                layer.prepared.clear()
        self._native, self._native_made = None, False
        return QuantizedExperts.stack(gate_up), QuantizedExperts.stack(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._fused_tried:
            self._fused_tried = True
            if self.kernels.fused_moe is not None:
                with torch.inference_mode(False):  # the stacks are weights, kept for good
                    self.use_fused(self.kernels.fused_moe)
        native = None if self.fused is not None else self._native_for(x)
        if native is not None:
            return native(x)
        experts, weights = self.route(x)
        if self.fused is not None and self._stacked is not None:
            return self.fused(x, *self._stacked, experts, weights.float()).to(x.dtype)
        return self.grouped(x, experts, weights)

    def grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
        """The torch path (and the twin of the native and fused ones): each expert's
        tokens through its projections, weighted, summed over a token's experts in id
        order."""
        out = torch.zeros(x.shape, dtype=weights.dtype, device=x.device)
        slots = experts.flatten()
        order = torch.argsort(slots, stable=True)  # by expert, tokens in order within one
        counts = torch.bincount(slots, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = tokens[start : start + count]
            slot_weights = weights.flatten()[order[start : start + count]]
            y = self.experts[expert](x[rows]).to(out.dtype) * slot_weights[:, None]
            out.index_add_(0, rows, y)
            start += count
        return out.to(x.dtype)

    def _native_for(self, x: torch.Tensor) -> NativeMoe | None:
        """The native layer where this step runs on it (`KernelChoice.native_rows`)."""
        return None if self.kernels.native_rows(x) is None else self.native_layer()

    def native_layer(self) -> NativeMoe | None:
        """This layer on the CPU's native kernels (one call: routing, the experts' grouped
        products, the weighted sum), where its experts are quantized projections without
        bias with SiLU and the model's kernels take them (`KernelChoice.moe_layer`; a
        quantized router's values taken once in float); else None (the torch path)."""
        if not self._native_made:
            self._native, self._native_made = self._make_native(), True
        return self._native

    def _make_native(self) -> NativeMoe | None:
        layers = [p for e in self.experts for p in (e.gate_proj, e.up_proj, e.down_proj)]
        if self.experts[0].act is not F.silu or not all(
            isinstance(p, QuantLinear) and p.bias is None for p in layers
        ):
            return None

        def weight(p: QuantLinear) -> tuple[int, torch.Tensor, int]:
            return p.weight_q.qtype.value, p.weight_q.data, p.out_features

        experts = [
            (weight(e.gate_proj), weight(e.up_proj), weight(e.down_proj)) for e in self.experts
        ]
        if isinstance(self.gate, QuantLinear):  # a small matrix: its values once, in float
            router = self.gate.weight_q.dequantize().float().contiguous()
        else:
            router = self.gate.weight.detach().float().contiguous()
        return self.kernels.moe_layer(router, experts, self.top_k, self.renormalize)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor parallelism:
    ``config`` is already this rank's share, `distributed.sharding.local_config`)."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        tp: Collectives | None = None,
        native: CpuKernels | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm_full:  # OLMoE: over the whole projections, before the heads
            self.q_norm = _norm(config, q_size, native)
            self.k_norm = _norm(config, kv_size, native)
        elif config.qk_norm:
            self.q_norm = _norm(config, self.head_dim, native)
            self.k_norm = _norm(config, self.head_dim, native)
        self.qk_norm = config.qk_norm and not config.qk_norm_full
        self.qk_norm_full, self.clip_qkv = config.qk_norm_full, config.clip_qkv
        self.spec = AttentionSpec(
            layer=layer,
            scale=config.scale,
            num_kv_groups=self.num_heads // self.num_kv_heads,
            sliding_window=config.window_of(layer),
            softcap=config.attn_softcap,
        )

    def forward(
        self, x: torch.Tensor, rotary: RotaryTables, backend: AttentionBackend
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        if self.qk_norm_full and self.tp is not None:
            q, k = self._sharded_norm(self.q_norm, q), self._sharded_norm(self.k_norm, k)
        elif self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = ops.qk_norm_rotate(
            q, k, (self.q_norm, self.k_norm) if self.qk_norm else None, rotary
        )
        out = backend.attend(q, k, v, self.spec)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))

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


def _norm(config: ModelConfig, dim: int, native: CpuKernels | None) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, config.norm_offset, config.norm_in_float, native)


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
        self.input_layernorm = _norm(config, hidden, native)
        self.post_attention_layernorm = _norm(config, hidden, native)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = _norm(config, hidden, native)
            self.post_feedforward_layernorm = _norm(config, hidden, native)

    def forward(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        rotary: RotaryTables,
        backend: AttentionBackend,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` the residual stream, ``h`` its normed copy (this layer's input norm) →
        the new residual stream and its norm by ``next_norm`` (the next layer's input norm
        or the final one). Each residual add and the norm after it are one step
        (`ops.add_rms_norm_layer`); ``x`` may be updated in place."""
        attn = self._summed(self.self_attn(h, rotary, backend))
        add_norm = ops.add_rms_norm_layer
        if not self.sandwich:
            x, h = add_norm(x, attn, None, self.post_attention_layernorm)
            return add_norm(x, self._summed(self.mlp(h)), None, next_norm)
        x, h = add_norm(x, attn, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        return add_norm(x, self._summed(self.mlp(h)), self.post_feedforward_layernorm, next_norm)

    def _summed(self, part: torch.Tensor) -> torch.Tensor:
        return part if self.tp is None else self.tp.all_reduce(part)
