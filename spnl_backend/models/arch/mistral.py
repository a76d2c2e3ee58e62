"""Mistral: Llama with a sliding window on every layer (its GGUFs are ``llama`` files),
and the language model of Mistral Small 3.1 and 3.2 (``mistral3``: its config nested in
a multimodal one, the vision model left unread; llama.cpp's ``mistral3`` GGUFs, whose q
and k it permutes as for Llama). Ministral 3's text model (``ministral3``) scales its
queries by position, which no layer here does: its config and its GGUF keys are refused."""

from ...errors import UnsupportedArchitectureError
from .family import Family, Fields, GgufKeys, HfKeys, biases

# What llama.cpp's converter writes for Ministral 3 alone (its queries' temperature).
_MINISTRAL3_KEYS = ("attention.temperature_scale", "rope.scaling.yarn_log_multiplier")


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return biases(keys)


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    for key in _MINISTRAL3_KEYS:
        if keys.get(key) is not None:
            raise UnsupportedArchitectureError(
                f"a mistral3 GGUF with {key!r} (Ministral 3: queries scaled by position) is "
                "not supported; supported: mistral3 files without it (Mistral Small 3.1/3.2)"
            )
    return {}


FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    wrapper_types=("mistral3",),
    gguf_archs=("mistral3",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_permuted_qk=True,
    tiny={"head_dim": 16, "sliding_window": 8},
)
