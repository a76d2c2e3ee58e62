"""Phi-3: fused qkv and gate-up projections, LongRoPE with partial rotation."""

from .family import COMMON_GGUF_NAMES, Family

_HALF = 16 // 4  # the tiny model's rotated pairs: half of its 16 head dims rotate

FAMILY = Family(
    name="phi3",
    model_types=("phi3",),
    gguf_archs=("phi3",),
    gguf_names={
        **COMMON_GGUF_NAMES,
        "attn_qkv": "self_attn.qkv_proj",
        "ffn_up": "mlp.gate_up_proj",
    },
    gguf_auto_tokenizer=True,
    tiny={
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0 + 0.1 * i for i in range(_HALF)],
            "long_factor": [2.0 + 0.1 * i for i in range(_HALF)],
            "original_max_position_embeddings": 256,
        },
    },
)
