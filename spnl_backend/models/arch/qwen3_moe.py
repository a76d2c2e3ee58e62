"""Qwen3-MoE: Qwen3's attention; a layer has experts unless listed in ``mlp_only_layers``
or off the ``decoder_sparse_step`` (transformers' rule)."""

import dataclasses
from typing import TYPE_CHECKING

from . import qwen3
from .family import Family, Fields, HfKeys, experts

if TYPE_CHECKING:
    from ..components import MoeConfig


def qwen_experts(keys: HfKeys) -> "MoeConfig":
    """Qwen's experts (Qwen2-MoE's and Qwen3-MoE's): top-k renormalised where
    ``norm_topk_prob``, and which layers have them (`sparse_layers`)."""
    moe = experts(keys, "moe_intermediate_size", bool(keys.get("norm_topk_prob", False)))
    return dataclasses.replace(moe, sparse=sparse_layers(keys))


def sparse_layers(keys: HfKeys) -> tuple[bool, ...]:
    """transformers' rule: a layer has experts unless listed in ``mlp_only_layers`` or off
    the ``decoder_sparse_step``."""
    layers = keys.count("num_hidden_layers")
    step = keys.count("decoder_sparse_step", None) or 1
    dense = keys.get("mlp_only_layers") or []
    if not (isinstance(dense, list) and all(isinstance(i, int) for i in dense)):
        raise keys.wrong("mlp_only_layers", dense, "a list of layer indices")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return {**qwen3.hf_fields(keys, head_dim), "moe": qwen_experts(keys)}


FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    gguf_archs=("qwen3moe",),
    hf_fields=_hf,
    gguf_fields=qwen3.gguf_fields,
    gguf_auto_tokenizer=True,
    tiny={  # renormalised top-k; layer 1 dense
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    },
)
