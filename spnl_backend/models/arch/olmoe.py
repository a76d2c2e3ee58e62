"""OLMoE: q and k normed over their whole projections (before the heads are split), q, k
and v optionally clamped, experts whose top-k weights are used as they come.

In GGUF, ``attn_q_norm``/``attn_k_norm`` hold heads x head size weights; q, k and v are
clamped where the file has ``attention.clamp_kqv`` (the key llama.cpp's converter writes
for OLMo's ``clip_qkv``; for OLMoE neither its converter nor its graph clamps, so a file
without the key runs unclamped, as llama.cpp runs it). Its rope is llama.cpp's NEOX kind
(rotate-half) and the converter does not permute q and k, so their rows load as they are;
llama.cpp's graph does not renormalise the top-k weights (``norm_w`` false).
"""

from .family import Family, Fields, GgufKeys, HfKeys, biases, experts


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return {
        **biases(keys),
        "qk_norm_full": True,
        "clip_qkv": keys.positive("clip_qkv", None),
        "moe": experts(keys, "intermediate_size", bool(keys.get("norm_topk_prob", False))),
    }


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    return {"qk_norm_full": True, "clip_qkv": keys.positive("attention.clamp_kqv", None)}


FAMILY = Family(
    name="olmoe",
    model_types=("olmoe",),
    gguf_archs=("olmoe",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_renormalizes_top_k=False,
    tiny={"num_experts": 8, "num_experts_per_tok": 3, "clip_qkv": 4.0},
)
