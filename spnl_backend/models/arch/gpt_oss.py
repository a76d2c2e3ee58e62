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

OpenAI's checkpoints (``quantization_config.quant_method`` "mxfp4") store the two expert
projections as MXFP4: ``{gate_up,down}_proj_blocks [E, out, in / 32, 16]`` (uint8, two
E2M1 values a byte, the first in the low nibble) and ``*_scales [E, out, in / 32]`` (E8M0
exponents), gate_up's rows interleaved as its float columns are (gate at the even ones).
They stay MXFP4: repacked as ggml's blocks, run by the MXFP4 products.
"""

import dataclasses
import re
from typing import TYPE_CHECKING

import torch
from gguf import GGMLQuantizationType

from ...errors import ModelFileError
from ...quant.ggml import MXFP4_NAN_SCALE, mxfp4_from_microscaling
from ...quant.linear import QuantizedWeight
from ..layers import LayerSpec, describe_layers
from .family import COMMON_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys, Tensors, experts
from .harmony import HARMONY_CHAT_TEMPLATE

if TYPE_CHECKING:
    from ..config import ModelConfig

_SWA_PATTERN = 2
# transformers' stacks, and llama.cpp's stacked biases (its weights the loader splits)
_EXPERTS = re.compile(
    r"(model\.layers\.\d+\.mlp)\.experts\."
    r"(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias|(?:gate|up|down)_proj\.bias)"
)
_ROUTER = re.compile(r"(model\.layers\.\d+\.mlp)\.router\.(weight|bias)")
# OpenAI's MXFP4 experts: a projection's blocks and its scales
_PACKED = re.compile(
    r"(model\.layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)_(blocks|scales)"
)
_MXFP4 = "mxfp4"
_GROUP = 32  # values per E8M0 scale


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


def tensors(stored: Tensors, config: "ModelConfig") -> Tensors:
    """The checkpoint's router, stacked experts (float or MXFP4) and sinks as the model's
    parameters."""
    unpaired: dict[tuple[str, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for name, tensor in stored:
        if match := _PACKED.fullmatch(name):
            parts = unpaired.setdefault((match[1], match[2]), {})
            parts[match[3]] = (name, tensor)
            if len(parts) == 2:  # blocks and scales, in either order or shard
                del unpaired[(match[1], match[2])]
                yield from _mxfp4_experts(match[1], match[2], parts, config)
        elif match := _ROUTER.fullmatch(name):
            yield f"{match[1]}.gate.{match[2]}", tensor
        elif name.endswith(".self_attn.sinks.weight"):  # llama.cpp's name
            yield name.removesuffix(".weight"), tensor
        elif match := _EXPERTS.fullmatch(name):
            yield from _experts(match[1], match[2], tensor)
        else:
            yield name, tensor
    for parts in unpaired.values():
        ((kind, (name, _)),) = parts.items()
        other = "scales" if kind == "blocks" else "blocks"
        raise ModelFileError(
            f"tensor {name!r} has no {name.removesuffix(kind) + other!r} beside it: MXFP4 "
            "experts need both their blocks and their scales"
        )


def _mxfp4_experts(
    stem: str, proj: str, parts: dict[str, tuple[str, torch.Tensor]], config: "ModelConfig"
) -> Tensors:
    """One projection's MXFP4 blocks and scales as each expert's quantized weights (ggml's
    blocks of the same values), gate_up's interleaved rows sorted into gate's and up's."""
    blocks_name, blocks = parts["blocks"]
    scales_name, scales = parts["scales"]
    if config.quantization != _MXFP4:
        raise ModelFileError(
            f"tensor {blocks_name!r} holds MXFP4 experts, but config.json's "
            "quantization_config does not give quant_method 'mxfp4'"
        )
    moe, hidden = config.moe, config.hidden_size
    inner = moe.intermediate_size
    rows, cols = (2 * inner, hidden) if proj == "gate_up_proj" else (hidden, inner)
    if cols % _GROUP:
        raise ModelFileError(
            f"tensor {blocks_name!r}: MXFP4 groups of {_GROUP} values cannot hold rows of "
            f"{cols} (hidden_size and the experts' intermediate_size must be multiples of 32)"
        )
    groups = (moe.num_experts, rows, cols // _GROUP)
    _check_packed(blocks_name, blocks, (*groups, _GROUP // 2), "MXFP4 blocks, two values a byte")
    _check_packed(scales_name, scales, groups, "E8M0 exponents, one per block")
    bad = int((scales == MXFP4_NAN_SCALE).sum())
    if bad:
        raise ModelFileError(
            f"tensor {scales_name!r} holds {bad:,} NaN exponents (0xff); a model with such "
            "weights computes NaN, so it is refused"
        )
    mxfp4 = GGMLQuantizationType.MXFP4
    for expert in range(moe.num_experts):  # one at a time: the repacking's copies stay small
        data = mxfp4_from_microscaling(blocks[expert], scales[expert])  # [rows, groups * 17]
        prefix = f"{stem}.experts.{expert}"
        if proj == "down_proj":
            yield f"{prefix}.down_proj.weight", QuantizedWeight(data, mxfp4, (hidden, inner))
            continue
        gate, up = data[0::2].contiguous(), data[1::2].contiguous()  # rows interleaved
        yield f"{prefix}.gate_proj.weight", QuantizedWeight(gate, mxfp4, (inner, hidden))
        yield f"{prefix}.up_proj.weight", QuantizedWeight(up, mxfp4, (inner, hidden))


def _check_packed(name: str, tensor: torch.Tensor, shape: tuple[int, ...], holding: str) -> None:
    if tensor.dtype != torch.uint8 or tuple(tensor.shape) != shape:
        found = f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"
        raise ModelFileError(
            f"tensor {name!r} is {found}; expected uint8 {list(shape)} ({holding}: "
            "[experts, rows, columns / 32, ...] from the config's sizes)"
        )


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
    chat_template=HARMONY_CHAT_TEMPLATE,
    tensors=tensors,
    quant_methods={_MXFP4: ("_blocks", "_scales")},
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
