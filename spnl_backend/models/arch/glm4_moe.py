"""GLM-4 MoE (GLM-4.5, GLM-4.5-Air): grouped-query attention (q, k and v biased where
``attention_bias``, each head of q and k normed where ``use_qk_norm``) whose rope turns
the first ``partial_rotary_factor`` of each head in halves (transformers' default half;
llama.cpp's NEOX kind, rows as the checkpoint has them), and after the first
``first_k_dense_replace`` dense layers DeepSeek-V3's experts: sigmoid scores, a learned
``e_score_correction_bias`` for choosing alone, the best ``topk_group`` of ``n_group``
groups (each scored by its best two), the top-k renormalised where ``norm_topk_prob``
and scaled by ``routed_scaling_factor``, beside always-on shared experts.

The checkpoints keep multi-token prediction layers after the decoder's
(``num_nextn_predict_layers``): left unread, as llama.cpp's files' ``nextn`` blocks.
llama.cpp's ``glm4moe`` files hold the norm before the MLP as ``post_attention_norm``;
their routing is read as DeepSeek's ``deepseek2`` files' (`deepseek.gguf_moe`).
"""

from typing import TYPE_CHECKING

from .deepseek import EXPERT_GGUF_NAMES, expert_tensors, gguf_moe, hf_moe
from .family import COMMON_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys, Tensors

if TYPE_CHECKING:
    from ..config import ModelConfig

_GGUF_NAMES = {
    **COMMON_GGUF_NAMES,
    **EXPERT_GGUF_NAMES,
    "post_attention_norm": "post_attention_layernorm",
}


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return {
        "qkv_bias": bool(keys.get("attention_bias", False)),
        "o_bias": False,
        "qk_norm": bool(keys.get("use_qk_norm", False)),
        "moe": hf_moe(keys, v3=True),
    }


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    return {
        "qkv_bias": keys.has_tensor("blk.0.attn_q.bias"),
        "o_bias": False,
        "qk_norm": keys.has_tensor("blk.0.attn_q_norm.weight"),
        "moe": gguf_moe(keys, fields.get("moe")),
    }


def _tensors(stored: Tensors, config: "ModelConfig") -> Tensors:
    return expert_tensors(stored, config.num_layers)


FAMILY = Family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    gguf_archs=("glm4moe",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names=_GGUF_NAMES,
    tensors=_tensors,
    extra_layers_key="num_nextn_predict_layers",
    # 8 experts, 2 per token, renormalised and scaled, beside one shared expert, in one
    # group (as the checkpoints: llama.cpp's converter writes no groups); layer 0 dense;
    # q, k and v biased, q and k normed; half of each head rotates (the config's default)
    tiny={
        "head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "attention_bias": True,
        "use_qk_norm": True,
        "num_nextn_predict_layers": 0,
    },
)
