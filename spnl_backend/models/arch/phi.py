"""Phi-2: attention and a plain GELU MLP side by side on the one LayerNorm's output
(`models.layers.NormPlacement` "shared"), partial rotary, biases on every projection and
on the LM head.

llama.cpp's converter writes the MLP's width as four times the hidden size and as many
K/V heads as query heads (Phi-2's own shapes: a file whose tensors say otherwise is
refused as it loads); its graph runs the tanh GELU, as the checkpoints do (``gelu_new``).
"""

from .family import COMMON_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys, layer_norm_fields, renaming


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    if keys.get("qk_layernorm"):
        raise keys.wrong("qk_layernorm", True, "false (LayerNorms of q and k are not supported)")
    return {**_fields(keys.positive("layer_norm_eps")), "qkv_bias": True, "o_bias": True}


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    return {
        **_fields(keys.positive("attention.layer_norm_epsilon")),
        "qkv_bias": keys.has_tensor("blk.0.attn_q.bias") or keys.has_tensor("blk.0.attn_qkv.bias"),
        "o_bias": keys.has_tensor("blk.0.attn_output.bias"),
        "lm_head_bias": keys.has_tensor("output.bias"),
        "activation": "gelu_tanh",
    }


def _fields(eps: float) -> Fields:
    return {**layer_norm_fields(eps), "norm_placement": "shared", "lm_head_bias": True}


FAMILY = Family(
    name="phi",
    model_types=("phi",),
    gguf_archs=("phi2",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names={**COMMON_GGUF_NAMES, "attn_qkv": "self_attn.qkv_proj"},
    tensors=renaming(
        {
            "self_attn.dense": "self_attn.o_proj",
            "mlp.fc1": "mlp.up_proj",
            "mlp.fc2": "mlp.down_proj",
            "final_layernorm": "norm",
        }
    ),
    tiny={
        "num_key_value_heads": None,  # Phi-2's: as many as the query heads
        "intermediate_size": 4 * 64,  # Phi-2's 4 x hidden (what the converter writes)
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.4,
        },
    },
)
