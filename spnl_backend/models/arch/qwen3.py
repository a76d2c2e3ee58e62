"""Qwen3: Llama with each head of q and k normed before rotation."""

from .family import Family, Fields, GgufKeys, HfKeys, biases


def hf_fields(keys: HfKeys, head_dim: int) -> Fields:
    return {**biases(keys), "qk_norm": True}


def gguf_fields(keys: GgufKeys, fields: Fields) -> Fields:
    return {"qk_norm": True}


FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    gguf_archs=("qwen3",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    gguf_auto_tokenizer=True,
    tiny={
        "head_dim": 16,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    },
)
