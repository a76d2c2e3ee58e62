"""Synthetic GGUF files at real model sizes, for benchmarks: realistic shapes, metadata and
quantization mixes, filled with random but valid blocks.

Every block's float16 scales are finite, normal and of realistic magnitude (the weights
come out with a standard deviation of about 0.02-0.15); every other byte (quants, packed
sub-block scales) is random (MXFP4's exponent bytes are drawn from a narrow range, for
weights of the same magnitude). Blocks are written directly, not quantized from floats, so an
8B file takes under a minute on 2 cores, and the tensors are written one at a time so
memory stays at about one tensor.

The tokenizer is the default model's (Gemma 3's SentencePiece vocabulary, 262,144 tokens).
Shapes whose real vocabulary is smaller (Llama 3's 128,256) keep that many of its tokens
(see `kept_token_ids`): the special and byte-fallback tokens at their own ids, and every
single character, so text still tokenizes into words.

    python bench/synthetic_gguf.py --shape llama-1b --format q4_k_m --out /tmp/l1b.gguf
    python bench/synthetic_gguf.py --shape qwen35-4b --format q4_k_m --out /tmp/q35.gguf
    python bench/synthetic_gguf.py --shape gpt-oss-20b --format mxfp4_moe --out /tmp/oss.gguf
    python bench/synthetic_gguf.py --shape gemma4-e4b --format q4_k_m --out /tmp/g4.gguf
"""

import argparse
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from spnl_backend.quant.ggml import SCALE_OFFSETS, ggml_format


@dataclass(frozen=True)
class DeltaNet:
    """Qwen3.5's Gated DeltaNet layers (llama.cpp's ``qwen35``): every ``interval``-th
    layer attends, the others are DeltaNet layers of these sizes. llama.cpp's qwen35 loader
    takes both head widths from ssm.state_size: a file for it needs ``k_dim == v_dim``."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int = 4
    interval: int = 4


@dataclass(frozen=True)
class Gemma4:
    """Gemma 4's own parts (llama.cpp's ``gemma4``): every ``period``-th layer global,
    with heads of ``global_head_dim`` and a proportional rope turning ``partial`` of
    them (the converter's divisors, tensor rope_freqs), the sliding layers' rope base
    ``local_theta``; the last ``shared_kv_layers`` layers reading earlier layers' K and
    V; per-layer embeddings of ``per_layer_input``
    values per layer; final logits softcapped."""

    global_head_dim: int
    per_layer_input: int
    shared_kv_layers: int
    period: int = 6
    local_theta: float = 10000.0
    partial: float = 0.25
    softcap: float = 30.0

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.period == 0


@dataclass(frozen=True)
class Shape:
    arch: str  # "llama", "gemma3", "gemma4", "qwen3moe", "qwen35" or "gpt-oss"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    context: int
    rope_theta: float
    rms_eps: float
    sliding_window: int | None = None
    # Llama 3's rope scaling ("llama3"), stored as tensor rope_freqs.weight
    rope_llama3_factor: float | None = None
    # A mixture of experts (every layer): ``experts`` feed-forwards of ``ffn`` rows,
    # ``experts_used`` per token.
    experts: int = 0
    experts_used: int = 0
    delta_net: DeltaNet | None = None
    rotary_dim: int | None = None  # a partial rotation (Qwen3.5: a quarter of the head)
    # YaRN (gpt-oss): the factor and the original context
    yarn: tuple[float, int] | None = None
    gemma4: Gemma4 | None = None


SHAPES = {
    # Llama-3.2-1B
    "llama-1b": Shape(
        "llama",
        2048,
        16,
        32,
        8,
        64,
        8192,
        128256,
        True,
        131072,
        500000.0,
        1e-5,
        rope_llama3_factor=32.0,
    ),
    # Llama-3.1-8B
    "llama-8b": Shape(
        "llama",
        4096,
        32,
        32,
        8,
        128,
        14336,
        128256,
        False,
        131072,
        500000.0,
        1e-5,
        rope_llama3_factor=8.0,
    ),
    # Gemma-3-4B (text model); every 6th layer global, as llama.cpp hard-codes for gemma3
    "gemma3-4b": Shape(
        "gemma3",
        2560,
        34,
        8,
        4,
        256,
        10240,
        262144,
        True,
        131072,
        1000000.0,
        1e-6,
        sliding_window=1024,
    ),
    # Gemma-3-1B (text only); every 6th layer global, as for the 4B
    "gemma3-1b": Shape(
        "gemma3",
        1152,
        26,
        4,
        1,
        256,
        6912,
        262144,
        True,
        32768,
        1000000.0,
        1e-6,
        sliding_window=512,
    ),
    # OLMoE-1B-7B's sizes (64 experts of 1,024, 8 per token, 16 layers) as llama.cpp's
    # qwen3moe (its q/k norms per head): llama.cpp and we run that architecture from GGUF
    "olmoe-7b": Shape(
        "qwen3moe",
        2048,
        16,
        16,
        16,
        128,
        1024,
        50304,
        False,
        4096,
        10000.0,
        1e-5,
        experts=64,
        experts_used=8,
    ),
    # Qwen3.5-4B (text; llama.cpp's qwen35): 24 Gated DeltaNet layers (16 key heads, 32
    # value heads of 128), every 4th layer attention (16 heads of 256, 4 KV heads, q doubled
    # by its output gate, a quarter of the head rotated), the embedding tied
    "qwen35-4b": Shape(
        "qwen35",
        2560,
        32,
        16,
        4,
        256,
        9216,
        248320,
        True,
        262144,
        10000000.0,
        1e-6,
        delta_net=DeltaNet(16, 32, 128, 128),
        rotary_dim=64,
    ),
    # gpt-oss-20b: 24 layers, 32 experts of 2,880 (4 per token, biased, MXFP4 in its
    # files), 64 heads of 64 with sinks, 8 KV heads, 128-token windows on even layers
    "gpt-oss-20b": Shape(
        "gpt-oss",
        2880,
        24,
        64,
        8,
        64,
        2880,
        201088,
        False,
        131072,
        150000.0,
        1e-5,
        sliding_window=128,
        experts=32,
        experts_used=4,
        yarn=(32.0, 4096),
    ),
    # Gemma-4-E4B (text): google/gemma-4-E4B's config.json text_config (hidden 2,560, 42
    # layers of 5 sliding then 1 global, FFN 10,240, 8 heads, 2 KV heads, head 256 and
    # global head 512, window 512, the last 18 layers sharing K/V, PLE 256 per layer,
    # vocabulary 262,144 for both tables, rope bases 1e4 / 1e6 with a quarter of the
    # global head turning, softcap 30, tied), as public code quoting that config gives it
    "gemma4-e4b": Shape(
        "gemma4",
        2560,
        42,
        8,
        2,
        256,
        10240,
        262144,
        True,
        131072,
        1000000.0,
        1e-6,
        sliding_window=512,
        gemma4=Gemma4(global_head_dim=512, per_layer_input=256, shared_kv_layers=18),
    ),
    # for tests: seconds to write and load
    "tiny": Shape("llama", 256, 2, 4, 2, 64, 512, 512, True, 4096, 500000.0, 1e-5),
    "tiny-moe": Shape(
        "qwen3moe",
        256,
        2,
        4,
        2,
        64,
        256,
        512,
        False,
        4096,
        10000.0,
        1e-5,
        experts=8,
        experts_used=2,
    ),
    "tiny-qwen35": Shape(
        "qwen35",
        256,
        4,
        4,
        2,
        64,
        512,
        512,
        True,
        4096,
        10000000.0,
        1e-6,
        delta_net=DeltaNet(2, 4, 64, 64),  # llama.cpp: value heads as wide as key heads
        rotary_dim=16,
    ),
    "tiny-gemma4": Shape(
        "gemma4",
        256,
        6,
        4,
        2,
        64,
        512,
        512,
        True,
        4096,
        1000000.0,
        1e-6,
        sliding_window=8,
        gemma4=Gemma4(global_head_dim=128, per_layer_input=256, shared_kv_layers=3, period=3),
    ),
    "tiny-gpt-oss": Shape(
        "gpt-oss",
        256,
        2,
        4,
        2,
        64,
        256,
        512,
        False,
        4096,
        150000.0,
        1e-5,
        sliding_window=8,
        experts=8,
        experts_used=2,
        yarn=(32.0, 4096),
    ),
}
# llama_ftype values (general.file_type); mxfp4_moe: experts MXFP4, other matrices Q8_0
FILE_TYPES = {"q4_k_m": 15, "q8_0": 7, "q4_0": 2, "mxfp4_moe": 38}

# log-uniform ranges of each float16 scale field (d, then dmin), by format: weights
# come out with a standard deviation of roughly 0.02–0.15 given random quants and random
# packed sub-block scales (Q4_K: 6-bit 0..63; Q6_K: int8).
_SCALE_RANGES = {
    Q.Q4_0: ((2e-3, 6e-3),),
    Q.Q5_0: ((1e-3, 3e-3),),  # the k-quant fallbacks (_ROW_FALLBACK)
    Q.Q5_1: ((1e-3, 3e-3), (1e-2, 4e-2)),
    Q.Q8_0: ((1.5e-4, 4e-4),),
    Q.Q4_K: ((1e-4, 2e-4), (5e-4, 1.5e-3)),
    Q.Q5_K: ((6.5e-5, 1.3e-4), (5e-4, 1.5e-3)),
    Q.Q6_K: ((6.5e-5, 1.3e-4),),  # the smallest normal float16 is 6.1e-5
}
# MXFP4's E8M0 exponent byte (a scale of 2^(e - 128) over ggml's doubled E2M1 values,
# whose random nibbles have an RMS of about 5.9): weights of RMS about 0.02-0.05
_MXFP4_EXPONENTS = (119, 121)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers Q4_K_M gives Q6_K (ffn_down, attn_v)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# llama-quantize's fallback for a k-quant whose rows are not whole blocks of 256 (Gemma 3
# 1B's width of 1,152): a 32-value format of about as many bits
_ROW_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def tensor_plan(shape: Shape, fmt: str, pure: bool = False) -> Iterator[tuple[str, tuple, Q]]:
    """(name, numpy shape [rows, row length], type) of every tensor, in llama.cpp's order
    and with llama-quantize's type choices for the format, rows of a width that is not
    whole k-quant blocks falling back as it does."""
    for name, dims, qtype in _tensor_plan(shape, fmt, pure):
        if qtype in _ROW_FALLBACK and dims[-1] % 256:
            qtype = _ROW_FALLBACK[qtype]
        yield name, dims, qtype


def _tensor_plan(shape: Shape, fmt: str, pure: bool) -> Iterator[tuple[str, tuple, Q]]:
    if shape.arch == "gpt-oss":
        yield from _gpt_oss_plan(shape, fmt)
        return
    if shape.arch == "gemma4":
        yield from _gemma4_plan(shape, fmt, pure)
        return
    base = {"q4_k_m": Q.Q4_K, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "mxfp4_moe": Q.Q8_0}[fmt]
    # llama-quantize gives the output matrix (the embedding when tied) Q6_K unless Q8_0
    head = base if pure or base == Q.Q8_0 else Q.Q6_K
    h, q_dim, kv_dim = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    yield "token_embd.weight", (shape.vocab, h), head if shape.tied else base
    if shape.rope_llama3_factor:
        yield "rope_freqs.weight", (shape.head_dim // 2,), Q.F32
    mixed = fmt == "q4_k_m" and not pure
    attention = [i for i in range(shape.layers) if not _is_delta_net(shape, i)]
    for i in range(shape.layers):
        more = mixed and use_more_bits(i, shape.layers)
        wide = Q.Q6_K if more else base
        blk = f"blk.{i}."
        yield blk + "attn_norm.weight", (h,), Q.F32
        if _is_delta_net(shape, i):
            yield from _delta_net_plan(shape, blk, base, mixed)
        else:
            # llama-quantize counts attn_v over the attention layers only
            v_more = mixed and use_more_bits(attention.index(i), len(attention))
            # Qwen3.5's q projection carries its output gate: twice the rows
            q_rows = 2 * q_dim if shape.arch == "qwen35" else q_dim
            yield blk + "attn_q.weight", (q_rows, h), base
            yield blk + "attn_k.weight", (kv_dim, h), base
            yield blk + "attn_v.weight", (kv_dim, h), Q.Q6_K if v_more else base
            if shape.arch in ("gemma3", "qwen3moe", "qwen35"):
                yield blk + "attn_q_norm.weight", (shape.head_dim,), Q.F32
                yield blk + "attn_k_norm.weight", (shape.head_dim,), Q.F32
            yield blk + "attn_output.weight", (h, q_dim), base
        if shape.arch == "gemma3":
            yield blk + "post_attention_norm.weight", (h,), Q.F32
        if shape.arch == "qwen35":  # the norm before the MLP
            yield blk + "post_attention_norm.weight", (h,), Q.F32
        else:
            yield blk + "ffn_norm.weight", (h,), Q.F32
        if shape.experts:  # llama-quantize keeps the router in float
            e = shape.experts
            yield blk + "ffn_gate_inp.weight", (e, h), Q.F32
            yield blk + "ffn_gate_exps.weight", (e, shape.ffn, h), base
            yield blk + "ffn_up_exps.weight", (e, shape.ffn, h), base
            yield blk + "ffn_down_exps.weight", (e, h, shape.ffn), wide
            continue
        yield blk + "ffn_gate.weight", (shape.ffn, h), base
        yield blk + "ffn_up.weight", (shape.ffn, h), base
        yield blk + "ffn_down.weight", (h, shape.ffn), wide
        if shape.arch == "gemma3":
            yield blk + "post_ffw_norm.weight", (h,), Q.F32
    yield "output_norm.weight", (h,), Q.F32
    if not shape.tied:
        yield "output.weight", (shape.vocab, h), head


def _is_delta_net(shape: Shape, layer: int) -> bool:
    net = shape.delta_net
    return net is not None and (layer + 1) % net.interval != 0


def _delta_net_plan(shape: Shape, blk: str, base: Q, mixed: bool):
    """A Qwen3.5 DeltaNet layer's tensors as llama.cpp's converter names them; llama-quantize's
    Q4_K_M gives the fused qkv projection Q5_K (its ATTENTION_QKV rule) and keeps the
    convolution in float."""
    net, h = shape.delta_net, shape.hidden
    key_dim, value_dim = net.k_heads * net.k_dim, net.v_heads * net.v_dim
    yield blk + "attn_qkv.weight", (2 * key_dim + value_dim, h), Q.Q5_K if mixed else base
    yield blk + "attn_gate.weight", (value_dim, h), base
    yield blk + "ssm_conv1d.weight", (2 * key_dim + value_dim, net.conv_kernel), Q.F32
    yield blk + "ssm_dt.bias", (net.v_heads,), Q.F32
    yield blk + "ssm_a", (net.v_heads,), Q.F32
    yield blk + "ssm_beta.weight", (net.v_heads, h), base
    yield blk + "ssm_alpha.weight", (net.v_heads, h), base
    yield blk + "ssm_norm.weight", (net.v_dim,), Q.F32
    yield blk + "ssm_out.weight", (h, value_dim), base


def _gemma4_plan(shape: Shape, fmt: str, pure: bool):
    """Gemma 4 as llama.cpp's converter names its tensors and llama-quantize types them:
    the tied embedding and the per-layer table (both its TOKEN_EMBD) Q6_K under Q4_K_M,
    per_layer_model_proj left in float (float16 here), Q6_K for attn_v and ffn_down on
    its "more bits" layers, norms, the rope divisors and the output scales float32. The
    shared layers keep the checkpoints' k and v projections and norms, which the
    converter writes and neither llama.cpp nor we use."""
    g, h = shape.gemma4, shape.hidden
    base = {"q4_k_m": Q.Q4_K, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[fmt]
    head = base if pure or base == Q.Q8_0 else Q.Q6_K
    mixed = fmt == "q4_k_m" and not pure
    packed = shape.layers * g.per_layer_input
    yield "token_embd.weight", (shape.vocab, h), head
    yield "per_layer_token_embd.weight", (shape.vocab, packed), head
    yield "per_layer_model_proj.weight", (packed, h), Q.F16
    yield "per_layer_proj_norm.weight", (g.per_layer_input,), Q.F32
    yield "rope_freqs.weight", (g.global_head_dim // 2,), Q.F32
    for i in range(shape.layers):
        dim = g.global_head_dim if g.is_global(i) else shape.head_dim
        q_dim, kv_dim = shape.heads * dim, shape.kv_heads * dim
        blk = f"blk.{i}."
        yield blk + "attn_norm.weight", (h,), Q.F32
        more = mixed and use_more_bits(i, shape.layers)
        yield blk + "attn_q.weight", (q_dim, h), base
        yield blk + "attn_k.weight", (kv_dim, h), base
        yield blk + "attn_v.weight", (kv_dim, h), Q.Q6_K if more else base
        yield blk + "attn_k_norm.weight", (dim,), Q.F32
        yield blk + "attn_q_norm.weight", (dim,), Q.F32
        yield blk + "attn_output.weight", (h, q_dim), base
        yield blk + "post_attention_norm.weight", (h,), Q.F32
        yield blk + "ffn_norm.weight", (h,), Q.F32
        yield blk + "ffn_gate.weight", (shape.ffn, h), base
        yield blk + "ffn_up.weight", (shape.ffn, h), base
        yield blk + "ffn_down.weight", (h, shape.ffn), Q.Q6_K if more else base
        yield blk + "post_ffw_norm.weight", (h,), Q.F32
        yield blk + "inp_gate.weight", (g.per_layer_input, h), base
        yield blk + "proj.weight", (h, g.per_layer_input), base
        yield blk + "post_norm.weight", (h,), Q.F32
        yield blk + "layer_output_scale.weight", (1,), Q.F32
    yield "output_norm.weight", (h,), Q.F32


def gemma4_rope_divisors(g: Gemma4) -> np.ndarray:
    """The converter's rope_freqs for Gemma 4's proportional rope: 1 for the pairs that
    turn, 1e30 for those that stand still."""
    turning = int(g.global_head_dim * g.partial / 2)
    still = g.global_head_dim // 2 - turning
    return np.array([1.0] * turning + [1e30] * still, dtype=np.float32)


def _gpt_oss_plan(shape: Shape, fmt: str):
    """gpt-oss as its published GGUFs hold it (llama-quantize's MXFP4_MOE): the experts
    MXFP4, every other matrix Q8_0 (its rows of 2,880 fit no K-quant), the router, norms,
    sinks and biases float32."""
    if fmt not in ("mxfp4_moe", "q8_0"):
        raise SystemExit("gpt-oss shapes are written as mxfp4_moe or q8_0 (rows of 2,880)")
    experts = Q.MXFP4 if fmt == "mxfp4_moe" else Q.Q8_0
    h, e, ffn = shape.hidden, shape.experts, shape.ffn
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    yield "token_embd.weight", (shape.vocab, h), Q.Q8_0
    for i in range(shape.layers):
        blk = f"blk.{i}."
        yield blk + "attn_norm.weight", (h,), Q.F32
        for name, rows in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
            yield blk + name + ".weight", (rows, h), Q.Q8_0
            yield blk + name + ".bias", (rows,), Q.F32
        yield blk + "attn_output.weight", (h, q_dim), Q.Q8_0
        yield blk + "attn_output.bias", (h,), Q.F32
        yield blk + "attn_sinks.weight", (shape.heads,), Q.F32
        yield blk + "post_attention_norm.weight", (h,), Q.F32
        yield blk + "ffn_gate_inp.weight", (e, h), Q.F32
        yield blk + "ffn_gate_inp.bias", (e,), Q.F32
        yield blk + "ffn_gate_exps.weight", (e, ffn, h), experts
        yield blk + "ffn_gate_exps.bias", (e, ffn), Q.F32
        yield blk + "ffn_up_exps.weight", (e, ffn, h), experts
        yield blk + "ffn_up_exps.bias", (e, ffn), Q.F32
        yield blk + "ffn_down_exps.weight", (e, h, ffn), experts
        yield blk + "ffn_down_exps.bias", (e, h), Q.F32
    yield "output_norm.weight", (h,), Q.F32
    yield "output.weight", (shape.vocab, h), Q.Q8_0


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for rope_scaling type "llama3"."""
    factor, low, high, original = shape.rope_llama3_factor, 1.0, 4.0, 8192
    dim = shape.head_dim
    freqs = 1.0 / shape.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def random_blocks(rng: np.random.Generator, qtype: Q, n_elements: int) -> np.ndarray:
    """``n_elements`` weights of ``qtype`` as ``[n_blocks, type_size]`` uint8: random bytes,
    then finite float16 scales of realistic magnitude written over the scale fields."""
    fmt = ggml_format(qtype)
    n_blocks = n_elements // fmt.block_size
    blocks = np.frombuffer(bytearray(rng.bytes(n_blocks * fmt.type_size)), dtype=np.uint8)
    blocks = blocks.reshape(n_blocks, fmt.type_size)
    if qtype == Q.MXFP4:  # an exponent byte, not a float16
        low, high = _MXFP4_EXPONENTS
        blocks[:, 0] = rng.integers(low, high + 1, n_blocks, dtype=np.uint8)
        return blocks
    for offset, (lo, hi) in zip(SCALE_OFFSETS[qtype], _SCALE_RANGES[qtype], strict=True):
        scale = np.exp(rng.uniform(math.log(lo), math.log(hi), n_blocks)).astype("<f2")
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def tensor_data(rng: np.random.Generator, name: str, shape: tuple, qtype: Q, model: Shape):
    if name == "rope_freqs.weight":
        return gemma4_rope_divisors(model.gemma4) if model.gemma4 else llama3_rope_factors(model)
    if name.endswith("layer_output_scale.weight"):  # Gemma 4's learned scale per layer
        return rng.uniform(0.5, 1.0, shape).astype(np.float32)
    if qtype == Q.F16:  # a float matrix llama-quantize leaves (per_layer_model_proj)
        return (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)
    if name.endswith("ffn_gate_inp.weight"):  # a router: logits of a few units
        return (0.05 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(".bias") and not name.endswith("ssm_dt.bias"):  # gpt-oss's biases
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("attn_sinks.weight"):  # a sink logit per head
        return rng.normal(0.0, 1.0, shape).astype(np.float32)
    if name.endswith("ssm_a"):  # Qwen3.5's A stored as -exp(A_log), A in (0, 16]
        return (-rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith("ssm_conv1d.weight"):  # convolution taps
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)
    if qtype == Q.F32:  # norm weights (Gemma's stored as 1 + w, as llama.cpp converts them)
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return random_blocks(rng, qtype, math.prod(shape)).reshape(*shape[:-1], -1)


def tokenizer_metadata() -> dict:
    """The default model's metadata (our reader: gguf.GGUFReader takes 12 s over its
    262,144 tokens, one field part each)."""
    from spnl_backend.loader.default_model import default_model_path
    from spnl_backend.loader.gguf_file import GGUFFile

    return GGUFFile(default_model_path()).metadata


def kept_token_ids(tokens: list[str], types: np.ndarray, vocab: int) -> np.ndarray:
    """Which ``vocab`` of the source's tokens to keep, in order. Gemma's vocabulary lists
    its single characters last (ids 236,743 on), and merges need them: a smaller vocabulary
    keeps the first tokens (the special and byte tokens among them, at their own ids) and
    then every single character. Too small for that (the tiny shape): the first tokens."""
    if vocab == len(tokens):
        return np.arange(vocab)
    singles = np.array([i for i, t in enumerate(tokens) if len(t) == 1 and types[i] == 1])
    head = vocab - len(singles)
    if head < 1024 or singles.min() < head:
        return np.arange(vocab)
    return np.concatenate([np.arange(head), singles])


def add_tokenizer(writer: gguf.GGUFWriter, source: dict, vocab: int) -> None:
    """The source's tokenizer.ggml.* keys, the vocabulary cut to its first ``vocab``, and
    the vocabulary's own chat format (Gemma's, which the default file leaves to the
    reader), so that chats and span queries run on every shape."""
    from spnl_backend.models.arch.gemma3 import GEMMA_CHAT_TEMPLATE

    tokens = source["tokenizer.ggml.tokens"]
    if vocab > len(tokens):
        raise SystemExit(f"the tokenizer has {len(tokens):,} tokens; the shape needs {vocab:,}")
    writer.add_tokenizer_model(source["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in source:
        writer.add_tokenizer_pre(source["tokenizer.ggml.pre"])
    ids = kept_token_ids(tokens, source["tokenizer.ggml.token_type"], vocab)
    writer.add_token_list([tokens[i] for i in ids])
    writer.add_token_scores(np.asarray(source["tokenizer.ggml.scores"])[ids].tolist())
    writer.add_token_types(np.asarray(source["tokenizer.ggml.token_type"])[ids].tolist())
    for key, value in source.items():
        if not key.startswith("tokenizer.ggml.") or key in writer.kv_data[0]:
            continue
        if key.endswith(("tokens", "scores", "token_type", "merges")):
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int) and key.endswith("_token_id"):
            if value < vocab:  # llama.cpp's ids are uint32
                writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            raise SystemExit(f"tokenizer key {key!r}: {type(value).__name__} not copied")
    writer.add_chat_template(source.get("tokenizer.chat_template", GEMMA_CHAT_TEMPLATE))


def add_metadata(writer: gguf.GGUFWriter, name: str, shape: Shape, fmt: str) -> None:
    writer.add_name(f"synthetic {name} {fmt}")
    writer.add_type("model")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    if not shape.gemma4:  # (Gemma 4's key_length is its global layers')
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
        writer.add_rope_dimension_count(shape.rotary_dim or shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    if shape.arch == "llama":
        writer.add_vocab_size(shape.vocab)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.yarn:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(shape.yarn[0])
        writer.add_rope_scaling_orig_ctx_len(shape.yarn[1])
    if shape.delta_net:
        add_delta_net_metadata(writer, shape)
    if shape.gemma4:
        add_gemma4_metadata(writer, shape)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.ffn)
    writer.add_file_type(FILE_TYPES[fmt])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def add_delta_net_metadata(writer: gguf.GGUFWriter, shape: Shape) -> None:
    """The keys llama.cpp's converter writes for Qwen3.5 (its Qwen3NextModel and
    _Qwen35MRopeMixin): the DeltaNet's sizes as ssm.*, the layer kinds, and the multimodal
    rope's sections, which llama.cpp's qwen35 loader requires (text uses the first)."""
    net, arch = shape.delta_net, shape.arch
    writer.add_ssm_conv_kernel(net.conv_kernel)
    writer.add_ssm_state_size(net.k_dim)
    writer.add_ssm_group_count(net.k_heads)
    writer.add_ssm_time_step_rank(net.v_heads)
    writer.add_ssm_inner_size(net.v_dim * net.v_heads)
    recurrent = [_is_delta_net(shape, i) for i in range(shape.layers)]
    writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    writer.add_full_attention_interval(net.interval)
    pairs = (shape.rotary_dim or shape.head_dim) // 2  # Qwen3.5's [11, 11, 10] at 32 pairs
    first = round(pairs * 11 / 32)
    writer.add_rope_dimension_sections([first, first, pairs - 2 * first, 0])


def add_gemma4_metadata(writer: gguf.GGUFWriter, shape: Shape) -> None:
    """The keys llama.cpp's converter writes for Gemma 4 over the common ones: the global
    head size as key_length (the sliding one as key_length_swa), rope widths and bases
    of both kinds, the sliding pattern, the shared layers, PLE's width, the softcap."""
    g = shape.gemma4
    writer.add_key_length(g.global_head_dim)
    writer.add_value_length(g.global_head_dim)
    writer.add_key_length_swa(shape.head_dim)
    writer.add_value_length_swa(shape.head_dim)
    writer.add_rope_dimension_count(g.global_head_dim)
    writer.add_rope_dimension_count_swa(shape.head_dim)
    writer.add_rope_freq_base_swa(g.local_theta)
    writer.add_sliding_window_pattern([not g.is_global(i) for i in range(shape.layers)])
    writer.add_shared_kv_layers(g.shared_kv_layers)
    writer.add_embedding_length_per_layer_input(g.per_layer_input)
    writer.add_final_logit_softcapping(g.softcap)


def write(
    out: Path, name: str, fmt: str, seed: int = 0, pure: bool = False, vocab: int | None = None
) -> int:
    """Write the file; return its size in bytes."""
    shape = SHAPES[name]
    if vocab is not None:
        shape = Shape(**{**shape.__dict__, "vocab": vocab})
    rng = np.random.default_rng(seed)
    plan = list(tensor_plan(shape, fmt, pure))
    writer = gguf.GGUFWriter(out, shape.arch)
    add_metadata(writer, name, shape, fmt)
    add_tokenizer(writer, tokenizer_metadata(), shape.vocab)
    for tensor, dims, qtype in plan:
        if qtype in (Q.F32, Q.F16):
            dtype = np.dtype(np.float32 if qtype == Q.F32 else np.float16)
            writer.add_tensor_info(tensor, dims, dtype, dtype.itemsize * math.prod(dims))
        else:
            nbytes = ggml_format(qtype).nbytes(math.prod(dims))
            rows = math.prod(dims[:-1])
            byte_shape = (*dims[:-1], nbytes // rows)
            writer.add_tensor_info(tensor, byte_shape, np.dtype(np.uint8), nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor, dims, qtype in plan:
        writer.write_tensor_data(tensor_data(rng, tensor, dims, qtype, shape))
    writer.close()
    return out.stat().st_size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--format", choices=sorted(FILE_TYPES), default="q4_k_m")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--pure",
        action="store_true",
        help="every matrix in the one format (no Q6_K output/embedding, no Q4_K_M mix)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    size = write(args.out, args.shape, args.format, args.seed, args.pure)
    elapsed = time.perf_counter() - start
    print(f"{args.out}: {size / 2**30:.2f} GiB ({size:,} bytes) in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
