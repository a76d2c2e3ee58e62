"""`CausalLM`: the decoder-only transformer every supported architecture instantiates."""

import torch
from torch import nn

from ..kernels.dispatch import TORCH_CHOICE, KernelChoice
from .collectives import Collectives, shard_range
from .config import ModelConfig
from .decoder import DecoderLayer
from .linear import Embedding, Linear
from .lora import LoraAdapters
from .moe import SparseMoE
from .native_blocks import LayerBlocks
from .norms import norm_of
from .per_layer import packed_projection, per_layer_inputs, per_layer_weights
from .rope import RotaryEmbedding, RotaryTables
from .step_attention import StepAttention


class Backbone(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp: Collectives | None = None,
        kernels: KernelChoice = TORCH_CHOICE,
    ) -> None:
        super().__init__()
        self.tp, self.kernels = tp, kernels
        native = kernels.native
        # With tensor parallelism each rank holds a share of the vocabulary's rows.
        self.vocab_range = (0, config.vocab_size)
        if tp is not None:
            self.vocab_range = shard_range(config.vocab_size, tp.rank, tp.world)
        start, end = self.vocab_range
        self.embed_tokens = Embedding(end - start, config.hidden_size)
        for name, module in per_layer_weights(config, native).items():  # Gemma 4's PLE
            setattr(self, name, module)
        self.has_per_layer = bool(config.per_layer_input_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, tp, kernels) for i in range(config.num_layers)
        )
        self.norm = norm_of(config, config.hidden_size, native, config.norm_kind)
        self.rotary = RotaryEmbedding(config.rope, config.max_position_embeddings, native)
        self.rotary_local = (
            RotaryEmbedding(config.rope_local, config.max_position_embeddings, native)
            if config.rope_local
            else None
        )
        self.embedding_multiplier = config.embedding_multiplier
        # Each layer's rotary table (None: it does not rotate, a state layer included);
        # a layer that does not rotate but reads the step's positions (Llama 4's query
        # temperature) is handed the global tables for them, and rotates nothing.
        self.ropes = [getattr(spec.mixer, "rope", None) for spec in config.layers]
        self.reads_positions = [
            spec.attention is not None and spec.attention.temperature is not None
            for spec in config.layers
        ]
        self.local_layers = frozenset(i for i, rope in enumerate(self.ropes) if rope == "local")
        # Whether steps may run on the native layer blocks where they can (False: always
        # the per-op path, their twin); the blocks are built on first use.
        self.use_layer_blocks = True
        self._blocks: LayerBlocks | None = None
        # Layer mapping (`CausalLM.place`): each layer's device, None on one device; and
        # the mapping's devices as (device, consecutive layers), which the KV pool follows
        # (the CPU's "devices" are one torch device, each with its own part of the pool).
        self.layer_devices: list[torch.device] | None = None
        self.layer_spans: list[tuple[torch.device, int]] | None = None

    def _native_step(self, x: torch.Tensor, attention: StepAttention):
        """The layer blocks, the step's keys and the pools, where this step runs on the
        native layer blocks (`models.native_blocks`: the kernels allow it for ``x``, and the
        step's attention for its keys), else None."""
        native = self.kernels.layer_blocks(x)
        if native is None or not self.use_layer_blocks:
            return None
        if self.tp is not None:  # the ranks' sums come between a layer's two calls
            return None
        if self._blocks is None:
            self._blocks = LayerBlocks.build(
                native, list(self.layers), self.norm, self.local_layers
            )
            if self._blocks is None:
                self.use_layer_blocks = False
                return None
        if not self._blocks.adapters_run():  # an adapter where the blocks add none
            return None
        found = attention.native_keys(self._blocks.windows)
        return None if found is None else (self._blocks, *found)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: StepAttention
    ) -> torch.Tensor:
        x, h, tables, per_layer = self._inputs(input_ids, positions)
        native = self._native_step(x, attention)
        if native is not None:
            blocks, keys, pools = native
            return blocks.run(x.contiguous(), h, tables[x.device], keys, pools)
        return self._layers(x, h, tables, attention, len(self.layers), per_layer)[1]

    def layer_kv(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: StepAttention,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V ``[T, kv_heads, head_dim]`` that layer ``layer`` would store for
        the tokens, the layers before it run over ``attention`` (per op: what probes a
        layer's keys, `engine.pic_probe`). One rank's model alone: under tensor
        parallelism the other ranks run only what rank 0 announces."""
        x, h, tables, per_layer = self._inputs(input_ids, positions)
        x, h = self._layers(x, h, tables, attention, layer, per_layer)
        if self.layer_devices is not None:
            h = _moved((h,), self.layer_devices[layer])[0]
        _, k, v = self.layers[layer].self_attn.qkv(h, self._table(layer, tables, h.device))
        return k, v

    def _inputs(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """The residual stream, its norm for the first layer, the rotary tables (global,
        local) by device, and each token's per-layer inputs (None: the model has none)."""
        x = self._embed(input_ids)
        if self.embedding_multiplier is not None:
            x = x * torch.tensor(self.embedding_multiplier, dtype=x.dtype)
        per_layer = None
        if self.has_per_layer:
            per_layer = per_layer_inputs(
                input_ids,
                x,
                self.embed_tokens_per_layer,
                self.per_layer_model_projection,
                self.per_layer_projection_norm,
            )
        rotary = self.rotary(positions, x.dtype)
        local = self.rotary_local(positions, x.dtype) if self.rotary_local else rotary
        layers = self.layers
        h = layers[0].input_norm(x) if len(layers) else self.norm(x)
        return x, h, {x.device: (rotary, local)}, per_layer

    def _table(self, layer: int, tables: dict, device: torch.device) -> RotaryTables | None:
        """Layer ``layer``'s rotary tables on ``device`` (None: it does not rotate)."""
        if device not in tables:
            rotary, local = next(iter(tables.values()))
            tables[device] = (rotary.to(device), local.to(device))
        rotary, local = tables[device]
        rope = self.ropes[layer]
        if rope is None:
            return rotary if self.reads_positions[layer] else None
        return local if rope == "local" else rotary

    def _layers(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        tables: dict,
        attention: StepAttention,
        stop: int,
        per_layer: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers ``0 .. stop - 1`` per op: the residual stream and its norm by the next
        layer's input norm (the final norm after the last layer)."""
        layers = self.layers
        for i, layer in enumerate(layers[:stop]):
            if self.layer_devices is not None:  # a boundary: the activations move on
                x, h = _moved((x, h), self.layer_devices[i])
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            rotary = self._table(i, tables, x.device)
            own = None if per_layer is None else _moved((per_layer[:, i],), x.device)[0]
            x, h = layer(x, h, rotary, attention, next_norm, own)
        return x, h

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each token's embedding; with tensor parallelism the rank holding its row gives
        it, the others zeros, summed over the ranks."""
        if self.tp is None:
            return self.embed_tokens(input_ids)
        start, end = self.vocab_range
        ours = (input_ids >= start) & (input_ids < end)
        rows = self.embed_tokens(torch.where(ours, input_ids - start, 0))
        return self.tp.all_reduce(torch.where(ours[:, None], rows, 0).contiguous())


def _moved(tensors: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(t if t.device == device else t.to(device) for t in tensors)


def device_of_weight(name: str, devices: list[torch.device]) -> torch.device:
    """Where a weight lives under layer mapping (``devices``: each layer's): the embedding
    on the first device, the final norm and LM head on the last, a layer's weights on its
    own, except its input norm, which the layer before applies (its output's norm) and so
    lives on that layer's device."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        layer = int(parts[2])
        if parts[3] == "input_layernorm" and layer > 0:
            return devices[layer - 1]
        return devices[layer]
    if parts[0] == "lm_head" or parts[:2] == ["model", "norm"]:
        return devices[-1]
    return devices[0]


class CausalLM(nn.Module):
    """Token ids in, hidden states out; logits only for the rows asked for.

    Parameter names follow the Hugging Face checkpoints (``model.layers.0.self_attn
    .q_proj.weight``), so text models load by name and GGUF tensors are renamed to them.
    """

    def __init__(
        self,
        config: ModelConfig,
        tp: Collectives | None = None,
        kernels: KernelChoice = TORCH_CHOICE,
    ) -> None:
        """``tp``: the tensor-parallel group this rank's share of the model runs in
        (``config`` is then its share's, `distributed.sharding.local_config`); ``kernels``:
        what it runs on (`kernels.dispatch.choose_kernels`), the one route by which that
        choice reaches its layers."""
        super().__init__()
        self.config, self.tp, self.kernels = config, tp, kernels
        self.model = Backbone(config, tp, kernels)
        self.adapters: LoraAdapters | None = None  # LoRA adapters, once any is attached
        if not config.tie_word_embeddings:
            start, end = self.model.vocab_range
            self.lm_head = Linear(config.hidden_size, end - start, bias=config.lm_head_bias)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: StepAttention
    ) -> torch.Tensor:
        """``input_ids``/``positions [T]`` (sequences packed) → hidden states ``[T, hidden]``."""
        if self.tp is not None:
            groups = [] if self.adapters is None else self.adapters.step.groups
            self.tp.before_forward(input_ids, positions, attention, groups)
        return self.model(input_ids, positions, attention)

    def place(self, spans: list[tuple[torch.device, int]]) -> None:
        """Layer mapping over ``spans`` (each device and its consecutive layers): every
        weight and buffer moved to its device (`device_of_weight`), each layer run on its
        own."""
        devices = [device for device, count in spans for _ in range(count)]
        for name, module in self.named_modules():
            own = list(module.named_parameters(recurse=False))
            own += list(module.named_buffers(recurse=False))
            if own:
                module.to(device_of_weight(f"{name}.{own[0][0]}", devices))
        self.model.layer_devices, self.model.layer_spans = devices, spans

    def prepare_experts(self) -> None:
        """Once the weights are in: every MoE layer's experts stacked where the model's
        kernels fuse them (`SparseMoE.prepare_experts`), before a KV pool is sized from what
        memory is left (stacking moves a layer's experts once); and Gemma 4's per-layer
        projection kept float16 where it is (`per_layer.packed_projection`)."""
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.prepare_experts()
        backbone = self.model
        if backbone.has_per_layer:  # Gemma 4's projection: float16 where it is exactly that
            backbone.per_layer_model_projection = packed_projection(
                backbone.per_layer_model_projection, self.kernels.matmuls
            )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of the rows to sample from → float32 logits ``[rows, vocab]``
        (with tensor parallelism: each rank's share of the vocabulary, gathered)."""
        if self.tp is not None:
            self.tp.before_logits(hidden)
        if self.config.tie_word_embeddings:
            if self.model.layer_devices is not None:  # the embedding is on the first device
                hidden = hidden.to(self.model.layer_devices[0])
            logits = self.model.embed_tokens.project(hidden)
        else:
            logits = self.lm_head(hidden)
        logits = logits.float()
        if self.tp is not None:
            logits = self.tp.gather_columns(logits.contiguous(), self.config.vocab_size)
        if self.config.logits_scaling is not None:
            logits = logits / self.config.logits_scaling
        if self.config.final_softcap is not None:
            cap = self.config.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
