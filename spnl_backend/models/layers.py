"""One description per layer: its mixer, its feed-forward and where its norms sit.

A family's ``layers(config)`` (`models.arch`) makes them from the `ModelConfig`; the
layer modules are built from them alone, and what runs a layer (the kernel sets, the
native layer blocks, the KV pool) reads the one description, so a per-layer setting is
one field here rather than an argument passed from module to module.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..kernels.scoring import Scoring
from .step_attention import AttentionSpec

if TYPE_CHECKING:
    from .config import (
        AttentionTemperature,
        DeltaNetConfig,
        Mamba1Config,
        Mamba2Config,
        MlaConfig,
        ModelConfig,
        MoeConfig,
    )

# pre: a norm before attention and before the MLP (Llama); sandwich: also after each
# (Gemma); post: only after each, the residual stream entering un-normed (OLMo 2 and 3);
# parallel: attention and MLP both read the layer's input, each through a norm of its own,
# and both outputs join the stream at once (GPT-NeoX); shared: as parallel, through the
# one input norm (Phi-2, Cohere).
NormPlacement = Literal["pre", "sandwich", "post", "parallel", "shared"]
# rms: RMSNorm with a weight; layer: LayerNorm with a weight and a bias (Phi-2, StarCoder2,
# GPT-NeoX); layer_no_bias: LayerNorm with a weight alone (Cohere); layer_1p: with a
# bias, its weight applied as (1 + w) (Nemotron); layer_plain: neither weight nor bias (OLMo).
NormKind = Literal["rms", "layer", "layer_no_bias", "layer_1p", "layer_plain"]
# Which rotary table turns a layer's queries and keys; None: no rotation (NoPE).
RopeTable = Literal["global", "local"]
# RMSNorm per head, or over the whole projection (OLMo); or a LayerNorm per head, each head
# its own weight row (Cohere); unit: RMSNorm per head without a weight, after the rotation
# (Llama 4's L2 norm); rotated: RMSNorm per head after the rotation (HunYuan)
QkNorm = Literal["head", "full", "layer", "unit", "rotated"]


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
    # Qwen3.5: the q projection also gives a per-head gate, its sigmoid scaling the output.
    output_gate: bool = False
    sinks: bool = False  # a learned sink logit per head (gpt-oss): `AttentionSpec.sinks`
    # Gemma 4: values are the k projection's output (no v_proj), and RMS-normed per head
    # without a weight.
    k_eq_v: bool = False
    v_norm: bool = False
    # DeepSeek's multi-head latent attention, of these sizes: ``num_kv_heads`` is then 1
    # and ``head_dim`` the cached latent's width (`MlaConfig.latent_width`).
    latent: "MlaConfig | None" = None
    # Llama 4: the queries scaled by a factor of their position (layers that do not rotate).
    temperature: "AttentionTemperature | None" = None


@dataclass(frozen=True)
class DeltaNetMixer:
    """A Gated DeltaNet (Qwen3.5): linear attention whose memory is one state per
    sequence (a recurrent state per value head and a convolution's last inputs), kept
    in the cache's state group at place ``state``."""

    config: "DeltaNetConfig"
    state: int

    @property
    def conv_shape(self) -> tuple[int, int]:
        """A sequence's convolution state: its last ``kernel - 1`` inputs (model dtype)."""
        return (self.config.conv_kernel - 1, self.config.conv_dim)

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        """A sequence's recurrent state: a ``[head_k_dim, head_v_dim]`` matrix per value
        head (float32 at least)."""
        d = self.config
        return (d.num_v_heads, d.head_k_dim, d.head_v_dim)


@dataclass(frozen=True)
class Mamba2Mixer:
    """A Mamba-2 (Granite 4.0-H): a selective state space per head, whose memory is one
    state per sequence (the SSM state and the convolution's last inputs), kept in the
    cache's state group at place ``state``."""

    config: "Mamba2Config"
    state: int

    @property
    def conv_shape(self) -> tuple[int, int]:
        """A sequence's convolution state: its last ``kernel - 1`` inputs (model dtype)."""
        return (self.config.conv_kernel - 1, self.config.conv_dim)

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        """A sequence's SSM state: ``[head_dim, state_size]`` per head (float32 at least)."""
        m = self.config
        return (m.num_heads, m.head_dim, m.state_size)


@dataclass(frozen=True)
class Mamba1Mixer:
    """A Mamba-1 (Jamba): a selective state space per channel, whose memory is one state
    per sequence (the SSM state and the convolution's last inputs), kept in the cache's
    state group at place ``state``."""

    config: "Mamba1Config"
    state: int

    @property
    def conv_shape(self) -> tuple[int, int]:
        """A sequence's convolution state: its last ``kernel - 1`` inputs (model dtype)."""
        return (self.config.conv_kernel - 1, self.config.inner_size)

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        """A sequence's SSM state: ``state_size`` per channel (float32 at least)."""
        return (self.config.inner_size, self.config.state_size)


# A mixer that keeps a state per sequence (its shapes: ``conv_shape``, ``recurrent_shape``).
StateMixer = DeltaNetMixer | Mamba2Mixer | Mamba1Mixer


@dataclass(frozen=True)
class ParallelMixer:
    """Attention and a state mixer side by side (Falcon-H1): both read the layer's normed
    input and their outputs are summed. The layer keeps K and V at the attention's place
    in the KV pool and a state at the state mixer's place in the state group."""

    attention: AttentionMixer
    state_mixer: StateMixer

    @property
    def rope(self) -> RopeTable | None:
        return self.attention.rope


@dataclass(frozen=True)
class DenseFFN:
    """A dense MLP: ``gated``, ``down(act(gate(x)) * up(x))`` (Llama); else
    ``down(act(up(x)))`` (Phi-2, StarCoder2, GPT-NeoX, Arcee, Apertus); ``bias``: its
    projections biased."""

    intermediate_size: int
    activation: str
    gated: bool = True
    bias: bool = False


@dataclass(frozen=True)
class MoeFFN:
    moe: "MoeConfig"
    activation: str


@dataclass(frozen=True)
class LayerSpec:
    """``residual_scale``: what the mixer's and the FFN's outputs are multiplied by before
    they join the residual stream (Granite's ``residual_multiplier``; None: as they are);
    ``per_layer_input``: the width of Gemma 4's per-layer embedding this layer adds after
    its MLP (0: none); ``output_scale``: its output scaled by a learned scalar;
    ``norm``: the kind of its norms (its q/k norms are RMSNorms whatever it says)."""

    mixer: AttentionMixer | StateMixer | ParallelMixer
    ffn: DenseFFN | MoeFFN
    norms: NormPlacement = "pre"
    norm: NormKind = "rms"
    residual_scale: float | None = None
    per_layer_input: int = 0
    output_scale: bool = False

    @property
    def attention(self) -> AttentionMixer | None:
        """The layer's attention (alone, or beside a state mixer); None: it has none."""
        if isinstance(self.mixer, ParallelMixer):
            return self.mixer.attention
        return self.mixer if isinstance(self.mixer, AttentionMixer) else None

    @property
    def state_mixer(self) -> StateMixer | None:
        """The mixer that keeps a state per sequence (a conv and a recurrent state of the
        shapes it gives), alone or beside attention; None for attention alone."""
        if isinstance(self.mixer, ParallelMixer):
            return self.mixer.state_mixer
        return None if isinstance(self.mixer, AttentionMixer) else self.mixer

    @property
    def kv_layer(self) -> int | None:
        """The place in the KV pool the layer attends over (None: it keeps no K and V)."""
        attention = self.attention
        return None if attention is None else attention.spec.layer

    @property
    def kv_store(self) -> int | None:
        """The place in the KV pool the layer writes (None: a state layer, or one that
        reads another layer's K and V)."""
        attention = self.attention
        return None if attention is None or attention.spec.shared_kv else attention.spec.layer


def describe_layers(config: "ModelConfig") -> tuple[LayerSpec, ...]:
    """The layers a `ModelConfig`'s fields describe: what every family's ``layers`` gives
    unless it says otherwise. Attention layers take the KV pool's places in order, state
    layers the state group's."""
    layers, kv, state = [], 0, 0
    stored: dict[str, int] = {}  # each layer type's last KV place (what shared layers read)
    first_shared = config.num_layers - config.num_kv_shared_layers
    for i in range(config.num_layers):
        kind = config.layer_types[i]
        if kind == "linear":
            mixer: AttentionMixer | StateMixer | ParallelMixer = _state_mixer(config, state)
            state += 1
        elif kind == "hybrid":
            mixer = ParallelMixer(_attention(config, i, kv), _state_mixer(config, state))
            kv, state = kv + 1, state + 1
        elif i >= first_shared:
            mixer = _attention(config, i, stored[kind], shared=True)
        else:
            mixer = _attention(config, i, kv)
            stored[kind] = kv
            kv += 1
        layers.append(
            LayerSpec(
                mixer,
                _ffn(config, i),
                config.norm_placement,
                residual_scale=config.residual_multiplier,
                per_layer_input=config.per_layer_input_size,
                output_scale=config.layer_output_scale,
                norm=config.norm_kind,
            )
        )
    return tuple(layers)


def _state_mixer(config: "ModelConfig", state: int) -> StateMixer:
    """A "linear" layer's (or a "hybrid" one's beside its attention): the kind of state
    layer the config gives sizes for (`ModelConfig`
    checks that it gives one)."""
    if config.delta_net is not None:
        return DeltaNetMixer(config.delta_net, state)
    if config.mamba1 is not None:
        return Mamba1Mixer(config.mamba1, state)
    assert config.mamba is not None
    return Mamba2Mixer(config.mamba, state)


def _attention(
    config: "ModelConfig", i: int, kv_layer: int, shared: bool = False
) -> AttentionMixer:
    if config.mla is not None:
        return _latent_attention(config, kv_layer)
    sliding = config.layer_types[i] == "sliding"
    chunked = config.layer_types[i] == "chunked"
    kv_heads, head_dim = config.layer_kv_heads(i), config.layer_head_dim(i)
    scoring = Scoring(
        scale=config.attn_scale or head_dim**-0.5,
        window=config.sliding_window if sliding else None,
        softcap=config.attn_softcap,
        chunk=config.attention_chunk_size if chunked else None,
    )
    spec = AttentionSpec(kv_layer, config.num_heads // kv_heads, scoring, shared_kv=shared)
    rope: RopeTable | None = "local" if sliding and config.rope_local else "global"
    if config.rope_layers and not config.rope_layers[i]:
        rope = None
    qk_norm: QkNorm | None = None
    if config.qk_norm_full:
        qk_norm = "full"
    elif config.qk_norm:  # of the model's norm kind
        if config.norm_kind != "rms":
            qk_norm = "layer"
        else:
            qk_norm = "rotated" if config.qk_norm_after_rope else "head"
    if config.qk_norm_unit and rope is not None:
        qk_norm = "unit"
    return AttentionMixer(
        config.num_heads,
        kv_heads,
        head_dim,
        spec,
        rope=rope,
        qk_norm=qk_norm,
        clip_qkv=config.clip_qkv,
        qkv_bias=config.qkv_bias,
        o_bias=config.o_bias,
        output_gate=config.attn_output_gate,
        k_eq_v=config.attn_k_eq_v and not sliding,
        v_norm=config.v_norm,
        temperature=config.attn_temperature if rope is None else None,
    )


def _latent_attention(config: "ModelConfig", kv_layer: int) -> AttentionMixer:
    """A DeepSeek layer: one cached latent and rotated key per token, read by every head."""
    mla = config.mla
    assert mla is not None
    scoring = Scoring(scale=config.scale)
    spec = AttentionSpec(kv_layer, config.num_heads, scoring, latent=mla.kv_lora_rank)
    return AttentionMixer(config.num_heads, 1, mla.latent_width, spec, latent=mla)


def _ffn(config: "ModelConfig", i: int) -> DenseFFN | MoeFFN:
    if config.moe is not None and config.moe.sparse[i]:
        return MoeFFN(config.moe, config.activation)
    shared = i >= config.num_layers - config.num_kv_shared_layers
    wide = 2 if shared and config.double_wide_shared_mlp else 1
    return DenseFFN(
        wide * config.intermediate_size,
        config.activation,
        gated=config.mlp_gated,
        bias=config.mlp_bias,
    )
