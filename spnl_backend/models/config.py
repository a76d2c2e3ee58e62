"""`ModelConfig`: one description of a decoder-only transformer, whatever file it came from.

The loader fills it from a Hugging Face config or from GGUF metadata; the model
is built from it alone. Every architecture difference is a field here, so the
model code is written once.
"""

from dataclasses import dataclass
from typing import Literal

from ..errors import UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")
LayerType = Literal["full", "sliding"]
RopeKind = Literal["default", "linear", "llama3", "yarn", "longrope"]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer type: base, rotated dims and the scaling rule."""

    theta: float
    rotary_dim: int
    kind: RopeKind = "default"
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn, longrope
    short_factor: tuple[float, ...] | None = None  # longrope
    long_factor: tuple[float, ...] | None = None  # longrope
    freq_factors: tuple[float, ...] | None = None  # per-dimension divisors stored in a GGUF


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    rope_local: RopeConfig | None = None  # sliding layers, where they rotate differently
    layer_types: tuple[LayerType, ...] = ()
    sliding_window: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0  # Gemma scales by (offset + weight)
    norm_in_float: bool = False  # Gemma multiplies by the weight before casting back
    sandwich_norms: bool = False  # Gemma's post-attention and post-feedforward norms
    embedding_multiplier: float | None = None
    attn_scale: float = 0.0  # 0 means head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    activation: Literal["silu", "gelu_tanh"] = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str | None = None  # as the checkpoint stores it

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"architecture {self.architecture!r} is not supported; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads} attention heads do not split into "
                f"{self.num_kv_heads} KV-head groups"
            )

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding" else None
