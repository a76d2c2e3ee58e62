"""Mistral: Llama with a sliding window on every layer (its GGUFs are ``llama`` files)."""

from .family import Family, Fields, HfKeys, biases


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return biases(keys)


FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    hf_fields=_hf,
    tiny={"head_dim": 16, "sliding_window": 8},
)
