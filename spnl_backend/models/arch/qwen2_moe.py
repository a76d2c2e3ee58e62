"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q, k and v biased) with
experts in the FFN: a softmax router, its top-k weights renormalised where
``norm_topk_prob``, and beside the routed experts a shared one whose output is scaled per
token by the sigmoid of a one-row projection of the layer's input (``shared_expert_gate``).
Layers listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` keep a dense MLP
of ``intermediate_size`` (`qwen3_moe.sparse_layers`).

llama.cpp's ``qwen2moe`` files hold the shared expert as ``ffn_*_shexp`` (its size
``expert_shared_feed_forward_length``, else the dense size) and its gate as
``ffn_gate_inp_shexp``; its graph never renormalises the top-k weights (the file's
``expert_weights_norm`` decides where it has one). A block without a router is read as a
dense layer.
"""

import dataclasses

from ..components import MoeConfig
from . import qwen2
from .family import (
    COMMON_GGUF_NAMES,
    SHARED_EXPERT_GGUF_NAMES,
    Family,
    Fields,
    GgufKeys,
    HfKeys,
    Tensors,
    shared_expert_tensors,
)
from .qwen3_moe import qwen_experts


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    moe = dataclasses.replace(
        qwen_experts(keys),
        shared_intermediate_size=keys.count("shared_expert_intermediate_size"),
        shared_gate=True,
    )
    # (its config writes a window of 0 where ``use_sliding_window`` is off: none)
    window = keys.get("sliding_window") or None
    return {**qwen2.FAMILY.hf_fields(keys, head_dim), "moe": moe, "sliding_window": window}


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    moe: MoeConfig | None = fields["moe"]
    if moe is None:
        raise keys.wrong(
            "expert_count", keys.get("expert_count"), "experts (blk.N.ffn_gate_inp.weight)"
        )
    shared = keys.count("expert_shared_feed_forward_length", None)
    moe = dataclasses.replace(
        moe,
        shared_intermediate_size=shared or keys.count("feed_forward_length"),
        shared_gate=True,
    )
    return {**qwen2.FAMILY.gguf_fields(keys, fields), "moe": moe}


def _tensors(stored: Tensors, config: object) -> Tensors:
    return shared_expert_tensors(stored)


FAMILY = Family(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    gguf_archs=("qwen2moe",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names={**COMMON_GGUF_NAMES, **SHARED_EXPERT_GGUF_NAMES},
    gguf_renormalizes_top_k=False,
    gguf_auto_tokenizer=True,
    tensors=_tensors,
    # 8 experts of 64 values, two per token, beside a shared one of 48, in every layer (as
    # the checkpoints; llama.cpp's converter maps no dense MLP for qwen2moe). The top-k
    # weights are not renormalised (as Qwen's checkpoints and llama.cpp's graph).
    tiny={
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 48,
        "norm_topk_prob": False,
    },
)
