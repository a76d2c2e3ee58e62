"""Qwen2: Llama with biases on q, k and v (not o)."""

from .family import Family, Fields, GgufKeys, HfKeys


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return {"qkv_bias": True, "o_bias": False}


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    return {"qkv_bias": keys.has_tensor("blk.0.attn_q.bias")}


FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    gguf_archs=("qwen2",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_auto_tokenizer=True,
    tiny={
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    },
)
