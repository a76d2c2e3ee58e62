"""HunYuan dense (``hunyuan_v1_dense``): Llama whose q and k are normed per head after
their rotation (``query_layernorm``, ``key_layernorm``), with transformers' fixed NTK-alpha
rope (a "dynamic" rope with an ``alpha``: the base raised by alpha^(d / (d - 2))).

llama.cpp's ``hunyuan-dense`` files carry the raised base itself; its converter keeps q
and k rows as they are (NEOX rope)."""

from collections.abc import Mapping

from .family import COMMON_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys, Tensors, biases

_NORMS: Mapping[str, str] = {
    ".self_attn.query_layernorm.": ".self_attn.q_norm.",
    ".self_attn.key_layernorm.": ".self_attn.k_norm.",
}
_FIELDS: Fields = {"qk_norm": True, "qk_norm_after_rope": True}


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    if keys.get("mlp_bias", False):
        raise keys.wrong("mlp_bias", True, "false (biased MLP projections are not supported)")
    return {**biases(keys), **_FIELDS}


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    bias = keys.has_tensor("blk.0.attn_q.bias")
    return {"qkv_bias": bias, "o_bias": keys.has_tensor("blk.0.attn_output.bias"), **_FIELDS}


def _tensors(tensors: Tensors, config) -> Tensors:
    for name, tensor in tensors:
        for old, new in _NORMS.items():
            name = name.replace(old, new)
        yield name, tensor


FAMILY = Family(
    name="hunyuan_v1_dense",
    model_types=("hunyuan_v1_dense",),
    gguf_archs=("hunyuan-dense",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names=COMMON_GGUF_NAMES,
    tensors=_tensors,
    ntk_alpha_rope=True,
    tiny={
        "head_dim": 16,
        # (llama.cpp's converter takes an alpha rope only with the 32k or 256k context)
        "max_position_embeddings": 32768,
        "rope_parameters": {
            "rope_type": "dynamic",
            "rope_theta": 10000.0,
            "alpha": 4.0,
            "factor": 1.0,
        },
    },
)
