"""Falcon-H1: every layer runs attention and a Mamba-2 side by side on the same normed
input and adds their outputs to the residual stream, then a gated MLP (`ParallelMixer`:
the layer keeps K and V and a state per sequence).

Its muP multipliers scale the inputs and outputs of the projections: the attention's
input (``attention_in_multiplier``) and output, the keys (``key_multiplier``), the
Mamba-2's input and output, each of its projection's five parts (``ssm_multipliers``:
z, x, B, C, dt), the MLP's gate and down projections (``mlp_multipliers``). They fold
into the weights as a checkpoint loads (`tensors`), as llama.cpp's converter folds them
into a GGUF's; the embedding and logit multipliers stay as the model's own
(``embedding_multiplier``; ``lm_head_multiplier`` as a logit divisor), since a tied head
shares the embedding's weights.

The Mamba-2's grouped norm is optional (``mamba_rms_norm``; without it the output is
only gated) and may come before the gate (``mamba_norm_before_gate``); its output
projection's bias is ``projectors_bias``, its input's ``mamba_proj_bias``.

In GGUF (llama.cpp's ``falcon-h1``) the multipliers are already in the weights; a file
carries no norm placement, and llama.cpp norms after the gate where the file has the
norm's weight (``ssm_norm``), which is how it is read here. Rope is NEOX's (rotate-half),
so q and k are stored unpermuted; the converter names the MLP's norm ``ffn_norm``,
without a ``weight`` suffix.
"""

from typing import TYPE_CHECKING

import torch

from ..components import FoldedMultipliers, Mamba2Config
from .family import (
    COMMON_GGUF_NAMES,
    MAMBA2_GGUF_NAMES,
    Family,
    Fields,
    GgufKeys,
    HfKeys,
    Tensors,
    as_state_layer_holds,
    biases,
    time_step_limit,
)

if TYPE_CHECKING:
    from ..config import ModelConfig


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    if keys.get("mlp_bias"):
        raise keys.wrong("mlp_bias", keys.get("mlp_bias"), "false (an MLP without biases)")
    return {
        **biases(keys),
        "mamba": _mamba(keys),
        "folded_multipliers": _multipliers(keys),
        "embedding_multiplier": keys.positive("embedding_multiplier", 1.0),
        "logits_scaling": 1.0 / keys.positive("lm_head_multiplier", 1.0),
    }


def _mamba(keys: HfKeys) -> Mamba2Config:
    heads, head_dim = keys.count("mamba_n_heads"), keys.count("mamba_d_head")
    inner = keys.count("mamba_d_ssm", None) or keys.count("mamba_expand") * keys.count(
        "hidden_size"
    )
    if heads * head_dim != inner:
        raise keys.wrong(
            "mamba_d_ssm", inner, f"mamba_n_heads x mamba_d_head ({heads} x {head_dim})"
        )
    norm = "none"
    if keys.boolean("mamba_rms_norm", False):
        norm = "before_gate" if keys.boolean("mamba_norm_before_gate", True) else "after_gate"
    return Mamba2Config(
        num_heads=heads,
        head_dim=head_dim,
        state_size=keys.count("mamba_d_state"),
        n_groups=keys.count("mamba_n_groups"),
        conv_kernel=keys.count("mamba_d_conv"),
        chunk_size=keys.count("mamba_chunk_size"),
        conv_bias=keys.boolean("mamba_conv_bias"),
        proj_bias=keys.boolean("mamba_proj_bias"),
        out_bias=keys.boolean("projectors_bias", False),
        time_step_limit=time_step_limit(keys),
        norm=norm,
    )


def _multipliers(keys: HfKeys) -> FoldedMultipliers:
    segments = _numbers(keys, "ssm_multipliers", 5)
    gate, down = _numbers(keys, "mlp_multipliers", 2)
    return FoldedMultipliers(
        attention_in=_number(keys, "attention_in_multiplier"),
        attention_out=_number(keys, "attention_out_multiplier"),
        key=_number(keys, "key_multiplier"),
        ssm_in=_number(keys, "ssm_in_multiplier"),
        ssm_out=_number(keys, "ssm_out_multiplier"),
        ssm_segments=(segments[0], segments[1], segments[2], segments[3], segments[4]),
        mlp_gate=gate,
        mlp_down=down,
    )


def _number(keys: HfKeys, key: str) -> float:
    value = keys.get(key)
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise keys.wrong(key, value, "a number")
    return float(value)


def _numbers(keys: HfKeys, key: str, count: int) -> list[float]:
    value = keys.get(key)
    if value is None:
        return [1.0] * count
    ok = isinstance(value, list | tuple) and len(value) == count
    if not ok or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        raise keys.wrong(key, value, f"{count} numbers")
    return [float(v) for v in value]


# The checkpoints' names → ours.
_RENAMED = {
    "model.final_layernorm.": "model.norm.",
    ".pre_ff_layernorm.": ".post_attention_layernorm.",
    ".feed_forward.": ".mlp.",
}


def tensors(stored: Tensors, config: "ModelConfig") -> Tensors:
    """The checkpoints' names as ours, the multipliers folded into the projections they
    scale; llama.cpp's stored forms (a GGUF's, its multipliers already folded) as the
    layer holds them."""
    folded = config.folded_multipliers
    for name, tensor in stored:
        for theirs, ours in _RENAMED.items():
            name = name.replace(theirs, ours)
        if name.endswith("post_attention_layernorm"):  # llama.cpp's ffn_norm: no suffix
            name += ".weight"
        if isinstance(tensor, torch.Tensor):
            name, tensor = as_state_layer_holds(name, tensor)
            if name.endswith(("mamba.D", "mamba.norm.weight")):  # a column; a row per group
                tensor = tensor.flatten()
            if folded is not None:
                tensor = _folded(name, tensor, folded, config)
        yield name, tensor


def _folded(
    name: str, tensor: torch.Tensor, m: FoldedMultipliers, config: "ModelConfig"
) -> torch.Tensor:
    """``tensor`` with the multipliers that scale its projection folded in: an input's
    multiplier into the weight alone, an output's into the weight and the bias."""
    module, _, kind = name.rpartition(".")
    weight = kind == "weight"
    scale: float | torch.Tensor = 1.0
    if module.endswith(("self_attn.q_proj", "self_attn.v_proj")):
        scale = m.attention_in if weight else 1.0
    elif module.endswith("self_attn.k_proj"):
        scale = m.key * (m.attention_in if weight else 1.0)
    elif module.endswith("self_attn.o_proj"):
        scale = m.attention_out
    elif module.endswith("mamba.in_proj"):
        scale = _segment_scales(m, config) * (m.ssm_in if weight else 1.0)
        if weight:
            scale = scale[:, None]
    elif module.endswith("mamba.out_proj"):
        scale = m.ssm_out
    elif module.endswith("mlp.gate_proj"):
        scale = m.mlp_gate
    elif module.endswith("mlp.down_proj"):
        scale = m.mlp_down
    if isinstance(scale, float) and scale == 1.0:
        return tensor
    return tensor.float() * scale


def _segment_scales(m: FoldedMultipliers, config: "ModelConfig") -> torch.Tensor:
    """Each row of the Mamba-2's input projection's multiplier: z, x, B, C, dt."""
    mamba = config.mamba
    assert mamba is not None
    groups = mamba.n_groups * mamba.state_size
    sizes = (mamba.inner_size, mamba.inner_size, groups, groups, mamba.num_heads)
    return torch.cat([torch.full((n,), s) for n, s in zip(sizes, m.ssm_segments, strict=True)])


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    layers = fields["num_layers"]
    inner = keys.count("ssm.inner_size")
    heads = keys.count("ssm.time_step_rank")  # llama.cpp's name for the head count
    if inner % heads:
        raise keys.wrong("ssm.inner_size", inner, f"a multiple of the {heads} SSM heads")
    mamba = Mamba2Config(
        num_heads=heads,
        head_dim=inner // heads,
        state_size=keys.count("ssm.state_size"),
        n_groups=keys.count("ssm.group_count"),
        conv_kernel=keys.count("ssm.conv_kernel"),
        conv_bias=keys.has_tensor("blk.0.ssm_conv1d.bias"),
        proj_bias=keys.has_tensor("blk.0.ssm_in.bias"),
        out_bias=keys.has_tensor("blk.0.ssm_out.bias"),
        norm="after_gate" if keys.has_tensor("blk.0.ssm_norm.weight") else "none",
    )
    return {
        "layer_types": ("hybrid",) * layers,
        "mamba": mamba,
        "qkv_bias": keys.has_tensor("blk.0.attn_q.bias"),
        "o_bias": keys.has_tensor("blk.0.attn_output.bias"),
    }


_GGUF_NAMES = {
    **COMMON_GGUF_NAMES,
    **MAMBA2_GGUF_NAMES,
}


FAMILY = Family(
    name="falcon_h1",
    model_types=("falcon_h1",),
    gguf_archs=("falcon-h1",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    tensors=tensors,
    gguf_names=_GGUF_NAMES,
    state_layers=True,
    # Every multiplier away from 1, two groups of B and C, chunks of 8 so that a prompt's
    # prefill crosses several; the Mamba-2 without its norm, as the released models are
    # (tests/test_hybrid.py runs the norm's two placements).
    tiny={
        "num_hidden_layers": 3,
        "head_dim": 16,
        "mamba_d_ssm": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_n_groups": 2,
        "mamba_d_conv": 4,
        "mamba_chunk_size": 8,
        "mamba_rms_norm": False,
        "embedding_multiplier": 2.0,
        "lm_head_multiplier": 0.5,
        "attention_in_multiplier": 0.8,
        "attention_out_multiplier": 1.2,
        "key_multiplier": 0.9,
        "ssm_in_multiplier": 1.1,
        "ssm_out_multiplier": 0.7,
        "ssm_multipliers": [0.5, 1.5, 0.8, 1.2, 0.9],
        "mlp_multipliers": [1.3, 0.6],
    },
)
