"""Jamba: Mamba-1 layers with an attention layer every ``attn_layer_period`` layers (from
``attn_layer_offset``), and experts in place of the MLP every ``expert_layer_period``
layers (from ``expert_layer_offset``). Its attention does not rotate (no positions but
the Mamba layers' order); its Mamba-1 RMS-norms the step's input, B and C; its router
takes the top-k of a softmax over the experts without renormalising them.

Its checkpoints name the FFN ``feed_forward`` (the router ``router``, the experts stacked
as transformers holds them, or one by one as the first releases did), the norm before it
``pre_ff_layernorm`` and the final norm ``final_layernorm``; they load under our names
(`tensors`).

In GGUF (llama.cpp's ``jamba``) a Mamba layer is one whose K/V head count is 0
(``attention.head_count_kv`` per layer), an expert layer one with a router
(``ffn_gate_inp``); the converter stores A as ``-exp(A_log)`` and the conv taps as
``[channels, kernel]``.
"""

from typing import TYPE_CHECKING

import torch

from ..components import Mamba1Config, MoeConfig
from .family import COMMON_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys, Tensors

if TYPE_CHECKING:
    from ..config import ModelConfig


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    layers = keys.count("num_hidden_layers")
    hidden = keys.count("hidden_size")
    fields: Fields = {
        "mamba1": Mamba1Config(
            inner_size=keys.count("mamba_expand") * hidden,
            state_size=keys.count("mamba_d_state"),
            dt_rank=keys.count("mamba_dt_rank"),
            conv_kernel=keys.count("mamba_d_conv"),
            conv_bias=keys.boolean("mamba_conv_bias"),
            proj_bias=keys.boolean("mamba_proj_bias"),
        ),
        "rope_layers": (False,) * layers,
        "layer_types": _periodic(keys, "attn_layer", layers, "full", "linear"),
    }
    experts = keys.count("num_experts")
    if experts > 1:  # (one expert: every layer's MLP is dense)
        sparse = _periodic(keys, "expert_layer", layers, True, False)
        fields["moe"] = MoeConfig(
            num_experts=experts,
            top_k=keys.count("num_experts_per_tok"),
            intermediate_size=keys.count("intermediate_size"),
            renormalize=False,
            sparse=tuple(sparse),
        )
    return fields


def _periodic(keys: HfKeys, prefix: str, layers: int, on, off) -> tuple:
    """``on`` for the layers at ``{prefix}_offset`` modulo ``{prefix}_period``, else ``off``."""
    period, offset = keys.count(f"{prefix}_period"), keys.get(f"{prefix}_offset")
    if not (isinstance(offset, int) and 0 <= offset < period):
        raise keys.wrong(f"{prefix}_offset", offset, f"an integer from 0 to {period - 1}")
    return tuple(on if i % period == offset else off for i in range(layers))


# The checkpoints' names → ours (``feed_forward`` already read as ``mlp``).
_RENAMED = {
    "model.final_layernorm.": "model.norm.",
    ".pre_ff_layernorm.": ".post_attention_layernorm.",
    ".feed_forward.": ".mlp.",
    ".mlp.router.": ".mlp.gate.",
}


def tensors(stored: Tensors, config: "ModelConfig") -> Tensors:
    """The checkpoints' names as ours (a dense layer stored as a single expert, as early
    checkpoints did, as the layer's MLP); llama.cpp's stored forms as the layer holds
    them."""
    for name, tensor in stored:
        for theirs, ours in _RENAMED.items():
            name = name.replace(theirs, ours)
        if ".mlp.experts.0." in name and not config.is_moe_layer(int(name.split(".")[2])):
            name = name.replace(".mlp.experts.0.", ".mlp.")
        if isinstance(tensor, torch.Tensor):
            if name.endswith(".ssm_a"):  # -exp(A_log), [channels, state] as the layer's
                name, tensor = name.removesuffix(".ssm_a") + ".A_log", torch.log(-tensor.float())
            elif name.endswith("mamba.conv1d.weight") and tensor.dim() == 2:
                tensor = tensor.unsqueeze(1)
        yield name, tensor


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    layers = fields["num_layers"]
    kv_heads = keys.get("attention.head_count_kv")  # per layer (checked by the loader)
    per_layer = getattr(kv_heads, "ndim", 0) == 1
    kinds = ["linear" if n == 0 else "full" for n in kv_heads] if per_layer else ["full"] * layers
    first = kinds.index("linear") if "linear" in kinds else 0
    return {
        "layer_types": tuple(kinds),
        "rope_layers": (False,) * layers,
        "mamba1": Mamba1Config(
            inner_size=keys.count("ssm.inner_size"),
            state_size=keys.count("ssm.state_size"),
            dt_rank=keys.count("ssm.time_step_rank"),
            conv_kernel=keys.count("ssm.conv_kernel"),
            conv_bias=keys.has_tensor(f"blk.{first}.ssm_conv1d.bias"),
            proj_bias=keys.has_tensor(f"blk.{first}.ssm_in.bias"),
            dt_norms=keys.has_tensor(f"blk.{first}.ssm_dt_norm.weight"),
        ),
    }


_GGUF_NAMES = {
    **COMMON_GGUF_NAMES,
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_x": "mamba.x_proj",
    "ssm_dt": "mamba.dt_proj",
    "ssm_a": "mamba.ssm_a",
    "ssm_d": "mamba.D",
    "ssm_out": "mamba.out_proj",
    "ssm_dt_norm": "mamba.dt_layernorm",
    "ssm_b_norm": "mamba.b_layernorm",
    "ssm_c_norm": "mamba.c_layernorm",
}


FAMILY = Family(
    name="jamba",
    model_types=("jamba",),
    gguf_archs=("jamba",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    tensors=tensors,
    gguf_names=_GGUF_NAMES,
    gguf_renormalizes_top_k=False,
    state_layers=True,
    # An attention layer among three Mamba-1 ones, experts every other layer; a
    # low-rank step of 4 and a state of 8 per channel.
    tiny={
        "num_hidden_layers": 4,
        "attn_layer_period": 4,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 48,
        "mamba_expand": 2,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_dt_rank": 4,
    },
)
