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
from gguf import GGMLQuantizationType
from torch import nn

from ..kernels.cpu import CpuKernels
from ..kernels.matmuls import CpuMatmuls
from ..log import get_logger
from ..quant.linear import QuantizedWeight, QuantLinear
from .config import ModelConfig
from .linear import Embedding, Linear
from .norms import RMSNorm, rms_norm_of

log = get_logger()

# The two halves (token table and projection) are summed and scaled back to unit size.
_HALVES = 2.0**-0.5
_F16_BLOCK = 32


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


def packed_projection(projection: nn.Module, matmuls: object) -> nn.Module:
    """The model-level projection as a float16 native product where its float32 weight
    holds float16 values exactly (a GGUF's F16 tensor) and it runs on the CPU's kernels:
    the same weights at half the bytes read per token (else ``projection`` unchanged)."""
    if not isinstance(matmuls, CpuMatmuls) or not isinstance(projection, nn.Linear):
        return projection
    weight = projection.weight
    if projection.bias is not None or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return projection
    if weight.shape[1] % _F16_BLOCK:  # the kernel takes the rows 32 values at a time
        return projection
    half = weight.detach().to(torch.float16)
    if not torch.equal(half.float(), weight):
        return projection
    rows, cols = weight.shape
    data = half.contiguous().view(torch.uint8).reshape(rows, 2 * cols)
    log.info("per_layer.projection_packed", qtype="F16", shape=[rows, cols])
    return QuantLinear(QuantizedWeight(data, GGMLQuantizationType.F16, (rows, cols)), None, matmuls)


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
