"""gpt-oss: attention with a learned sink logit per head and biased q, k, v and o; sliding
(128-token) and global layers alternating, one YaRN rope for both; every layer's MLP a
mixture of experts whose router and projections are biased, gated by a clamped SwiGLU
(`models.mlp.ClampedSwiGLU`), their top-k weights a softmax over the chosen logits (the
renormalised rule).

transformers stores the experts stacked and transposed: ``gate_up_proj [E, hidden, 2I]``
with gate and up interleaved by column (gate at the even ones), ``down_proj [E, I,
hidden]``, each with a stacked bias; the router is ``mlp.router``. llama.cpp (``gpt-oss``)
splits gate and up, stores the sinks as ``attn_sinks.weight``, the norm before the experts
as ``post_attention_norm``, and hard-codes the SwiGLU's alpha and limit and the
alternation (even layers slide). Its YaRN truncates the correction range where
transformers' gpt-oss does not: the model's own definition (transformers') is followed.
"""

import dataclasses
import re

import torch

from ..layers import LayerSpec, describe_layers
from .family import COMMON_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys, Tensors, experts

_SWA_PATTERN = 2
# transformers' stacks, and llama.cpp's stacked biases (its weights the loader splits)
_EXPERTS = re.compile(
    r"(model\.layers\.\d+\.mlp)\.experts\."
    r"(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias|(?:gate|up|down)_proj\.bias)"
)
_ROUTER = re.compile(r"(model\.layers\.\d+\.mlp)\.router\.(weight|bias)")


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    moe = experts(keys, "intermediate_size", renormalize=True)
    return {
        "qkv_bias": bool(keys.get("attention_bias", True)),
        "o_bias": bool(keys.get("attention_bias", True)),
        "moe": dataclasses.replace(moe, bias=True),
        "activation": "swiglu_oai",
        "swiglu_alpha": keys.positive("swiglu_alpha", 1.702),
        "swiglu_limit": keys.positive("swiglu_limit", 7.0),
    }


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    rope = fields["rope"]
    return {
        "qkv_bias": keys.has_tensor("blk.0.attn_q.bias"),
        "o_bias": keys.has_tensor("blk.0.attn_output.bias"),
        "moe": dataclasses.replace(fields["moe"], bias=True),
        "activation": "swiglu_oai",
        "layer_types": keys.swa_layer_types(_SWA_PATTERN, fields["num_layers"]),
        "rope": dataclasses.replace(rope, truncate=False) if rope.kind == "yarn" else rope,
    }


def _layers(config) -> tuple[LayerSpec, ...]:
    return tuple(
        dataclasses.replace(layer, mixer=dataclasses.replace(layer.mixer, sinks=True))
        for layer in describe_layers(config)
    )


def tensors(stored: Tensors, config: object) -> Tensors:
    """The checkpoint's router, stacked experts and sinks as the model's parameters."""
    for name, tensor in stored:
        if match := _ROUTER.fullmatch(name):
            yield f"{match[1]}.gate.{match[2]}", tensor
        elif name.endswith(".self_attn.sinks.weight"):  # llama.cpp's name
            yield name.removesuffix(".weight"), tensor
        elif match := _EXPERTS.fullmatch(name):
            yield from _experts(match[1], match[2], tensor)
        else:
            yield name, tensor


def _experts(stem: str, kind: str, tensor: torch.Tensor) -> Tensors:
    """One stacked tensor as each expert's own: transformers' (interleaved, transposed)
    or llama.cpp's biases ``[E, rows]``."""
    for expert, part in enumerate(tensor.unbind(0)):
        prefix = f"{stem}.experts.{expert}"
        if kind == "gate_up_proj":  # [hidden, 2I]
            yield f"{prefix}.gate_proj.weight", part[:, ::2].T.contiguous()
            yield f"{prefix}.up_proj.weight", part[:, 1::2].T.contiguous()
        elif kind == "gate_up_proj_bias":
            yield f"{prefix}.gate_proj.bias", part[::2].contiguous()
            yield f"{prefix}.up_proj.bias", part[1::2].contiguous()
        elif kind == "down_proj":  # [I, hidden]
            yield f"{prefix}.down_proj.weight", part.T.contiguous()
        elif kind == "down_proj_bias":
            yield f"{prefix}.down_proj.bias", part
        else:  # llama.cpp's stacked biases: gate_proj.bias, up_proj.bias, down_proj.bias
            yield f"{prefix}.{kind}", part


FAMILY = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    gguf_archs=("gpt-oss",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names={
        **COMMON_GGUF_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "attn_sinks": "self_attn.sinks",
    },
    layers=_layers,
    tensors=tensors,
    # Experts of their own size; windows of 8 on layers 0 and 2; YaRN from 64. The SwiGLU's
    # limit stays llama.cpp's (7, which its files cannot change): the clamps are tested
    # on the layer alone.
    tiny={
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 96,
        "head_dim": 16,
        "sliding_window": 8,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    },
)
