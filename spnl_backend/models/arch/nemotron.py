"""Nemotron (Minitron): Llama's layout with LayerNorm1p (a LayerNorm with a bias whose
weight applies as ``1 + w``), a plain ReLU² MLP and partial rotary.

llama.cpp's converter stores each norm's weight with the 1 already added, for its graph's
plain LayerNorm: a GGUF's norms are read as such (kind "layer"). Its q and k keep their
rows (NEOX rope).
"""

from .family import Family, Fields, GgufKeys, HfKeys


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    bias = bool(keys.get("attention_bias", False))
    return {
        "norm_kind": "layer_1p",
        "rms_norm_eps": keys.positive("norm_eps"),
        "mlp_gated": False,
        "mlp_bias": bool(keys.get("mlp_bias", False)),
        "qkv_bias": bias,
        "o_bias": bias,
    }


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    # (llama.cpp's graph for nemotron is ReLU squared, whatever the file says)
    return {
        "norm_kind": "layer",
        "rms_norm_eps": keys.positive("attention.layer_norm_epsilon"),
        "mlp_gated": False,
        "mlp_bias": keys.has_tensor("blk.0.ffn_up.bias"),
        "qkv_bias": keys.has_tensor("blk.0.attn_q.bias"),
        "o_bias": keys.has_tensor("blk.0.attn_output.bias"),
        "activation": "relu2",
    }


FAMILY = Family(
    name="nemotron",
    model_types=("nemotron",),
    gguf_archs=("nemotron",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    tiny={
        "hidden_act": "relu2",
        "norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    },
)
