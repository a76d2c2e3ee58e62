"""A decoder's layers as two native calls each on the CPU: the attention block and the MLP
block of ``layer_blocks.c`` (the gated activation at its start, the per-op path's kernel for
it). This module
reads the model into each layer's fixed arguments; `kernels.cpu.layer_blocks` runs a step.

The per-op path (`DecoderLayer.forward`) is the twin: each block runs the very kernels
that path calls, in the same order on the same values, so the two give the same bits (a
test checks it); this path only leaves Python out of the layer, a tenth of a decode
token at 1B sizes. It runs where every product, store and attention of the step would be
native anyway: float32 activations on the CPU, quantized projections without bias on the
per-row products (batch invariance), and a float paged pool whose every query attends
through the decode kernel (`StepAttention.native_keys`). A layer with experts runs
them as the MoE block: the one native call (`kernels.cpu.moe`) the per-op path makes too.
Anything else takes the per-op path.
"""

import ctypes

import torch

from ..kernels.cpu import CpuKernels, LayerArgs, scoring_args
from ..kernels.cpu.abi import GATED_ACTS
from ..kernels.cpu.layer_blocks import LayerStack
from ..kernels.cpu.lora import LoraTables, lora_groups
from ..kernels.cpu.moe import NativeMoe
from ..kernels.sets import NativeKeys
from ..quant.linear import QuantLinear
from .attention import Attention
from .decoder import DecoderLayer
from .linear import Linear
from .mlp import GatedMLP
from .moe import SparseMoE
from .norms import RMSNorm
from .rope import RotaryTables


class LayerBlocks:
    """The native layer blocks of one backbone: each layer's fixed arguments, built once."""

    def __init__(
        self,
        native: CpuKernels,
        layers: list[DecoderLayer],
        final_norm: RMSNorm,
        local_layers: frozenset[int],
    ) -> None:
        attn = layers[0].self_attn
        self.native = native
        self.hidden = attn.q_proj.in_features
        dense = [layer.mlp for layer in layers if isinstance(layer.mlp, GatedMLP)]
        self.inner = dense[0].gate_proj.out_features if dense else 0
        self.keep: list = []  # what the structs point into
        self.moe: NativeMoe | None = None  # one MoE layer: the scratch all of them take
        args = [
            self._layer_args(layer, nxt, i in local_layers)
            for i, (layer, nxt) in enumerate(
                zip(layers, [*(lay.input_layernorm for lay in layers[1:]), final_norm], strict=True)
            )
        ]
        self.stack = LayerStack(
            native,
            self.hidden,
            self.inner,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            args,
            self.moe,
        )
        # Each layer's projections in common.h's LORA_* order, where LoRA adapters attach
        # (the blocks add their products after each), their tables, and every other
        # projection of the layers (an adapter there: the step takes the per-op path).
        self.lora_projections = [_lora_projections(layer) for layer in layers]
        self.lora_tables = [[LoraTables() for _ in lins] for lins in self.lora_projections]
        wired = {id(lin) for lins in self.lora_projections for lin in lins}
        self.other_projections = [
            module
            for layer in layers
            for module in layer.modules()
            if isinstance(module, (Linear, QuantLinear)) and id(module) not in wired
        ]
        # The layers' sliding windows (a step with PIC queries reads one table for them).
        self.windows = tuple(
            sorted({w for layer in layers if (w := layer.self_attn.spec.scoring.window)})
        )

    @classmethod
    def build(
        cls,
        native: CpuKernels,
        layers: list[DecoderLayer],
        final_norm: RMSNorm,
        local_layers: frozenset[int],
    ) -> "LayerBlocks | None":
        """The blocks of ``layers`` on ``native`` (`KernelChoice.layer_blocks`), or None
        where a layer is not one they run."""
        if not _blocks_run(layers, final_norm):
            return None
        return cls(native, layers, final_norm, local_layers)

    def _layer_args(self, layer: DecoderLayer, next_norm: RMSNorm, local: bool) -> LayerArgs:
        attn, mlp = layer.self_attn, layer.mlp
        products = [
            self._products([attn.q_proj, attn.k_proj, attn.v_proj]),
            self._products([attn.o_proj]),
        ]
        moe = None
        if isinstance(mlp, SparseMoE):
            moe = self.moe = mlp.native_layer()
            self.keep.append(moe)
        else:
            products += [self._products([mlp.gate_proj, mlp.up_proj])]
            products += [self._products([mlp.down_proj])]
        if layer.sandwich:
            norms = (
                layer.post_attention_layernorm,
                layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm,
                next_norm,
            )
        else:
            norms = (None, layer.post_attention_layernorm, None, next_norm)
        qk = (attn.q_norm, attn.k_norm) if attn.qk_norm or attn.qk_norm_full else (None, None)
        spec = attn.spec
        self.keep.append(spec.scoring)  # its sinks, where it has them
        return LayerArgs(
            *(ctypes.pointer(p.args) for p in products),
            *([None, None] if moe else []),
            hidden=self.hidden,
            inner=self.inner,
            heads=attn.num_heads,
            kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            q_norm=self._scale(qk[0]),
            k_norm=self._scale(qk[1]),
            attn_delta_norm=self._scale(norms[0]),
            attn_out_norm=self._scale(norms[1]),
            mlp_delta_norm=self._scale(norms[2]),
            mlp_out_norm=self._scale(norms[3]),
            eps=layer.input_layernorm.eps,
            local=int(local),
            scoring=scoring_args(spec.scoring, attn.num_heads),
            qk_full=int(attn.qk_norm_full),
            has_clip=int(attn.clip_qkv is not None),
            clip=attn.clip_qkv or 0.0,
            act=0 if moe else GATED_ACTS[mlp.native_act],
            moe=None if moe is None else ctypes.pointer(moe.args),
        )

    def _products(self, linears: list[QuantLinear]):
        k_in = linears[0].in_features
        weights = [
            (lin.weight_q.native_format, lin.weight_q.data, lin.out_features) for lin in linears
        ]
        for qtype, data, _ in weights:
            self.native.check_row_bytes(qtype, k_in, data.shape[1], "layer block")
        products = self.native.products(weights)
        self.keep.append(products)
        return products

    def _scale(self, norm: RMSNorm | None) -> int | None:
        if norm is None:
            return None
        scale, _ = norm.float_norm(torch.empty(0))
        self.keep.append(scale)
        return scale.data_ptr()

    def run(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        tables: tuple[RotaryTables, RotaryTables],
        keys: NativeKeys,
        pools: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Every layer over ``x`` (the residual stream, updated in place) and ``h`` (its norm
        by the first layer's input norm) → the final norm's output."""
        lora = self._lora_step()  # held through the run: the groups point into its rows
        return self.stack.run(x, h, tables, keys, pools, None if lora is None else lora[0])

    def adapters_run(self) -> bool:
        """Whether the blocks run every LoRA adapter held: none sits on a projection they
        do not add adapters at (else the step takes the per-op path)."""
        return not any(lin.lora is not None and lin.lora.pairs for lin in self.other_projections)

    def _lora_step(self):
        """This step's adapter rows for the blocks and what they point into (None: none),
        each layer's tables set."""
        sites = [lin.lora for lins in self.lora_projections for lin in lins if lin.lora]
        if not sites or not sites[0].step.groups:
            return None
        for args, lins, tables in zip(
            self.stack.layers, self.lora_projections, self.lora_tables, strict=True
        ):
            for i, (lin, table) in enumerate(zip(lins, tables, strict=True)):
                pairs = {} if lin.lora is None else lin.lora.pairs
                args.lora[i] = table.pointer(pairs, lin.in_features, lin.out_features)
        return lora_groups(sites[0].step.groups)


def _blocks_run(layers: list[DecoderLayer], final_norm: RMSNorm) -> bool:
    """Whether every layer is one the blocks run: attention (not a state layer) with
    rotated queries and keys (normed before the rotation, if at all), no output gate and no
    sinks, its own K and V from its own k
    and v projections, no norm of the values, nothing after its MLP's residual add
    (per-layer inputs, an output scale), an input norm (pre or sandwich RMSNorms), quantized
    projections without bias (on the model's per-row products), the same shapes, a known
    activation or experts on the native MoE layer, one eps; no scaled residuals or shared
    expert (Granite); RMSNorms (not LayerNorms) in sequence (pre or sandwich: not the
    parallel residuals of GPT-NeoX and Phi-2), gated MLPs."""
    if not isinstance(final_norm, RMSNorm):
        return False
    shapes, inners, moes, eps = set(), set(), set(), {final_norm.eps}
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), layer.mlp
        if layer.spec.state_mixer is not None:  # a state layer, or one beside attention
            return False
        if layer.spec.attention is not None and layer.spec.attention.latent is not None:
            return False  # latent attention (DeepSeek): the blocks keep K and V per head
        if attn is None or attn.rope is None or attn.output_gate or not layer.input_layernorm:
            return False
        if layer.spec.norms not in ("pre", "sandwich") or layer.spec.norm != "rms":
            return False  # the blocks' norms are RMSNorms, each after its own residual add
        if attn.qk_norm_layer:
            return False  # Cohere's q/k LayerNorms
        if not all(isinstance(norm, RMSNorm) for norm in _norms(layer)):
            return False  # the blocks' norms are RMSNorms, each after its own residual add
        if attn.spec.scoring.sinks is not None:  # on the ops alone: every such model has biases
            return False
        if attn.unit_norm is not None or attn.temperature is not None:
            return False  # Llama 4's weightless q/k norm after the rotation, its temperature
        if attn.qk_norm_rotated:  # the blocks norm q and k before the rotation only
            return False
        if layer.spec.residual_scale is not None or layer.shared_mlp is not None:
            return False
        if layer.has_tail or attn.shared_kv or attn.k_eq_v or attn.v_norm is not None:
            return False  # Gemma 4's parts: the blocks have no call for them
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        if isinstance(mlp, SparseMoE):
            moe = mlp.native_layer()
            if moe is None or moe.hidden != attn.q_proj.in_features:
                return False
            moes.add((moe.args.experts, moe.args.top_k, moe.args.inner))
        elif isinstance(mlp, GatedMLP) and mlp.native_act is not None:
            linears += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
            inners.add(mlp.gate_proj.out_features)
        else:
            return False
        if not all(isinstance(lin, QuantLinear) and lin.bias is None for lin in linears):
            return False
        eps.update(norm.eps for norm in _norms(layer))
        hidden = attn.q_proj.in_features
        if [(lin.in_features, lin.out_features) for lin in linears] != _expected(attn, linears):
            return False
        shapes.add((attn.num_heads, attn.num_kv_heads, attn.head_dim, hidden))
    return len(shapes) == 1 and len(inners) <= 1 and len(moes) <= 1 and len(eps) == 1


def _lora_projections(layer: DecoderLayer) -> list[QuantLinear]:
    """q, k, v, o, then a dense MLP's gate, up and down (common.h's LORA_* order)."""
    attn, mlp = layer.self_attn, layer.mlp
    projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
    if isinstance(mlp, GatedMLP):
        projections += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return projections


def _norms(layer: DecoderLayer) -> list[RMSNorm]:
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.sandwich:
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    if layer.self_attn.qk_norm or layer.self_attn.qk_norm_full:
        norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
    return norms


def _expected(attn: Attention, linears: list) -> list[tuple[int, int]]:
    """The (in, out) features a layer's projections must have: q, k, v, o, then the MLP's
    gate, up and down where it has them (an MoE layer's experts are checked by their call)."""
    hidden = attn.q_proj.in_features
    q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    expected = [(hidden, q_size), (hidden, kv_size), (hidden, kv_size), (q_size, hidden)]
    if len(linears) > 4:
        inner = linears[4].out_features
        expected += [(hidden, inner), (hidden, inner), (inner, hidden)]
    return expected
