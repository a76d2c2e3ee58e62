"""Llama (1-3.x): pre-norm, gated MLP, optional attention biases; the GGUF ``llama``
architecture also carries Mistral and, with experts, Mixtral."""

import dataclasses

from .family import Family, Fields, GgufKeys, HfKeys, biases


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return biases(keys)


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    """A llama file with experts is Mixtral, whose top-k weights are kept in float32."""
    moe = fields["moe"]
    if moe is None:
        return {}
    return {"architecture": "mixtral", "moe": dataclasses.replace(moe, float_weights=True)}


FAMILY = Family(
    name="llama",
    model_types=("llama",),
    gguf_archs=("llama",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_permuted_qk=True,
    gguf_auto_tokenizer=True,
    tiny={
        "head_dim": 16,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
)
