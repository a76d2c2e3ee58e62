"""GPT-NeoX (Pythia): attention and a plain GELU MLP side by side on the layer's input,
each through a LayerNorm of its own (`models.layers.NormPlacement` "parallel"; in
sequence where ``use_parallel_residual`` is false), partial rotary, biased projections.

Its checkpoints name the model ``gpt_neox.`` and the head ``embed_out``, and fuse q, k and
v into one projection whose rows run head by head (each head's q, k, v): they are put in
q, k, v order as they load, as llama.cpp's converter stores them. A GGUF names no
activation: llama.cpp's graph runs the tanh GELU, the checkpoints (``hidden_act``,
"gelu" for every Pythia) the exact one, which is what runs here.
"""

from typing import TYPE_CHECKING

import torch

from ...errors import ModelFileError
from .family import COMMON_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys, Tensors, layer_norm_fields

if TYPE_CHECKING:
    from ..config import ModelConfig

_FUSED = ".attention.query_key_value."
_MODULES = {
    "model.embed_in.": "model.embed_tokens.",
    "model.final_layer_norm.": "model.norm.",
    ".attention.dense.": ".self_attn.o_proj.",
    ".mlp.dense_h_to_4h.": ".mlp.up_proj.",
    ".mlp.dense_4h_to_h.": ".mlp.down_proj.",
}


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    bias = keys.boolean("attention_bias", True)
    return {
        **_fields(keys.positive("layer_norm_eps"), keys.boolean("use_parallel_residual", True)),
        "qkv_bias": bias,
        "o_bias": bias,
    }


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    return {
        **_fields(
            keys.positive("attention.layer_norm_epsilon"), keys.boolean("use_parallel_residual")
        ),
        "qkv_bias": keys.has_tensor("blk.0.attn_qkv.bias"),
        "o_bias": keys.has_tensor("blk.0.attn_output.bias"),
        "activation": "gelu",
    }


def _fields(eps: float, parallel: bool) -> Fields:
    return {**layer_norm_fields(eps), "norm_placement": "parallel" if parallel else "pre"}


def _tensors(stored: Tensors, config: "ModelConfig") -> Tensors:
    """A checkpoint's names as ours, its fused q/k/v in q, k, v order (a GGUF's are already
    ours, and in that order)."""
    for name, tensor in stored:
        if _FUSED in name:
            yield name.replace(_FUSED, ".self_attn.qkv_proj."), _by_projection(name, tensor, config)
            continue
        for old, new in _MODULES.items():
            if old in name:
                name = name.replace(old, new)
                break
        yield name, tensor


def _by_projection(name: str, tensor: torch.Tensor, config: "ModelConfig") -> torch.Tensor:
    """Rows ``[heads, (q, k, v), head_dim]`` → ``[(q, k, v), heads, head_dim]``."""
    heads, rows = config.num_heads, 3 * config.num_heads * config.head_dim
    if tensor.shape[0] != rows:
        raise ModelFileError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}; the config's {heads} heads of "
            f"{config.head_dim} make {rows} rows (q, k and v of each head)"
        )
    grouped = tensor.reshape(heads, 3, config.head_dim, *tensor.shape[1:])
    return grouped.transpose(0, 1).reshape(tensor.shape)


FAMILY = Family(
    name="gpt_neox",
    model_types=("gpt_neox",),
    gguf_archs=("gptneox",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names={**COMMON_GGUF_NAMES, "attn_qkv": "self_attn.qkv_proj"},
    tensors=_tensors,
    hf_prefixes={"gpt_neox.": "model.", "embed_out.": "lm_head."},
    hf_unused=(".attention.bias", ".attention.masked_bias", ".attention.rotary_emb.inv_freq"),
    tiny={
        "num_key_value_heads": None,  # (GPT-NeoX has as many K/V heads as query heads)
        "hidden_act": "gelu",
        "use_parallel_residual": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    },
)
