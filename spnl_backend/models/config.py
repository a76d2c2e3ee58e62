"""`ModelConfig`: one description of a decoder-only transformer, whatever file it came from.

The loader fills it from a Hugging Face config or from GGUF metadata, through the
family's module (`models.arch`); its family's ``layers`` turns it into one description
per layer (`models.layers`), from which the model is built.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..errors import ModelFileError, UnsupportedArchitectureError
from .components import (
    AttentionTemperature,
    DeltaNetConfig,
    FoldedMultipliers,
    Mamba1Config,
    Mamba2Config,
    MlaConfig,
    MoeConfig,
    RopeConfig,
)

if TYPE_CHECKING:
    from .layers import LayerSpec, NormKind, NormPlacement

# linear: a state layer, a Gated DeltaNet (`delta_net`), a Mamba-2 (`mamba`) or a Mamba-1
# (`mamba1`); hybrid: full attention and such a state layer side by side (Falcon-H1);
# chunked: attention within chunks of `attention_chunk_size` positions (Llama 4)
LayerType = Literal["full", "sliding", "chunked", "linear", "hybrid"]
STATE_LAYER_TYPES = ("linear", "hybrid")
MAX_COUNT = 2**31 - 1  # every size and count fits the int32 indices kernels use
# `models.layers.NormKind`, as a ModelConfig accepts it.
_NORM_KINDS = ("rms", "layer", "layer_no_bias", "layer_1p", "layer_plain")
_COUNTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position_embeddings",
)


class ConfigValueError(ValueError):
    """A `ModelConfig` field out of its range. The loaders name the file and the key the
    field came from; ``expected`` is worded for either source."""

    def __init__(self, field: str, found: object, expected: str) -> None:
        super().__init__(f"{field} is {found!r}; expected {expected}")
        self.field, self.found, self.expected = field, found, expected


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
    rms_norm_eps: float  # every norm's eps (a LayerNorm's too: `norm_kind`)
    max_position_embeddings: int
    rope: RopeConfig
    rope_local: RopeConfig | None = None  # sliding layers, where they rotate differently
    layer_types: tuple[LayerType, ...] = ()
    sliding_window: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    qk_norm_after_rope: bool = False  # HunYuan: q and k normed per head once rotated
    norm_offset: float = 0.0  # Gemma scales by (offset + weight)
    norm_in_float: bool = False  # Gemma multiplies by the weight before casting back
    norm_placement: "NormPlacement" = "pre"  # `models.layers.NormPlacement`
    # `models.layers.NormKind`: RMSNorm, or LayerNorm with a bias or without one (Cohere's),
    # its weight as (1 + w) (Nemotron's) or with neither (OLMo's);
    # a LayerNorm's eps is ``rms_norm_eps`` too: the one eps of the model's norms
    norm_kind: "NormKind" = "rms"
    # The dense MLP: gated (Llama) or ``down(act(up(x)))`` (Phi-2, GPT-NeoX), its
    # projections biased or not; and a bias on the LM head (Phi-2).
    mlp_gated: bool = True
    mlp_bias: bool = False
    lm_head_bias: bool = False
    rope_layers: tuple[bool, ...] = ()  # which layers rotate (SmolLM3's NoPE); () = all
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None  # Granite: each layer's outputs scaled
    logits_scaling: float | None = None  # Granite: the logits divided by it
    attn_scale: float = 0.0  # 0 means head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # swiglu_oai: gpt-oss's experts, ``(up + 1) * gate * sigmoid(alpha * gate)`` with the
    # gate clamped above at ``swiglu_limit`` and up to [-limit, limit] (`models.mlp`).
    # gelu: the exact (erf) GELU; gelu_tanh: its tanh approximation; relu2: ReLU squared;
    # xielu: xIELU, with learned scalars per layer (Apertus).
    activation: Literal["silu", "gelu", "gelu_tanh", "swiglu_oai", "relu2", "xielu"] = "silu"
    # A GGUF's per-layer activation scalars, which a checkpoint holds as tensors: xIELU's
    # (alpha_p, alpha_n, beta, eps) as the checkpoint stores them (`models.mlp.XIELU`).
    activation_scalars: tuple[tuple[float, ...], ...] = ()
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # OLMoE: q and k normed over the whole projection (before the heads are split), and
    # q, k and v clamped to [-clip_qkv, clip_qkv] after it.
    qk_norm_full: bool = False
    clip_qkv: float | None = None
    moe: "MoeConfig | None" = None  # mixture-of-experts layers, where the model has them
    delta_net: DeltaNetConfig | None = None  # the "linear" layers' sizes (Qwen3.5)
    mamba: Mamba2Config | None = None  # or theirs, where they are Mamba-2 (Granite 4.0-H)
    mamba1: Mamba1Config | None = None  # or Mamba-1 (Jamba)
    attn_output_gate: bool = False  # Qwen3.5: a sigmoid gate from the q projection
    # DeepSeek-V2/V3: every attention layer is multi-head latent attention of these sizes
    # (``head_dim``: a query head's, ``qk_nope_head_dim + qk_rope_head_dim``).
    mla: MlaConfig | None = None
    # Llama 4: the "chunked" layers' chunk; q and k of the layers that rotate RMS-normed per
    # head without a weight after their rotation; the queries of those that do not rotate
    # scaled by a factor of their position.
    attention_chunk_size: int | None = None
    qk_norm_unit: bool = False
    attn_temperature: AttentionTemperature | None = None
    # Falcon-H1's multipliers, folded into a checkpoint's weights as they load (None: none)
    folded_multipliers: FoldedMultipliers | None = None
    # Gemma 4: the full-attention layers' own head size and KV heads (None: as the others),
    # their values the keys' projection (no v_proj, ``attn_k_eq_v``), values RMS-normed
    # without a weight, and the last ``num_kv_shared_layers`` layers reading the K and V of
    # the last earlier layer of their type (computing only q; their MLP twice as wide
    # where ``double_wide_shared_mlp``).
    global_head_dim: int | None = None
    global_num_kv_heads: int | None = None
    attn_k_eq_v: bool = False
    v_norm: bool = False
    num_kv_shared_layers: int = 0
    double_wide_shared_mlp: bool = False
    # Gemma 4's per-layer embeddings (PLE): a second table of ``per_layer_input_size``
    # values per layer, from a vocabulary of ``per_layer_vocab_size``, fed into each layer
    # after its MLP; and each layer's output scaled by a learned scalar.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int | None = None
    layer_output_scale: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str | None = None  # as the checkpoint stores it
    # config.json's quantization_config.quant_method (`Family.quant_methods`), e.g.
    # gpt-oss's "mxfp4": its experts stored as MXFP4 blocks and scales
    quantization: str | None = None
    # How /v1/embeddings pools the last hidden states (`engine.embed`): a GGUF's
    # pooling_type where it has one; the last token's state otherwise.
    pooling: Literal["last", "mean", "first"] = "last"
    # Whose code runs the model: a family module's layers (native), or transformers' own
    # modeling code over the engine's cache (`models.transformers_lm`): then
    # ``architecture`` is the config.json model type, the config describes the KV layers
    # and sizes the engine reads, and the fields that build native layers go unused.
    implementation: Literal["native", "transformers"] = "native"

    def __post_init__(self) -> None:
        from .arch import family_names

        if self.implementation == "native" and self.architecture not in family_names():
            raise UnsupportedArchitectureError(
                f"architecture {self.architecture!r} is not supported; supported: "
                + ", ".join(family_names())
            )
        for name in _COUNTS:
            if name != "intermediate_size":
                _check_count(name, getattr(self, name))
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)
        if self.moe is not None and not self.moe.sparse:
            sparse = (True,) * self.num_layers
            object.__setattr__(self, "moe", dataclasses.replace(self.moe, sparse=sparse))
        _check_dense_size(self)
        _validate(self)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.sparse[layer]

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    def layer_head_dim(self, layer: int) -> int:
        """Layer ``layer``'s head size (Gemma 4's full layers have their own)."""
        full = self.layer_types[layer] == "full"
        return self.global_head_dim if full and self.global_head_dim else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        full = self.layer_types[layer] == "full"
        return self.global_num_kv_heads if full and self.global_num_kv_heads else self.num_kv_heads

    @property
    def kv_shapes(self) -> tuple[tuple[int, int], ...]:
        """Each KV pool layer's ``(kv_heads, head_dim)``, in pool order: its storing
        layer's (`models.layers.LayerSpec.kv_store`)."""
        shapes = {}
        for spec in self.layers:
            if spec.kv_store is not None and (attention := spec.attention) is not None:
                shapes[spec.kv_store] = (attention.num_kv_heads, attention.head_dim)
        return tuple(shapes[place] for place in sorted(shapes))

    @property
    def kv_planes(self) -> tuple[int, ...]:
        """Each KV pool layer's tensors per token, in pool order: 2 (its K and V), or 1
        (a latent layer's: keys whose first dims are also the values,
        `AttentionSpec.latent`)."""
        planes = {}
        for spec in self.layers:
            if spec.kv_store is not None:
                planes[spec.kv_store] = 1 if spec.attention.spec.latent else 2
        return tuple(planes[place] for place in sorted(planes))

    @property
    def uniform_kv(self) -> bool:
        """Whether every KV pool layer has one shape, keeps K and V of its own and every
        attention layer stores its own: what the features that see the pool as one tensor
        of K and V need (compression, tensor parallelism, PIC)."""
        readers = sum(1 for s in self.layers if s.kv_layer is not None)
        own_kv = all(planes == 2 for planes in self.kv_planes)
        return len(set(self.kv_shapes)) <= 1 and readers == self.num_kv_layers and own_kv

    @property
    def chunked_attention(self) -> bool:
        """Whether some layer attends within chunks of positions (Llama 4): where a key
        counts depends on its absolute position, which PIC's blocks move."""
        return any(
            s.kv_layer is not None and s.attention.spec.scoring.chunk is not None
            for s in self.layers
        )

    @property
    def num_kv_layers(self) -> int:
        """The layers that keep K and V of their own: the KV pool's layers (a layer's
        `AttentionSpec.layer` is its place there; a state layer keeps none)."""
        return len({s.kv_layer for s in self.layers if s.kv_layer is not None})

    @property
    def num_state_layers(self) -> int:
        """The layers that keep a state per sequence (`models.layers.StateMixer`), instead
        of K and V or beside them."""
        return sum(1 for s in self.layers if s.state_mixer is not None)

    @functools.cached_property
    def layers(self) -> tuple["LayerSpec", ...]:
        """One description per layer, by the family's ``layers`` (`models.arch`); a model
        on transformers' code has attention layers alone (`loader.transformers_path`
        refuses any other)."""
        from .arch import family
        from .layers import describe_layers

        if self.implementation == "transformers":
            return describe_layers(self)
        return family(self.architecture).layers(self)


def check_config_shapes(
    config: ModelConfig, shapes: dict[str, tuple[int, ...]], source: object
) -> None:
    """The config's sizes against the tensors they describe (the embedding and the first
    layer's projections), before a model of those sizes is built: a size that disagrees
    with the file is an error naming the tensor, not a huge allocation."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    layer = "model.layers.0."
    expected = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        layer + "self_attn.q_proj.weight": (q, hidden),
        layer + "self_attn.k_proj.weight": (kv, hidden),
        layer + "self_attn.qkv_proj.weight": (q + 2 * kv, hidden),
        layer + "mlp.down_proj.weight": (hidden, inner),
        layer + "mlp.gate_up_proj.weight": (2 * inner, hidden),
    }
    for name, shape in expected.items():
        if name in shapes and tuple(shapes[name]) != shape:
            raise ModelFileError(
                f"{source}: tensor {name!r} has shape {tuple(shapes[name])}, but the "
                f"config's sizes make it {shape}"
            )


def _validate(config: ModelConfig) -> None:
    """Every value in its range, so that no kernel ever sees a shape it cannot handle
    (a rotary width past the head reads out of bounds in the native kernels)."""
    _check_positive("rms_norm_eps", config.rms_norm_eps)
    if config.num_heads % config.num_kv_heads:
        raise ConfigValueError(
            "num_kv_heads",
            config.num_kv_heads,
            f"a divisor of the number of attention heads ({config.num_heads})",
        )
    if config.global_head_dim is not None:
        _check_count("global_head_dim", config.global_head_dim)
    if config.global_num_kv_heads is not None:
        _check_count("global_num_kv_heads", config.global_num_kv_heads)
        if config.num_heads % config.global_num_kv_heads:
            raise ConfigValueError(
                "global_num_kv_heads",
                config.global_num_kv_heads,
                f"a divisor of the number of attention heads ({config.num_heads})",
            )
    # The global rope turns the full layers (every layer where there is no local one).
    global_dim = config.global_head_dim or config.head_dim
    if config.rope_local is None:
        global_dim = min(global_dim, config.head_dim)
    _check_rope("rope", config.rope, global_dim)
    if config.rope_local is not None:
        _check_rope("rope_local", config.rope_local, config.head_dim)
    if len(config.layer_types) != config.num_layers or not set(config.layer_types) <= {
        "full",
        "sliding",
        "chunked",
        *STATE_LAYER_TYPES,
    }:
        raise ConfigValueError(
            "layer_types",
            config.layer_types,
            f"{config.num_layers} entries (one per layer), each 'full', 'sliding', 'chunked', "
            "'linear' or 'hybrid'",
        )
    if "chunked" in config.layer_types or config.attention_chunk_size is not None:
        _check_count("attention_chunk_size", config.attention_chunk_size)
    if config.attn_temperature is not None:
        _check_positive("attn_temperature.floor_scale", config.attn_temperature.floor_scale)
        if not _is_real(config.attn_temperature.scale):
            raise ConfigValueError(
                "attn_temperature.scale", config.attn_temperature.scale, "a finite number"
            )
    if set(STATE_LAYER_TYPES) & set(config.layer_types):
        _check_state_layers(config)
    if config.sliding_window is not None:
        _check_count("sliding_window", config.sliding_window)
    if config.norm_placement not in ("pre", "sandwich", "post", "parallel", "shared"):
        raise ConfigValueError(
            "norm_placement", config.norm_placement, "pre, sandwich, post, parallel or shared"
        )
    if config.norm_kind not in _NORM_KINDS:
        raise ConfigValueError("norm_kind", config.norm_kind, ", ".join(_NORM_KINDS))
    if config.lm_head_bias and config.tie_word_embeddings:
        raise ConfigValueError(
            "lm_head_bias", True, "no bias on a head tied to the embedding (an untied head)"
        )
    if config.activation not in ("silu", "gelu", "gelu_tanh", "swiglu_oai", "relu2", "xielu"):
        raise ConfigValueError(
            "activation", config.activation, "silu, gelu, gelu_tanh, swiglu_oai, relu2 or xielu"
        )
    if config.rope_layers and len(config.rope_layers) != config.num_layers:
        raise ConfigValueError(
            "rope_layers", config.rope_layers, f"{config.num_layers} flags (one per layer)"
        )
    for name in (
        "embedding_multiplier",
        "residual_multiplier",
        "logits_scaling",
        "attn_softcap",
        "final_softcap",
        "swiglu_alpha",
        "swiglu_limit",
    ):
        if getattr(config, name) is not None:
            _check_positive(name, getattr(config, name))
    if config.activation == "xielu" and (config.mlp_gated or config.moe is not None):
        raise ConfigValueError(
            "activation", "xielu", "an activation of a gated MLP (xIELU: plain MLPs only)"
        )
    if not (_is_real(config.attn_scale) and config.attn_scale >= 0):
        raise ConfigValueError("attn_scale", config.attn_scale, "a finite number >= 0")
    if config.clip_qkv is not None:
        _check_positive("clip_qkv", config.clip_qkv)
    if config.moe is not None:
        _check_moe(config.moe, config.num_layers)
    if config.mla is not None:
        _check_mla(config)
    if config.folded_multipliers is not None:
        _check_multipliers(config.folded_multipliers)
    _check_sharing(config)
    if config.per_layer_input_size:
        _check_count("per_layer_input_size", config.per_layer_input_size)
        _check_count("per_layer_vocab_size", config.per_layer_vocab_size)
    _check_token_ids(config)


def _check_dense_size(config: ModelConfig) -> None:
    """The dense MLP's size; 0 (no dense MLP: Qwen3.5 MoE's files give none) only where
    every layer has experts."""
    every_layer_sparse = config.moe is not None and all(config.moe.sparse)
    unused = config.implementation == "transformers"  # transformers' own MLP runs
    if config.intermediate_size == 0 and (every_layer_sparse or unused):
        return
    if not (_is_int(config.intermediate_size) and 0 < config.intermediate_size <= MAX_COUNT):
        raise ConfigValueError(
            "intermediate_size",
            config.intermediate_size,
            f"a positive integer up to {MAX_COUNT:,} (the dense MLP's size; absent only where "
            "every layer has experts)",
        )


def _check_state_layers(config: ModelConfig) -> None:
    """The state layers' sizes: a Gated DeltaNet's, a Mamba-2's or a Mamba-1's, one of them."""
    given = [s for s in (config.delta_net, config.mamba, config.mamba1) if s is not None]
    if len(given) != 1:
        raise ConfigValueError(
            "delta_net",
            f"{len(given)} kinds",
            "the state layers' sizes: a Gated DeltaNet's, a Mamba-2's or a Mamba-1's",
        )
    if config.delta_net is not None:
        _check_delta_net(config.delta_net)
    elif config.mamba is not None:
        _check_mamba(config.mamba)
    else:
        _check_mamba1(config.mamba1)


def _check_mamba1(mamba: Mamba1Config) -> None:
    for name in ("inner_size", "state_size", "dt_rank", "conv_kernel"):
        _check_count(f"mamba1.{name}", getattr(mamba, name))


def _check_mamba(mamba: Mamba2Config) -> None:
    for name in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size"):
        _check_count(f"mamba.{name}", getattr(mamba, name))
    if mamba.norm not in ("after_gate", "before_gate", "none"):
        raise ConfigValueError("mamba.norm", mamba.norm, "after_gate, before_gate or none")
    if mamba.num_heads % mamba.n_groups:
        raise ConfigValueError(
            "mamba.n_groups", mamba.n_groups, f"a divisor of the {mamba.num_heads} heads"
        )
    low, high = mamba.time_step_limit
    if not (0 <= low <= high):
        raise ConfigValueError(
            "mamba.time_step_limit", mamba.time_step_limit, "a range 0 <= low <= high"
        )


def _check_multipliers(multipliers: FoldedMultipliers) -> None:
    for field in dataclasses.fields(multipliers):
        value = getattr(multipliers, field.name)
        values = value if isinstance(value, tuple) else (value,)
        if not all(_is_real(v) for v in values):
            raise ConfigValueError(field.name, value, "finite numbers")


def _check_sharing(config: ModelConfig) -> None:
    """Gemma 4's shared layers: each reads an earlier layer of its type."""
    shared = config.num_kv_shared_layers
    if not (_is_int(shared) and 0 <= shared < config.num_layers):
        raise ConfigValueError(
            "num_kv_shared_layers", shared, f"an integer from 0 to {config.num_layers - 1}"
        )
    first = config.num_layers - shared
    if shared and not set(config.layer_types[first:]) <= set(config.layer_types[:first]):
        raise ConfigValueError(
            "num_kv_shared_layers",
            shared,
            "a count whose layers each find an earlier layer of their type to read",
        )
    if shared and set(STATE_LAYER_TYPES) & set(config.layer_types):
        raise ConfigValueError("num_kv_shared_layers", shared, "0 in a model with linear layers")


def _check_delta_net(delta: DeltaNetConfig) -> None:
    for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel"):
        _check_count(name, getattr(delta, name))
    if delta.num_v_heads % delta.num_k_heads:
        raise ConfigValueError(
            "num_v_heads",
            delta.num_v_heads,
            f"a multiple of the linear layers' key heads ({delta.num_k_heads})",
        )


def _check_moe(moe: MoeConfig, layers: int) -> None:
    _check_count("num_experts", moe.num_experts)
    _check_count("moe_intermediate_size", moe.intermediate_size)
    if not (_is_int(moe.top_k) and 1 <= moe.top_k <= moe.num_experts):
        raise ConfigValueError(
            "num_experts_per_tok", moe.top_k, f"an integer from 1 to the {moe.num_experts} experts"
        )
    if len(moe.sparse) != layers:
        raise ConfigValueError("moe.sparse", moe.sparse, f"{layers} entries (one per layer)")
    _check_positive("routed_scaling_factor", moe.routed_scale)
    _check_groups(moe)


def _check_groups(moe: MoeConfig) -> None:
    """Group-limited routing: the experts split evenly into ``n_group`` groups, of which
    ``topk_group`` hold at least ``top_k`` experts (and two each, scored by their best two)."""
    _check_count("n_group", moe.n_group)
    if moe.num_experts % moe.n_group:
        raise ConfigValueError(
            "n_group", moe.n_group, f"a divisor of the {moe.num_experts} routed experts"
        )
    per_group = moe.num_experts // moe.n_group
    if not (_is_int(moe.topk_group) and 1 <= moe.topk_group <= moe.n_group):
        raise ConfigValueError("topk_group", moe.topk_group, f"an integer from 1 to {moe.n_group}")
    if moe.top_k > moe.topk_group * per_group:
        raise ConfigValueError(
            "num_experts_per_tok",
            moe.top_k,
            f"at most the {moe.topk_group * per_group} experts of the chosen groups",
        )
    if moe.group_rule == "top2" and moe.n_group > 1 and per_group < 2:
        raise ConfigValueError("n_group", moe.n_group, "groups of two experts at least")


def _check_mla(config: ModelConfig) -> None:
    mla = config.mla
    assert mla is not None
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        _check_count(name, getattr(mla, name))
    if mla.q_lora_rank is not None:
        _check_count("q_lora_rank", mla.q_lora_rank)
    if config.head_dim != mla.qk_head_dim:
        raise ConfigValueError(
            "head_dim", config.head_dim, f"qk_nope_head_dim + qk_rope_head_dim ({mla.qk_head_dim})"
        )
    if config.rope.rotary_dim != mla.qk_rope_head_dim:
        raise ConfigValueError(
            "rope.rotary_dim", config.rope.rotary_dim, f"qk_rope_head_dim ({mla.qk_rope_head_dim})"
        )


def _check_rope(name: str, rope: RopeConfig, head_dim: int) -> None:
    _check_positive(f"{name}.theta", rope.theta)
    dim = rope.rotary_dim
    if not (_is_int(dim) and 2 <= dim <= head_dim and dim % 2 == 0):
        expected = f"an even number of dimensions from 2 to the head's {head_dim}"
        raise ConfigValueError(f"{name}.rotary_dim", dim, expected)
    _check_positive(f"{name}.factor", rope.factor)
    if not (_is_real(rope.partial_rotary_factor) and 0 < rope.partial_rotary_factor <= 1):
        raise ConfigValueError(
            f"{name}.partial_rotary_factor", rope.partial_rotary_factor, "a number in (0, 1]"
        )
    for field in ("beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor"):
        _check_positive(f"{name}.{field}", getattr(rope, field))
    for field in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(rope, field) is not None:
            _check_positive(f"{name}.{field}", getattr(rope, field))
    if rope.original_max_position is not None or rope.kind in ("llama3", "yarn", "longrope"):
        _check_count(f"{name}.original_max_position", rope.original_max_position)
    if rope.kind == "yarn" and rope.theta == 1:
        raise ConfigValueError(f"{name}.theta", rope.theta, "a base other than 1 (yarn)")
    # (equal factors leave no band between the scaled and the kept frequencies: Llama 4)
    if rope.kind == "llama3" and rope.high_freq_factor < rope.low_freq_factor:
        raise ConfigValueError(
            f"{name}.high_freq_factor",
            rope.high_freq_factor,
            f"at least the low frequency factor ({rope.low_freq_factor})",
        )
    for field in ("freq_factors", "short_factor", "long_factor"):
        _check_factors(f"{name}.{field}", getattr(rope, field), dim // 2)
    if rope.kind == "longrope" and (rope.short_factor is None or rope.long_factor is None):
        raise ConfigValueError(f"{name}.long_factor", None, "short and long factors (longrope)")


def _check_factors(name: str, factors: tuple[float, ...] | None, count: int) -> None:
    if factors is None:
        return
    if len(factors) != count or not all(_is_real(f) and f > 0 for f in factors):
        shown = f"{len(factors)} values" if len(factors) != count else factors
        raise ConfigValueError(name, shown, f"{count} finite positive numbers (one per pair)")


def _check_token_ids(config: ModelConfig) -> None:
    ids = {"bos_token_id": [config.bos_token_id] if config.bos_token_id is not None else []}
    ids["eos_token_ids"] = list(config.eos_token_ids)
    for name, values in ids.items():
        for value in values:
            if not (_is_int(value) and 0 <= value < config.vocab_size):
                raise ConfigValueError(
                    name, value, f"a token id within the vocabulary (0 to {config.vocab_size - 1})"
                )


def _check_count(name: str, value: object) -> None:
    if not (_is_int(value) and 0 < value <= MAX_COUNT):
        raise ConfigValueError(name, value, f"a positive integer up to {MAX_COUNT:,}")


def _check_positive(name: str, value: object) -> None:
    if not (_is_real(value) and value > 0):
        raise ConfigValueError(name, value, "a finite number > 0")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A finite number torch can compute with (a Python int past int64 it cannot take)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) < 2**63
    return isinstance(value, float) and math.isfinite(value)
