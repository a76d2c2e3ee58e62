"""GGUF metadata → `ModelConfig`, and GGUF tensor names → our (Hugging Face) names.

GGUF keeps what llama.cpp needs and leaves out what llama.cpp hard-codes per
architecture (Gemma 3's local rope base, its 5:1 sliding/global pattern); those
defaults are filled in here the way llama.cpp fills them.
"""

import re
from typing import Any

from ..errors import ModelFileError, UnsupportedArchitectureError
from ..models.config import LayerType, ModelConfig, RopeConfig
from .gguf_file import GGUFFile

_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
# Tokens that end a turn; llama.cpp treats those in the vocabulary as end-of-generation.
END_OF_TURN_TOKENS = (
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|endoftext|>",
)
_GEMMA3_SWA_PATTERN = 6  # every sixth layer attends globally
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62  # the size whose query scale llama.cpp takes from hidden / heads

_COMMON_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA_NAMES = {
    **_COMMON_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_NAMES = {**_COMMON_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_NAMES_BY_ARCH = {"gemma3": _GEMMA_NAMES, "phi3": _PHI3_NAMES}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
CONFIG_TENSORS = frozenset(
    {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
)


def model_config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    arch = gguf.architecture
    if arch not in _ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; supported: "
            + ", ".join(_ARCHITECTURES)
            + " (Mistral GGUFs use 'llama')"
        )
    meta = _Metadata(gguf, arch)
    hidden, heads = meta.need("embedding_length"), meta.need("attention.head_count")
    head_dim = meta.get("attention.key_length", hidden // heads)
    layers = meta.need("block_count")
    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=meta.need("feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=meta.get("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=meta.need("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=meta.need("context_length"),
        rope=_rope(gguf, meta, head_dim),
        sliding_window=meta.get("attention.sliding_window"),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=gguf.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_token_ids(gguf),
    )
    if fields["sliding_window"]:
        fields["layer_types"] = _swa_layer_types(
            meta.get("attention.sliding_window_pattern"), layers
        )
    if arch == "qwen2":
        fields.update(qkv_bias="blk.0.attn_q.bias" in gguf.tensors)
    if arch == "qwen3":
        fields.update(qk_norm=True)
    if arch == "gemma3":
        fields.update(_gemma3(meta, fields))
    return ModelConfig(**fields)


def eos_token_ids(gguf: GGUFFile) -> tuple[int, ...]:
    meta = gguf.metadata
    ids = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    tokens = meta.get("tokenizer.ggml.tokens", [])
    index = {token: i for i, token in enumerate(tokens) if token in END_OF_TURN_TOKENS}
    return tuple(sorted({int(i) for i in ids if i is not None} | set(index.values())))


def _gemma3(meta: "_Metadata", fields: dict[str, Any]) -> dict[str, Any]:
    layers, hidden, heads = fields["num_layers"], fields["hidden_size"], fields["num_heads"]
    query_dim = hidden // heads if layers == _GEMMA3_27B_LAYERS else fields["head_dim"]
    return dict(
        layer_types=_swa_layer_types(
            meta.get("attention.sliding_window_pattern", _GEMMA3_SWA_PATTERN), layers
        ),
        qk_norm=True,
        norm_offset=0.0,  # llama.cpp's converter stores Gemma's norm weights as 1 + w
        norm_in_float=True,
        sandwich_norms=True,
        embedding_multiplier=hidden**0.5,
        attn_scale=query_dim**-0.5,
        final_softcap=meta.get("final_logit_softcapping"),
        activation="gelu_tanh",
        rope_local=RopeConfig(
            theta=float(meta.get("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE)),
            rotary_dim=fields["rope"].rotary_dim,
        ),
    )


def _swa_layer_types(pattern: Any, layers: int) -> tuple[LayerType, ...]:
    """llama.cpp's pattern: a period n (the last layer of every n is global), one flag
    per layer (true: sliding), or none (every layer slides)."""
    if pattern is None:
        return ("sliding",) * layers
    if isinstance(pattern, int):
        return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers))
    return tuple("sliding" if flag else "full" for flag in pattern)


def _rope(gguf: GGUFFile, meta: "_Metadata", head_dim: int) -> RopeConfig:
    base = dict(
        theta=float(meta.get("rope.freq_base", 10000.0)),
        rotary_dim=int(meta.get("rope.dimension_count", head_dim)),
    )
    if "rope_freqs.weight" in gguf.tensors:
        base["freq_factors"] = tuple(gguf.load("rope_freqs.weight").tolist())
    original = meta.get("rope.scaling.original_context_length")
    if "rope_factors_long.weight" in gguf.tensors:
        return RopeConfig(
            **base,
            kind="longrope",
            original_max_position=original,
            factor=meta.need("context_length") / original,
            attention_factor=meta.get("rope.scaling.attn_factor"),
            long_factor=tuple(gguf.load("rope_factors_long.weight").tolist()),
            short_factor=tuple(gguf.load("rope_factors_short.weight").tolist()),
        )
    kind = meta.get("rope.scaling.type", "none")
    if kind in ("none", None):
        return RopeConfig(**base)
    if kind == "linear":
        return RopeConfig(**base, kind="linear", factor=float(meta.need("rope.scaling.factor")))
    if kind == "yarn":
        extra = {
            key: float(meta.get(f"rope.scaling.yarn_{key}"))
            for key in ("beta_fast", "beta_slow")
            if meta.get(f"rope.scaling.yarn_{key}")
        }
        return RopeConfig(
            **base,
            kind="yarn",
            factor=float(meta.need("rope.scaling.factor")),
            original_max_position=original,
            **extra,
        )
    raise UnsupportedArchitectureError(
        f"{gguf.path}: rope scaling {kind!r} is not supported; supported: none, linear, yarn"
    )


class _Metadata:
    """``{arch}.key`` lookups with a clear error for required keys."""

    def __init__(self, gguf: GGUFFile, arch: str) -> None:
        self.gguf, self.arch = gguf, arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.gguf.metadata.get(f"{self.arch}.{key}", default)

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelFileError(f"{self.gguf.path}: metadata key {self.arch}.{key!r} is missing")
        return value


def hf_name(gguf_name: str, arch: str) -> str | None:
    """Our parameter name for a GGUF tensor, or None for tensors that only feed the config."""
    if gguf_name in CONFIG_TENSORS:
        return None
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    match = _BLOCK.fullmatch(gguf_name)
    names = _NAMES_BY_ARCH.get(arch, _COMMON_NAMES)
    if match and match[2] in names:
        return f"model.layers.{match[1]}.{names[match[2]]}.{match[3]}"
    raise ModelFileError(f"{gguf_name!r} is not a tensor of a GGUF {arch} model")
