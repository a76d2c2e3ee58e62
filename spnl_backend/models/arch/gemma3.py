"""Gemma 3: sandwich norms scaled by (1 + w) in float32, q and k normed per head, a
scaled embedding, 5:1 sliding/global layers with their own rope base, GELU.

GGUF keeps less than llama.cpp needs and llama.cpp hard-codes the rest: the 5:1 pattern,
the local rope base, the 27B's query scale (hidden / heads); its converter stores the
norm weights as 1 + w.
"""

from ..components import RopeConfig
from .family import SANDWICH_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys, biases

# The turns Gemma's instruction-tuned models use (a file normally carries it); Gemma has
# no system role: a system message is prepended to the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' "
    "else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
_SWA_PATTERN = 6  # every sixth layer attends globally
_LOCAL_ROPE_BASE = 10000.0
_27B_LAYERS = 62  # the size whose query scale llama.cpp takes from hidden / heads


def gemma_fields(keys: HfKeys) -> Fields:
    """What Gemma 2 and 3 share in ``config.json``."""
    return {
        **biases(keys),
        "norm_offset": 1.0,
        "norm_in_float": True,
        "norm_placement": "sandwich",
        "embedding_multiplier": keys.count("hidden_size") ** 0.5,
        "attn_scale": keys.positive("query_pre_attn_scalar") ** -0.5,
        "final_softcap": keys.positive("final_logit_softcapping", None),
    }


def gemma_gguf_fields(
    keys: GgufKeys, fields: Fields, swa_pattern: int, large_layers: int
) -> Fields:
    """What Gemma 2 and 3 share in GGUF; ``large_layers``: the layer count of the size
    whose query scale llama.cpp takes from hidden / heads rather than the head size."""
    layers, hidden, heads = fields["num_layers"], fields["hidden_size"], fields["num_heads"]
    query_dim = hidden // heads if layers == large_layers else fields["head_dim"]
    if query_dim < 1:
        raise keys.wrong("embedding_length", hidden, f"at least the head count ({heads})")
    return dict(
        layer_types=keys.swa_layer_types(swa_pattern, layers),
        norm_offset=0.0,  # llama.cpp's converter stores Gemma's norm weights as 1 + w
        norm_in_float=True,
        norm_placement="sandwich",
        embedding_multiplier=hidden**0.5,
        attn_scale=query_dim**-0.5,
        final_softcap=keys.positive("final_logit_softcapping", None),
        activation="gelu_tanh",
    )


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    # Gemma 3 dropped Gemma 2's attention softcapping: transformers and llama.cpp ignore
    # the config field, and so do we.
    return {
        **gemma_fields(keys),
        "qk_norm": True,
        "rope_local": keys.rope("sliding_attention", head_dim),
    }


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    if not fields["sliding_window"]:  # (absent, or 0: llama.cpp's "none")
        key = "attention.sliding_window"
        found = keys.get(key)
        if found is None:
            raise keys.missing(key)
        raise keys.wrong(key, found, "a positive integer (the local layers' window)")
    local = RopeConfig(
        theta=keys.positive("rope.freq_base_swa", _LOCAL_ROPE_BASE),
        rotary_dim=fields["rope"].rotary_dim,
    )
    return {
        **gemma_gguf_fields(keys, fields, _SWA_PATTERN, _27B_LAYERS),
        "qk_norm": True,
        "rope_local": local,
    }


FAMILY = Family(
    name="gemma3",
    model_types=("gemma3_text",),
    wrapper_types=("gemma3",),
    gguf_archs=("gemma3",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names=SANDWICH_GGUF_NAMES,
    gguf_auto_tokenizer=True,
    chat_template=GEMMA_CHAT_TEMPLATE,
    tiny={
        "tie_word_embeddings": True,
        "head_dim": 16,
        "sliding_window": 8,
        "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
)
