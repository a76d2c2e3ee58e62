"""A Hugging Face ``config.json`` (through transformers' config classes) → `ModelConfig`.

Every value is checked before it is used: the raw file first (transformers' config
classes divide by the head count, build per-layer lists and fill in defaults for missing
sizes), then what transformers made of it. A problem is a ModelFileError naming the
file, the key, what it holds and what was expected.
"""

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ModelFileError, UnsupportedArchitectureError
from ..models.arch import Family, family_names, family_of_model_type, family_of_wrapper
from ..models.config import (
    ConfigValueError,
    LayerType,
    ModelConfig,
    RopeConfig,
    check_config_shapes,
)
from .resolve import unreadable
from .typed import MISSING, TypedReader, is_int
from .weights import layer_indices, safetensors_files, safetensors_shapes

if TYPE_CHECKING:  # transformers takes half a second to import: text models only
    from transformers import PretrainedConfig

_ROPE_KINDS = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",  # (Phi-2's: the tanh approximation, written out)
    "relu2": "relu2",
    "xielu": "xielu",  # (with learned scalars: a plain MLP's alone, `ModelConfig`)
}
_LAYER_TYPES: dict[str, LayerType] = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "linear",
    "hybrid": "hybrid",  # Falcon-H1: attention and a Mamba-2 in every layer
    # the older names Granite 4.0-H's files use (transformers reads them as the above)
    "attention": "full",
    "mamba": "linear",
}
_REQUIRED_COUNTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
# (intermediate_size: a model whose every layer has experts has no dense MLP to size)
_OPTIONAL_COUNTS = (
    "intermediate_size",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
_ROPE_OPTIONAL = (
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
)
_ROPE_NUMBERS = (
    "rope_theta",
    "factor",
    "partial_rotary_factor",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
)
# config.json keys of the `ModelConfig` fields that are not named alike.
_FIELD_KEYS = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "final_softcap": "final_logit_softcapping",
    "attn_softcap": "attn_logit_softcapping",
    "num_k_heads": "linear_num_key_heads",
    "num_v_heads": "linear_num_value_heads",
    "head_k_dim": "linear_key_head_dim",
    "head_v_dim": "linear_value_head_dim",
    "conv_kernel": "linear_conv_kernel_dim",
    "attn_scale": "query_pre_attn_scalar",
    "eos_token_ids": "eos_token_id",
    # Falcon-H1's multipliers (`FoldedMultipliers`)
    "attention_in": "attention_in_multiplier",
    "attention_out": "attention_out_multiplier",
    "key": "key_multiplier",
    "ssm_in": "ssm_in_multiplier",
    "ssm_out": "ssm_out_multiplier",
    "ssm_segments": "ssm_multipliers",
    "mlp_gate": "mlp_multipliers",
    "mlp_down": "mlp_multipliers",
}
_ROPE_FIELD_KEYS = {
    "theta": "rope_theta",
    "rotary_dim": "partial_rotary_factor (times the head size)",
    "original_max_position": "original_max_position_embeddings",
}


def read_text_config(model_dir: Path) -> tuple[ModelConfig, tuple[int, ...]]:
    """The model directory's ``config.json`` as a `ModelConfig`, and its end-of-sequence
    ids (config.json's and generation_config.json's together), every value checked."""
    path = model_dir / "config.json"
    shapes = safetensors_shapes(safetensors_files(model_dir))
    check_raw_config(json_object(path), path, layer_indices(shapes))
    config = model_config_from_hf(_transformers_config(model_dir, path), path)
    check_config_shapes(config, shapes, model_dir)
    generation = model_dir / "generation_config.json"
    eos = set(config.eos_token_ids)
    if generation.exists():
        eos |= set(generation_eos(model_dir, generation, config.vocab_size))
    return config, tuple(sorted(eos))


def json_object(path: Path) -> dict[str, Any]:
    try:
        content = json.loads(path.read_bytes())
    except OSError as exc:
        raise unreadable(path, exc) from None
    except (ValueError, RecursionError) as exc:  # JSON and UTF-8 errors; absurd nesting
        raise ModelFileError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(content, dict):
        raise ModelFileError(f"{path}: holds a JSON {type(content).__name__}; expected an object")
    return content


def check_raw_config(raw: dict[str, Any], path: Path, layers: set[int] | None = None) -> None:
    """The file as written, before transformers reads it: the architecture, the sizes it
    needs (present, positive integers), and the layer count against the weights."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise _wrong(path, "model_type", model_type, "a string naming the architecture")
    section, prefix = raw, ""
    wrapped = family_of_wrapper(model_type)
    if wrapped is not None:  # multimodal: the language model's config is nested
        section, prefix = raw.get("text_config", {}), "text_config."
        if not isinstance(section, dict):
            raise _wrong(path, "text_config", section, "an object")
        model_type = section.get("model_type", wrapped.model_types[0])
    family = _check_architecture(model_type, path)
    keys = _Keys(section, path, prefix)
    for key in _REQUIRED_COUNTS:
        keys.count(key)
    for key in _OPTIONAL_COUNTS:
        keys.count(key, None)
    keys.positive("rms_norm_eps", None)
    _check_raw_rope(keys)
    hidden, heads = section["hidden_size"], section["num_attention_heads"]
    if section.get("head_dim") is None and hidden % heads:
        raise ModelFileError(
            f"{path}: key {prefix + 'hidden_size'!r} ({hidden}) is not a multiple of key "
            f"{prefix + 'num_attention_heads'!r} ({heads}), and {prefix + 'head_dim'!r} is "
            "not given: the head size is unknown"
        )
    count = section["num_hidden_layers"]
    if family.extra_layers_key is not None and layers is not None:
        # layers kept after the decoder's (DeepSeek-V3's multi-token prediction), unread
        extra = keys.integer(family.extra_layers_key, 0) or 0
        if extra > 0 and _is_range(layers, count + extra):
            count += extra
    if layers is not None and not _is_range(layers, count):
        held = f"layers 0..{max(layers)}" if layers else "no model.layers.* tensors"
        raise ModelFileError(
            f"{path}: key {prefix + 'num_hidden_layers'!r} is {count:,}, but the weights hold "
            f"tensors for {len(layers):,} layers ({held})"
        )
    _layer_types(keys)


def _check_raw_rope(keys: "_Keys") -> None:
    """The rope numbers as written, at the top level and in ``rope_parameters`` or
    ``rope_scaling`` (per layer type too): transformers divides by some as it reads."""
    keys.positive("rope_theta", None)
    keys.positive("partial_rotary_factor", None)
    keys.count("original_max_position_embeddings", None)
    for section in _rope_sections(keys):
        for key in _ROPE_NUMBERS:
            section.positive(key, None)
        section.count("original_max_position_embeddings", None)


def _rope_sections(keys: "_Keys") -> list["_Keys"]:
    sections = []
    for name in ("rope_parameters", "rope_scaling"):
        params = keys.get(name)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise keys.wrong(name, params, "an object")
        sections.append(keys.nested(name, params))
        for layer_type in _LAYER_TYPES:
            if layer_type in params:
                if not isinstance(params[layer_type], dict):
                    raise keys.wrong(f"{name}.{layer_type}", params[layer_type], "an object")
                sections.append(keys.nested(f"{name}.{layer_type}", params[layer_type]))
    return sections


def _transformers_config(model_dir: Path, path: Path) -> "PretrainedConfig":
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # its config classes raise whatever their own checks raise
        raise ModelFileError(
            f"{path}: transformers cannot read it: {type(exc).__name__}: {exc}"
        ) from exc


def generation_eos(model_dir: Path, path: Path, vocab: int) -> tuple[int, ...]:
    from transformers import GenerationConfig

    try:
        value = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except Exception as exc:  # as above, for generation_config.json
        raise ModelFileError(
            f"{path}: transformers cannot read it: {type(exc).__name__}: {exc}"
        ) from exc
    ids = token_ids(value)
    for token in ids:
        if not (is_int(token) and 0 <= token < vocab):
            raise _wrong(path, "eos_token_id", value, f"token ids from 0 to {vocab - 1:,}")
    return ids


def text_config(config: "PretrainedConfig") -> "PretrainedConfig":
    """The language model's config (a multimodal model's wraps it in ``text_config``:
    `Family.wrapper_types`)."""
    return config.text_config if family_of_wrapper(config.model_type) else config


def model_config_from_hf(
    config: "PretrainedConfig", source: Path = Path("config.json")
) -> ModelConfig:
    """``config`` as a `ModelConfig`; a value of the wrong type or out of range is a
    ModelFileError naming ``source`` and the key."""
    prefix = "text_config." if family_of_wrapper(config.model_type) else ""
    quantization = getattr(config, "quantization_config", None)  # the whole model's
    config = text_config(config)
    family = _check_architecture(config.model_type, source)
    if getattr(config, "is_heterogeneous", False):
        # Layers of several shapes (Gemma 4): the top-level values are the common layers',
        # the family reads the others from ``per_layer_config``.
        config.allow_global_per_layer_attribute_access = True
    keys = _Keys(config, source, prefix)
    head_dim = _head_dim(keys)
    fields = dict(
        architecture=family.name,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=keys.count("intermediate_size", None) or 0,  # 0: none
        num_layers=keys.count("num_hidden_layers"),
        num_heads=config.num_attention_heads,
        num_kv_heads=keys.count("num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        # (a family whose norms are LayerNorms reads its own key: `Family.hf_fields`)
        rms_norm_eps=keys.positive("rms_norm_eps", None),
        max_position_embeddings=config.max_position_embeddings,
        rope=_rope(keys, "full_attention", head_dim, family.ntk_alpha_rope),
        layer_types=_layer_types(keys),
        sliding_window=getattr(config, "sliding_window", None),
        activation=_activation(keys),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        bos_token_id=config.bos_token_id,
        eos_token_ids=token_ids(config.eos_token_id),
        dtype=_dtype_name(keys),
    )
    fields["quantization"] = _quant_method(quantization, family, source)
    fields.update(family.hf_fields(keys, head_dim))
    if fields["rms_norm_eps"] is None:
        raise keys.missing("rms_norm_eps")
    moe = fields.get("moe")
    if not fields["intermediate_size"] and not (moe is not None and all(moe.sparse)):
        raise keys.missing("intermediate_size")  # (only a model of experts alone has none)
    try:
        return ModelConfig(**fields)
    except ConfigValueError as exc:
        raise keys.invalid(exc) from None


def _check_architecture(model_type: Any, path: Path) -> Family:
    family = family_of_model_type(model_type)
    if family is None:
        raise UnsupportedArchitectureError(
            f"{path}: model type {model_type!r} is not supported; supported architectures: "
            + ", ".join(family_names())
        )
    return family


def _quant_method(section: Any, family: Family, path: Path) -> str | None:
    """``quantization_config.quant_method``, where the family reads checkpoints quantized
    that way (`Family.quant_methods`); any other is refused, naming those it reads."""
    if section is None:
        return None
    if not isinstance(section, dict):
        section = getattr(section, "to_dict", lambda: section)()  # a transformers object
    method = section.get("quant_method") if isinstance(section, dict) else None
    if not isinstance(method, str):
        raise _wrong(path, "quantization_config", section, "an object naming its quant_method")
    if method not in family.quant_methods:
        supported = ", ".join(map(repr, family.quant_methods)) or "none (float weights only)"
        raise UnsupportedArchitectureError(
            f"{path}: quantization_config.quant_method {method!r} is not supported for "
            f"{family.name} checkpoints; supported: {supported}"
        )
    return method


def _head_dim(keys: "_Keys") -> int:
    heads = keys.count("num_attention_heads")
    return keys.count("head_dim", None) or keys.count("hidden_size") // heads


def _rope(keys: "_Keys", layer_type: str, head_dim: int, ntk_alpha: bool = False) -> RopeConfig:
    """``ntk_alpha``: the family reads a "dynamic" rope with an ``alpha`` as transformers'
    HunYuan does (`Family.ntk_alpha_rope`)."""
    params = keys.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise keys.wrong("rope_parameters", params, "an object")
    name = "rope_parameters"
    if layer_type in params:
        params, name = params[layer_type], f"rope_parameters.{layer_type}"
    if not isinstance(params, dict):
        raise keys.wrong(name, params, "an object")
    rope = keys.nested(name, params)
    kind = rope.string("rope_type", "default")
    if kind == "dynamic" and ntk_alpha and rope.get("alpha") is not None:
        # NTK-alpha: fixed frequencies from a base raised by alpha^(d / (d - 2)), over the
        # whole head (transformers' HunYuan; not the length-dependent "dynamic" scaling)
        alpha = rope.positive("alpha")
        theta = rope.positive("rope_theta", 10000.0) * alpha ** (head_dim / (head_dim - 2))
        return RopeConfig(theta=theta, rotary_dim=head_dim)
    if kind not in _ROPE_KINDS:
        raise UnsupportedArchitectureError(
            f"{keys.path}: rope type {kind!r} is not supported; supported: "
            + ", ".join(_ROPE_KINDS)
        )
    partial = rope.positive("partial_rotary_factor", keys.positive("partial_rotary_factor", 1.0))
    original = rope.count("original_max_position_embeddings", None) or keys.count(
        "original_max_position_embeddings", None
    )
    factor = rope.positive("factor", None)
    if factor is None and kind in ("yarn", "longrope"):
        if original is None:
            raise keys.missing(f"{name}.original_max_position_embeddings")
        factor = keys.count("max_position_embeddings") / original
    optional: dict[str, Any] = {
        key: rope.positive(key) for key in _ROPE_OPTIONAL if rope.get(key) is not None
    }
    if rope.get("truncate") is not None:
        optional["truncate"] = bool(rope.get("truncate"))
    for key in ("short_factor", "long_factor"):
        if rope.get(key) is not None:
            optional[key] = tuple(rope.numbers(key))
    if kind == "proportional":  # the whole head rotates, some of its pairs at 0 Hz
        optional["partial_rotary_factor"], partial = partial, 1.0
    return RopeConfig(
        theta=rope.positive("rope_theta", 10000.0),
        rotary_dim=int(head_dim * partial),
        kind=kind,
        factor=factor or 1.0,
        original_max_position=original,
        **optional,
    )


def _layer_types(keys: "_Keys") -> tuple[LayerType, ...]:
    layers = keys.count("num_hidden_layers")
    layer_types = keys.get("layer_types")
    if layer_types:
        if not (
            isinstance(layer_types, list)
            and len(layer_types) == layers
            and all(isinstance(kind, str) and kind in _LAYER_TYPES for kind in layer_types)
        ):
            raise keys.wrong(
                "layer_types", layer_types, f"{layers} of " + ", ".join(map(repr, _LAYER_TYPES))
            )
        return tuple(_LAYER_TYPES[kind] for kind in layer_types)
    kind: LayerType = "sliding" if keys.get("sliding_window") else "full"
    return (kind,) * layers


def _activation(keys: "_Keys") -> str:
    key = "hidden_activation" if keys.get("hidden_activation") else "hidden_act"
    name = keys.get(key, "silu")
    if not isinstance(name, str):
        raise keys.wrong(key, name, "the name of an activation function")
    if name not in _ACTIVATIONS:
        raise UnsupportedArchitectureError(
            f"activation {name!r} of {keys.get('model_type')} is not supported; supported: "
            + ", ".join(_ACTIVATIONS)
        )
    return _ACTIVATIONS[name]


def token_ids(value: Any) -> tuple[Any, ...]:
    """A config's token id field (an id, a list of ids, or none) as a tuple; the ids are
    checked against the vocabulary by `ModelConfig`."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (value,)


def _dtype_name(keys: "_Keys") -> str | None:
    key = "dtype" if keys.get("dtype") is not None else "torch_dtype"
    dtype = keys.get(key)
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    torch_dtype = getattr(torch, name, None)
    if not (isinstance(torch_dtype, torch.dtype) and torch_dtype.is_floating_point):
        raise keys.wrong(key, dtype, "the name of a floating-point dtype (e.g. 'bfloat16')")
    return name


class _Keys(TypedReader):
    """Typed reads of a config (a dict, or transformers' config object) naming the file and
    the key in every error."""

    def __init__(self, config: Any, path: Path, prefix: str) -> None:
        self.config, self.path, self.prefix = config, path, prefix

    def get(self, key: str, default: Any = None) -> Any:
        if isinstance(self.config, dict):
            return self.config.get(key, default)
        return getattr(self.config, key, default)

    def numbers(self, key: str) -> list[float]:
        value = self._value(key, MISSING)
        if isinstance(value, list) and all(is_int(v) or isinstance(v, float) for v in value):
            return value
        raise self.wrong(key, value, "a list of numbers")

    def rope(self, layer_type: str, head_dim: int) -> RopeConfig:
        """The rope of ``layer_type``'s layers (its own section where the config has one)."""
        return _rope(self, layer_type, head_dim)

    def nested(self, key: str, section: dict[str, Any]) -> "_Keys":
        return _Keys(section, self.path, f"{self.prefix}{key}.")

    def wrong(self, key: str, value: Any, expected: str) -> ModelFileError:
        return _wrong(self.path, self.prefix + key, value, expected)

    def missing(self, key: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: key {self.prefix + key!r} is missing")

    def invalid(self, exc: ConfigValueError) -> ModelFileError:
        """A `ModelConfig` range error, told in terms of the key it came from."""
        params = self.get("rope_parameters")
        nested = isinstance(params, dict) and "full_attention" in params
        key = _source_key(self.prefix, exc.field, nested)
        return ModelFileError(f"{self.path}: {key} is {exc.found!r}; expected {exc.expected}")


def _source_key(prefix: str, field: str, nested_rope: bool) -> str:
    """The config.json key a `ModelConfig` field (``num_heads``, ``rope.theta`` ...) comes
    from; ``nested_rope``: rope parameters given per layer type (Gemma 3)."""
    section, _, name = field.rpartition(".")
    if not section:
        return f"key {prefix + _FIELD_KEYS.get(field, field)!r}"
    rope = "rope_parameters"
    if nested_rope or section == "rope_local":
        rope += ".sliding_attention" if section == "rope_local" else ".full_attention"
    return f"key {prefix + rope + '.' + _ROPE_FIELD_KEYS.get(name, name)!r}"


def _wrong(path: Path, key: str, value: Any, expected: str) -> ModelFileError:
    shown = f"{value!r}"[:80] if value is not None else "missing (null)"
    return ModelFileError(f"{path}: key {key!r} is {shown}; expected {expected}")


def _is_range(indices: set[int], count: int) -> bool:
    """``indices == set(range(count))``, without building a range a corrupt count makes huge."""
    return len(indices) == count and min(indices, default=0) == 0 and max(indices) == count - 1
