"""The parts a `ModelConfig` is made of: a rotary embedding's configuration, a mixture of
experts', Llama 4's query temperature, a Gated DeltaNet's, a Mamba-2's and a Mamba-1's
sizes. The family modules (`models.arch`) build them; they depend on nothing of the
project's, so that the families and `ModelConfig` need not import each other."""

import math
from dataclasses import dataclass
from typing import Literal

import torch

RopeKind = Literal["default", "linear", "llama3", "yarn", "longrope", "proportional"]


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
    # proportional (Gemma 4's global layers): the whole head is paired for rotate-half and
    # the exponents run over it, but only this share of the pairs turns (the rest: 0 Hz).
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts feed-forward: a router picks ``top_k`` of ``num_experts``
    gated MLPs per token. Routing follows transformers: a float32 softmax over the
    router's logits, the top-k probabilities, renormalised to sum to 1 where
    ``renormalize``; Mixtral weighs the experts' outputs in float32 (``float_weights``),
    the others in the model's dtype. ``sparse``: which layers are MoE layers (Qwen3-MoE
    may keep some dense, with the model's ``intermediate_size``).
    ``shared_intermediate_size``: a shared expert beside the routed ones, which every
    token runs through; ``shared_gate``: its output scaled per token by the sigmoid of
    one more projection of the layer's input (Qwen2-MoE, Qwen3.5 MoE), else added as it is.
    ``routing``: ``softmax`` (the rule above), or ``sigmoid_input`` (Llama 4): the top-k
    router logits chosen as they are, and each chosen expert's input (not its output)
    scaled by the sigmoid of its logit."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    float_weights: bool = False
    sparse: tuple[bool, ...] = ()
    bias: bool = False  # gpt-oss: the router and every expert projection biased
    shared_intermediate_size: int | None = None
    shared_gate: bool = False
    # DeepSeek's routing (V2: softmax, V3: sigmoid): ``score_bias`` adds a learned bias per
    # expert to the scores for choosing alone (V3's ``e_score_correction_bias``); with
    # ``n_group`` groups, only experts of the ``topk_group`` best groups are chosen, a
    # group scored by its best expert (``max``, V2) or its best two summed (``top2``, V3);
    # the chosen weights are then renormalised where ``renormalize`` and multiplied by
    # ``routed_scale``.
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    score_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_rule: Literal["max", "top2"] = "max"
    routed_scale: float = 1.0
    routing: Literal["softmax", "sigmoid_input"] = "softmax"

    @property
    def plain_routing(self) -> bool:
        """A softmax top-k over every expert, as the native and fused kernels route."""
        return (
            self.routing == "softmax"
            and self.scoring == "softmax"
            and not self.score_bias
            and self.n_group == 1
            and self.routed_scale == 1.0
        )


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention's sizes (DeepSeek-V2 and V3): queries projected
    directly (``q_lora_rank`` None) or through a normed rank-``q_lora_rank`` bottleneck;
    keys and values made per head from one latent of ``kv_lora_rank`` per token
    (``kv_b_proj``), beside one rotated key of ``qk_rope_head_dim`` shared by every head.
    A query head is ``qk_nope_head_dim + qk_rope_head_dim`` wide, a value head
    ``v_head_dim``. The cache keeps the latent and the rotated key alone."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # The checkpoint's rotated dims come in interleaved pairs (DeepSeek's layout; the
    # loader regroups them into halves for rotate-half), or already in halves.
    rope_interleaved: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """What a token keeps per layer: its latent, then its rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class AttentionTemperature:
    """Llama 4's temperature tuning on the layers that do not rotate: each query scaled by
    ``1 + scale * log(1 + floor((position + 1) / floor_scale))``, so attention sharpens
    as the context grows past multiples of ``floor_scale`` tokens."""

    floor_scale: float
    scale: float

    def factors(self, positions: torch.Tensor) -> torch.Tensor:
        """The float32 factor of each of ``positions [T]``."""
        steps = torch.floor((positions.float() + 1.0) / self.floor_scale)
        return torch.log1p(steps) * self.scale + 1.0


@dataclass(frozen=True)
class DeltaNetConfig:
    """A Gated DeltaNet's sizes (Qwen3.5): ``num_k_heads`` query/key heads of
    ``head_k_dim``, ``num_v_heads`` value heads of ``head_v_dim`` (each key head serving
    ``num_v_heads / num_k_heads`` of them), and a causal depthwise convolution of
    ``conv_kernel`` taps over the q, k and v projections."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    # Value heads in llama.cpp's order: head h reads key head h % num_k_heads ("tiled");
    # else transformers', head h reading key head h // (num_v_heads / num_k_heads).
    v_heads_tiled: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class Mamba2Config:
    """A Mamba-2 layer's sizes (Granite 4.0-H): ``num_heads`` heads of ``head_dim``
    channels, each a selective state space of ``state_size`` per channel, whose input (B)
    and output (C) projections come in ``n_groups`` groups shared by consecutive heads; a
    causal depthwise convolution of ``conv_kernel`` taps over x, B and C. ``chunk_size``:
    the scan's chunk in prefill; ``time_step_limit``: the clamp of each step's dt."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int = 256
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    # The grouped RMS norm and the SiLU gate z: normed after gating (Mamba-2, Granite),
    # before it (Falcon-H1's ``mamba_norm_before_gate``), or no norm, the gate alone.
    norm: Literal["after_gate", "before_gate", "none"] = "after_gate"
    out_bias: bool | None = None  # out_proj's bias where it differs from in_proj's

    @property
    def out_proj_bias(self) -> bool:
        return self.proj_bias if self.out_bias is None else self.out_bias

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: x, then B and C of every group."""
        return self.inner_size + 2 * self.n_groups * self.state_size

    @property
    def projection_size(self) -> int:
        """``in_proj``'s rows: the gate z, the convolution's inputs, then dt per head."""
        return self.inner_size + self.conv_dim + self.num_heads


@dataclass(frozen=True)
class Mamba1Config:
    """A Mamba-1 layer's sizes (Jamba): ``inner_size`` channels, each a selective state
    space of ``state_size`` with its own decay rates (A is ``[inner_size, state_size]``);
    B, C and the step's low-rank input (``dt_rank``) projected from the convolved
    channels, the step then widened to every channel; a causal depthwise convolution of
    ``conv_kernel`` taps. ``dt_norms``: Jamba's RMS norms of the step's input, B and C."""

    inner_size: int
    state_size: int
    dt_rank: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    dt_norms: bool = True


@dataclass(frozen=True)
class FoldedMultipliers:
    """Falcon-H1's muP multipliers, which scale a projection's input or output: folded
    into the weights as a checkpoint loads (llama.cpp's converter folds them into a
    GGUF's), so the layers run as plain ones. ``ssm_segments``: the Mamba-2 projection's
    five parts (z, x, B, C, dt) each scaled by its own."""

    attention_in: float = 1.0
    attention_out: float = 1.0
    key: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0
    ssm_segments: tuple[float, float, float, float, float] = (1.0,) * 5
    mlp_gate: float = 1.0
    mlp_down: float = 1.0
