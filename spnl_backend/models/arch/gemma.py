"""Gemma (the first): Llama's pre-norm layer with Gemma's norms, scaled by (1 + w) in
float32, its embedding scaled by sqrt(hidden), GELU (tanh) gating and tied embeddings.

llama.cpp's converter stores the norm weights as 1 + w and writes no rope base (its
default, 10,000, is the checkpoints'). Bidirectional attention (an embedding model's)
is refused."""

from .family import Family, Fields, GgufKeys, HfKeys, biases
from .gemma3 import GEMMA_CHAT_TEMPLATE


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    if keys.get("use_bidirectional_attention", False):
        raise keys.wrong("use_bidirectional_attention", True, "false (causal attention)")
    return {
        **biases(keys),
        "norm_offset": 1.0,
        "norm_in_float": True,
        "embedding_multiplier": keys.count("hidden_size") ** 0.5,
    }


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    return {
        "norm_offset": 0.0,  # stored as 1 + w
        "norm_in_float": True,
        "embedding_multiplier": fields["hidden_size"] ** 0.5,
        "activation": "gelu_tanh",
    }


FAMILY = Family(
    name="gemma",
    model_types=("gemma",),
    gguf_archs=("gemma",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_auto_tokenizer=False,
    chat_template=GEMMA_CHAT_TEMPLATE,
    tiny={"head_dim": 16, "tie_word_embeddings": True},
)
