"""One description per layer: its mixer, its feed-forward and where its norms sit.

A family's ``layers(config)`` (`models.arch`) makes them from the `ModelConfig`; the
layer modules are built from them alone, and what runs a layer (the kernel sets, the
native layer blocks, the KV pool) reads the one description, so a per-layer setting is
one field here rather than an argument passed from module to module.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .step_attention import AttentionSpec

if TYPE_CHECKING:
    from .config import ModelConfig, MoeConfig

# pre: a norm before attention and before the MLP (Llama); sandwich: also after each
# (Gemma); post: only after each, the residual stream entering un-normed (OLMo 2 and 3).
NormPlacement = Literal["pre", "sandwich", "post"]
# Which rotary table turns a layer's queries and keys; None: no rotation (NoPE).
RopeTable = Literal["global", "local"]
QkNorm = Literal["head", "full"]  # per head, or over the whole projection (OLMo)


@dataclass(frozen=True)
class AttentionMixer:
    """Self-attention: the projections' shapes and what happens between them and the
    kernels (`spec` is what the kernels take whole)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    spec: AttentionSpec
    rope: RopeTable | None = "global"
    qk_norm: QkNorm | None = None
    clip_qkv: float | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    sinks: bool = False  # a learned sink logit per head (gpt-oss): `AttentionSpec.sinks`


@dataclass(frozen=True)
class DenseFFN:
    intermediate_size: int
    activation: str


@dataclass(frozen=True)
class MoeFFN:
    moe: "MoeConfig"
    activation: str


@dataclass(frozen=True)
class LayerSpec:
    mixer: AttentionMixer
    ffn: DenseFFN | MoeFFN
    norms: NormPlacement = "pre"


def describe_layers(config: "ModelConfig") -> tuple[LayerSpec, ...]:
    """The layers a `ModelConfig`'s fields describe: what every family's ``layers`` gives
    unless it says otherwise."""
    return tuple(_layer(config, i) for i in range(config.num_layers))


def _layer(config: "ModelConfig", i: int) -> LayerSpec:
    sliding = config.layer_types[i] == "sliding"
    spec = AttentionSpec(
        layer=i,
        scale=config.scale,
        num_kv_groups=config.num_heads // config.num_kv_heads,
        sliding_window=config.sliding_window if sliding else None,
        softcap=config.attn_softcap,
    )
    rope: RopeTable | None = "local" if sliding and config.rope_local else "global"
    if config.rope_layers and not config.rope_layers[i]:
        rope = None
    qk_norm: QkNorm | None = "full" if config.qk_norm_full else "head" if config.qk_norm else None
    mixer = AttentionMixer(
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        spec,
        rope=rope,
        qk_norm=qk_norm,
        clip_qkv=config.clip_qkv,
        qkv_bias=config.qkv_bias,
        o_bias=config.o_bias,
    )
    ffn: DenseFFN | MoeFFN = DenseFFN(config.intermediate_size, config.activation)
    if config.moe is not None and config.moe.sparse[i]:
        ffn = MoeFFN(config.moe, config.activation)
    return LayerSpec(mixer, ffn, config.norm_placement)
