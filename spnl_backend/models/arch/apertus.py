"""Apertus: Llama with q and k normed per head and a plain MLP (no gate) whose
activation is xIELU, four scalars learned per layer (`models.mlp.XIELU`); its norms are
named ``attention_layernorm`` and ``feedforward_layernorm``.

llama.cpp's converter keeps q and k rows as they are (NEOX rope) and writes the scalars
as per-layer metadata (``xielu.alpha_p``, ``alpha_n``, ``beta``, ``eps``, without an
architecture prefix), read back here as the checkpoint's tensors."""

import numpy as np
import torch

from .family import Family, Fields, GgufKeys, HfKeys, Tensors, biases

_SCALARS = ("alpha_p", "alpha_n", "beta", "eps")
_NORMS = {
    ".attention_layernorm.": ".input_layernorm.",
    ".feedforward_layernorm.": ".post_attention_layernorm.",
}
_FIELDS: Fields = {"qk_norm": True, "mlp_gated": False}


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return {**biases(keys), **_FIELDS}


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    layers = fields["num_layers"]
    columns = [_per_layer(keys, f"xielu.{name}", layers) for name in _SCALARS]
    return {
        **_FIELDS,
        "activation": "xielu",
        "activation_scalars": tuple(zip(*columns, strict=True)),
    }


def _per_layer(keys: GgufKeys, key: str, layers: int) -> tuple[float, ...]:
    """One value per layer (llama.cpp also takes one value for every layer)."""
    value = keys.get(key)
    if value is None:
        raise keys.missing(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),) * layers
    if (
        isinstance(value, np.ndarray)
        and value.dtype.kind == "f"
        and value.shape == (layers,)
        and np.isfinite(value).all()
    ):
        return tuple(float(v) for v in value)
    raise keys.wrong(key, value, f"a finite number, or {layers} of them (one per layer)")


def _tensors(tensors: Tensors, config) -> Tensors:
    """The checkpoint's norms under the layer's names; a GGUF's scalars as the
    checkpoint's tensors (``mlp.act_fn.*``)."""
    for name, tensor in tensors:
        for old, new in _NORMS.items():
            name = name.replace(old, new)
        yield name, tensor
    for i, scalars in enumerate(config.activation_scalars):
        for name, value in zip(_SCALARS, scalars, strict=True):
            shape = (1,) if name.startswith("alpha") else ()
            yield f"model.layers.{i}.mlp.act_fn.{name}", torch.full(shape, value)


FAMILY = Family(
    name="apertus",
    model_types=("apertus",),
    gguf_archs=("apertus",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    tensors=_tensors,
    tiny={
        "head_dim": 16,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
)
