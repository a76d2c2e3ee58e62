"""Gemma 4 (the text model): Gemma 3's sandwich norms and 5:1 sliding/global layers, with
norms scaled by w (not 1 + w), q and k normed per head and the values normed without a
weight, attention unscaled (the norms set the size), global layers of their own head
size and KV heads (the larger ones: values from the k projection), a proportional rope
on them, per-layer embeddings (PLE), a learned scale per layer, and the last layers
reading earlier layers' K and V (`ModelConfig.num_kv_shared_layers`).

The mixture-of-experts variant (``enable_moe_block``) and bidirectional attention are
refused by name.

GGUF (llama.cpp's ``gemma4``): ``attention.key_length`` is the global layers' head size,
``key_length_swa`` the sliding layers'; K/V heads and MLP widths may come one per layer
(a wider MLP on the shared layers); the rope bases are ``rope.freq_base`` (global) and
``freq_base_swa``. The converter stores the norms as they are (no 1 + w), names the
output scale ``layer_output_scale.weight``, and writes the proportional rope as a
full-width one whose still pairs have their frequencies divided by 1e30 (tensor
``rope_freqs``), turned back here into the rope transformers defines.
"""

import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...errors import UnsupportedArchitectureError
from ...log import get_logger
from ..components import RopeConfig
from .family import SANDWICH_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys, Tensors, biases

if TYPE_CHECKING:
    from ..config import LayerType, ModelConfig

log = get_logger()

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


# llama.cpp's names for the per-layer embeddings' tensors and the output scale.
_GGUF_NAMES = {
    **SANDWICH_GGUF_NAMES,
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "layer_output_scale": "layer_scalar",
}
_GGUF_TOP_NAMES = {
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
_SHARED_KV_WEIGHT = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")
_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope.freq_base_swa where a file has none
# A rope divisor this large leaves its pair still (llama.cpp's converter writes 1e30).
_STILL_DIVISOR = 1e20


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    if fields["moe"] is not None:
        raise UnsupportedArchitectureError(
            "Gemma 4 with mixture-of-experts blocks (ffn_gate_inp tensors) is not supported yet"
        )
    layers, hidden, kv_heads = fields["num_layers"], fields["hidden_size"], fields["num_kv_heads"]
    if keys.get("attention.sliding_window_pattern") is None:
        raise keys.missing("attention.sliding_window_pattern")
    types = keys.swa_layer_types(None, layers)
    shared = keys.integer("attention.shared_kv_layers", 0)  # its range: `ModelConfig`
    _check_shared_sources(keys, types, shared)
    global_dim = fields["head_dim"]  # attention.key_length: the global layers'
    local_dim = keys.count("attention.key_length_swa")
    if keys.count("attention.value_length_swa", local_dim) != local_dim:
        raise keys.wrong(
            "attention.value_length_swa",
            keys.get("attention.value_length_swa"),
            f"the sliding layers' key length ({local_dim})",
        )
    ple = keys.integer("embedding_length_per_layer_input", 0)
    return {
        "layer_types": types,
        "sliding_window": keys.count("attention.sliding_window"),
        "head_dim": local_dim,
        "global_head_dim": None if global_dim == local_dim else global_dim,
        "num_kv_heads": _kv_heads_of(keys, types, "sliding", kv_heads) or kv_heads,
        "global_num_kv_heads": _kv_heads_of(keys, types, "full", kv_heads),
        "attn_k_eq_v": _values_from_keys(keys, types, shared),
        "num_kv_shared_layers": shared,
        "double_wide_shared_mlp": _per_layer_widths(keys),
        "per_layer_input_size": ple,
        "per_layer_vocab_size": fields["vocab_size"] if ple else None,  # llama.cpp's rule
        "layer_output_scale": keys.has_tensor("blk.0.layer_output_scale.weight"),
        "rope": _global_rope(fields["rope"]),
        "rope_local": RopeConfig(
            theta=keys.positive("rope.freq_base_swa", _LOCAL_ROPE_BASE),
            rotary_dim=keys.count("rope.dimension_count_swa", fields["rope"].rotary_dim),
        ),
        "norm_offset": 0.0,
        "norm_in_float": True,
        "norm_placement": "sandwich",
        "embedding_multiplier": hidden**0.5,
        "attn_scale": 1.0,
        "final_softcap": keys.positive("final_logit_softcapping", None),
        "qk_norm": True,
        "v_norm": True,
        "activation": "gelu_tanh",
    }


def _check_shared_sources(keys: GgufKeys, types: Sequence["LayerType"], shared: int) -> None:
    """llama.cpp's shared layers read the two layers before them (a sliding layer the
    second last, a global one the last); transformers' (ours) the last earlier layer of
    their type. Where the two differ the file describes no one model."""
    first = len(types) - shared
    llama_cpp = {"sliding": first - 2, "full": first - 1}
    for kind in set(types[first:]) if shared else ():
        ours = max((i for i in range(first) if types[i] == kind), default=None)
        if ours != llama_cpp[kind]:
            raise keys.wrong(
                "attention.shared_kv_layers",
                shared,
                "a count leaving a sliding then a global layer last before the shared ones "
                "(llama.cpp's shared layers read those two)",
            )


def _kv_heads_of(keys: GgufKeys, types: Sequence["LayerType"], kind: str, one: int) -> int | None:
    """The K/V heads of the first layer of ``kind`` (None: the model has none): the
    file's count for it where it gives one per layer (the loader checks every layer's),
    else ``one``, the count of every layer."""
    if kind not in types:
        return None
    value = keys.get("attention.head_count_kv")
    return int(value[types.index(kind)]) if getattr(value, "ndim", 0) == 1 else one


def _values_from_keys(keys: GgufKeys, types: Sequence["LayerType"], shared: int) -> bool:
    """Whether the global layers take their values from the k projection: the first
    that stores K and V has no v projection."""
    stores = [i for i, kind in enumerate(types[: len(types) - shared]) if kind == "full"]
    return bool(stores) and not keys.has_tensor(f"blk.{stores[0]}.attn_v.weight")


def _per_layer_widths(keys: GgufKeys) -> bool:
    """Whether the MLP widths vary by layer (the converter's array where the shared
    layers' MLP is twice as wide; the loader checks every layer's)."""
    widths = keys.get("feed_forward_length")
    return getattr(widths, "ndim", 0) == 1 and len(set(widths.tolist())) > 1


def _global_rope(rope: RopeConfig) -> RopeConfig:
    """The global layers' rope: llama.cpp's full-width rope whose frequencies are divided
    by 1 for the pairs that turn and by 1e30 for the rest, as the proportional rope those
    divisors stand for (the still pairs at 0 Hz exactly); any other divisors as they are."""
    factors = rope.freq_factors
    if factors is None or rope.kind != "default":
        return rope
    turning = next((i for i, f in enumerate(factors) if f != 1.0), len(factors))
    if turning == 0 or not all(f >= _STILL_DIVISOR for f in factors[turning:]):
        return rope
    share = _turning_share(turning, rope.rotary_dim)
    return RopeConfig(
        theta=rope.theta,
        rotary_dim=rope.rotary_dim,
        kind="proportional",
        partial_rotary_factor=share,
    )


def _turning_share(pairs: int, rotary_dim: int) -> float:
    """The share of ``rotary_dim`` whose pairs turn, rounded so that the rope's
    ``int(share * rotary_dim // 2)`` gives back ``pairs``."""
    share = 2 * pairs / rotary_dim
    while int(share * rotary_dim // 2) < pairs:
        share = math.nextafter(share, math.inf)
    return share


def _tensors(stored: Tensors, config: "ModelConfig") -> Tensors:
    """The checkpoints' k and v projections and norms of the shared layers, which read
    earlier layers' K and V, left out (transformers skips them too; llama.cpp's converter
    keeps them and its graph leaves them unused); a GGUF's output scale, a weight there
    (``layer_output_scale.weight``), as the parameter itself."""
    first_shared = config.num_layers - config.num_kv_shared_layers
    skipped = 0
    for name, tensor in stored:
        unused = _SHARED_KV_WEIGHT.match(name)
        if unused and int(unused[1]) >= first_shared:
            skipped += 1
            continue
        if name.endswith(".layer_scalar.weight"):
            name = name.removesuffix(".weight")
        yield name, tensor
    if skipped:
        log.info("gemma4.shared_kv_weights_skipped", tensors=skipped, first_shared=first_shared)


FAMILY = Family(
    name="gemma4",
    model_types=("gemma4_text",),
    gguf_archs=("gemma4",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names=_GGUF_NAMES,
    gguf_top_names=_GGUF_TOP_NAMES,
    tensors=_tensors,
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
