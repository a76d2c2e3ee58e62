"""What a model family is: its names in both file formats, how its config fields are read
from each, its GGUF tensor names, its tokenizer rules, its layers and its tiny test model.

One module per family holds one `Family`; `models.arch` lists them. The loaders read
the fields common to every family themselves and ask the family for the rest, through
a typed reader of the file's keys (`ConfigKeys`) that names the file and key in errors.
"""

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ...errors import ModelFileError
from ...memory import host_tensor
from ...quant.linear import QuantizedWeight
from ..layers import LayerSpec, describe_layers

if TYPE_CHECKING:
    from ..config import LayerType, ModelConfig, MoeConfig, RopeConfig

Fields = dict[str, Any]
# (name, tensor) pairs as a file holds them (GGUF names already ours), as the model's
# parameters; the tensors torch ones or the loader's quantized weights.
Tensors = Iterator[tuple[str, Any]]


class ConfigKeys(Protocol):
    """Typed reads of a file's config values (`loader.typed.TypedReader`): each raises a
    ModelFileError naming the file and the key."""

    def get(self, key: str, default: Any = None) -> Any: ...
    def count(self, key: str, default: Any = ...) -> Any: ...
    def positive(self, key: str, default: Any = ...) -> Any: ...
    def boolean(self, key: str, default: Any = ...) -> Any: ...
    def wrong(self, key: str, value: Any, expected: str) -> Exception: ...
    def missing(self, key: str) -> Exception: ...


class HfKeys(ConfigKeys, Protocol):
    """A ``config.json`` (`loader.hf_config`): also its rope section of a layer type."""

    def rope(self, layer_type: str, head_dim: int) -> "RopeConfig": ...


class GgufKeys(ConfigKeys, Protocol):
    """A GGUF file's metadata under ``{arch}.`` (`loader.gguf_config`): also its tensors
    and llama.cpp's sliding-window pattern."""

    def has_tensor(self, name: str) -> bool: ...
    def swa_layer_types(
        self, default_period: int | None, layers: int
    ) -> tuple["LayerType", ...]: ...


def no_fields(keys: ConfigKeys, *_: Any) -> Fields:
    return {}


def as_stored(tensors: Tensors, config: "ModelConfig") -> Tensors:
    return tensors


def rows_as_stored(name: str, tensor: Any, config: "ModelConfig") -> Any:
    return tensor


def as_state_layer_holds(name: str, tensor: Any) -> tuple[str, Any]:
    """A state layer's tensor as llama.cpp's converters store it → as the layer holds it
    (a checkpoint's passes unchanged): A stored as ``-exp(A_log)`` (``*.ssm_a``, a row or
    a column), dt's bias as ``*.dt.bias``, the convolution's taps as ``[channels,
    kernel]``."""
    if name.endswith(".ssm_a"):
        return name.removesuffix(".ssm_a") + ".A_log", torch.log(-tensor.flatten().float())
    if name.endswith(".dt.bias"):
        return name.removesuffix(".dt.bias") + ".dt_bias", tensor
    if name.endswith(".conv1d.weight") and tensor.dim() == 2:
        return name, tensor.unsqueeze(1)
    return name, tensor


def pairs_to_halves(
    weight: "torch.Tensor | QuantizedWeight", heads: int, rotary_dim: int | None = None
) -> "torch.Tensor | QuantizedWeight":
    """q or k rows (or their bias) whose rotary dims rotate in adjacent pairs (GPT-J's
    interleaved rope, llama.cpp's NORM kind) put in rotate-half order, which is the one
    the rope here applies: each head's first ``rotary_dim`` rows (all where None) become
    its even rows, then its odd ones; the rest stay. q and k move alike, so their scores
    are unchanged. A quantized matrix moves whole rows of blocks."""
    data = weight.data if isinstance(weight, QuantizedWeight) else weight
    head_dim = data.shape[0] // heads
    rotary = rotary_dim or head_dim
    within = torch.cat(
        [torch.arange(0, rotary, 2), torch.arange(1, rotary, 2), torch.arange(rotary, head_dim)]
    )
    order = (torch.arange(heads)[:, None] * head_dim + within).flatten()
    # where the loader put the weight (huge pages for a large one), not torch's allocator
    data = torch.index_select(
        data, 0, order, out=host_tensor(tuple(data.shape), data.dtype, zeroed=False)
    )
    if isinstance(weight, QuantizedWeight):
        return QuantizedWeight(data, weight.qtype, weight.shape)
    return data


def rotate_pairs_as_halves(tensors: Tensors, config: "ModelConfig") -> Tensors:
    """A family whose q and k rotate in adjacent pairs, in both formats: their rows (and
    biases) put in rotate-half order as they load (`pairs_to_halves`)."""
    for name, tensor in tensors:
        proj = name.rpartition(".self_attn.")[2].partition(".")[0]
        if proj in ("q_proj", "k_proj") and name.endswith((".weight", ".bias")):
            heads = config.num_heads if proj == "q_proj" else config.num_kv_heads
            rows = heads * config.head_dim
            if tensor.shape[0] != rows:
                raise ModelFileError(
                    f"tensor {name!r} has {tensor.shape[0]} rows; the model expects {rows} "
                    "(heads x head size)"
                )
            tensor = pairs_to_halves(tensor, heads, config.rope.rotary_dim)
        yield name, tensor


# llama.cpp's block tensor names → ours (the Hugging Face module names), as most families
# name them; a family lists its own where they differ.
COMMON_GGUF_NAMES: Mapping[str, str] = {
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
    # Mixtures of experts: the router, and each projection's experts stacked [E, rows,
    # columns] (`loader.weights.read_gguf` splits them into each expert's own).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Gemma's four norms around attention and MLP ("sandwich"), and OLMo 2's two after them.
SANDWICH_GGUF_NAMES: Mapping[str, str] = {
    **COMMON_GGUF_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# A Mamba-2 mixer's tensors (Granite 4.0-H, Falcon-H1), as llama.cpp's files name them.
MAMBA2_GGUF_NAMES: Mapping[str, str] = {
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_dt": "mamba.dt",
    "ssm_a": "mamba.ssm_a",
    "ssm_d": "mamba.D",
    "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj",
}

# A shared expert beside the routed ones and the one-row projection gating it (Qwen2-MoE,
# Qwen3.5 MoE), as llama.cpp's files name them.
SHARED_EXPERT_GGUF_NAMES: Mapping[str, str] = {
    "ffn_gate_inp_shexp": "shared_mlp_gate",
    "ffn_gate_shexp": "shared_mlp.gate_proj",
    "ffn_up_shexp": "shared_mlp.up_proj",
    "ffn_down_shexp": "shared_mlp.down_proj",
}
# The checkpoints' names of them inside a layer → ours (the decoder layer's).
_SHARED_EXPERT_NAMES = {
    ".mlp.shared_expert_gate.": ".shared_mlp_gate.",
    ".mlp.shared_expert.": ".shared_mlp.",
}


def shared_expert_tensors(stored: Tensors) -> Tensors:
    """A shared expert and its gate under our names (a GGUF's gate a row of hidden size:
    ours is a one-row matrix)."""
    for name, tensor in stored:
        for theirs, ours in _SHARED_EXPERT_NAMES.items():
            name = name.replace(theirs, ours)
        if name.endswith(".shared_mlp_gate.weight") and isinstance(tensor, torch.Tensor):
            tensor = tensor.reshape(1, -1)
        yield name, tensor


@dataclass(frozen=True)
class Family:
    """One model family. ``name`` is `ModelConfig.architecture`.

    - ``model_types``: the ``config.json`` model types it reads (``wrapper_types``: those
      of multimodal configs nesting its language model in ``text_config``, whose other
      parts are left unread); ``gguf_archs``: the GGUF
      ``general.architecture`` names (several families may share one, the first family
      listing it reads it: a llama file with experts is Mixtral).
    - ``hf_fields(keys, head_dim)`` / ``gguf_fields(keys, fields)``: the `ModelConfig`
      fields beyond the common ones (``fields``: those read so far).
    - ``gguf_names``: block tensor names (a GGUF name's kind, ``weight`` or ``bias``,
      follows; a few tensors have none, ``ssm_a``); ``gguf_top_names``: the family's
      model-level tensors beyond the embedding, the final norm and the head;
      ``gguf_permuted_qk``: llama.cpp's
      converter permutes q and k rows for its NORM rope (Llama's layout), undone as they
      load.
    - ``gguf_renormalizes_top_k``: llama.cpp's rule for MoE weights where the file does
      not say (``expert_weights_norm``).
    - ``gguf_auto_tokenizer``: transformers' AutoTokenizer converts its GGUF vocabulary
      (else the generic fast tokenizer reads the file's tokenizer metadata).
    - ``ntk_alpha_rope``: a ``config.json`` rope of type "dynamic" with an ``alpha`` is
      fixed NTK-alpha scaling (transformers' HunYuan), not length-dependent scaling.
    - ``chat_template``: the template where a file carries none.
    - ``layers(config)``: one `LayerSpec` per layer; ``state_layers``: some of them keep
      a state per sequence (a hybrid: what needs K and V of every layer refuses it).
    - ``tensors(stored, config)``: the file's tensors renamed, split and reshaped where
      the family's layout is its own (both formats, before the loader's common splits;
      a GGUF's under the names ``gguf_names`` gives them).
    - ``hf_prefixes``: a checkpoint's name prefixes outside the ``model.`` layout
      (GPT-NeoX's ``gpt_neox.``), renamed to ours before anything reads the names;
      ``hf_unused``: name suffixes of checkpoint tensors the model does not use (old
      buffers saved beside the weights), left unread.
    - ``projection_rows(name, tensor, config)``: a projection's output rows (the weight
      ``name``'s) in the order the model holds them, where ``tensors`` reorders them
      (Cohere's q and k); a LoRA adapter's ``lora_B`` rows go through it too.
    - ``quant_methods``: the ``quantization_config.quant_method``s of a ``config.json``
      that it reads, each with the name suffixes of the tensors stored packed under it
      (read as their bytes, not checked as floats: ``tensors`` turns them into quantized
      weights); a checkpoint quantized any other way is refused at load.
    - ``extra_layers_key``: the ``config.json`` key counting layers a checkpoint keeps
      after the decoder's as more ``model.layers.N`` (DeepSeek-V3's multi-token
      prediction), accepted by the layer-count check; ``tensors`` leaves them out.
    - ``tiny``: the family's tiny test model: ``config.json`` keys beside the common tiny
      sizes (None: a common one left out); the tests build it through transformers, and
      fail for a family without one.
    """

    name: str
    model_types: tuple[str, ...]
    wrapper_types: tuple[str, ...] = ()
    gguf_archs: tuple[str, ...] = ()
    hf_fields: Callable[..., Fields] = no_fields
    gguf_fields: Callable[..., Fields] = no_fields
    gguf_names: Mapping[str, str] = field(default_factory=lambda: COMMON_GGUF_NAMES)
    gguf_top_names: Mapping[str, str] = field(default_factory=dict)
    gguf_permuted_qk: bool = False
    gguf_renormalizes_top_k: bool = True
    gguf_auto_tokenizer: bool = False
    ntk_alpha_rope: bool = False
    chat_template: str | None = None
    layers: Callable[["ModelConfig"], tuple[LayerSpec, ...]] = describe_layers
    state_layers: bool = False
    tensors: Callable[[Tensors, "ModelConfig"], Tensors] = as_stored
    hf_prefixes: Mapping[str, str] = field(default_factory=dict)
    hf_unused: tuple[str, ...] = ()
    projection_rows: Callable[[str, Any, "ModelConfig"], Any] = rows_as_stored
    quant_methods: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    tiny: Mapping[str, Any] = field(default_factory=dict)
    extra_layers_key: str | None = None


def renaming(modules: Mapping[str, str]) -> Callable[[Tensors, "ModelConfig"], Tensors]:
    """A family's ``tensors`` that renames a checkpoint's modules to ours (``.old.`` to
    ``.new.`` within each name: Phi-2's ``mlp.fc1`` is our ``mlp.up_proj``)."""

    def renamed(tensors: Tensors, config: "ModelConfig") -> Tensors:
        for name, tensor in tensors:
            for old, new in modules.items():
                if f".{old}." in name:
                    name = name.replace(f".{old}.", f".{new}.")
                    break
            yield name, tensor

    return renamed


def layer_norm_fields(eps: float) -> Fields:
    """The fields of a model of LayerNorms (weight and bias) and plain, biased MLPs."""
    return {"norm_kind": "layer", "rms_norm_eps": eps, "mlp_gated": False, "mlp_bias": True}


def biases(keys: ConfigKeys) -> Fields:
    """Llama's ``attention_bias``: q, k, v and o together."""
    bias = bool(keys.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def experts(keys: ConfigKeys, inner_key: str, renormalize: bool) -> "MoeConfig":
    """The experts' counts from a ``config.json``, under either name transformers writes."""
    from ..components import MoeConfig

    name = "num_experts" if keys.get("num_experts") is not None else "num_local_experts"
    return MoeConfig(
        num_experts=keys.count(name),
        top_k=keys.count("num_experts_per_tok"),
        intermediate_size=keys.count(inner_key),
        renormalize=renormalize,
    )


def time_step_limit(keys: ConfigKeys) -> tuple[float, float]:
    """A Mamba-2's clamp of each step's dt (``time_step_limit``; none where absent)."""
    limit = keys.get("time_step_limit")
    if limit is None:
        return (0.0, math.inf)
    if not (isinstance(limit, list | tuple) and len(limit) == 2):
        raise keys.wrong("time_step_limit", limit, "two numbers: the least and most dt")
    return (float(limit[0]), float(limit[1]))
