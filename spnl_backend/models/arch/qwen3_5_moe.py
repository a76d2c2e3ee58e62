"""Qwen3.5 MoE: Qwen3.5's layers (`qwen3_5`: three Gated DeltaNet layers to one of gated
full attention) with experts in every layer's FFN: a softmax router whose top-k weights
are renormalised, and beside the routed experts a shared one, its output scaled per
token by the sigmoid of a one-row projection of the layer's input (``shared_expert_gate``).
Its checkpoints give no dense MLP size (``intermediate_size``): no layer has one.

The checkpoints keep the shared expert and its gate inside ``mlp`` (``mlp.shared_expert``,
``mlp.shared_expert_gate``); they load as the layer's ``shared_mlp`` and
``shared_mlp_gate``. llama.cpp's ``qwen35moe`` files hold them as ``ffn_*_shexp`` and
``ffn_gate_inp_shexp`` (a row of hidden size), the routed experts stacked by projection,
and the rest as its ``qwen35`` files do; its graph renormalises the top-k weights
whatever the file says.
"""

import dataclasses

from ..components import MoeConfig
from . import qwen3_5
from .family import (
    SHARED_EXPERT_GGUF_NAMES,
    Family,
    Fields,
    GgufKeys,
    HfKeys,
    Tensors,
    shared_expert_tensors,
)


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    moe = MoeConfig(
        num_experts=keys.count("num_experts"),
        top_k=keys.count("num_experts_per_tok"),
        intermediate_size=keys.count("moe_intermediate_size"),
        renormalize=True,
        shared_intermediate_size=keys.count("shared_expert_intermediate_size"),
        shared_gate=True,
    )
    return {**qwen3_5.hf_fields(keys, head_dim), "moe": moe}


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    """The shared expert's size (``expert_shared_feed_forward_length``, else llama.cpp's
    fallback, the dense size) beside what the loader read of the experts."""
    moe = fields["moe"]
    if moe is None or not all(moe.sparse):
        routed = "none" if moe is None else f"{sum(moe.sparse)} of {len(moe.sparse)}"
        raise keys.wrong(
            "expert_count",
            keys.get("expert_count"),
            f"experts in every block (a router, blk.N.ffn_gate_inp.weight, in each; {routed} "
            "have one)",
        )
    shared = keys.count("expert_shared_feed_forward_length", None)
    moe = dataclasses.replace(
        moe,
        renormalize=True,
        shared_intermediate_size=shared or keys.count("feed_forward_length"),
        shared_gate=True,
    )
    return {**qwen3_5.gguf_fields(keys, fields), "moe": moe}


def tensors(stored: Tensors, config: object) -> Tensors:
    """The shared expert and its gate under our names (a GGUF's gate a row: ours is a
    one-row matrix), then Qwen3.5's own layout."""
    return qwen3_5.tensors(shared_expert_tensors(stored), config)


FAMILY = Family(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe_text",),
    wrapper_types=("qwen3_5_moe",),
    gguf_archs=("qwen35moe",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names={**qwen3_5.GGUF_NAMES, **SHARED_EXPERT_GGUF_NAMES},
    tensors=tensors,
    state_layers=True,
    # Every layer's experts: 8 of 32 values, two per token, and a shared one of 48;
    # no dense MLP size (None: the key left out, as the checkpoints leave it).
    tiny={
        **qwen3_5.TINY,
        "intermediate_size": None,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
)
