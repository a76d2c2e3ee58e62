"""Gemma 4 (the text model): Gemma 3's sandwich norms and 5:1 sliding/global layers, with
norms scaled by w (not 1 + w), q and k normed per head and the values normed without a
weight, attention unscaled (the norms set the size), global layers of their own head
size and KV heads (the larger ones: values from the k projection), a proportional rope
on them, per-layer embeddings (PLE), a learned scale per layer, and the last layers
reading earlier layers' K and V (`ModelConfig.num_kv_shared_layers`).

The mixture-of-experts variant (``enable_moe_block``) and bidirectional attention are
refused by name.
"""

from typing import Any

from ...errors import UnsupportedArchitectureError
from .family import SANDWICH_GGUF_NAMES, Family, Fields, HfKeys, biases

# The turns of the instruction-tuned models (a file normally carries its own template):
# a system turn where there is a system message, and an empty thought channel opening the
# model's turn (thinking off).
GEMMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] in ['system', 'developer'] %}"
    "{{ '<|turn>system\n' + messages[0]['content'] | trim + '<turn|>\n' }}"
    "{% set messages = messages[1:] %}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\n' + message['content'] | trim + '<turn|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n<|channel>thought\n<channel|>' }}"
    "{% endif %}"
)


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    _refuse_variants(keys)
    global_dim, global_kv = _global_shape(keys)
    ple = keys.get("hidden_size_per_layer_input") or 0
    return {
        **biases(keys),
        "norm_offset": 0.0,
        "norm_in_float": True,
        "norm_placement": "sandwich",
        "embedding_multiplier": keys.count("hidden_size") ** 0.5,
        "attn_scale": 1.0,
        "final_softcap": keys.positive("final_logit_softcapping", None),
        "qk_norm": True,
        "v_norm": True,
        "rope": keys.rope("full_attention", global_dim or head_dim),
        "rope_local": keys.rope("sliding_attention", head_dim),
        "global_head_dim": global_dim,
        "global_num_kv_heads": global_kv,
        "attn_k_eq_v": keys.boolean("attention_k_eq_v", False),
        "num_kv_shared_layers": keys.get("num_kv_shared_layers") or 0,
        "double_wide_shared_mlp": keys.boolean("use_double_wide_mlp", False),
        "per_layer_input_size": ple,
        "per_layer_vocab_size": keys.count("vocab_size_per_layer_input") if ple else None,
        "layer_output_scale": True,
    }


def _refuse_variants(keys: HfKeys) -> None:
    if keys.get("enable_moe_block"):
        raise UnsupportedArchitectureError(
            "Gemma 4 with mixture-of-experts blocks (enable_moe_block) is not supported yet"
        )
    if keys.get("use_bidirectional_attention") == "all":
        raise UnsupportedArchitectureError(
            "Gemma 4 with bidirectional attention (use_bidirectional_attention='all') is not "
            "a causal language model"
        )


def _global_shape(keys: HfKeys) -> tuple[int | None, int | None]:
    """The full-attention layers' head size and KV heads where they differ: transformers
    reads ``global_head_dim`` and ``num_global_key_value_heads`` into a per-layer config
    (older versions keep them as they are)."""
    layers = keys.get("per_layer_config")
    types = keys.get("layer_types") or []
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    if layers is None or not full:
        return keys.count("global_head_dim", None), _global_kv_heads(keys)
    shapes = {_layer_shape(layers, i) for i in full}
    if len(shapes) != 1:
        raise keys.wrong("per_layer_config", sorted(shapes), "one shape for every full layer")
    dim, kv_heads = shapes.pop()
    return (None if dim == keys.count("head_dim") else dim), kv_heads


def _global_kv_heads(keys: HfKeys) -> int | None:
    """Older configs: the global KV heads count only with values from the k projection."""
    if not keys.boolean("attention_k_eq_v", False):
        return None
    return keys.count("num_global_key_value_heads", None)


def _layer_shape(layers: Any, index: int) -> tuple[int, int]:
    layer = layers[index]
    return int(layer.head_dim), int(layer.num_key_value_heads)


FAMILY = Family(
    name="gemma4",
    model_types=("gemma4_text",),
    hf_fields=_hf,
    gguf_names=SANDWICH_GGUF_NAMES,
    chat_template=GEMMA4_CHAT_TEMPLATE,
    tiny={
        "tie_word_embeddings": True,
        "num_hidden_layers": 5,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True,
        "hidden_size_per_layer_input": 8,
        "sliding_window": 8,
        "layer_types": [
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
            },
        },
        "final_logit_softcapping": 30.0,
    },
)
