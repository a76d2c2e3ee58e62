"""GGUF metadata → `ModelConfig`, and GGUF tensor names → our (Hugging Face) names.

GGUF keeps what llama.cpp needs and leaves out what llama.cpp hard-codes per
architecture (Gemma 3's local rope base, its 5:1 sliding/global pattern); the family's
module (`models.arch`) fills those in the way llama.cpp fills them.
"""

import re
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelFileError, UnsupportedArchitectureError
from ..models.arch import Family, family_of_gguf, gguf_architectures
from ..models.config import (
    MAX_COUNT,
    ConfigValueError,
    LayerType,
    ModelConfig,
    MoeConfig,
    RopeConfig,
    check_config_shapes,
)
from ..models.layers import DenseFFN
from .gguf_file import GGUFFile, describe_value
from .typed import MISSING, TypedReader

# Tokens that end a turn; llama.cpp treats those in the vocabulary as end-of-generation.
END_OF_TURN_TOKENS = (
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|endoftext|>",
)
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?")  # (a few have no suffix)
_BLOCK_INDEX = re.compile(r"blk\.(\d+)\.")
CONFIG_TENSORS = frozenset(
    {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
)


# llama.cpp's pooling types (1 mean, 2 cls, 3 last; 0 none and 4 rank have no single
# vector per text here, and take the last token's).
_POOLING = {1: "mean", 2: "first", 3: "last"}

# Where each `ModelConfig` field comes from, for error messages ({arch}. is prefixed).
_FIELD_KEYS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_layers": "block_count",
    "num_heads": "attention.head_count",
    "num_kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "max_position_embeddings": "context_length",
    "sliding_window": "attention.sliding_window",
    "layer_types": "attention.sliding_window_pattern",
    "final_softcap": "final_logit_softcapping",
    "attn_softcap": "attn_logit_softcapping",
    "num_k_heads": "ssm.group_count",
    "num_v_heads": "ssm.time_step_rank",
    "head_k_dim": "ssm.state_size",
    "conv_kernel": "ssm.conv_kernel",
    "clip_qkv": "attention.clamp_kqv",
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "rope.theta": "rope.freq_base",
    "rope.rotary_dim": "rope.dimension_count",
    "rope.factor": "rope.scaling.factor",
    "rope.original_max_position": "rope.scaling.original_context_length",
    "rope.attention_factor": "rope.scaling.attn_factor",
    "rope.beta_fast": "rope.scaling.yarn_beta_fast",
    "rope.beta_slow": "rope.scaling.yarn_beta_slow",
    "rope_local.theta": "rope.freq_base_swa",
    "global_head_dim": "attention.key_length",
    "global_num_kv_heads": "attention.head_count_kv",
    "num_kv_shared_layers": "attention.shared_kv_layers",
    "per_layer_input_size": "embedding_length_per_layer_input",
    "rope_local.rotary_dim": "rope.dimension_count",
}
_FIELD_SOURCES = {
    "vocab_size": "the vocabulary size (rows of tensor 'token_embd.weight')",
    "rope.freq_factors": "tensor 'rope_freqs.weight'",
    "rope.long_factor": "tensor 'rope_factors_long.weight'",
    "rope.short_factor": "tensor 'rope_factors_short.weight'",
    "bos_token_id": "metadata key 'tokenizer.ggml.bos_token_id'",
    "eos_token_ids": "an end-of-sequence id (tokenizer.ggml.eos/eot/eom_token_id)",
}
_TOKEN_ID_KEY = re.compile(r"tokenizer\.ggml\.\w+_token_id")
_TOKENIZER_FLAG_KEY = re.compile(r"tokenizer\.ggml\.(add|remove)_\w+")


def model_config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    """The file's model, checked: a key of the wrong type, a value out of range or a
    metadata value that disagrees with the tensors is a ModelFileError naming the key."""
    arch = gguf.architecture
    family = family_of_gguf(arch)
    if family is None:
        raise UnsupportedArchitectureError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; supported: "
            + ", ".join(gguf_architectures())
            + " (Mistral 7B's and Mixtral's GGUFs use 'llama')"
        )
    meta = _Metadata(gguf, arch)
    vocab = _vocab_size(gguf)
    check_tokenizer_metadata(gguf, vocab)
    hidden, heads = meta.count("embedding_length"), meta.count("attention.head_count")
    head_dim = _head_dim(meta, hidden, heads)
    layers = _layers(gguf, meta)
    fields: dict[str, Any] = dict(
        architecture=family.name,
        moe=_moe(gguf, meta, family, layers),
        vocab_size=vocab,
        hidden_size=hidden,
        # 0: no dense MLP, where every layer has experts (`ModelConfig`)
        intermediate_size=_per_layer_count(meta, "feed_forward_length", layers, missing=0),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_kv_heads(meta, heads, layers),
        head_dim=head_dim,
        # (a family whose norms are LayerNorms reads attention.layer_norm_epsilon)
        rms_norm_eps=meta.positive("attention.layer_norm_rms_epsilon", None),
        max_position_embeddings=meta.count("context_length"),
        rope=_rope(gguf, meta, head_dim),
        sliding_window=_sliding_window(meta),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=meta.integer("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=eos_token_ids(gguf),
        pooling=_POOLING.get(meta.integer("pooling_type", 0), "last"),
    )
    if fields["sliding_window"]:
        fields["layer_types"] = meta.swa_layer_types(None, layers)
    fields.update(family.gguf_fields(meta, fields))
    if fields["rms_norm_eps"] is None:
        raise meta.missing("attention.layer_norm_rms_epsilon")
    if not fields["intermediate_size"] and not _every_layer_sparse(fields["moe"]):
        raise meta.missing("feed_forward_length")
    try:
        config = ModelConfig(**fields)
    except ConfigValueError as exc:
        raise meta.invalid(exc) from None
    _check_per_layer_counts(meta, config)
    shapes = {
        hf_name(n, arch, gguf.path): info.shape
        for n, info in gguf.tensors.items()
        if not _past(n, layers)
    }
    check_config_shapes(config, shapes, gguf.path)
    return config


def _sliding_window(meta: "_Metadata") -> int | None:
    """The window, where the file has one: llama.cpp's converters write 0 for none (Phi-3
    without a window, Llama 4's all-global models)."""
    if meta.integer("attention.sliding_window", None) == 0:
        return None
    return meta.count("attention.sliding_window", None)


def _moe(gguf: GGUFFile, meta: "_Metadata", family: Family, layers: int) -> MoeConfig | None:
    """The experts, where the file has a router (``ffn_gate_inp``) in some block; a block
    without one is dense. Renormalising the top-k weights: the file's
    ``expert_weights_norm`` where it says, else llama.cpp's rule for the family."""
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in gguf.tensors for i in range(layers))
    for i, routed in enumerate(sparse):
        if not routed and f"blk.{i}.ffn_gate_exps.weight" in gguf.tensors:
            raise ModelFileError(
                f"{gguf.path}: block {i} has experts (blk.{i}.ffn_gate_exps.weight) but no "
                f"router: tensor 'blk.{i}.ffn_gate_inp.weight' is missing"
            )
    if not any(sparse):
        return None
    norm = meta.boolean("expert_weights_norm", None)
    return MoeConfig(
        num_experts=meta.count("expert_count"),
        top_k=meta.count("expert_used_count"),
        intermediate_size=meta.count("expert_feed_forward_length", None)
        or meta.count("feed_forward_length"),
        renormalize=family.gguf_renormalizes_top_k if norm is None else bool(norm),
        sparse=sparse,
    )


def _every_layer_sparse(moe: MoeConfig | None) -> bool:
    """Whether every layer has experts: then the model needs no dense MLP size."""
    return moe is not None and all(moe.sparse)


def _kv_heads(meta: "_Metadata", heads: int, layers: int) -> int:
    """The attention layers' K/V heads: one count, or the first attention layer's of one
    per layer (llama.cpp writes 0 for a hybrid's state layers, and Gemma 4's global
    layers have their own): the family reads the others, and every layer's count is
    checked against the layers the config describes (`_check_per_layer_counts`)."""
    key = "attention.head_count_kv"
    if not isinstance(meta.get(key), np.ndarray):
        return meta.count(key, heads)
    attention = [count for count in _counts(meta, key, layers, zero=True) if count]
    if not attention:
        raise meta.wrong(key, meta.get(key), "at least one attention layer's count (not 0)")
    return attention[0]


def _per_layer_count(meta: "_Metadata", key: str, layers: int, missing: int | None = None) -> int:
    """A count, or the first layer's of one per layer (checked whole once the config's
    layers are known, `_check_per_layer_counts`); ``missing`` where the file has none
    (None: it must have one)."""
    if not isinstance(meta.get(key), np.ndarray):
        if missing is None:
            return meta.count(key)
        found = meta.count(key, None)  # (an explicit 0 is out of range)
        return missing if found is None else found
    return _counts(meta, key, layers, zero=False)[0]


def _counts(meta: "_Metadata", key: str, layers: int, zero: bool) -> list[int]:
    value = meta.get(key)
    counts = value.tolist() if value.dtype.kind in "iu" else []
    low = 0 if zero else 1
    if len(counts) != layers or not all(low <= c <= MAX_COUNT for c in counts):
        kind = "integers >= 0 (0 for a state layer)" if zero else "positive integers"
        raise meta.wrong(key, value, f"a count, or {layers} {kind}, one per layer")
    return counts


def _check_per_layer_counts(meta: "_Metadata", config: ModelConfig) -> None:
    """A per-layer array of K/V heads or feed-forward widths against the layers the
    config describes: a family that reads one count where the file gives another is
    refused naming the layer, never run with the wrong shape."""
    kv, widths = meta.get("attention.head_count_kv"), meta.get("feed_forward_length")
    for i, spec in enumerate(config.layers):
        if isinstance(kv, np.ndarray):
            heads = 0 if spec.attention is None else spec.attention.num_kv_heads
            _check_layer_count(meta, "attention.head_count_kv", i, heads, "K/V heads")
        if isinstance(widths, np.ndarray) and isinstance(spec.ffn, DenseFFN):
            inner = spec.ffn.intermediate_size
            _check_layer_count(meta, "feed_forward_length", i, inner, "MLP rows")


def _check_layer_count(meta: "_Metadata", key: str, layer: int, expected: int, what: str) -> None:
    found = int(meta.get(key)[layer])
    if found != expected:
        raise ModelFileError(
            f"{meta.gguf.path}: metadata key {meta.key(key)!r} gives layer {layer} {found:,} "
            f"{what}; the {meta.arch} model its other keys describe has {expected:,} there"
        )


def _head_dim(meta: "_Metadata", hidden: int, heads: int) -> int:
    if meta.get("attention.key_length") is None and hidden % heads:
        raise ModelFileError(
            f"{meta.gguf.path}: metadata key {meta.key('embedding_length')!r} ({hidden}) is "
            f"not a multiple of {meta.key('attention.head_count')!r} ({heads}), and "
            f"{meta.key('attention.key_length')!r} is missing: the head size is unknown"
        )
    head_dim = meta.count("attention.key_length", hidden // heads)
    value_dim = meta.count("attention.value_length", head_dim)
    # (multi-head latent attention: the cached latent and rotated key, and the latent;
    # the family reads the heads' own sizes, ``key_length_mla`` and ``value_length_mla``)
    if value_dim != head_dim and meta.get("attention.kv_lora_rank") is None:
        raise meta.wrong(
            "attention.value_length",
            value_dim,
            f"the key length ({head_dim}); values and "
            "keys of one head have the same size in every supported architecture",
        )
    return head_dim


def _vocab_size(gguf: GGUFFile) -> int:
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is None:
        raise ModelFileError(f"{gguf.path}: tensor 'token_embd.weight' is missing")
    if len(embedding.shape) != 2:
        raise ModelFileError(
            f"{gguf.path}: tensor 'token_embd.weight' has shape {embedding.shape}; "
            "expected a matrix [vocabulary, embedding_length]"
        )
    return embedding.shape[0]


def _layers(gguf: GGUFFile, meta: "_Metadata") -> int:
    """The decoder layers: the blocks less the multi-token prediction blocks after them
    (``nextn_predict_layers``: llama.cpp's converters keep Qwen3.5's as extra blocks; a
    plain run leaves them unread), the block count checked against the tensors."""
    blocks = meta.count("block_count")
    _check_layers(gguf, meta, blocks)
    extra = meta.integer("nextn_predict_layers", 0)
    if not 0 <= extra < blocks:
        raise meta.wrong(
            "nextn_predict_layers", extra, f"an integer from 0 to {blocks - 1} (blocks less one)"
        )
    return blocks - extra


def _past(gguf_name: str, layers: int) -> bool:
    """Whether a tensor belongs to a block past the decoder's ``layers`` (an MTP block)."""
    match = _BLOCK_INDEX.match(gguf_name)  # (an MTP block's names have dots of their own)
    return match is not None and int(match[1]) >= layers


def _check_layers(gguf: GGUFFile, meta: "_Metadata", layers: int) -> None:
    """The block count against the blocks the tensors belong to, before a model of that
    many layers is built."""
    found = {int(m[1]) for name in gguf.tensors if (m := _BLOCK.fullmatch(name))}
    if not _is_range(found, layers):
        held = f"blocks 0..{max(found)}" if found else "no blk.* tensors"
        raise ModelFileError(
            f"{gguf.path}: metadata key {meta.key('block_count')!r} is {layers:,}, but the "
            f"file holds tensors for {len(found):,} blocks ({held})"
        )


def check_tokenizer_metadata(gguf: GGUFFile, vocab: int) -> None:
    """The vocabulary and its companions: tokens (one per embedding row), scores and token
    types of the same length, merges, special token ids within the vocabulary, flags."""
    meta = _Metadata(gguf, gguf.architecture)
    meta.string("tokenizer.ggml.model")
    meta.string("tokenizer.ggml.pre", None)
    meta.string("tokenizer.chat_template", None)
    tokens = meta.strings("tokenizer.ggml.tokens")
    if len(tokens) != vocab:
        raise ModelFileError(
            f"{gguf.path}: metadata key 'tokenizer.ggml.tokens' lists {len(tokens):,} "
            f"tokens; expected one per row of tensor 'token_embd.weight' ({vocab:,})"
        )
    meta.numbers("tokenizer.ggml.scores", len(tokens), "f")
    meta.numbers("tokenizer.ggml.token_type", len(tokens), "iu")
    meta.strings("tokenizer.ggml.merges", None)
    for key, value in gguf.metadata.items():
        if _TOKEN_ID_KEY.fullmatch(key):
            meta.token_id(key, len(tokens))
        elif _TOKENIZER_FLAG_KEY.fullmatch(key) and not isinstance(value, bool):
            raise meta.wrong(key, value, "a bool")


def eos_token_ids(gguf: GGUFFile) -> tuple[int, ...]:
    meta = gguf.metadata
    ids = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    tokens = meta.get("tokenizer.ggml.tokens", [])
    index = {token: i for i, token in enumerate(tokens) if token in END_OF_TURN_TOKENS}
    return tuple(sorted({int(i) for i in ids if i is not None} | set(index.values())))


def _swa_layer_types(meta: "_Metadata", default: int | None, layers: int) -> tuple[LayerType, ...]:
    """llama.cpp's pattern: a period n (the last layer of every n is global), one flag
    per layer (true: sliding), or none (every layer slides)."""
    key = "attention.sliding_window_pattern"
    pattern = meta.get(key, default)
    if pattern is None:
        return ("sliding",) * layers
    if isinstance(pattern, int) and not isinstance(pattern, bool):
        period = meta.count(key, default)
        return tuple("full" if (i + 1) % period == 0 else "sliding" for i in range(layers))
    if not (isinstance(pattern, np.ndarray) and pattern.dtype == bool and len(pattern) == layers):
        raise meta.wrong(key, pattern, f"a period (a positive integer) or {layers} bools")
    return tuple("sliding" if flag else "full" for flag in pattern)


def _rope(gguf: GGUFFile, meta: "_Metadata", head_dim: int) -> RopeConfig:
    base = dict(
        theta=meta.positive("rope.freq_base", 10000.0),
        rotary_dim=meta.count("rope.dimension_count", head_dim),
    )
    if "rope_freqs.weight" in gguf.tensors:
        base["freq_factors"] = tuple(gguf.load("rope_freqs.weight").flatten().tolist())
    context = meta.count("context_length")
    if "rope_factors_long.weight" in gguf.tensors:
        original = meta.count("rope.scaling.original_context_length")
        return RopeConfig(
            **base,
            kind="longrope",
            original_max_position=original,
            factor=context / original,
            attention_factor=meta.positive("rope.scaling.attn_factor", None),
            long_factor=tuple(gguf.load("rope_factors_long.weight").flatten().tolist()),
            short_factor=_short_factors(gguf),
        )
    kind = meta.string("rope.scaling.type", "none")
    if kind == "none":
        return RopeConfig(**base)
    if kind == "linear":
        return RopeConfig(**base, kind="linear", factor=meta.positive("rope.scaling.factor"))
    if kind == "yarn":
        extra = {
            key: meta.positive(f"rope.scaling.yarn_{key}")
            for key in ("beta_fast", "beta_slow")
            if meta.get(f"rope.scaling.yarn_{key}")
        }
        return RopeConfig(
            **base,
            kind="yarn",
            factor=meta.positive("rope.scaling.factor"),
            # llama.cpp's default: the training context is the original one
            original_max_position=meta.count("rope.scaling.original_context_length", context),
            **extra,
        )
    raise UnsupportedArchitectureError(
        f"{gguf.path}: rope scaling {kind!r} is not supported; supported: none, linear, yarn"
    )


def _short_factors(gguf: GGUFFile) -> tuple[float, ...]:
    if "rope_factors_short.weight" not in gguf.tensors:
        raise ModelFileError(
            f"{gguf.path}: tensor 'rope_factors_short.weight' is missing; LongRoPE needs it "
            "beside 'rope_factors_long.weight'"
        )
    return tuple(gguf.load("rope_factors_short.weight").flatten().tolist())


class _Metadata(TypedReader):
    """Typed reads of the file's metadata (``{arch}.key`` for the model's own keys): a
    missing required key, a value of the wrong type or out of range is a ModelFileError
    naming the file and the key. Integers may come in any GGUF integer width, numbers as
    any integer or float type."""

    def __init__(self, gguf: GGUFFile, arch: str) -> None:
        self.gguf, self.arch = gguf, arch

    def key(self, name: str) -> str:
        # (llama.cpp's xIELU keys carry no architecture prefix)
        unprefixed = name.startswith(("tokenizer.", "general.", "xielu."))
        return name if unprefixed else f"{self.arch}.{name}"

    def get(self, name: str, default: Any = None) -> Any:
        return self.gguf.metadata.get(self.key(name), default)

    def has_tensor(self, name: str) -> bool:
        return name in self.gguf.tensors

    def swa_layer_types(self, default_period: int | None, layers: int) -> tuple[LayerType, ...]:
        return _swa_layer_types(self, default_period, layers)

    def strings(self, name: str, default: Any = MISSING) -> Any:
        value = self._value(name, default)
        if value is default or _is_strings(value):
            return value
        raise self.wrong(name, value, "an array of strings")

    def numbers(self, name: str, length: int, kinds: str) -> None:
        """An optional numeric array of ``length`` items of numpy kinds ``kinds``."""
        value = self._value(name, None)
        if value is None:
            return
        if not (isinstance(value, np.ndarray) and value.dtype.kind in kinds):
            raise self.wrong(name, value, "an array of " + ("floats" if kinds == "f" else "ints"))
        if len(value) != length:
            raise self.wrong(name, value, f"{length:,} values, one per token")

    def token_id(self, name: str, vocab: int) -> int:
        value = self.integer(name)
        if 0 <= value < vocab:
            return value
        raise self.wrong(name, value, f"a token id within the vocabulary (0 to {vocab - 1:,})")

    def missing(self, name: str) -> ModelFileError:
        return ModelFileError(f"{self.gguf.path}: metadata key {self.key(name)!r} is missing")

    def wrong(self, name: str, value: Any, expected: str) -> ModelFileError:
        return ModelFileError(
            f"{self.gguf.path}: metadata key {self.key(name)!r} is {describe_value(value)}; "
            f"expected {expected}"
        )

    def invalid(self, exc: ConfigValueError) -> ModelFileError:
        """A `ModelConfig` range error, told in terms of the key it came from."""
        if exc.field in _FIELD_KEYS:
            source = f"metadata key {self.key(_FIELD_KEYS[exc.field])!r}"
        else:
            source = _FIELD_SOURCES.get(exc.field, exc.field)
        return ModelFileError(
            f"{self.gguf.path}: {source} is {exc.found!r}; expected {exc.expected}"
        )


def _is_range(indices: set[int], count: int) -> bool:
    """``indices == set(range(count))``, without building a range a corrupt count makes huge."""
    return len(indices) == count and min(indices, default=0) == 0 and max(indices) == count - 1


def _is_strings(value: Any) -> bool:
    # A GGUF array has one item type, so its first item tells (262k tokens: no loop).
    return isinstance(value, list) and (not value or isinstance(value[0], str))


def hf_name(
    gguf_name: str, arch: str, path: Path | str = "GGUF file", layers: int | None = None
) -> str | None:
    """Our parameter name for a GGUF tensor, or None for tensors that only feed the config
    and (given the decoder's ``layers``) those of the blocks after them, left unread."""
    if gguf_name in CONFIG_TENSORS or (layers is not None and _past(gguf_name, layers)):
        return None
    stem, _, kind = gguf_name.rpartition(".")
    family = family_of_gguf(arch)
    top = {**_TOP_NAMES, **family.gguf_top_names} if family is not None else _TOP_NAMES
    if stem in top:
        return f"{top[stem]}.{kind}"
    match = _BLOCK.fullmatch(gguf_name)
    names = family.gguf_names if family is not None else {}
    if match and match[2] in names:
        suffix = f".{match[3]}" if match[3] else ""
        return f"model.layers.{match[1]}.{names[match[2]]}{suffix}"
    raise ModelFileError(f"{path}: {gguf_name!r} is not a tensor of a GGUF {arch} model")
