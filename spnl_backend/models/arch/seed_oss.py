"""Seed-OSS: Llama with biases on q, k and v (``attention_bias``) and, apart, on o
(``attention_out_bias``).

llama.cpp's ``seed_oss`` keeps q and k rows as they are (NEOX rope) and names the norm
before the MLP ``post_attention_norm``."""

from .family import COMMON_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return {
        "qkv_bias": bool(keys.get("attention_bias", True)),
        "o_bias": bool(keys.get("attention_out_bias", False)),
    }


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    return {
        "qkv_bias": keys.has_tensor("blk.0.attn_q.bias"),
        "o_bias": keys.has_tensor("blk.0.attn_output.bias"),
    }


FAMILY = Family(
    name="seed_oss",
    model_types=("seed_oss",),
    gguf_archs=("seed_oss",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names={
        **{k: v for k, v in COMMON_GGUF_NAMES.items() if k != "ffn_norm"},
        "post_attention_norm": "post_attention_layernorm",
    },
    tiny={"head_dim": 16, "attention_bias": True, "attention_out_bias": True},  # both read
)
