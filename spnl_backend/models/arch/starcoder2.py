"""StarCoder2: Llama's layout with LayerNorms (weight and bias), a plain tanh-GELU MLP,
biases on every projection (``use_bias``), sliding windows where the config gives one.

llama.cpp's converter writes no window and its graph attends to the whole context, so a
GGUF attends to the whole context here too.
"""

from .family import COMMON_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys, layer_norm_fields, renaming


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    bias = keys.boolean("use_bias", True)
    fields = layer_norm_fields(keys.positive("norm_epsilon"))
    return {**fields, "mlp_bias": bias, "qkv_bias": bias, "o_bias": bias}


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    return {
        **layer_norm_fields(keys.positive("attention.layer_norm_epsilon")),
        "mlp_bias": keys.has_tensor("blk.0.ffn_up.bias"),
        "qkv_bias": keys.has_tensor("blk.0.attn_q.bias") or keys.has_tensor("blk.0.attn_qkv.bias"),
        "o_bias": keys.has_tensor("blk.0.attn_output.bias"),
        "activation": "gelu_tanh",
    }


FAMILY = Family(
    name="starcoder2",
    model_types=("starcoder2",),
    gguf_archs=("starcoder2",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names={**COMMON_GGUF_NAMES, "attn_qkv": "self_attn.qkv_proj"},
    tensors=renaming({"mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}),
    tiny={
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    },
)
