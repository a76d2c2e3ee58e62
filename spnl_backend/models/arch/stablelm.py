"""StableLM (2): LayerNorms with a bias, partial rotary, a gated MLP without biases;
optionally q, k and v biases (``use_qkv_bias``), attention and the MLP side by side on
the one norm's output (``use_parallel_residual``: placement "shared") and q and k
LayerNormed per head, each head its own weight row and no bias (``qk_layernorm``).

The checkpoints hold a head's q or k norm as a module of its own
(``q_layernorm.norms.{h}``): they are stacked into one weight of a row per head as they
load, as llama.cpp's converter stores them. Its q and k keep their rows (NEOX rope).
"""

from typing import TYPE_CHECKING

import torch

from ...errors import ModelFileError
from .family import Family, Fields, GgufKeys, HfKeys, Tensors

if TYPE_CHECKING:
    from ..config import ModelConfig

_PER_HEAD = {".self_attn.q_layernorm.norms.": "q_norm", ".self_attn.k_layernorm.norms.": "k_norm"}


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return {
        **_fields(keys.positive("layer_norm_eps"), keys.boolean("use_parallel_residual", False)),
        "qkv_bias": keys.boolean("use_qkv_bias", False),
        "qk_norm": keys.boolean("qk_layernorm", False),
    }


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    return {
        # (llama.cpp's graph runs attention and MLP side by side where a layer has no
        # ffn_norm, whatever the file's use_parallel_residual says)
        **_fields(
            keys.positive("attention.layer_norm_epsilon"),
            not keys.has_tensor("blk.0.ffn_norm.weight"),
        ),
        "qkv_bias": keys.has_tensor("blk.0.attn_q.bias"),
        "qk_norm": keys.has_tensor("blk.0.attn_q_norm.weight"),
    }


def _fields(eps: float, parallel: bool) -> Fields:
    return {
        "norm_kind": "layer",
        "rms_norm_eps": eps,
        "norm_placement": "shared" if parallel else "pre",
    }


def _tensors(stored: Tensors, config: "ModelConfig") -> Tensors:
    """A checkpoint's per-head q and k norms stacked, a row per head (a GGUF's already are)."""
    heads: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in stored:
        marker = next((m for m in _PER_HEAD if m in name), None)
        if marker is None:
            yield name, tensor
            continue
        layer, _, rest = name.partition(marker)
        head, _, kind = rest.partition(".")
        if kind != "weight" or not head.isdigit():
            raise ModelFileError(f"tensor {name!r}: a per-head q/k norm holds a weight alone")
        norm = _PER_HEAD[marker]
        target = f"{layer}.self_attn.{norm}.weight"
        rows = heads.setdefault(target, {})
        rows[int(head)] = tensor
        count = config.num_heads if norm == "q_norm" else config.num_kv_heads
        if len(rows) == count:
            yield target, _stacked(target, heads.pop(target), count)
    if heads:
        raise ModelFileError(
            f"per-head q/k norms incomplete: {', '.join(sorted(heads))} (each needs a weight "
            "for every head)"
        )


def _stacked(name: str, rows: dict[int, torch.Tensor], count: int) -> torch.Tensor:
    if sorted(rows) != list(range(count)):
        raise ModelFileError(f"{name}: heads {sorted(rows)}; the config has {count}")
    return torch.stack([rows[h] for h in range(count)])


FAMILY = Family(
    name="stablelm",
    model_types=("stablelm",),
    gguf_archs=("stablelm",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    tensors=_tensors,
    tiny={
        "layer_norm_eps": 1e-5,
        "use_qkv_bias": True,
        "use_parallel_residual": True,
        "qk_layernorm": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    },
)
