"""EXAONE 4.0: OLMo 2's norms after attention and after the MLP only (the residual
stream enters each layer un-normed), q and k normed per head; where it has a sliding
window, its sliding layers rotate and its global layers do not (NoPE).

llama.cpp's graph turns sliding windows on by the layer count alone (the 32B's 64);
here a file's own window and pattern say, as the checkpoint's ``layer_types`` do."""

from .family import COMMON_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys

_FIELDS: Fields = {"qk_norm": True, "norm_placement": "post"}


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    if not keys.get("sliding_window"):
        return dict(_FIELDS)
    # (the common reader has checked the layer types: a list of known names)
    kinds = keys.get("layer_types") or ()
    return {**_FIELDS, "rope_layers": tuple(kind == "sliding_attention" for kind in kinds)}


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    if not fields["sliding_window"]:
        return dict(_FIELDS)
    return {**_FIELDS, "rope_layers": tuple(kind == "sliding" for kind in fields["layer_types"])}


FAMILY = Family(
    name="exaone4",
    model_types=("exaone4",),
    gguf_archs=("exaone4",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names={
        **COMMON_GGUF_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    tiny={  # layers 0 and 1 slide and rotate; layer 2 is global and unrotated
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    },
)
