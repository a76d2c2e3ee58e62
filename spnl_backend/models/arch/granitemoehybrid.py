"""Granite 4.0-H: Mamba-2 layers with a few attention layers between them, each layer's
FFN a shared expert beside routed ones (or the shared MLP alone, where the model has no
experts), and Granite's multipliers (`granite`: the embeddings, the layers' outputs, the
attention scores and the logits scaled). Its attention layers rotate only where
``position_embedding_type`` is "rope" (Granite 4.0-H's are "nope").

Its checkpoints keep the routed experts stacked under ``block_sparse_moe`` (the loader
reads it as our ``mlp``) as ``input_linear`` and ``output_linear``, the router as
``router.layer``, and the shared MLP's gate and up rows fused; they load under our names
(`tensors`).

In GGUF (llama.cpp's ``granitehybrid``) a Mamba-2 layer is one whose K/V head count is 0
(``attention.head_count_kv`` per layer); the multipliers are named as in Granite's
files; rope is on where ``rope.scaling.finetuned`` says (llama.cpp's switch for it, true
where absent). The
converter stores the conv taps as ``[channels, kernel]``, A as ``-exp(A_log)`` and D as
a column, the norm's weight per group, and permutes q and k rows as for Llama.
"""

import dataclasses
from typing import TYPE_CHECKING

import torch

from ..components import Mamba2Config, MoeConfig
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
from .granite import gguf_multipliers, multipliers

if TYPE_CHECKING:
    from ..config import ModelConfig


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    layers = keys.count("num_hidden_layers")
    rotates = keys.get("position_embedding_type") == "rope"
    return {
        **biases(keys),
        **_ffn(keys),
        "mamba": _mamba(keys),
        "rope_layers": (rotates,) * layers,
        **multipliers(keys),
    }


def _mamba(keys: HfKeys) -> Mamba2Config:
    return Mamba2Config(
        num_heads=keys.count("mamba_n_heads"),
        head_dim=keys.count("mamba_d_head"),
        state_size=keys.count("mamba_d_state"),
        n_groups=keys.count("mamba_n_groups"),
        conv_kernel=keys.count("mamba_d_conv"),
        chunk_size=keys.count("mamba_chunk_size"),
        conv_bias=keys.boolean("mamba_conv_bias"),
        proj_bias=keys.boolean("mamba_proj_bias"),
        time_step_limit=time_step_limit(keys),
    )


def _ffn(keys: HfKeys) -> Fields:
    """The shared MLP beside ``num_local_experts`` routed experts of ``intermediate_size``
    (softmax over the top-k router logits: renormalised top-k); without experts, the
    shared MLP is the layer's dense MLP."""
    shared = keys.count("shared_intermediate_size")
    experts = keys.get("num_local_experts") or 0
    if not experts:
        return {"intermediate_size": shared}
    moe = MoeConfig(
        num_experts=keys.count("num_local_experts"),
        top_k=keys.count("num_experts_per_tok"),
        intermediate_size=keys.count("intermediate_size"),
        renormalize=True,
    )
    return {"moe": dataclasses.replace(moe, shared_intermediate_size=shared)}


# The checkpoints' names (``block_sparse_moe`` already read as ``mlp``) → ours: the routed
# experts stacked [E, 2I, H] (gate rows first) and [E, H, I], the shared MLP's gate and up
# rows fused.
_TENSOR_NAMES = {
    ".mlp.input_linear.weight": ".mlp.experts.gate_up_proj",
    ".mlp.output_linear.weight": ".mlp.experts.down_proj",
    ".mlp.router.layer.weight": ".mlp.gate.weight",
    ".shared_mlp.input_linear.weight": ".shared_mlp.gate_up_proj.weight",
    ".shared_mlp.output_linear.weight": ".shared_mlp.down_proj.weight",
}


def tensors(stored: Tensors, config: "ModelConfig") -> Tensors:
    """The checkpoints' names as ours (without experts the shared MLP is the layer's MLP),
    and llama.cpp's stored forms as the layer holds them."""
    for name, tensor in stored:
        for theirs, ours in _TENSOR_NAMES.items():
            if name.endswith(theirs):
                name = name.removesuffix(theirs) + ours
                break
        if config.moe is None:
            name = name.replace(".shared_mlp.", ".mlp.")
        if isinstance(tensor, torch.Tensor):
            name, tensor = as_state_layer_holds(name, tensor)
            if name.endswith(("mamba.D", "mamba.norm.weight")):  # a column; a row per group
                tensor = tensor.flatten()
        yield name, tensor


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    layers = fields["num_layers"]
    kv_heads = keys.get("attention.head_count_kv")  # per layer (checked by the loader)
    per_layer = getattr(kv_heads, "ndim", 0) == 1
    kinds = ["linear" if n == 0 else "full" for n in kv_heads] if per_layer else ["full"] * layers
    inner = keys.count("ssm.inner_size")
    heads = keys.count("ssm.time_step_rank")  # llama.cpp's name for the head count
    if inner % heads:
        raise keys.wrong("ssm.inner_size", inner, f"a multiple of the {heads} SSM heads")
    first = kinds.index("linear") if "linear" in kinds else 0
    mamba = Mamba2Config(
        num_heads=heads,
        head_dim=inner // heads,
        state_size=keys.count("ssm.state_size"),
        n_groups=keys.count("ssm.group_count"),
        conv_kernel=keys.count("ssm.conv_kernel"),
        conv_bias=keys.has_tensor(f"blk.{first}.ssm_conv1d.bias"),
        proj_bias=keys.has_tensor(f"blk.{first}.ssm_in.bias"),
    )
    out: Fields = {
        "layer_types": tuple(kinds),
        "mamba": mamba,
        "rope_layers": (bool(keys.boolean("rope.scaling.finetuned", True)),) * layers,
        **gguf_multipliers(keys),
    }
    shared = keys.count("expert_shared_feed_forward_length", None)
    if fields["moe"] is not None and shared:
        out["moe"] = dataclasses.replace(fields["moe"], shared_intermediate_size=shared)
    return out


_GGUF_NAMES = {
    **COMMON_GGUF_NAMES,
    **MAMBA2_GGUF_NAMES,
    "ffn_gate_shexp": "shared_mlp.gate_proj",
    "ffn_up_shexp": "shared_mlp.up_proj",
    "ffn_down_shexp": "shared_mlp.down_proj",
}


FAMILY = Family(
    name="granitemoehybrid",
    model_types=("granitemoehybrid",),
    gguf_archs=("granitehybrid",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    tensors=tensors,
    gguf_names=_GGUF_NAMES,
    gguf_permuted_qk=True,
    state_layers=True,
    # One attention layer among three Mamba-2 ones (by the names real files use), two
    # groups of B and C, chunks of 8 so that a prompt's prefill crosses several.
    tiny={
        "num_hidden_layers": 4,
        "layer_types": ["mamba", "attention", "mamba", "mamba"],
        "intermediate_size": 32,
        "shared_intermediate_size": 48,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "mamba_n_heads": 4,
        "mamba_d_head": 32,
        "mamba_d_state": 16,
        "mamba_n_groups": 2,
        "mamba_chunk_size": 8,
        "position_embedding_type": "nope",
        "embedding_multiplier": 4.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.125,
        "logits_scaling": 2.0,
    },
)
