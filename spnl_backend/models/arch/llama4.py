"""Llama 4 (text): pre-norm layers of three kinds of attention and two of FFN.

- Attention: on the layers that rotate, chunked (a query sees only the keys of its own
  chunk of ``attention_chunk_size`` positions: `Scoring.chunk`) with q and k RMS-normed per
  head without a weight after the rotation (``use_qk_norm``); every fourth layer
  (``no_rope_layers``: 0) neither rotates nor chunks, and scales its queries by a factor of
  their position (``attn_temperature_tuning``: `AttentionTemperature`).
- FFN: dense (``intermediate_size_mlp``) or experts (``moe_layers``, else every
  ``interleave_moe_layer_step``-th layer): a top-k router whose chosen logits' sigmoids
  scale each expert's input (`MoeConfig.routing` ``sigmoid_input``), beside a shared expert
  every token runs through, ungated (both of ``intermediate_size``).

Meta's checkpoints rotate q and k as complex pairs (dims 2i and 2i + 1 of a head); the
model rotates halves (i and i + d/2), so q and k rows are reordered as they load, in either
format (llama.cpp's converter keeps the pairs: its ``llama4`` files use NORM rope).
transformers keeps the FFN under ``feed_forward`` with the experts stacked (``gate_up_proj
[E, hidden, 2I]``, gate columns first; ``down_proj [E, I, hidden]``) and the router as
``router``. A multimodal checkpoint (``llama4``) nests the language model's config in
``text_config`` and its weights under ``language_model.``; the vision tower is left unread.

llama.cpp's ``llama4`` GGUF keeps neither the chunk size nor the temperature: its graph
hard-codes a chunk of 8192, a floor scale of 8192 and a scale of 0.1, one layer in four not
rotating (the fourth), the chunked layers by ``attention.sliding_window_pattern`` (else 3 in
4), and the q/k norm on every model but the 128-expert one. A file it reads as chunk-free
(``attention.sliding_window`` 0) is refused: llama.cpp's
graph for it leaves its last layer unrotated with no temperature, which no checkpoint
describes. Any other window is ignored, as llama.cpp ignores it.
"""

import dataclasses
import re
from typing import TYPE_CHECKING

import torch

from ...errors import ModelFileError
from ...quant.linear import QuantizedWeight
from ..components import AttentionTemperature, MoeConfig
from .family import COMMON_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys, Tensors, biases

if TYPE_CHECKING:
    from ..config import ModelConfig

# llama.cpp's constants for every llama4 file (its graph's, not the file's)
_GGUF_CHUNK = 8192
_GGUF_TEMPERATURE = AttentionTemperature(floor_scale=8192.0, scale=0.1)
_GGUF_NO_ROPE_STEP = 4
_GGUF_SWA_PERIOD = 4
_GGUF_NO_QK_NORM_EXPERTS = 128  # the 128-expert model was trained without it

_EXPERTS = re.compile(r"(model\.layers\.\d+)\.feed_forward\.experts\.(gate_up_proj|down_proj)")
_QK = re.compile(r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj)\.(?:weight|bias)")
_RENAMED = (
    (".feed_forward.router.", ".mlp.gate."),
    (".feed_forward.shared_expert.", ".shared_mlp."),
    (".feed_forward.", ".mlp."),
)


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    layers = keys.count("num_hidden_layers")
    moe = _hf_experts(keys, layers)
    dense = moe is None or not all(moe.sparse)
    tuned = bool(keys.get("attn_temperature_tuning", True))
    temperature = None
    if tuned:
        scale = keys.get("attn_scale", 0.1)
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            raise keys.wrong("attn_scale", scale, "a number (the temperature's strength)")
        temperature = AttentionTemperature(keys.positive("floor_scale", 8192), float(scale))
    return {
        **biases(keys),
        "intermediate_size": keys.count("intermediate_size_mlp") if dense else 0,
        "moe": moe,
        "rope_layers": _rotating_layers(keys, layers),
        "qk_norm_unit": bool(keys.get("use_qk_norm", True)),
        "attention_chunk_size": keys.count("attention_chunk_size", None),
        "attn_temperature": temperature,
    }


def _hf_experts(keys: HfKeys, layers: int) -> MoeConfig | None:
    """The experts of the layers ``moe_layers`` names (transformers fills it in from
    ``interleave_moe_layer_step``); None where it names none."""
    named = keys.get("moe_layers")
    if not (
        isinstance(named, list)
        and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in named)
    ):
        raise keys.wrong("moe_layers", named, f"a list of layer indices from 0 to {layers - 1}")
    if not named:
        return None
    inner = keys.count("intermediate_size")
    return MoeConfig(
        num_experts=keys.count("num_local_experts"),
        top_k=keys.count("num_experts_per_tok"),
        intermediate_size=inner,
        renormalize=False,
        sparse=tuple(i in named for i in range(layers)),
        shared_intermediate_size=inner,
        routing="sigmoid_input",
    )


def _rotating_layers(keys: HfKeys, layers: int) -> tuple[bool, ...]:
    """``no_rope_layers``: one flag per layer, 1 where it rotates (transformers fills it
    in from ``no_rope_layer_interval``; a longer list's extra flags are unused)."""
    flags = keys.get("no_rope_layers")
    if not (isinstance(flags, list) and len(flags) >= layers and set(flags) <= {0, 1}):
        raise keys.wrong("no_rope_layers", flags, f"at least {layers} flags, 1 or 0 per layer")
    return tuple(bool(flag) for flag in flags[:layers])


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    """What llama.cpp's graph hard-codes for ``llama4`` (module docstring)."""
    moe = fields["moe"]
    if moe is None:
        raise keys.wrong(
            "expert_count",
            keys.get("expert_count"),
            "experts in some block (a router, blk.N.ffn_gate_inp.weight): a llama4 model has them",
        )
    if keys.get("attention.sliding_window") == 0:  # chunk-free to llama.cpp (docstring)
        raise keys.wrong(
            "attention.sliding_window",
            0,
            "a window other than 0: llama.cpp reads 0 as chunk-free attention with an "
            "unrotated last layer and no temperature, which no Llama 4 checkpoint describes",
        )
    layers = fields["num_layers"]
    moe = dataclasses.replace(
        moe,
        renormalize=False,
        shared_intermediate_size=moe.intermediate_size,
        routing="sigmoid_input",
    )
    swa = keys.swa_layer_types(_GGUF_SWA_PERIOD, layers)
    return {
        "moe": moe,
        "sliding_window": None,
        "layer_types": tuple("chunked" if kind == "sliding" else kind for kind in swa),
        "attention_chunk_size": _GGUF_CHUNK,
        "rope_layers": tuple((i + 1) % _GGUF_NO_ROPE_STEP != 0 for i in range(layers)),
        "qk_norm_unit": moe.num_experts != _GGUF_NO_QK_NORM_EXPERTS,
        "attn_temperature": _GGUF_TEMPERATURE,
    }


def tensors(stored: Tensors, config: "ModelConfig") -> Tensors:
    """The FFN under the model's names (the stacked experts each its own), q and k rows
    from complex pairs to halves."""
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    for name, tensor in stored:
        if match := _EXPERTS.fullmatch(name):
            yield from _experts(match[1], match[2], tensor)
            continue
        for theirs, ours in _RENAMED:
            if theirs in name:
                name = name.replace(theirs, ours)
                break
        if match := _QK.fullmatch(name):
            tensor = _pairs_to_halves(tensor, heads[match[1]], name)
        yield name, tensor


def _experts(stem: str, kind: str, stacked: torch.Tensor) -> Tensors:
    """transformers' stacks as each expert's projections (``[out, in]``)."""
    for expert, part in enumerate(stacked.unbind(0)):
        prefix = f"{stem}.mlp.experts.{expert}"
        if kind == "gate_up_proj":  # [hidden, 2I]: gate's columns, then up's
            gate, up = part.chunk(2, dim=-1)
            yield f"{prefix}.gate_proj.weight", gate.T.contiguous()
            yield f"{prefix}.up_proj.weight", up.T.contiguous()
        else:  # [I, hidden]
            yield f"{prefix}.down_proj.weight", part.T.contiguous()


def _pairs_to_halves(
    tensor: torch.Tensor | QuantizedWeight, heads: int, name: str
) -> torch.Tensor | QuantizedWeight:
    """A q or k projection's rows (weight or bias; a quantized matrix's rows of blocks move
    whole) reordered within each head from pairs (2i, 2i + 1) to halves (i, i + d/2)."""
    data = tensor.data if isinstance(tensor, QuantizedWeight) else tensor
    rows = data.shape[0]
    if rows % (2 * heads):
        raise ModelFileError(
            f"tensor {name!r} has {rows} rows, not an even number per head for its {heads} heads"
        )
    order = data.reshape(heads, rows // heads // 2, 2, *data.shape[1:]).transpose(1, 2)
    data = order.reshape(data.shape).contiguous()
    if isinstance(tensor, QuantizedWeight):
        return QuantizedWeight(data, tensor.qtype, tensor.shape)
    return data


FAMILY = Family(
    name="llama4",
    model_types=("llama4_text",),
    wrapper_types=("llama4",),
    gguf_archs=("llama4",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names={
        **COMMON_GGUF_NAMES,
        "ffn_gate_shexp": "shared_mlp.gate_proj",
        "ffn_up_shexp": "shared_mlp.up_proj",
        "ffn_down_shexp": "shared_mlp.down_proj",
    },
    tensors=tensors,
    # Four layers: chunks of 4 (a 20-token prompt crosses five), the fourth layer without
    # rope and with a temperature that moves every 4 positions; experts in layers 1 and 3
    # (one of four per token, and the shared one), dense layers 0 and 2. The rope is Llama
    # 4's llama3 scaling with equal frequency factors (no band between).
    tiny={
        "num_hidden_layers": 4,
        "head_dim": 16,
        "intermediate_size": 32,
        "intermediate_size_mlp": 96,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "attention_chunk_size": 4,
        "floor_scale": 4,
        "attn_scale": 0.5,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 64,
        },
    },
)
