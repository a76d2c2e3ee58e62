"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (`models.mla`) and, after the
first ``first_k_dense_replace`` dense layers, experts beside always-on shared experts.

Attention: queries projected directly (V2-Lite's ``q_proj``) or through a normed
bottleneck (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``); one latent per token
(``kv_a_proj_with_mqa``, normed by ``kv_a_layernorm``) beside a rotated key all heads
share; the softmax scale ``qk_head_dim ** -0.5``, times ``mscale(factor,
mscale_all_dim) ** 2`` where the rope is scaled (transformers' rule). DeepSeek rotates
interleaved pairs; the loader regroups those rows into halves (rotate-half gives the same
products), unless a V3 config says ``rope_interleave: false``.

Routing: V2 takes a softmax top-k (``topk_method`` greedy), or first keeps the experts of
the ``topk_group`` groups whose best expert scores highest (group_limited_greedy); V3
takes sigmoid scores, adds ``e_score_correction_bias`` to them for choosing alone, keeps
the groups whose best two sum highest, and renormalises where ``norm_topk_prob``; both
scale the chosen weights by ``routed_scaling_factor``.

Refused, with the reason: attention biases, ``moe_layer_freq`` other than 1, a V2 with
``norm_topk_prob`` (transformers' V2 ignores it where DeepSeek's own code applies it), a
scoring function other than the version's.

Checkpoints store ``kv_b_proj`` whole; it loads split per head as llama.cpp's
``deepseek2`` files store it (``attn_k_b [heads, kv_lora_rank, qk_nope]``, ``attn_v_b
[heads, v_head_dim, kv_lora_rank]``). A ``deepseek2`` file is read by the V2 family,
whichever version it holds: its gating function (``expert_gating_func``: softmax,
sigmoid) decides V2's or V3's routing rules.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ...errors import UnsupportedArchitectureError
from ...quant.linear import QuantizedWeight
from ..components import MlaConfig, MoeConfig, RopeConfig
from .family import COMMON_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys, Tensors

if TYPE_CHECKING:
    from ..config import ModelConfig

# llama.cpp's ``deepseek2`` block tensor names → ours, beyond the common ones.
# The score bias and the shared experts, as llama.cpp names them.
EXPERT_GGUF_NAMES = {
    "exp_probs_b": "mlp.e_score_correction_bias",
    "ffn_gate_shexp": "shared_mlp.gate_proj",
    "ffn_up_shexp": "shared_mlp.up_proj",
    "ffn_down_shexp": "shared_mlp.down_proj",
}
_GGUF_NAMES = {
    **COMMON_GGUF_NAMES,
    **EXPERT_GGUF_NAMES,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
}
# The checkpoints' names inside a layer → ours.
_RENAMED = {
    ".mlp.shared_experts.": ".shared_mlp.",
    ".mlp.gate.e_score_correction_bias": ".mlp.e_score_correction_bias",
    ".mlp.e_score_correction_bias.bias": ".mlp.e_score_correction_bias",  # a GGUF's
}
_SOFTMAX, _SIGMOID = 1, 2  # llama.cpp's expert_gating_func


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(mla: MlaConfig, rope: RopeConfig) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` where the rope
    is scaled and the config gives ``mscale_all_dim``."""
    scale = mla.qk_head_dim**-0.5
    if rope.kind != "default" and rope.mscale_all_dim:
        scale *= _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def _mla_fields(mla: MlaConfig, rope: RopeConfig, num_heads: int) -> Fields:
    return {
        "mla": mla,
        "head_dim": mla.qk_head_dim,
        "num_kv_heads": num_heads,
        "rope": rope,
        "attn_scale": softmax_scale(mla, rope),
    }


def _hf_mla(keys: HfKeys, interleaved: bool) -> MlaConfig:
    if keys.get("attention_bias"):
        raise _refused(keys, "attention_bias", "biased attention projections")
    return MlaConfig(
        q_lora_rank=keys.count("q_lora_rank", None),
        kv_lora_rank=keys.count("kv_lora_rank"),
        qk_nope_head_dim=keys.count("qk_nope_head_dim"),
        qk_rope_head_dim=keys.count("qk_rope_head_dim"),
        v_head_dim=keys.count("v_head_dim"),
        rope_interleaved=interleaved,
    )


def hf_moe(keys: HfKeys, v3: bool) -> MoeConfig | None:
    """The experts, where the config has them (``n_routed_experts``): V2's routing or V3's
    (GLM-4 MoE's too)."""
    experts = keys.count("n_routed_experts", None)
    if experts is None:
        return None
    if keys.integer("moe_layer_freq", 1) != 1:
        raise _refused(keys, "moe_layer_freq", "experts in every layer after the dense ones")
    layers, dense = keys.count("num_hidden_layers"), keys.integer("first_k_dense_replace", 0)
    if not 0 <= dense <= layers:
        raise keys.wrong("first_k_dense_replace", dense, f"an integer from 0 to {layers}")
    scoring = keys.get("scoring_func", "sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise _refused(keys, "scoring_func", "the version's own scoring function")
    inner = keys.count("moe_intermediate_size")
    shared = keys.integer("n_shared_experts", 0) or 0
    moe = MoeConfig(
        num_experts=experts,
        top_k=keys.count("num_experts_per_tok"),
        intermediate_size=inner,
        renormalize=bool(keys.get("norm_topk_prob", False)),
        sparse=tuple(i >= dense for i in range(layers)),
        shared_intermediate_size=shared * inner or None,
        routed_scale=keys.positive("routed_scaling_factor", 1.0),
        float_weights=True,
    )
    return _v3_routing(keys, moe) if v3 else _v2_routing(keys, moe)


def _v2_routing(keys: HfKeys, moe: MoeConfig) -> MoeConfig:
    if moe.renormalize:
        raise _refused(keys, "norm_topk_prob", "DeepSeek-V2 without it (transformers ignores it)")
    method = keys.get("topk_method", "greedy")
    if method == "greedy":
        return moe
    if method != "group_limited_greedy":
        raise keys.wrong("topk_method", method, "'greedy' or 'group_limited_greedy'")
    groups = keys.count("n_group")
    return dataclasses.replace(moe, n_group=groups, topk_group=keys.count("topk_group"))


def _v3_routing(keys: HfKeys, moe: MoeConfig) -> MoeConfig:
    return dataclasses.replace(
        moe,
        scoring="sigmoid",
        score_bias=True,
        n_group=keys.count("n_group", None) or 1,
        topk_group=keys.count("topk_group", None) or 1,
        group_rule="top2",
    )


def _hf(v3: bool) -> Callable[[HfKeys, int], Fields]:
    def fields(keys: HfKeys, head_dim: int) -> Fields:
        interleaved = bool(keys.get("rope_interleave", True)) if v3 else True
        mla = _hf_mla(keys, interleaved)
        rope = keys.rope("full_attention", mla.qk_rope_head_dim)
        heads = keys.count("num_attention_heads")
        if keys.count("num_key_value_heads", heads) != heads:
            raise keys.wrong("num_key_value_heads", keys.get("num_key_value_heads"), f"{heads}")
        return {**_mla_fields(mla, rope, heads), "moe": hf_moe(keys, v3)}

    return fields


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    """What llama.cpp's converter writes for ``deepseek2``: the MLA sizes (the query and
    value heads' under ``*_mla``), the leading dense layers, the shared experts' count,
    the routing (gating function, groups, weights' scale and norm)."""
    heads = fields["num_heads"]
    rope_dim = keys.count("rope.dimension_count")
    qk_head = keys.count("attention.key_length_mla")
    if qk_head <= rope_dim:
        raise keys.wrong("attention.key_length_mla", qk_head, f"more than {rope_dim}")
    mla = MlaConfig(
        q_lora_rank=keys.count("attention.q_lora_rank", None),
        kv_lora_rank=keys.count("attention.kv_lora_rank"),
        qk_nope_head_dim=qk_head - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=keys.count("attention.value_length_mla"),
    )
    rope = dataclasses.replace(fields["rope"], rotary_dim=rope_dim)
    log_mul = keys.positive("rope.scaling.yarn_log_multiplier", None)
    if log_mul is not None:  # the converter writes 0.1 * mscale_all_dim
        rope = dataclasses.replace(rope, mscale_all_dim=log_mul / 0.1, mscale=log_mul / 0.1)
    return {**_mla_fields(mla, rope, heads), "moe": gguf_moe(keys, fields.get("moe"))}


def gguf_moe(keys: GgufKeys, moe: MoeConfig | None) -> MoeConfig | None:
    """The routing llama.cpp's ``deepseek2`` and ``glm4moe`` files describe."""
    if moe is None:
        return None
    gating = keys.integer("expert_gating_func", _SOFTMAX)
    if gating not in (_SOFTMAX, _SIGMOID):
        raise keys.wrong("expert_gating_func", gating, "1 (softmax) or 2 (sigmoid)")
    shared = keys.integer("expert_shared_count", 0) or 0
    sigmoid = gating == _SIGMOID
    return dataclasses.replace(
        moe,
        renormalize=bool(keys.get("expert_weights_norm", False)),
        shared_intermediate_size=shared * moe.intermediate_size or None,
        routed_scale=keys.positive("expert_weights_scale", 1.0),
        float_weights=True,
        scoring="sigmoid" if sigmoid else "softmax",
        score_bias=keys.has_tensor(f"blk.{_first_sparse(moe)}.exp_probs_b.bias"),
        n_group=keys.count("expert_group_count", None) or 1,
        topk_group=keys.count("expert_group_used_count", None) or 1,
        group_rule="top2" if sigmoid else "max",
    )


def _first_sparse(moe: MoeConfig) -> int:
    return next((i for i, sparse in enumerate(moe.sparse) if sparse), 0)


def _refused(keys: HfKeys, key: str, supported: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"{keys.get('model_type')}: {key}={keys.get(key)!r} is not supported; supported: "
        f"{supported}"
    )


def tensors(stored: Tensors, config: "ModelConfig") -> Tensors:
    """The checkpoint's layout as the model holds it: ``kv_b_proj`` split per head, the
    rotated rows regrouped from interleaved pairs into halves, the shared experts and the
    score bias under our names."""
    mla = config.mla
    assert mla is not None
    for name, tensor in expert_tensors(stored, config.num_layers):
        if name.endswith(".self_attn.kv_b_proj.weight"):
            yield from _split_kv_b(name, tensor, mla, config.num_heads)
            continue
        if mla.rope_interleaved and name.endswith(_ROTATED):
            heads = 1 if "kv_a_proj" in name else config.num_heads
            tensor = _rows(tensor, _halves_order(mla, heads, "kv_a_proj" in name))
        yield name, tensor


def expert_tensors(stored: Tensors, layers: int) -> Tensors:
    """The shared experts and the score bias under our names; the layers past the
    decoder's ``layers`` (multi-token prediction) left out."""
    for name, tensor in stored:
        if _past_decoder(name, layers):
            continue
        for old, new in _RENAMED.items():
            name = name.replace(old, new)
        yield name, tensor


def _past_decoder(name: str, layers: int) -> bool:
    parts = name.split(".", 3)
    return parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= layers


_ROTATED = (
    ".self_attn.q_proj.weight",
    ".self_attn.q_b_proj.weight",
    ".self_attn.kv_a_proj_with_mqa.weight",
)


def _split_kv_b(name: str, tensor: object, mla: MlaConfig, heads: int) -> Tensors:
    if isinstance(tensor, QuantizedWeight):
        tensor = tensor.dequantize()
    assert isinstance(tensor, torch.Tensor)
    per_head = tensor.view(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
    k_b, v_b = per_head.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
    stem = name.removesuffix("kv_b_proj.weight")
    yield stem + "k_b_proj.weight", k_b.transpose(1, 2).contiguous()
    yield stem + "v_b_proj.weight", v_b.contiguous()


def _halves_order(mla: MlaConfig, heads: int, latent: bool) -> torch.Tensor:
    """The rows in their new order: each head's (or the latent's) non-rotated ones as
    they are, then its rotated ones, the even of each pair first, then the odd."""
    before = mla.kv_lora_rank if latent else mla.qk_nope_head_dim
    width = before + mla.qk_rope_head_dim
    rotated = torch.arange(mla.qk_rope_head_dim)
    halves = torch.cat([rotated[0::2], rotated[1::2]]) + before
    one = torch.cat([torch.arange(before), halves])
    return torch.cat([one + head * width for head in range(heads)])


def _rows(tensor: object, order: torch.Tensor) -> object:
    if isinstance(tensor, QuantizedWeight):  # whole rows of blocks move
        return QuantizedWeight(tensor.data[order], tensor.qtype, tensor.shape)
    assert isinstance(tensor, torch.Tensor)
    return tensor[order]


_TINY = {
    "num_key_value_heads": 4,  # transformers' MLA takes a K/V head per query head
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
}

V2 = Family(
    name="deepseek_v2",
    model_types=("deepseek_v2",),
    gguf_archs=("deepseek2",),
    hf_fields=_hf(v3=False),
    gguf_fields=_gguf,
    gguf_names=_GGUF_NAMES,
    gguf_auto_tokenizer=False,
    tensors=tensors,
    tiny={  # V2-Lite's shape: queries projected directly, greedy softmax routing
        **_TINY,
        "q_lora_rank": None,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "n_shared_experts": 2,
        "topk_method": "greedy",
    },
)
V3 = Family(
    name="deepseek_v3",
    model_types=("deepseek_v3",),
    hf_fields=_hf(v3=True),
    tensors=tensors,
    extra_layers_key="num_nextn_predict_layers",
    tiny={  # queries through a bottleneck, sigmoid routing in groups, yarn rope
        **_TINY,
        "q_lora_rank": 48,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",  # as DeepSeek's files say (llama.cpp's converter reads it)
        "rope_parameters": {  # V2-Lite's and V3's mscale rule: equal, the softmax scaled
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    },
)
FAMILIES = (V2, V3)
