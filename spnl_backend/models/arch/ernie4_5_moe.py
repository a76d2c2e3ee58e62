"""ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, 300B-A47B): ERNIE 4.5's attention (its rope turning
adjacent pairs: q and k rows put in rotate-half order as they load) and experts in the
layers from ``moe_layer_start_index`` to ``moe_layer_end_index`` on the
``moe_layer_interval`` (transformers' rule; the others keep a dense MLP of
``intermediate_size``), beside always-on shared experts (``moe_num_shared_experts`` of
``moe_intermediate_size``).

Routing: a float32 softmax over every expert; ``e_score_correction_bias`` added to it
for choosing the top-k alone; the chosen probabilities always renormalised (transformers
divides by their sum clamped at ``moe_norm_min``, which the sum of k of them never
reaches below); no scale. The checkpoints store that bias as a ``[1, experts]`` row
under ``mlp.moe_statics``; llama.cpp's ``ernie4_5-moe`` files as ``exp_probs_b``, and
their shared experts' size as ``expert_shared_feed_forward_length`` (llama.cpp's rule:
none where absent). ``use_bias`` (biases on every projection) is refused, as the dense
family's.
"""

import dataclasses
from typing import TYPE_CHECKING

import torch

from ..components import MoeConfig
from .deepseek import EXPERT_GGUF_NAMES
from .family import (
    COMMON_GGUF_NAMES,
    Family,
    Fields,
    GgufKeys,
    HfKeys,
    Tensors,
    rotate_pairs_as_halves,
)

if TYPE_CHECKING:
    from ..config import ModelConfig

_GGUF_NAMES = {**COMMON_GGUF_NAMES, **EXPERT_GGUF_NAMES}
# The checkpoints' names inside a layer → ours (transformers' own and as it loads them).
_RENAMED = {
    ".mlp.shared_experts.": ".shared_mlp.",
    ".mlp.gate.moe_statics.e_score_correction_bias": ".mlp.e_score_correction_bias",
    ".mlp.moe_statics.e_score_correction_bias": ".mlp.e_score_correction_bias",
    ".mlp.e_score_correction_bias.bias": ".mlp.e_score_correction_bias",  # a GGUF's
}


def _sparse(keys: HfKeys) -> tuple[bool, ...]:
    layers = keys.count("num_hidden_layers")
    start = keys.integer("moe_layer_start_index", 1)
    end = keys.integer("moe_layer_end_index", -1)
    end = layers - 1 if end == -1 else end
    interval = keys.count("moe_layer_interval", None) or 1
    if not 0 <= start < layers:
        raise keys.wrong("moe_layer_start_index", start, f"an integer from 0 to {layers - 1}")
    return tuple(start <= i <= end and (i + 1) % interval == 0 for i in range(layers))


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    if keys.get("use_bias", False):
        raise keys.wrong("use_bias", True, "false (biased MLP projections are not supported)")
    inner = keys.count("moe_intermediate_size")
    shared = keys.integer("moe_num_shared_experts", 0) or 0
    moe = MoeConfig(
        num_experts=keys.count("moe_num_experts"),
        top_k=keys.count("moe_k"),
        intermediate_size=inner,
        renormalize=True,
        sparse=_sparse(keys),
        shared_intermediate_size=shared * inner or None,
        score_bias=True,
    )
    return {"moe": moe}


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    moe: MoeConfig | None = fields.get("moe")
    if moe is None:
        raise keys.wrong(
            "expert_count", keys.get("expert_count"), "experts (blk.N.ffn_gate_inp.weight)"
        )
    first = next(i for i, sparse in enumerate(moe.sparse) if sparse)
    moe = dataclasses.replace(
        moe,
        renormalize=True,  # llama.cpp's graph always renormalises
        shared_intermediate_size=keys.count("expert_shared_feed_forward_length", None) or None,
        score_bias=keys.has_tensor(f"blk.{first}.exp_probs_b.bias"),
    )
    return {"moe": moe}


def _tensors(stored: Tensors, config: "ModelConfig") -> Tensors:
    """The shared experts and the score bias (a row: ours a vector) under our names, then
    q and k rows in rotate-half order."""

    def renamed() -> Tensors:
        for name, tensor in stored:
            for old, new in _RENAMED.items():
                name = name.replace(old, new)
            if name.endswith(".mlp.e_score_correction_bias") and isinstance(tensor, torch.Tensor):
                tensor = tensor.reshape(-1)
            yield name, tensor

    return rotate_pairs_as_halves(renamed(), config)


FAMILY = Family(
    name="ernie4_5_moe",
    model_types=("ernie4_5_moe",),
    gguf_archs=("ernie4_5-moe",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names=_GGUF_NAMES,
    tensors=_tensors,
    # 8 experts, two per token, beside two shared ones (the converter's shared size,
    # intermediate_size // KV heads, is theirs: 64); layer 0 dense, as the checkpoints
    tiny={
        "head_dim": 16,
        "tie_word_embeddings": True,
        "moe_num_experts": 8,
        "moe_k": 2,
        "moe_intermediate_size": 32,
        "moe_num_shared_experts": 2,
        "moe_layer_start_index": 1,
        "moe_layer_interval": 1,
    },
)
