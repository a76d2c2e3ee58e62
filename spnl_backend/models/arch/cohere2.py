"""Cohere 2 (Command R7B): Cohere's parallel layers (`cohere`, its pair-wise rope handled
the same way) without q/k norms, three sliding-window layers to one global; only the
sliding layers rotate, the global ones attend without positions.

llama.cpp's ``cohere2`` files give the window but not the pattern (every fourth layer
global, its default) and may give the sliding layers' rope base
(``rope.freq_base_swa``).
"""

from ..components import RopeConfig
from .cohere import cohere_fields, cohere_gguf_fields, projection_rows, tensors
from .family import Family, Fields, GgufKeys, HfKeys

_SWA_PATTERN = 4


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    """(transformers' config fills ``layer_types`` from the sliding-window pattern.)"""
    kinds = keys.get("layer_types")
    if not kinds:
        raise keys.missing("layer_types")
    return {
        **cohere_fields(keys),
        "rope_layers": tuple(kind == "sliding_attention" for kind in kinds),
    }


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    layer_types = keys.swa_layer_types(_SWA_PATTERN, fields["num_layers"])
    rope = fields["rope"]
    return {
        **cohere_gguf_fields(keys),
        "layer_types": layer_types,
        "rope_layers": tuple(kind == "sliding" for kind in layer_types),
        "rope": RopeConfig(
            theta=keys.positive("rope.freq_base_swa", rope.theta), rotary_dim=rope.rotary_dim
        ),
    }


FAMILY = Family(
    name="cohere2",
    model_types=("cohere2",),
    gguf_archs=("cohere2",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    tensors=tensors,
    projection_rows=projection_rows,
    # Cohere 2's own pattern (llama.cpp's converter keeps none): layers 0-2 sliding over 8
    # tokens, layer 3 global and unrotated.
    tiny={
        "num_hidden_layers": 4,
        "tie_word_embeddings": True,
        "logit_scale": 0.5,
        "layer_norm_eps": 1e-5,
        "sliding_window": 8,
        "rotary_pct": 1.0,  # (not transformers' key; llama.cpp's converter reads it)
    },
)
