"""Ministral (``ministral``, the 8B of 2024): Mistral whose layers each say whether they
slide (``layer_types``). Its published checkpoints call themselves ``mistral``, and
llama.cpp's converter has no ``ministral`` class: GGUFs of it are ``llama`` files."""

from .family import Family, Fields, HfKeys, biases


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return biases(keys)


FAMILY = Family(
    name="ministral",
    model_types=("ministral",),
    hf_fields=_hf,
    tiny={  # layers 0 and 2 slide, layer 1 attends to every earlier token
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
)
