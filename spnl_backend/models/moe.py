"""Mixture-of-experts layers: a router and its experts, on three paths (the grouped torch
twin, the native CPU layer, a fused kernel)."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu.moe import Biases, NativeMoe
from ..kernels.dispatch import TORCH_CHOICE, KernelChoice
from ..kernels.moe_ref import Experts
from ..quant.linear import QuantizedExperts, QuantLinear
from .config import ModelConfig, MoeConfig
from .linear import Linear, rows_alone
from .mlp import ClampedSwiGLU, GatedMLP

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
        self.moe = moe
        # Llama 4: the chosen experts' inputs scaled by the sigmoid of their logits.
        self.scales_input = moe.routing == "sigmoid_input"
        self.gate = Linear(config.hidden_size, moe.num_experts, bias=moe.bias)
        if moe.score_bias:  # DeepSeek-V3's bias of the scores, for choosing alone
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(moe.num_experts), requires_grad=False
            )
        self.experts = nn.ModuleList(
            GatedMLP(config, moe.intermediate_size, bias=moe.bias) for _ in range(moe.num_experts)
        )
        # The layer on the CPU's native kernels (`kernels.cpu.moe`), made on first use
        # where the experts run there (None: they do not).
        self._native: NativeMoe | None = None
        self._native_made = False
        # A fused kernel (`kernels.triton_moe` on CUDA, the choice's `fused_moe`), taken
        # once the weights are in (`prepare_experts`); its experts then live stacked, each
        # expert's weights views of them.
        self.fused: FusedMoe | None = None
        self._stacked: Stacked | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts ``[T, top_k]`` and their weights (float32 where the
        architecture weighs in float32, else ``x``'s dtype); with ``sigmoid_input``
        routing the top-k logits' sigmoids (float32, cast to ``x``'s dtype)."""
        if self.scales_input:
            logits, experts = torch.topk(rows_alone(self.gate, x), self.top_k, dim=-1)
            return experts, torch.sigmoid(logits.float()).to(x.dtype)
        logits = rows_alone(self.gate, x).float()
        if not self.moe.plain_routing:
            bias = getattr(self, "e_score_correction_bias", None)
            experts, weights = grouped_route(logits, self.moe, bias)
            return experts, weights if self.float_weights else weights.to(x.dtype)
        probs = torch.softmax(logits, dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights if self.float_weights else weights.to(x.dtype)

    def prepare_experts(self) -> None:
        """Stack the experts where the model's kernels fuse them (`KernelChoice.fused_moe`);
        else leave them as they are."""
        if self.kernels.fused_moe is not None:
            self.use_fused(self.kernels.fused_moe)

    def use_fused(self, fused: "FusedMoe") -> None:
        """Run the experts through ``fused``: their weights stacked once, float ones into
        ``[E, 2I, H]`` (gate rows, then up) and ``[E, H, I]``, quantized ones as the same
        stacks of GGML blocks (`QuantizedExperts`), each expert's projections left as views
        of them (no second copy). Experts that do not stack (float beside quantized, GGML
        types that differ within a projection, a gelu MLP, gpt-oss's biased experts with
        their clamped SwiGLU) keep the per-expert path."""
        if self._stacked is None:
            self._stacked = self._stack()
        if self._stacked is not None:
            self.fused = fused

    def _stack(self) -> Stacked | None:
        layers = [p for e in self.experts for p in (e.gate_proj, e.up_proj, e.down_proj)]
        quantized = {isinstance(layer, QuantLinear) for layer in layers}
        if self.experts[0].act is not F.silu or len(quantized) > 1 or _biased(layers):
            return None  # the kernels' activation is SiLU, unbiased; one kind of weight
        if self.scales_input:
            return None  # the kernels weigh the experts' outputs
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
        native = None if self.fused is not None else self._native_for(x)
        if native is not None:
            return native(x)
        experts, weights = self.route(x)
        if self.fused is not None and self._stacked is not None:
            return self.fused(x, *self._stacked, experts, weights.float()).to(x.dtype)
        return self.grouped(x, experts, weights)

    def grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
        """The torch path (and the twin of the native and fused ones): each expert's
        tokens through its projections, weighted (their inputs, with ``sigmoid_input``
        routing), summed over a token's experts in id order."""
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
            slot_weights = weights.flatten()[order[start : start + count]][:, None]
            if self.scales_input:  # the expert's input weighed, its output as it is
                y = self.experts[expert]((x[rows] * slot_weights).to(x.dtype)).to(out.dtype)
            else:
                y = self.experts[expert](x[rows]).to(out.dtype) * slot_weights
            out.index_add_(0, rows, y)
            start += count
        return out.to(x.dtype)

    def _native_for(self, x: torch.Tensor) -> NativeMoe | None:
        """The native layer where this step runs on it (`KernelChoice.native_rows`)."""
        return None if self.kernels.native_rows(x) is None else self.native_layer()

    def native_layer(self) -> NativeMoe | None:
        """This layer on the CPU's native kernels (one call: routing, the experts' grouped
        products, the weighted sum), where its experts are quantized projections gated by
        SiLU or gpt-oss's clamped SwiGLU, biased or not (every projection and the router
        alike), and the model's kernels take them (`KernelChoice.moe_layer`; a quantized
        router's values taken once in float); else None (the torch path, which also runs
        ``sigmoid_input`` routing: its experts' inputs are weighed, not their outputs)."""
        if not self._native_made:
            self._native, self._native_made = self._make_native(), True
        return self._native

    def _make_native(self) -> NativeMoe | None:
        if not self.moe.plain_routing:  # the native layer routes by a softmax top-k alone,
            return None  # and weighs the experts' outputs (not, as Llama 4, their inputs)
        layers = [p for e in self.experts for p in (e.gate_proj, e.up_proj, e.down_proj)]
        glu = self.experts[0].glu
        clamped = (glu.alpha, glu.limit) if isinstance(glu, ClampedSwiGLU) else None
        if (
            (self.experts[0].act is not F.silu and clamped is None)
            or not all(isinstance(p, QuantLinear) for p in layers)
            or _biased([*layers, self.gate]) != _every_biased([*layers, self.gate])
        ):  # biases on some of the layer's projections only: not the native layer's case
            return None

        def weight(p: QuantLinear) -> tuple[int, torch.Tensor, int]:
            return p.weight_q.native_format, p.weight_q.data, p.out_features

        experts = [
            (weight(e.gate_proj), weight(e.up_proj), weight(e.down_proj)) for e in self.experts
        ]
        if isinstance(self.gate, QuantLinear):  # a small matrix: its values once, in float
            router = self.gate.weight_q.dequantize().float().contiguous()
        else:
            router = self.gate.weight.detach().float().contiguous()
        biases = self._biases() if _biased(layers) else None  # every one biased, or none
        return self.kernels.moe_layer(
            router, experts, self.top_k, self.renormalize, biases, clamped
        )

    def _biases(self) -> Biases:
        """The router's and the experts' biases, stacked in float32 for the native layer."""

        def bias(layer: nn.Module) -> torch.Tensor:
            return layer.bias.detach().float()

        return Biases(
            bias(self.gate).contiguous(),
            torch.stack([torch.cat([bias(e.gate_proj), bias(e.up_proj)]) for e in self.experts]),
            torch.stack([bias(e.down_proj) for e in self.experts]),
        )


def grouped_route(
    logits: torch.Tensor, moe: MoeConfig, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing of float32 router ``logits [T, E]``: each token's experts
    ``[T, top_k]`` and their float32 weights. Scores are the softmax (V2) or the sigmoid
    (V3) of the logits; ``bias`` (V3's) is added to them for choosing alone; with groups,
    the experts of all but the ``topk_group`` best groups are set aside first. The
    weights are the chosen experts' scores, renormalised where the config says, times the
    routed scale."""
    scores = torch.sigmoid(logits) if moe.scoring == "sigmoid" else torch.softmax(logits, -1)
    choice = scores if bias is None else scores + bias.float()
    if moe.n_group > 1:
        groups = choice.view(choice.shape[0], moe.n_group, -1)
        if moe.group_rule == "max":
            group_scores = groups.max(dim=-1).values
        else:
            group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        best = torch.topk(group_scores, moe.topk_group, dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        kept = kept.repeat_interleave(groups.shape[-1], dim=1)
        # V2 zeroes the set-aside softmax scores (all positive), V3 makes them -inf.
        aside = 0.0 if moe.scoring == "softmax" and bias is None else float("-inf")
        choice = choice.masked_fill(~kept, aside)
    experts = torch.topk(choice, moe.top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, weights * moe.routed_scale


def _biased(layers: list[nn.Module]) -> bool:
    return any(getattr(layer, "bias", None) is not None for layer in layers)


def _every_biased(layers: list[nn.Module]) -> bool:
    return all(getattr(layer, "bias", None) is not None for layer in layers)
