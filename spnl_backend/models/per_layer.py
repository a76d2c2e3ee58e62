"""Gemma 4's per-layer embeddings (PLE): a second token table holding a small vector per
layer, mixed with a projection of the token's main embedding, and added by each layer to
its output through a gate of its own (`add_gated`).

The backbone keeps the three model-level weights under transformers' names
(``embed_tokens_per_layer``, ``per_layer_model_projection``, ``per_layer_projection_norm``)
and each layer its gate's three (``per_layer_input_gate``, ``per_layer_projection``,
``post_per_layer_input_norm``), so a checkpoint loads by name; this module makes them and
holds their arithmetic.
"""

import math
from collections.abc import Callable

import torch
from torch import nn

from ..kernels.cpu import CpuKernels
from .config import ModelConfig
from .linear import Embedding, Linear
from .norms import RMSNorm, rms_norm_of

# The two halves (token table and projection) are summed and scaled back to unit size.
_HALVES = 2.0**-0.5


def per_layer_weights(config: ModelConfig, native: CpuKernels | None) -> dict[str, nn.Module]:
    """The backbone's PLE weights by their names (empty for a model without PLE)."""
    width = config.per_layer_input_size
    if not width:
        return {}
    packed = config.num_layers * width
    assert config.per_layer_vocab_size is not None  # `ModelConfig` checks it
    return {
        "embed_tokens_per_layer": Embedding(config.per_layer_vocab_size, packed),
        "per_layer_model_projection": Linear(config.hidden_size, packed, bias=False),
        "per_layer_projection_norm": rms_norm_of(config, width, native),
    }


def per_layer_inputs(
    input_ids: torch.Tensor,
    embedded: torch.Tensor,
    table: nn.Embedding,
    projection: nn.Module,
    norm: RMSNorm,
) -> torch.Tensor:
    """Each token's input to each layer ``[T, layers, width]`` from its id and its
    (scaled) main embedding ``embedded [T, hidden]``."""
    tokens, hidden = embedded.shape
    width = norm.weight.shape[0]
    own = table(input_ids) * torch.tensor(math.sqrt(width), dtype=embedded.dtype)
    mixed = norm((projection(embedded) * hidden**-0.5).view(tokens, -1, width))
    return (mixed + own.view(tokens, -1, width)) * _HALVES


def gate_weights(config: ModelConfig, native: CpuKernels | None) -> dict[str, nn.Module]:
    """A layer's gate of its per-layer input, by the layer's attribute names."""
    width, hidden = config.per_layer_input_size, config.hidden_size
    return {
        "per_layer_input_gate": Linear(hidden, width, bias=False),
        "per_layer_projection": Linear(width, hidden, bias=False),
        "post_per_layer_input_norm": rms_norm_of(config, hidden, native),
    }


def add_gated(
    x: torch.Tensor,
    per_layer: torch.Tensor,
    gate: nn.Module,
    up: nn.Module,
    norm: RMSNorm,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``x + norm(up(act(gate(x)) * per_layer))``: a layer's per-layer input added."""
    return x + norm(up(act(gate(x)) * per_layer))
