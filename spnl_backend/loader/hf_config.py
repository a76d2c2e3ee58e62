"""A Hugging Face ``config.json`` (through transformers' config classes) → `ModelConfig`."""

from typing import Any

from transformers import PretrainedConfig

from ..errors import UnsupportedArchitectureError
from ..models.config import SUPPORTED_ARCHITECTURES, LayerType, ModelConfig, RopeConfig

_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3_text": "gemma3",
}
_ROPE_KINDS = ("default", "linear", "llama3", "yarn", "longrope")
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
}


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config (multimodal Gemma 3 wraps it in ``text_config``)."""
    return config.text_config if config.model_type == "gemma3" else config


def model_config_from_hf(config: PretrainedConfig) -> ModelConfig:
    config = text_config(config)
    architecture = _ARCHITECTURE_BY_MODEL_TYPE.get(config.model_type)
    if architecture is None:
        raise UnsupportedArchitectureError(
            f"model type {config.model_type!r} is not supported; supported architectures: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    fields = dict(
        architecture=architecture,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        rope=_rope(config, _rope_parameters(config, "full_attention"), head_dim),
        layer_types=_layer_types(config),
        sliding_window=getattr(config, "sliding_window", None),
        activation=_activation(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        bos_token_id=config.bos_token_id,
        eos_token_ids=token_ids(config.eos_token_id),
        dtype=_dtype_name(config),
    )
    fields.update(_ARCHITECTURE_FIELDS[architecture](config, head_dim))
    return ModelConfig(**fields)


def _llama(config: PretrainedConfig, head_dim: int) -> dict[str, Any]:
    bias = bool(getattr(config, "attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def _qwen2(config: PretrainedConfig, head_dim: int) -> dict[str, Any]:
    return {"qkv_bias": True, "o_bias": False}


def _qwen3(config: PretrainedConfig, head_dim: int) -> dict[str, Any]:
    return {**_llama(config, head_dim), "qk_norm": True}


def _phi3(config: PretrainedConfig, head_dim: int) -> dict[str, Any]:
    return {}


def _gemma3(config: PretrainedConfig, head_dim: int) -> dict[str, Any]:
    return {
        **_llama(config, head_dim),
        "qk_norm": True,
        "norm_offset": 1.0,
        "norm_in_float": True,
        "sandwich_norms": True,
        "embedding_multiplier": config.hidden_size**0.5,
        "attn_scale": config.query_pre_attn_scalar**-0.5,
        # Gemma 3 dropped Gemma 2's attention softcapping: transformers and llama.cpp ignore
        # the config field, and so do we.
        "final_softcap": config.final_logit_softcapping,
        "rope_local": _rope(config, _rope_parameters(config, "sliding_attention"), head_dim),
    }


_ARCHITECTURE_FIELDS = {
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "phi3": _phi3,
    "gemma3": _gemma3,
}


def _rope_parameters(config: PretrainedConfig, layer_type: str) -> dict[str, Any]:
    params = dict(config.rope_parameters or {})
    return dict(params[layer_type]) if layer_type in params else params


def _rope(config: PretrainedConfig, params: dict[str, Any], head_dim: int) -> RopeConfig:
    kind = params.get("rope_type", "default")
    if kind not in _ROPE_KINDS:
        raise UnsupportedArchitectureError(
            f"rope type {kind!r} of {config.model_type} is not supported; supported: "
            + ", ".join(_ROPE_KINDS)
        )
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    factor = params.get("factor")
    if factor is None and kind in ("yarn", "longrope"):
        factor = config.max_position_embeddings / original
    optional = {
        key: params[key]
        for key in (
            "low_freq_factor",
            "high_freq_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "truncate",
        )
        if params.get(key) is not None
    }
    for key in ("short_factor", "long_factor"):
        if params.get(key) is not None:
            optional[key] = tuple(params[key])
    return RopeConfig(
        theta=float(params.get("rope_theta", 10000.0)),
        rotary_dim=int(head_dim * partial),
        kind=kind,
        factor=float(factor or 1.0),
        original_max_position=original,
        **optional,
    )


def _layer_types(config: PretrainedConfig) -> tuple[LayerType, ...]:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return tuple("sliding" if kind == "sliding_attention" else "full" for kind in layer_types)
    kind: LayerType = "sliding" if getattr(config, "sliding_window", None) else "full"
    return (kind,) * config.num_hidden_layers


def _activation(config: PretrainedConfig) -> str:
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if name not in _ACTIVATIONS:
        raise UnsupportedArchitectureError(
            f"activation {name!r} of {config.model_type} is not supported; supported: "
            + ", ".join(_ACTIVATIONS)
        )
    return _ACTIVATIONS[name]


def token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """A config's token id field (an id, a list of ids, or none) as a tuple."""
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _dtype_name(config: PretrainedConfig) -> str | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")
