"""Qwen3.5 (dense): three Gated DeltaNet layers to one of full attention; the attention
layers gate their output by a sigmoid from the q projection, norm q and k per head and
rotate a quarter of the head (Qwen's multimodal rope, whose three position rows are one
for text); every norm scales by (1 + w) in float32."""

from ..components import DeltaNetConfig
from .family import Family, Fields, HfKeys, biases


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    delta = DeltaNetConfig(
        num_k_heads=keys.count("linear_num_key_heads"),
        num_v_heads=keys.count("linear_num_value_heads"),
        head_k_dim=keys.count("linear_key_head_dim"),
        head_v_dim=keys.count("linear_value_head_dim"),
        conv_kernel=keys.count("linear_conv_kernel_dim"),
    )
    return {
        **biases(keys),
        "qk_norm": True,
        "norm_offset": 1.0,
        "norm_in_float": True,
        "attn_output_gate": True,
        "delta_net": delta,
    }


FAMILY = Family(
    name="qwen3_5",
    model_types=("qwen3_5_text",),
    hf_fields=_hf,
    state_layers=True,
    tiny={
        "num_hidden_layers": 4,
        "head_dim": 16,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    },
)
