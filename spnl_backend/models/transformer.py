"""`CausalLM`: the decoder-only transformer every supported architecture instantiates."""

import torch
from torch import nn

from ..kernels.cpu import CpuKernels
from ..quant.linear import QuantEmbedding
from .config import ModelConfig
from .layers import AttentionBackend, DecoderLayer, FusedMoe, Linear, RMSNorm, SparseMoE
from .native_blocks import LayerBlocks
from .rope import RotaryEmbedding


class Embedding(nn.Embedding):
    """Token embeddings that can also serve as the output projection (tied models)."""

    def reset_parameters(self) -> None:
        """Nothing to initialise: the weights always come from the checkpoint (and the
        random init, run on the meta device, would import torch._dynamo: 1.6 s)."""

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, config.norm_offset, config.norm_in_float
        )
        self.rotary = RotaryEmbedding(config.rope, config.max_position_embeddings)
        self.rotary_local = (
            RotaryEmbedding(config.rope_local, config.max_position_embeddings)
            if config.rope_local
            else None
        )
        self.embedding_multiplier = config.embedding_multiplier
        self.local_layers = frozenset(
            i for i, kind in enumerate(config.layer_types) if kind == "sliding"
        )
        # Whether steps may run on the native layer blocks where they can (False: always
        # the per-op path, their twin); the blocks are built on first use.
        self.use_layer_blocks = True
        self._blocks: LayerBlocks | None = None

    def _native_step(self, x: torch.Tensor, backend: AttentionBackend):
        """The layer blocks, the step's keys and the pools, where this step runs on the
        native layer blocks (`models.native_blocks`), else None."""
        if not self.use_layer_blocks or x.dtype != torch.float32 or not x.is_cpu:
            return None
        native_keys = getattr(backend, "native_keys", None)
        if native_keys is None:
            return None
        if self._blocks is None:
            self._blocks = LayerBlocks.build(list(self.layers), self.norm, self.local_layers)
            if self._blocks is None:
                self.use_layer_blocks = False
                return None
        found = native_keys(self._blocks.windows)
        return None if found is None else (self._blocks, *found)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier is not None:
            x = x * torch.tensor(self.embedding_multiplier, dtype=x.dtype)
        rotary = self.rotary(positions, x.dtype)
        local = self.rotary_local(positions, x.dtype) if self.rotary_local else rotary
        layers = self.layers
        h = layers[0].input_layernorm(x) if len(layers) else self.norm(x)
        native = self._native_step(x, backend)
        if native is not None:
            blocks, keys, pools = native
            return blocks.run(x.contiguous(), h, (rotary, local), keys, pools)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            x, h = layer(x, h, local if i in self.local_layers else rotary, backend, next_norm)
        return h


class CausalLM(nn.Module):
    """Token ids in, hidden states out; logits only for the rows asked for.

    Parameter names follow the Hugging Face checkpoints (``model.layers.0.self_attn
    .q_proj.weight``), so text models load by name and GGUF tensors are renamed to them.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """``input_ids``/``positions [T]`` (sequences packed) → hidden states ``[T, hidden]``."""
        return self.model(input_ids, positions, backend)

    def use_native_kernels(self, native: CpuKernels | None) -> None:
        """Run the norms, the rotary embeddings and quantized embedding lookups on the
        compiled CPU kernels ``native`` (None: their torch twins)."""
        for module in self.modules():
            if isinstance(module, RMSNorm | RotaryEmbedding | QuantEmbedding):
                module.native = native

    def use_fused_moe(self, fused: FusedMoe | None) -> None:
        """Run the experts of every MoE layer through ``fused`` (None: as they are)."""
        if fused is None:
            return
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.use_fused(fused)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of the rows to sample from → float32 logits ``[rows, vocab]``."""
        if self.config.tie_word_embeddings:
            logits = self.model.embed_tokens.project(hidden)
        else:
            logits = self.lm_head(hidden)
        logits = logits.float()
        if self.config.final_softcap is not None:
            cap = self.config.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
