"""OLMo (the first): Llama's layout whose norms are LayerNorms without weight or bias,
q, k and v optionally clamped to ``[-clip_qkv, clip_qkv]``.

The checkpoints' norms use eps 1e-5 whatever the config says (it has no key for it), as
llama.cpp's converter writes it. Its converter permutes q and k as for Llama (NORM rope).
"""

from .family import Family, Fields, GgufKeys, HfKeys, biases

_EPS = 1e-5  # transformers' OLMo norms, fixed


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return {
        **biases(keys),
        "norm_kind": "layer_plain",
        "rms_norm_eps": _EPS,
        "clip_qkv": keys.positive("clip_qkv", None),
    }


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    return {
        "norm_kind": "layer_plain",
        "rms_norm_eps": keys.positive("attention.layer_norm_epsilon"),
        "clip_qkv": keys.positive("attention.clamp_kqv", None),
        "qkv_bias": keys.has_tensor("blk.0.attn_q.bias"),
        "o_bias": keys.has_tensor("blk.0.attn_output.bias"),
    }


FAMILY = Family(
    name="olmo",
    model_types=("olmo",),
    gguf_archs=("olmo",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_permuted_qk=True,
    tiny={"clip_qkv": 0.1},  # (small enough to clamp the tiny model's q, k and v)
)
