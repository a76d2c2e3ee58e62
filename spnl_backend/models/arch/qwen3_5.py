"""Qwen3.5 (dense): three Gated DeltaNet layers to one of full attention; the attention
layers gate their output by a sigmoid from the q projection, norm q and k per head and
rotate a quarter of the head (Qwen's multimodal rope, whose three position rows are one
for text); every norm but the DeltaNet's own scales by (1 + w) in float32.

llama.cpp's ``qwen35`` files differ from the checkpoints in what its converter does:
the norms stored as 1 + w, ``A_log`` as ``-exp(A_log)``, the convolution squeezed to
``[channels, kernel]``, ``dt_bias`` as ``ssm_dt.bias``, and the value heads reordered from
grouped by key head to tiled (value head h reads key head h % key heads) in every tensor
that has them, which the layer then reads in that order (`DeltaNetConfig.v_heads_tiled`).
"""

import torch

from ..components import DeltaNetConfig
from .family import (
    COMMON_GGUF_NAMES,
    Family,
    Fields,
    GgufKeys,
    HfKeys,
    Tensors,
    as_state_layer_holds,
    biases,
)

_FULL_ATTENTION_INTERVAL = 4  # llama.cpp's default: every fourth layer attends


def hf_fields(keys: HfKeys, head_dim: int) -> Fields:
    delta = DeltaNetConfig(
        num_k_heads=keys.count("linear_num_key_heads"),
        num_v_heads=keys.count("linear_num_value_heads"),
        head_k_dim=keys.count("linear_key_head_dim"),
        head_v_dim=keys.count("linear_value_head_dim"),
        conv_kernel=keys.count("linear_conv_kernel_dim"),
    )
    return {**_common(), **biases(keys), "norm_offset": 1.0, "delta_net": delta}


def gguf_fields(keys: GgufKeys, fields: Fields) -> Fields:
    num_v_heads = keys.count("ssm.time_step_rank")
    inner = keys.count("ssm.inner_size")
    if inner % num_v_heads:
        raise keys.wrong(
            "ssm.inner_size", inner, f"a multiple of ssm.time_step_rank ({num_v_heads})"
        )
    delta = DeltaNetConfig(
        num_k_heads=keys.count("ssm.group_count"),
        num_v_heads=num_v_heads,
        head_k_dim=keys.count("ssm.state_size"),
        head_v_dim=inner // num_v_heads,
        conv_kernel=keys.count("ssm.conv_kernel"),
        v_heads_tiled=True,
    )
    layers = fields["num_layers"]
    return {
        **_common(),
        "norm_offset": 0.0,  # stored as 1 + w
        "delta_net": delta,
        "layer_types": _gguf_layer_types(keys, layers),
    }


def _common() -> Fields:
    return {"qk_norm": True, "norm_in_float": True, "attn_output_gate": True}


def _gguf_layer_types(keys: GgufKeys, layers: int) -> tuple[str, ...]:
    """``attention.recurrent_layers`` (a flag per layer, true: DeltaNet), else every
    ``full_attention_interval``-th layer attends."""
    flags = keys.get("attention.recurrent_layers")
    if flags is None:
        interval = keys.count("full_attention_interval", _FULL_ATTENTION_INTERVAL)
        flags = [(i + 1) % interval != 0 for i in range(layers)]
    flags = [bool(flag) for flag in flags]
    if len(flags) < layers:
        raise keys.wrong("attention.recurrent_layers", flags, f"{layers} flags (one per layer)")
    return tuple("linear" if flag else "full" for flag in flags[:layers])


def tensors(stored: Tensors, config: object) -> Tensors:
    """llama.cpp's layout of the DeltaNet's own tensors as the checkpoints' (the rest is)."""
    for name, tensor in stored:
        yield (
            as_state_layer_holds(name, tensor)
            if isinstance(tensor, torch.Tensor)
            else (
                name,
                tensor,
            )
        )


GGUF_NAMES = {
    **COMMON_GGUF_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt",
    "ssm_a": "linear_attn.ssm_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
TINY = {
    "num_hidden_layers": 4,
    "head_dim": 16,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}

FAMILY = Family(
    name="qwen3_5",
    model_types=("qwen3_5_text",),
    wrapper_types=("qwen3_5",),
    gguf_archs=("qwen35",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    gguf_names=GGUF_NAMES,
    tensors=tensors,
    state_layers=True,
    tiny=TINY,
)
