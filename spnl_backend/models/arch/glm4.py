"""GLM-4 (the 0414 models, ``glm4``): sandwich norms (before and after attention, before
and after the MLP), biases on q, k and v, gate and up fused, a rope that turns adjacent
pairs of the first half of each head (llama.cpp's NORM kind, left by its converter as the
checkpoint has it: both formats' q and k rows are put in rotate-half order as they load).

Its norms are named apart from Gemma's: ``post_self_attn_layernorm`` after attention,
``post_attention_layernorm`` before the MLP and ``post_mlp_layernorm`` after it; they are
renamed to the sandwich layer's as they load (a GGUF's under the checkpoint's names
first)."""

from collections.abc import Mapping

from .family import (
    COMMON_GGUF_NAMES,
    Family,
    Fields,
    GgufKeys,
    HfKeys,
    Tensors,
    rotate_pairs_as_halves,
)

# The checkpoint's norm names → the sandwich layer's (`models.decoder.DecoderLayer`).
_NORMS: Mapping[str, str] = {
    "post_self_attn_layernorm": "post_attention_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "post_mlp_layernorm": "post_feedforward_layernorm",
}
GGUF_NAMES: Mapping[str, str] = {
    **COMMON_GGUF_NAMES,
    "post_attention_norm": "post_self_attn_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
    "ffn_up": "mlp.gate_up_proj",  # gate then up, as the checkpoint fuses them
}


def hf_fields(keys: HfKeys, head_dim: int) -> Fields:
    return {
        "qkv_bias": bool(keys.get("attention_bias", True)),
        "o_bias": False,
        "norm_placement": "sandwich",
    }


def gguf_fields(keys: GgufKeys, fields: Fields) -> Fields:
    return {"qkv_bias": keys.has_tensor("blk.0.attn_q.bias"), "norm_placement": "sandwich"}


def sandwich_tensors(tensors: Tensors, config) -> Tensors:
    """The norms renamed, then q and k rows in rotate-half order."""

    def renamed() -> Tensors:
        for name, tensor in tensors:
            stem, dot, rest = name.rpartition(".")
            layer, _, module = stem.rpartition(".")
            yield (f"{layer}.{_NORMS[module]}{dot}{rest}" if module in _NORMS else name), tensor

    return rotate_pairs_as_halves(renamed(), config)


FAMILY = Family(
    name="glm4",
    model_types=("glm4",),
    gguf_archs=("glm4",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    gguf_names=GGUF_NAMES,
    tensors=sandwich_tensors,
    tiny={"head_dim": 16},  # half of each head rotates (the config's default)
)
