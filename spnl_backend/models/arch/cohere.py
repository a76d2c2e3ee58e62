"""Cohere (Command-R): attention and the MLP side by side (placement "shared"), both
reading one LayerNorm of the residual stream (no bias, the mean taken out) and both added
to it; q and k optionally LayerNormed per head, each head its own weight row
(``use_qk_norm``); the logits multiplied by ``logit_scale``; the embedding tied to the head.

Cohere's rope turns adjacent pairs of a head's dims (0 with 1, 2 with 3, ...) where the
model's tables turn its halves (i with i + d/2). The two agree once each head's rotated
dims are reordered, evens first and odds after, in q and k alike (their rows, biases and
norm weights): the scores q·k are the same sums in another order, the values untouched.
`tensors` does that as the weights load, from either format: llama.cpp's ``command-r``
files keep the checkpoints' order (its graph turns adjacent pairs itself).

llama.cpp reads the norms' eps as ``attention.layer_norm_epsilon`` and the multiplier as
``logit_scale``.
"""

from typing import TYPE_CHECKING

import torch

from ...errors import ModelFileError
from ...quant.linear import QuantizedWeight
from .family import Family, Fields, GgufKeys, HfKeys, Tensors, biases

if TYPE_CHECKING:
    from ..config import ModelConfig

# The projections whose rows, and the norms whose weights, are a head's dims.
_QK_ROWS = tuple(f"self_attn.{p}_proj.{kind}" for p in "qk" for kind in ("weight", "bias"))
_QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def cohere_fields(keys: HfKeys) -> Fields:
    """What Cohere and Cohere 2 share in ``config.json``."""
    return {
        **biases(keys),
        "norm_kind": "layer_no_bias",
        "norm_placement": "shared",
        "rms_norm_eps": keys.positive("layer_norm_eps"),
        "logits_scaling": 1.0 / keys.positive("logit_scale"),
    }


def cohere_gguf_fields(keys: GgufKeys) -> Fields:
    """What llama.cpp's ``command-r`` and ``cohere2`` files share."""
    return {
        "norm_kind": "layer_no_bias",
        "norm_placement": "shared",
        "rms_norm_eps": keys.positive("attention.layer_norm_epsilon"),
        "logits_scaling": 1.0 / keys.positive("logit_scale"),
        "qkv_bias": keys.has_tensor("blk.0.attn_q.bias"),
        "o_bias": keys.has_tensor("blk.0.attn_output.bias"),
    }


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return {**cohere_fields(keys), "qk_norm": bool(keys.get("use_qk_norm", False))}


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    return {**cohere_gguf_fields(keys), "qk_norm": keys.has_tensor("blk.0.attn_q_norm.weight")}


def tensors(stored: Tensors, config: "ModelConfig") -> Tensors:
    """q and k with each head's rotated dims reordered, evens then odds: adjacent-pair
    rotation as the rotate-half the model runs (see the module's note)."""
    for name, tensor in stored:
        if name.endswith(_QK_NORMS):
            order = halves_order(config.head_dim, config.rope.rotary_dim)
            tensor = tensor.reshape(-1, config.head_dim)[:, order]
        yield name, projection_rows(name, tensor, config)


def projection_rows(
    name: str, tensor: torch.Tensor | QuantizedWeight, config: "ModelConfig"
) -> torch.Tensor | QuantizedWeight:
    """The rows of q and k projections (weights, biases, LoRA's ``lora_B``) with each
    head's rotated dims evens first, then odds; other tensors as they are."""
    if not name.endswith(_QK_ROWS):
        return tensor
    heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
    order = halves_order(config.head_dim, config.rope.rotary_dim)
    return _rows_reordered(tensor, heads, order)


def halves_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """A head's dims as rotate-half reads the adjacent pairs of its first ``rotary_dim``:
    the even ones, the odd ones, then those that do not turn."""
    return torch.cat(
        [
            torch.arange(0, rotary_dim, 2),
            torch.arange(1, rotary_dim, 2),
            torch.arange(rotary_dim, head_dim),
        ]
    )


def _rows_reordered(
    weight: torch.Tensor | QuantizedWeight, heads: int, order: torch.Tensor
) -> torch.Tensor | QuantizedWeight:
    """Each head's rows of ``weight`` in ``order`` (a quantized matrix moves whole rows of
    blocks)."""
    head_dim = len(order)
    rows = (torch.arange(heads)[:, None] * head_dim + order).flatten()
    data = weight.data if isinstance(weight, QuantizedWeight) else weight
    if data.shape[0] != heads * head_dim:
        raise ModelFileError(
            f"a q or k tensor of {data.shape[0]} rows; the config's sizes make it {heads} "
            f"heads of {head_dim}"
        )
    if isinstance(weight, QuantizedWeight):
        return QuantizedWeight(data[rows], weight.qtype, weight.shape)
    return data[rows]


FAMILY = Family(
    name="cohere",
    model_types=("cohere",),
    gguf_archs=("command-r",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    tensors=tensors,
    projection_rows=projection_rows,
    tiny={
        "tie_word_embeddings": True,
        "logit_scale": 0.5,
        "use_qk_norm": True,
        "layer_norm_eps": 1e-5,
    },
)
