"""Granite 3: Llama's layers under Granite's four multipliers: the embeddings scaled
(``embedding_multiplier``), each layer's attention and MLP outputs scaled before they join
the residual stream (``residual_multiplier``), the attention's scores scaled by
``attention_multiplier`` (in place of the head size's), the logits divided by
``logits_scaling``. Granite 4.0-H (`granitemoehybrid`) reads them here too.

llama.cpp's ``granite`` files name them ``embedding_scale``, ``residual_scale``,
``attention.scale`` and ``logit_scale``; its converter permutes q and k rows as Llama's.
"""

from .family import Family, Fields, GgufKeys, HfKeys, biases


def multipliers(keys: HfKeys) -> Fields:
    """Granite's multipliers from a ``config.json`` (each required)."""
    return {
        "attn_scale": keys.positive("attention_multiplier"),
        "embedding_multiplier": keys.positive("embedding_multiplier"),
        "residual_multiplier": keys.positive("residual_multiplier"),
        "logits_scaling": keys.positive("logits_scaling"),
    }


def gguf_multipliers(keys: GgufKeys) -> Fields:
    """Granite's multipliers from a GGUF (each optional, as llama.cpp reads them: absent,
    the attention takes the head size's scale and the rest do nothing)."""
    return {
        "attn_scale": keys.positive("attention.scale", 0.0),
        "embedding_multiplier": keys.positive("embedding_scale", None),
        "residual_multiplier": keys.positive("residual_scale", None),
        "logits_scaling": keys.positive("logit_scale", None),
    }


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return {**biases(keys), **multipliers(keys)}


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    return {**gguf_multipliers(keys), "qkv_bias": keys.has_tensor("blk.0.attn_q.bias")}


FAMILY = Family(
    name="granite",
    model_types=("granite",),
    gguf_archs=("granite",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_permuted_qk=True,
    tiny={
        "embedding_multiplier": 4.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.125,
        "logits_scaling": 2.0,
    },
)
