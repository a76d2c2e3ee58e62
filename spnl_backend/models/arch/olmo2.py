"""OLMo 2 and OLMo 3: norms after attention and after the MLP only (the residual stream
enters each un-normed), q and k normed over their whole projections; OLMo 3 adds sliding
windows on three layers of four, whose rope is never scaled.

llama.cpp reads both as ``olmo2``: a file with ``attention.sliding_window`` is OLMo 3,
its pattern every fourth layer global unless the file says, the sliding layers rotating
at ``rope.freq_base_swa`` (else the global base) without scaling.
"""

from ..components import RopeConfig
from .family import COMMON_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys, biases

_SWA_PATTERN = 4


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    fields = {**biases(keys), "qk_norm_full": True, "norm_placement": "post"}
    if keys.get("sliding_window") and "sliding_attention" in (keys.get("layer_types") or ()):
        fields["rope_local"] = keys.rope("sliding_attention", head_dim)
    return fields


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    out: Fields = {"qk_norm_full": True, "norm_placement": "post"}
    if fields["sliding_window"]:
        out["layer_types"] = keys.swa_layer_types(_SWA_PATTERN, fields["num_layers"])
        out["rope_local"] = RopeConfig(
            theta=keys.positive("rope.freq_base_swa", fields["rope"].theta),
            rotary_dim=fields["rope"].rotary_dim,
        )
    return out


FAMILY = Family(
    name="olmo2",
    model_types=("olmo2", "olmo3"),
    gguf_archs=("olmo2",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names={
        **COMMON_GGUF_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    tiny={  # OLMo 3's: sliding windows on layers 0 and 1, yarn on the global layer
        "model_type": "olmo3",
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
)
