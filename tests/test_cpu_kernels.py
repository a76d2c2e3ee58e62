"""The CPU's compiled kernels against their torch twins."""

import dataclasses
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from paged_cases import CASES, paged_case, scoring_of

import spnl_backend.kernels.cpu as cpu
import spnl_backend.kernels.matmuls as matmuls
from spnl_backend.kernels import delta_rule, selective_scan, ssd
from spnl_backend.kernels.cpu import KernelArgumentError
from spnl_backend.kernels.matmuls import CpuMatmuls, int8_activations_ref
from spnl_backend.kernels.metadata import PagedMetadata
from spnl_backend.kernels.ops import (
    add_rms_norm_ref,
    gated_act_ref,
    qk_norm_rope_ref,
    rms_norm_ref,
    rotate_ref,
)
from spnl_backend.kernels.paged_ref import paged_attention_ref, to_cache
from spnl_backend.kernels.scoring import Scoring
from spnl_backend.kernels.thresholds import NATIVE_MAX_ROWS
from spnl_backend.quant.linear import QuantizedWeight
from spnl_backend.quant.quantize import QUANTIZERS

TYPES = sorted(QUANTIZERS, key=lambda t: t.value)
BLOCKS_OF_32 = [t for t in TYPES if GGML_QUANT_SIZES[t][0] == 32]
SINKS = torch.tensor([1.5, -0.5, 0.0, 3.0])  # one per query head of the 4-head cases


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "checked"])
def kernels(request):
    """Both builds: as shipped, and with every index checked (MISTRALRS_NATIVE_CHECKS)."""
    native = cpu.cpu_kernels(checks=request.param)
    if native is None:
        pytest.fail("the CPU kernels did not build: is there a C compiler?")
    assert native.checks == request.param
    return native


@pytest.fixture
def exact(kernels):
    """The float-activation kernels, as MISTRALRS_CPU_MATMUL=float32 selects them."""
    return dataclasses.replace(kernels, exact=True)


def quantized_matmuls(native, x, weights, gemm=None):
    return CpuMatmuls(native, gemm)(x, weights)


def _weights(qtype: Q, rows: int = 96, cols: int = 512, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    return QuantizedWeight.from_float(torch.randn(rows, cols, generator=gen), qtype)


def _twin(x: torch.Tensor, weights: list[QuantizedWeight]) -> torch.Tensor:
    return torch.cat([x @ w.dequantize().T for w in weights], dim=-1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3])
def test_exact_products_equal_the_twin(exact, qtype, rows):
    weights = [_weights(qtype), _weights(qtype, rows=40, seed=1)]
    x = torch.randn(rows, 512)
    torch.testing.assert_close(
        quantized_matmuls(exact, x, weights), _twin(x, weights), rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_int8_products_equal_the_twin_on_rounded_activations(kernels, qtype, rows):
    """Each matrix against the activations as rounded for its type (a k-quant and a
    32-value format in one call: both roundings of the same rows)."""
    if kernels.exact:
        pytest.skip("this CPU has no AVX2: the int8 kernels are not built")
    weights = [_weights(qtype), _weights(Q.Q8_0, rows=16, seed=2)]
    x = torch.randn(rows, 512)
    out = quantized_matmuls(kernels, x, weights)
    twin = torch.cat([_twin(int8_activations_ref(x, w.qtype), [w]) for w in weights], dim=-1)
    torch.testing.assert_close(out, twin, rtol=1e-4, atol=1e-3)
    relative = (out - _twin(x, weights)).norm() / _twin(x, weights).norm()
    assert relative < 0.01  # what rounding the activations costs


def _f16_weights(rows: int = 96, cols: int = 512, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    half = torch.randn(rows, cols, generator=gen).to(torch.float16)
    return QuantizedWeight(half.view(torch.uint8), Q.F16, (rows, cols))


@pytest.mark.parametrize("rows", [1, 3, 37])
def test_float16_products_equal_the_twin(kernels, rows):
    """A float16 matrix multiplies float32 activations unrounded (no int8 path), also
    beside a quantized one in the same call."""
    weights = [_f16_weights(), _weights(Q.Q4_K, rows=40, seed=1)]
    x = torch.randn(rows, 512)
    torch.testing.assert_close(
        quantized_matmuls(kernels, x, weights), _twin(x, weights), rtol=1e-5, atol=1e-4
    )
    alone = quantized_matmuls(kernels, x, weights[:1])
    torch.testing.assert_close(alone, _twin(x, weights[:1]), rtol=1e-5, atol=1e-4)


def test_float16_dequantize_and_gather_rows_are_exact(kernels):
    weight = _f16_weights()
    full = kernels.dequantize(Q.F16.value, weight.data, *weight.shape)
    assert torch.equal(full, weight.dequantize())
    rows = kernels.gather_rows(Q.F16.value, weight.data, torch.tensor([5, 0, 95, 5]), 512)
    assert torch.equal(rows, full[[5, 0, 95, 5]])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_and_gather_rows_are_exact(kernels, qtype):
    weight = _weights(qtype)
    full = kernels.dequantize(qtype.value, weight.data, *weight.shape)
    assert torch.equal(full, weight.dequantize())
    rows = kernels.gather_rows(qtype.value, weight.data, torch.tensor([5, 0, 95, 5]), 512)
    assert torch.equal(rows, full[[5, 0, 95, 5]])


@pytest.fixture
def small_slices(monkeypatch):
    """Dequantize a few rows at a time, so every matrix is cut into several slices."""
    monkeypatch.setattr(matmuls, "DEQUANT_SLICE_ELEMENTS", 512 * 24)


def test_many_rows_dequantize_slices_then_multiply_exactly(exact, small_slices):
    weights = [_weights(Q.Q4_K), _weights(Q.Q6_K, rows=8, seed=3)]
    x = torch.randn(NATIVE_MAX_ROWS + 7, 512)
    torch.testing.assert_close(
        quantized_matmuls(exact, x, weights, torch.float32), _twin(x, weights), rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-gemm", "f32-gemm"])
def test_many_rows_fast_path(kernels, small_slices, bf16):
    weights = [_weights(Q.Q4_K), _weights(Q.Q6_K, rows=8, seed=3)]
    x = torch.randn(NATIVE_MAX_ROWS + 1, 512)
    gemm = torch.bfloat16 if bf16 else torch.float32
    out, twin = quantized_matmuls(kernels, x, weights, gemm), _twin(x, weights)
    assert out.dtype == torch.float32
    assert out.shape == twin.shape
    relative = (out - twin).norm() / twin.norm()
    assert relative < (0.01 if bf16 else 1e-6)


def test_rms_norm(kernels):
    x, scale = torch.randn(3, 640), torch.rand(640) + 0.5
    torch.testing.assert_close(kernels.rms_norm(x, scale, 1e-6), rms_norm_ref(x, scale, 1e-6))


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("rows", "inner"), [(1, 1), (3, 17), (5, 2048 + 37), (9, 4100)])
def test_gated_act_is_close_to_torch_and_alike_on_any_threads_and_rows(kernels, kind, rows, inner):
    """act(gate) * up on a product's halves (rows apart, tails past whole vectors and pieces):
    close to torch's SiLU or tanh-GELU, closer still to the function in float64 (torch's
    float32 1 + tanh cancels for negative gates), and the same bits on 1 to 3 threads and
    for each row alone."""
    gate_up = torch.randn(rows, 2 * inner, generator=torch.Generator().manual_seed(inner)) * 4
    gate_up[0, :5] = torch.tensor([0.0, -30.0, 30.0, -90.0, 90.0])[: min(5, inner)]
    gate, up = gate_up[:, :inner], gate_up[:, inner:]
    out = kernels.gated_act(kind, gate, up)
    torch.testing.assert_close(out, gated_act_ref(kind, gate, up), rtol=1e-5, atol=1e-5)
    g = gate.double()  # both as x * sigmoid(z): GELU-tanh's z is 2 sqrt(2/pi) (x + 0.044715 x^3)
    z = g if kind == "silu" else 2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)
    exact = g * torch.sigmoid(z) * up.double()
    torch.testing.assert_close(out.double(), exact, rtol=100 * 2**-23, atol=1e-30)
    for threads in (1, 2, 3):
        on = dataclasses.replace(kernels, threads=threads)
        assert torch.equal(on.gated_act(kind, gate, up), out)
    for r in range(rows):
        assert torch.equal(kernels.gated_act(kind, gate[r : r + 1], up[r : r + 1]), out[r : r + 1])


def test_gated_act_is_the_tanh_gelu_not_the_exact_one(kernels):
    """GELU's tanh form, told apart from erf's where they differ most (near |x| = 2)."""
    gate = torch.linspace(-3, 3, 64).reshape(1, 64)
    out = kernels.gated_act("gelu_tanh", gate, torch.ones_like(gate))
    torch.testing.assert_close(out, F.gelu(gate, approximate="tanh"), rtol=2e-6, atol=1e-6)
    assert (out - F.gelu(gate)).abs().max() > 1e-4


def test_gated_act_keeps_nan_and_refuses_bad_input(kernels):
    gate = torch.tensor([[float("nan"), 1.0]])
    for kind in ("silu", "gelu_tanh"):
        assert kernels.gated_act(kind, gate, torch.ones_like(gate))[0, 0].isnan()
    with pytest.raises(KernelArgumentError, match=r"relu2.*silu, gelu_tanh"):
        kernels.gated_act("relu2", gate, gate)
    with pytest.raises(KernelArgumentError, match="float32"):
        kernels.gated_act("silu", gate, gate.double())
    with pytest.raises(KernelArgumentError, match="consecutive"):
        kernels.gated_act("silu", torch.ones(4, 3).T, torch.ones(4, 3).T)


def _tables(tokens: int, rotary: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[tokens, 1, rotary]`` laid out for rotate-half, as RotaryTables."""
    angles = torch.randn(tokens, 1, rotary // 2)
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    return cos, torch.cat([-angles.sin(), angles.sin()], -1)


@pytest.mark.parametrize("rotary", [64, 32])
def test_rope_is_bit_identical(kernels, rotary):
    q, k = torch.randn(5, 3, 64), torch.randn(5, 1, 64)
    cos, sin = _tables(5, rotary)
    expected = rotate_ref(q, cos, sin), rotate_ref(k, cos, sin)
    kernels.qk_norm_rope_(q, k, None, cos.squeeze(1).contiguous(), sin.squeeze(1).contiguous())
    assert torch.equal(q, expected[0])
    assert torch.equal(k, expected[1])


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("tokens", [3, 77])  # 77 rows: shared out among the threads
@pytest.mark.parametrize("post_norm", [False, True], ids=["plain", "normed-delta"])
def test_add_rms_norm_is_the_unfused_kernels_bit_for_bit(kernels, post_norm, tokens, threads):
    kernels = dataclasses.replace(kernels, threads=threads)
    x, delta = torch.randn(tokens, 640), torch.randn(tokens, 640) * 4
    scale, delta_scale = torch.rand(640) + 0.5, torch.rand(640) + 0.5
    delta_norm = (delta_scale, 1e-5) if post_norm else None
    added = x + (kernels.rms_norm(delta, delta_scale, 1e-5) if post_norm else delta)
    residual = x.clone()
    out = kernels.add_rms_norm(residual, delta, delta_norm, scale, 1e-6)
    assert torch.equal(residual, added)  # updated in place
    assert torch.equal(out, kernels.rms_norm(added, scale, 1e-6))
    twin_x, twin_out = add_rms_norm_ref(x, delta, delta_norm, scale, 1e-6)
    torch.testing.assert_close(residual, twin_x)
    torch.testing.assert_close(out, twin_out)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("normed", [False, True], ids=["rope", "norm-rope"])
@pytest.mark.parametrize("tokens", [1, 3, 90])  # 90 tokens: shared out among the threads
def test_qk_norm_rope_on_a_qkv_row_is_norm_then_rotation_bit_for_bit(
    kernels, normed, tokens, threads
):
    kernels = dataclasses.replace(kernels, threads=threads)
    heads, kv_heads, dim, rotary = 4, 2, 32, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    cos, sin = _tables(tokens, rotary)
    q_scale, k_scale = torch.rand(dim) + 0.5, torch.rand(dim) + 0.5
    norms = (q_scale, k_scale, 1e-6) if normed else None
    tables = cos.squeeze(1).contiguous(), sin.squeeze(1).contiguous()
    expected = []
    for part, scale in ((q, q_scale), (k, k_scale)):
        part = kernels.rms_norm(part, scale, 1e-6) if normed else part
        expected.append(rotate_ref(part, cos, sin))  # the rotation is exact: bit for bit
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    twin_q, twin_k = qk_norm_rope_ref(q.clone(), k.clone(), norms, cos, sin)
    kernels.qk_norm_rope_(q, k, norms, *tables)
    assert torch.equal(q, expected[0])
    assert torch.equal(k, expected[1])
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v untouched
    torch.testing.assert_close(q, twin_q)
    torch.testing.assert_close(k, twin_k)


def test_qk_norm_rope_refuses_heads_that_are_not_consecutive(kernels):
    q = torch.randn(2, 8, 4).transpose(1, 2)  # [2, 4 heads, 8 dims], heads interleaved
    table = torch.ones(2, 8)
    with pytest.raises(KernelArgumentError, match="heads consecutive"):
        kernels.qk_norm_rope_(q, torch.randn(2, 1, 8), None, table, table)


def test_store_kv_skips_padding(kernels):
    key_cache, value_cache = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    kernels.store_kv(key, value, key_cache, value_cache, torch.tensor([9, -1, 30]))
    flat = key_cache.view(32, 2, 16)
    assert torch.equal(flat[9], key[0])
    assert torch.equal(flat[30], key[2])
    assert int((flat != 0).any(-1).any(-1).sum()) == 2
    assert torch.equal(value_cache.view(32, 2, 16)[30], value[2])


def test_store_kv_into_a_float16_pool_rounds_and_saturates_as_the_twin(kernels):
    """Round to nearest, ties to even; past float16's range the largest finite value, never
    infinity; NaN stays NaN; and nothing but the written slots changes."""
    key_cache, value_cache = (
        torch.zeros(4, 8, 2, 24, dtype=torch.float16),
        torch.zeros(4, 8, 2, 24, dtype=torch.float16),
    )
    key, value = torch.randn(3, 2, 24) * 1000, torch.randn(3, 2, 24)
    key[0, 0, :6] = torch.tensor([7e4, -1e6, float("inf"), float("-inf"), 65519.0, 65520.0])
    key[2, 1, 3] = float("nan")
    value[2, 0, :2] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11])  # ties: to even
    kernels.store_kv(key, value, key_cache, value_cache, torch.tensor([9, -1, 30]))
    flat_k, flat_v = key_cache.view(32, 2, 24), value_cache.view(32, 2, 24)
    for slot, token in ((9, 0), (30, 2)):
        twin_k, twin_v = to_cache(key[token], torch.float16), to_cache(value[token], torch.float16)
        assert torch.equal(flat_k[slot].isnan(), twin_k.isnan())
        assert torch.equal(flat_k[slot].nan_to_num(), twin_k.nan_to_num())
        assert torch.equal(flat_v[slot], twin_v)
    assert flat_k[9, 0, :6].tolist() == [65504.0, -65504.0, 65504.0, -65504.0, 65504.0, 65504.0]
    assert flat_v[30, 0, :2].tolist() == [1.0, 1 + 4 * 2**-11]
    assert int((flat_k != 0).any(-1).any(-1).sum()) == 2


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("dim", [32, 84, 256])
def test_a_float16_pool_attends_as_its_values_widened_to_float32(kernels, window, dim):
    """The float16 kernels widen each key and value exactly and then do what the float32
    ones do: the same bits as the float32 pool holding the same values, and close to the
    torch twin over the float16 pool."""
    lens = [700, 5, 513, 256, 257]
    q, key_cache, value_cache, slots, seq_lens = _long_decode_case(lens, kv_heads=2, dim=dim)
    halves = key_cache.half(), value_cache.half()
    out = kernels.paged_decode(q, *halves, slots, seq_lens, Scoring(0.2, window=window))
    widened = kernels.paged_decode(
        q, halves[0].float(), halves[1].float(), slots, seq_lens, Scoring(0.2, window=window)
    )
    assert torch.equal(out, widened)
    twin = _decode_twin(q, halves[0].float(), halves[1].float(), slots, seq_lens, 0.2, window)
    torch.testing.assert_close(out, twin, rtol=1e-5, atol=1e-5)


def test_a_pool_of_mixed_dtypes_is_refused(kernels):
    q, key_cache, value_cache, slots, lens = _long_decode_case([20])
    with pytest.raises(KernelArgumentError, match=r"value cache is of torch\.float32"):
        kernels.paged_decode(q, key_cache.half(), value_cache, slots, lens, Scoring(1.0))
    with pytest.raises(KernelArgumentError, match=r"key cache is of torch\.bfloat16"):
        kernels.paged_decode(
            q, key_cache.bfloat16(), value_cache.bfloat16(), slots, lens, Scoring(1.0)
        )


@pytest.mark.parametrize(("kv_heads", "heads"), [(1, 4), (2, 8), (4, 4)])
@pytest.mark.parametrize(
    "options",
    [{}, {"sliding_window": 6}, {"softcap": 4.0}, {"chunk": 5}, {"chunk": 8, "sliding_window": 5}],
    ids=["plain", "window", "softcap", "chunk", "chunk+window"],
)
def test_paged_decode(kernels, kv_heads, heads, options):
    seq_lens, query_lens = CASES["decode"]
    q, key_cache, value_cache, meta, _, _ = paged_case(seq_lens, query_lens, kv_heads, heads, 8)
    lens = torch.tensor(seq_lens)
    out = kernels.paged_decode(
        q,
        key_cache,
        value_cache,
        meta.decode_slots,
        lens,
        scoring_of(0.25, options),
    )
    expected = paged_attention_ref(q, key_cache, value_cache, meta, scoring_of(0.25, options))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _long_decode_case(lens: list[int], kv_heads: int = 1, heads: int = 4, dim: int = 32):
    """Queries over contexts past the kernel's chunk of keys, in a pool of 16-slot blocks
    handed out in a shuffled order."""
    generator = torch.Generator().manual_seed(5)
    blocks_per_seq = [-(-n // 16) for n in lens]
    order = torch.randperm(sum(blocks_per_seq), generator=generator)
    shape = (len(order), 16, kv_heads, dim)
    key_cache, value_cache = torch.randn(shape, generator=generator), torch.randn(shape)
    slots = torch.full((len(lens), max(blocks_per_seq) * 16), -1, dtype=torch.int64)
    taken = 0
    for s, count in enumerate(blocks_per_seq):
        for b in range(count):
            block = int(order[taken + b])
            slots[s, b * 16 : (b + 1) * 16] = torch.arange(block * 16, block * 16 + 16)
        taken += count
    q = torch.randn(len(lens), heads, dim, generator=generator)
    return q, key_cache, value_cache, slots, torch.tensor(lens)


def _decode_twin(q, key_cache, value_cache, slots, lens, scale, window):
    kv_heads, dim = key_cache.shape[-2:]
    keys, values = key_cache.view(-1, kv_heads, dim), value_cache.view(-1, kv_heads, dim)
    out = []
    for s, n in enumerate(lens.tolist()):
        first = max(0, n - window) if window else 0
        visible = slots[s, first:n]
        k = keys[visible].repeat_interleave(q.shape[1] // kv_heads, dim=1)
        v = values[visible].repeat_interleave(q.shape[1] // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,jhd->hj", q[s], k) * scale, dim=-1)
        out.append(torch.einsum("hj,jhd->hd", weights, v))
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("dim", [32, 84, 256])  # 84: 64-float strips, 16-float ones, a tail
def test_long_contexts_attend_alike_alone_batched_and_on_any_threads(kernels, window, dim):
    """Past 256 keys a sequence is attended in chunks, spread over the threads when there
    are few sequences: a query's result is the same bits alone, batched and on 1 to 3
    threads, and close to the plain softmax."""
    lens = [700, 5, 513, 256, 257]
    q, key_cache, value_cache, slots, seq_lens = _long_decode_case(lens, kv_heads=1, dim=dim)

    def decode(rows, threads):
        on = dataclasses.replace(kernels, threads=threads)
        return on.paged_decode(
            q[rows],
            key_cache,
            value_cache,
            slots[rows],
            seq_lens[rows],
            Scoring(0.2, window=window),
        )

    batched = decode(slice(None), 2)
    twin = _decode_twin(q, key_cache, value_cache, slots, seq_lens, 0.2, window)
    torch.testing.assert_close(batched, twin, rtol=1e-5, atol=1e-5)
    for threads in (1, 2, 3):
        assert torch.equal(decode(slice(None), threads), batched)
        for s in range(len(lens)):
            assert torch.equal(decode(slice(s, s + 1), threads), batched[s : s + 1])


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize(
    ("heads", "dim"), [(4, 256), (6, 256), (8, 128), (5, 64), (4, 84), (2, 64)]
)
def test_a_query_head_attends_alike_whatever_heads_share_its_kv_head(kernels, heads, dim, half):
    """The heads of a group read each key and value once for all of them (widened once, in
    a float16 pool): each head's output is the bits of that head attending alone, over one
    KV head, and close to the plain softmax."""
    lens = [700, 5, 513]
    q, key_cache, value_cache, slots, seq_lens = _long_decode_case(lens, 2, heads * 2, dim)
    if half:
        key_cache, value_cache = key_cache.half(), value_cache.half()
    scoring = Scoring(0.2, window=300)
    grouped = kernels.paged_decode(q, key_cache, value_cache, slots, seq_lens, scoring)
    for h in range(heads * 2):
        kvh = h // heads
        alone = kernels.paged_decode(
            q[:, h : h + 1].contiguous(),
            key_cache[:, :, kvh : kvh + 1].contiguous(),
            value_cache[:, :, kvh : kvh + 1].contiguous(),
            slots,
            seq_lens,
            scoring,
        )
        assert torch.equal(grouped[:, h : h + 1], alone), f"head {h}"
    wide = key_cache.float(), value_cache.float()
    twin = _decode_twin(q, *wide, slots, seq_lens, 0.2, 300)
    torch.testing.assert_close(grouped, twin, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 300])
def test_sinks_over_chunks_of_keys_equal_the_twin(kernels, window):
    """gpt-oss's sinks join the peak and the denominator once, after the chunks combine:
    contexts of one chunk and of several, alone and batched alike, against the twin."""
    lens = [700, 5, 257]
    q, key_cache, value_cache, slots, seq_lens = _long_decode_case(lens, kv_heads=2, heads=4)
    sinks = torch.tensor([4.0, -1.0, 0.5, 30.0])  # 30: past every score, most weight on it
    out = kernels.paged_decode(
        q, key_cache, value_cache, slots, seq_lens, Scoring(0.2, window=window, sinks=sinks), None
    )
    twin = torch.cat(
        [
            paged_attention_ref(
                q[s : s + 1],
                key_cache,
                value_cache,
                _one_table(slots[s], int(seq_lens[s]), key_cache.shape[1]),
                Scoring(0.2, window=window, sinks=sinks),
            )
            for s in range(len(lens))
        ]
    )
    torch.testing.assert_close(out, twin, rtol=1e-5, atol=1e-6)
    alone = kernels.paged_decode(
        q[:1],
        key_cache,
        value_cache,
        slots[:1],
        seq_lens[:1],
        Scoring(0.2, window=window, sinks=sinks),
        None,
    )
    assert torch.equal(alone, out[:1])


def _one_table(slots: torch.Tensor, length: int, block_size: int) -> PagedMetadata:
    """A decode's metadata for a sequence whose slots run in whole blocks."""
    blocks = slots[: -(-length // block_size) * block_size : block_size] // block_size
    return PagedMetadata(blocks[None], [length], [1], block_size)


def test_a_chunk_of_keys_out_of_reach_weighs_nothing(kernels):
    """Scores of -inf (q . k past float32) for a whole chunk of keys: the chunk gets weight
    0, as in one softmax over all the keys, instead of poisoning the others with NaN."""
    q, key_cache, value_cache, slots, lens = _long_decode_case([300], kv_heads=1, heads=1)
    q[0, 0, 0] = 10.0
    keys = key_cache.view(-1, 1, key_cache.shape[-1])
    keys[slots[0, :256], 0, 0] = -3e38
    out = kernels.paged_decode(q, key_cache, value_cache, slots, lens, Scoring(1.0))
    twin = _decode_twin(q, key_cache, value_cache, slots, lens, 1.0, None)
    assert torch.isfinite(twin).all()
    torch.testing.assert_close(out, twin, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("mode", ["int8", "exact"])
def test_each_rows_product_is_bit_identical_to_that_row_alone(kernels, qtype, mode):
    """What makes a speculative verification compute each token exactly as decoding it."""
    native = dataclasses.replace(kernels, exact=mode == "exact")
    # 40 weight rows: two whole tiles of 16 for the k-quants, then 8 rows one at a time
    weights = [_weights(qtype, rows=40, cols=768)]
    x = torch.randn(150, 768)  # past the kernels' chunks of rows (32 and 64)
    together = quantized_matmuls(native, x, weights)
    alone = torch.cat([quantized_matmuls(native, x[i : i + 1], weights) for i in range(len(x))])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("blocks", [1, 2, 3, 5, 8, 9, 16, 17, 23])
def test_one_row_k_quant_products_give_the_tiles_bits_for_any_block_count(kernels, qtype, blocks):
    """A decode's Q4_K and Q6_K products take 8 blocks of 256 at a time, then the rest (Q6_K
    rows under 8 blocks a block at a time): for every rest a row alone gives the bits it
    gets beside others (16 weight rows in a tile, the last 2 a row at a time) and the
    twin's values."""
    if kernels.exact:
        pytest.skip("this CPU has no AVX2: the int8 kernels are not built")
    cols = 256 * blocks
    weights = [_weights(qtype, rows=18, cols=cols, seed=blocks)]
    x = torch.randn(5, cols) * torch.linspace(0.1, 3.0, cols)  # scales that differ by block
    together = quantized_matmuls(kernels, x, weights)
    alone = torch.cat([quantized_matmuls(kernels, x[i : i + 1], weights) for i in range(len(x))])
    assert torch.equal(alone, together)
    twin = _twin(int8_activations_ref(x, qtype), weights)
    torch.testing.assert_close(alone, twin, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("blocks", range(1, 41))
def test_a_decode_gives_each_weight_row_its_own_bits_in_a_run_of_rows(kernels, qtype, blocks):
    """A decode's Q4_K and Q6_K kernels go through a tile's weight rows in one run, a row's
    last group of 8 blocks (or its rest, 1 to 7) weighed while the next row's first is
    found: at every block count each row gets the bits it gets alone (a product of that
    one weight row), the bits of the tiles (5 activation rows) and the twin's values."""
    if kernels.exact:
        pytest.skip("this CPU has no AVX2: the int8 kernels are not built")
    cols = 256 * blocks
    weight = _raw_k_weights(qtype, rows=19, cols=cols, seed=blocks)  # a tile of 16, then 3
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(blocks))
    run = quantized_matmuls(kernels, x[:1], [weight])
    rows = weight.data.view(19, -1)
    alone = [QuantizedWeight(rows[r : r + 1].clone(), qtype, (1, cols)) for r in range(19)]
    assert torch.equal(run, torch.cat([quantized_matmuls(kernels, x[:1], [w]) for w in alone], -1))
    assert torch.equal(run, quantized_matmuls(kernels, x, [weight])[:1])
    twin = _twin(int8_activations_ref(x[:1], qtype), [weight])
    torch.testing.assert_close(run, twin, rtol=1e-4, atol=1e-4 * twin.abs().max().item())


@pytest.mark.parametrize("at", [0, 7, 8, 31, 100, 130, 248, 255])
def test_k_quant_activations_take_their_largest_magnitude_wherever_it_lies(kernels, at):
    """A block of 256 activations maps its largest magnitude to 127 (found a vector at a
    time, then the first value of that magnitude): at any position, of either sign, and
    tied with the other sign later (the first one's sign taken, the same numbers), the
    product is the twin's on the activations so rounded."""
    if kernels.exact:
        pytest.skip("this CPU has no AVX2: the int8 kernels are not built")
    gen = torch.Generator().manual_seed(at)
    weights = [_weights(Q.Q4_K, rows=16, cols=512, seed=at)]
    x = torch.randn(4, 512, generator=gen)
    x[0, at], x[1, 256 + at] = 9.0, -9.0
    x[2, at], x[2, 511 - at // 2] = -9.0, 9.0  # a tie: the first is the negative one
    x[3, :256] = 0.0  # a block of zeros: scale 0
    out = torch.cat([quantized_matmuls(kernels, x[i : i + 1], weights) for i in range(4)])
    twin = _twin(int8_activations_ref(x, Q.Q4_K), weights)
    torch.testing.assert_close(out, twin, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("qtype", [t for t in TYPES if GGML_QUANT_SIZES[t][0] == 32], ids=str)
@pytest.mark.parametrize("rows", [6, 7, 13])
def test_tiles_of_32_value_blocks_give_each_row_alone_bits(kernels, qtype, rows):
    # 25 blocks a row: the blocks' chains end mid-group; 6, 7 and 13 activation rows: the
    # tiles' groups of 4 rows end with 2, 3 and 1 (6 is the fewest that take the tiles).
    weights = [_weights(qtype, rows=33, cols=800)]
    x = torch.randn(rows, 800)
    native = dataclasses.replace(kernels, exact=False)  # the int8 products, where the tiles are
    together = quantized_matmuls(native, x, weights)
    alone = torch.cat([quantized_matmuls(native, x[i : i + 1], weights) for i in range(rows)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize(
    "build", ["plain", pytest.param("checked", marks=pytest.mark.slow)], ids=str
)
def test_products_read_nothing_past_their_weights_or_activations(build):
    """Every format's products, int8 and exact, one row (the one-row kernels, 4 blocks per
    vector), a few and the tiles, at 1 to 9 blocks of 32 (whole groups and tails) and odd
    weight row counts, on weights and activations flush against an unreadable page after
    them (and, apart, before them; and weights one byte past a page's start): a load out
    of bounds faults, in a child process so the fault is this test's failure, with the
    case it was on."""
    if platform.system() != "Linux":
        pytest.skip("mprotect through ctypes: Linux only")
    root = Path(__file__).parents[1]  # this checkout's package, not an installed one
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    script = Path(__file__).parent / "guarded_products.py"
    done = subprocess.run(
        [sys.executable, str(script), build],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
        env=env,
    )
    last = (done.stdout.strip().splitlines() or ["(no case started)"])[-1]
    assert done.returncode == 0, f"exit {done.returncode} at {last}\n{done.stderr[-2000:]}"
    assert last == "done"
    assert done.stdout.startswith(f"package {root / 'spnl_backend'}")


@pytest.mark.parametrize("qtype", BLOCKS_OF_32, ids=lambda t: t.name)
@pytest.mark.parametrize(
    "blocks", [1, 2, 3, 4, 5, 7, 9, 12, 15, 16, 17, 20, 23, 31, 32, 33, 36, 40]
)
def test_a_decode_rows_product_at_any_block_count(kernels, qtype, blocks):
    """One activation row (a decode: the formats' own one-row kernels, 4 blocks at a
    time, Q5_0's 16 at a time, then the rest) gives the bits of the same row among 2 rows
    (each block unpacked for the rows in turn) and among 7 (the tiles), and the twin's
    numbers on the rounded activations, whether or not the row's blocks fill its groups
    of 4 (and Q5_0's runs of 16)."""
    cols = 32 * blocks
    weights = [_weights(qtype, rows=35, cols=cols, seed=blocks)]
    x = torch.randn(7, cols, generator=torch.Generator().manual_seed(blocks))
    native = dataclasses.replace(kernels, exact=False)
    alone = torch.cat([quantized_matmuls(native, x[i : i + 1], weights) for i in range(7)])
    assert torch.equal(alone, quantized_matmuls(native, x, weights))
    assert torch.equal(alone[:2], quantized_matmuls(native, x[:2], weights))
    twin = _twin(int8_activations_ref(x, qtype), weights)
    torch.testing.assert_close(alone, twin, rtol=1e-4, atol=1e-3)


K_QUANTS = [t for t in TYPES if GGML_QUANT_SIZES[t][0] == 256]
# Where each k-quant keeps its float16 scales in a block: d (and dmin) after the packed bits.
K_SCALE_AT = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _raw_k_weights(qtype: Q, rows: int, cols: int, seed: int) -> QuantizedWeight:
    """Every byte of every block random (all the bit patterns of the packed values, scales
    and minimums a tile's fill takes apart), the float16 scales small and finite."""
    block, size = GGML_QUANT_SIZES[qtype]
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (rows, cols // block, size), generator=gen, dtype=torch.uint8)
    for at in K_SCALE_AT[qtype]:
        scales = torch.empty(rows, cols // block).uniform_(1e-3, 1e-2, generator=gen)
        data[:, :, at : at + 2] = scales.to(torch.float16).view(torch.uint8).view(rows, -1, 2)
    return QuantizedWeight(data.view(rows, -1), qtype, (rows, cols))


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [4, 7, 16, 70])
def test_k_quant_tiles_give_each_row_alone_bits(kernels, qtype, rows):
    """The tiles of 16 weight rows (Q4_K's filled block by block from the packed bytes, the
    others' from each row's parts) give every activation row the bits of that row alone,
    and the twin's products on the rounded activations: 4 rows (the fewest that take the
    tiles), 7 (a last group of 3), 16 (a decode batch) and 70 (more than the stack holds
    Q4_K's sums for); 37 weight rows: two tiles, then 5 rows one at a time."""
    if kernels.exact:
        pytest.skip("this CPU has no AVX2: the int8 kernels are not built")
    weight = _raw_k_weights(qtype, rows=37, cols=768, seed=rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(1))
    together = quantized_matmuls(kernels, x, [weight])
    alone = torch.cat([quantized_matmuls(kernels, x[i : i + 1], [weight]) for i in range(rows)])
    assert torch.equal(together, alone)
    twin = _twin(int8_activations_ref(x, qtype), [weight])
    torch.testing.assert_close(together, twin, rtol=1e-4, atol=1e-4 * twin.abs().max().item())


@pytest.mark.parametrize("pool", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["prefill", "prefix hit", "chunked prefill", "mixed"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"sliding_window": 6},
        {"softcap": 4.0},
        {"sliding_window": 6, "sinks": SINKS},
        {"chunk": 5},
    ],
    ids=["plain", "window", "softcap", "sinks", "chunk"],
)
def test_short_queries_attend_as_decode_rows(kernels, case, options, pool):
    from spnl_backend.kernels import cpu_kernel_set

    seq_lens, query_lens = CASES[case]
    q, key_cache, value_cache, meta, _, _ = paged_case(seq_lens, query_lens, 2, 4, 8)
    key_cache, value_cache = key_cache.to(pool), value_cache.to(pool)
    out = cpu_kernel_set(kernels).paged_attention(
        q, key_cache, value_cache, meta, scoring_of(0.25, options)
    )
    expected = paged_attention_ref(q, key_cache, value_cache, meta, scoring_of(0.25, options))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    single = each_query_decoded(kernels, q, key_cache, value_cache, meta, scoring_of(0.25, options))
    assert torch.equal(out, single)


def each_query_decoded(kernels, q, key_cache, value_cache, meta, scoring) -> torch.Tensor:
    """Every query row of ``meta`` attended as a decode of its own position, one at a time."""
    from spnl_backend.kernels import decode_rows

    rows = decode_rows(meta)
    return torch.cat(
        [
            kernels.paged_decode(
                q[i : i + 1],
                key_cache,
                value_cache,
                rows.decode_slots[i : i + 1],
                torch.tensor(rows.seq_lens[i : i + 1]),
                scoring,
            )
            for i in range(len(q))
        ]
    )


@pytest.mark.parametrize("pool", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "kv_heads", "dim"),
    [([600], [40], 1, 256), ([700, 530], [24, 30], 2, 84)],
    ids=["one sequence", "two sequences"],
)
@pytest.mark.parametrize(
    "options",
    [{}, {"sliding_window": 300}, {"softcap": 4.0}, {"sinks": SINKS}, {"chunk": 300}],
    ids=["plain", "window", "softcap", "sinks", "chunk"],
)
def test_a_prefills_queries_attend_together_with_each_ones_decode_bits(
    kernels, seq_lens, query_lens, kv_heads, dim, options, pool
):
    """A prefill's queries over chunks of keys they all see whole are attended together
    (each key and value read and widened once for the block): every query's output is the
    bits of its own decode, on 1 to 3 threads (blocks of other sizes), and close to the
    twin. Two sequences: a block holds queries of both, whose tables differ."""
    from spnl_backend.kernels import cpu_kernel_set

    q, key_cache, value_cache, meta, _, _ = paged_case(
        seq_lens, query_lens, kv_heads, 4, 16, head_dim=dim
    )
    key_cache, value_cache = key_cache.to(pool), value_cache.to(pool)
    scoring = scoring_of(dim**-0.5, options)
    expected = paged_attention_ref(q, key_cache, value_cache, meta, scoring)
    alone = each_query_decoded(kernels, q, key_cache, value_cache, meta, scoring)
    torch.testing.assert_close(alone, expected, rtol=1e-5, atol=1e-5)
    for threads in (1, 2, 3):
        on = dataclasses.replace(kernels, threads=threads)
        out = cpu_kernel_set(on).paged_attention(q, key_cache, value_cache, meta, scoring)
        assert torch.equal(out, alone), f"{threads} threads"


def test_the_queries_of_one_sequence_share_its_row_of_slots():
    from spnl_backend.kernels import decode_rows
    from spnl_backend.kernels.sets import _decode_keys

    _, _, _, meta, _, _ = paged_case([40], [9], 2, 4, 8)
    slots, lens = _decode_keys(meta)
    assert slots.shape == (9, 40)
    assert slots.stride() == (0, 1)
    rows = decode_rows(meta)
    assert torch.equal(slots, rows.decode_slots)
    assert lens.tolist() == list(range(32, 41))
    _, _, _, two, _, _ = paged_case(*CASES["chunked prefill"], 2, 4, 8)
    assert _decode_keys(two)[0].stride(0) > 0  # two sequences: a row each


# ---- what the kernels refuse instead of reading or writing out of bounds ---------------


def test_store_kv_refuses_a_slot_outside_the_pool(kernels):
    key_cache, value_cache = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)
    key, value = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    for bad in (32, -2, 2**40):
        with pytest.raises(KernelArgumentError, match="out of bounds"):
            kernels.store_kv(key, value, key_cache, value_cache, torch.tensor([3, bad]))
    assert not key_cache.any()


def test_gather_rows_refuses_ids_outside_the_matrix(kernels):
    weight = _weights(Q.Q8_0)
    with pytest.raises(KernelArgumentError, match="out of bounds"):
        kernels.gather_rows(Q.Q8_0.value, weight.data, torch.tensor([0, 96]), 512)


def test_rope_refuses_more_rotary_dims_than_the_head_has(kernels):
    q, k, table = torch.randn(2, 3, 16), torch.randn(2, 1, 16), torch.ones(2, 32)
    with pytest.raises(KernelArgumentError, match="rejected its arguments"):
        kernels.qk_norm_rope_(q, k, None, table, table)


@pytest.mark.parametrize(
    ("x", "why"),
    [
        (torch.randn(2, 256), "do not hold 256 weights"),
        (torch.randn(2, 512, dtype=torch.float64), "float64"),
        (torch.randn(512, 2).T, "not contiguous"),
    ],
)
def test_matmul_refuses_inputs_that_do_not_fit_the_weights(kernels, x, why):
    products = kernels.products([(Q.Q4_K.value, _weights(Q.Q4_K).data, 96)])
    with pytest.raises(KernelArgumentError, match=why):
        products(x)


def test_matmul_refuses_a_matrix_smaller_than_its_rows(kernels):
    weight = _weights(Q.Q4_K)
    with pytest.raises(KernelArgumentError, match="96 rows, not 97"):
        kernels.products([(Q.Q4_K.value, weight.data, 97)])


def test_paged_decode_refuses_lengths_past_the_slot_table(kernels):
    q, key_cache, value_cache, meta, _, _ = paged_case(*CASES["decode"], 2, 4, 8)
    slots = meta.decode_slots
    lens = torch.full((len(q),), slots.shape[1] + 1)
    with pytest.raises(KernelArgumentError, match="out of bounds"):
        kernels.paged_decode(q, key_cache, value_cache, slots, lens, Scoring(0.25))


def test_the_checked_build_refuses_a_slot_outside_the_pool():
    checked = cpu.cpu_kernels(checks=True)
    q, key_cache, value_cache, meta, _, _ = paged_case(*CASES["decode"], 2, 4, 8)
    slots = meta.decode_slots.clone()
    slots[0, 0] = key_cache.shape[0] * key_cache.shape[1]
    lens = torch.tensor(meta.seq_lens)
    with pytest.raises(KernelArgumentError, match="out of bounds"):
        checked.paged_decode(q, key_cache, value_cache, slots, lens, Scoring(0.25))


def test_the_cpu_kernel_set_refuses_block_tables_outside_the_pool(kernels):
    from spnl_backend.kernels import cpu_kernel_set

    q, key_cache, value_cache, meta, _, _ = paged_case(*CASES["decode"], 2, 4, 8)
    meta.block_tables[0, 0] = key_cache.shape[0]
    with pytest.raises(KernelArgumentError, match="outside the pool"):
        cpu_kernel_set(kernels).paged_attention(q, key_cache, value_cache, meta, Scoring(0.25))


def test_the_c_code_checks_the_extents_it_is_given(kernels):
    """Below the Python checks: a matrix said to be smaller than its rows is refused by C."""
    weight = _weights(Q.Q8_0)
    products = kernels.products([(Q.Q8_0.value, weight.data, 96)])
    products.args.w_bytes[0] -= 1
    x, out = torch.randn(1, 512), torch.empty(1, 96)
    status = kernels.library.spnl_qmatmul(
        products.args, x.data_ptr(), 1, 512, out.data_ptr(), 96, 1, 0
    )
    assert status == -3


def _coded_args(dim=16, k_bits=4, outliers=2, v_bits=4):
    """A one-sequence, one-key coded decode call of ``dim``-wide heads."""
    k_bytes, v_bytes = dim * k_bits // 8 + 2 + 3 * outliers, dim * v_bits // 8 + 2
    anchors = (torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, dim))
    return [
        torch.randn(1, 2, dim),
        torch.randn(1, 2, dim),
        anchors,
        torch.zeros(1, 1, k_bytes, dtype=torch.uint8),
        torch.zeros(1, 1, v_bytes, dtype=torch.uint8),
        (torch.randn(1 << min(k_bits, 8)), k_bits, outliers),
        (torch.randn(1 << v_bits), v_bits),
        torch.tensor([[0]]),
        torch.tensor([1]),
        Scoring(0.25),
    ]


@pytest.mark.parametrize(
    ("dim", "k_bits", "outliers"),
    [(8192, 1, 0), (16, 4, 2**62), (16, 4, 17), (16, 2**36, 2), (16, 0, 2)],
    ids=[
        "head-wider-than-the-stack-allows",
        "outliers-overflow",
        "outliers-past-the-head",
        "huge-bits",
        "zero-bits",
    ],
)
def test_coded_decode_refuses_formats_it_cannot_hold(kernels, dim, k_bits, outliers):
    args = _coded_args(dim=dim, k_bits=min(k_bits, 8) if k_bits > 0 else 1, outliers=0)
    args[5] = (args[5][0], k_bits, outliers)
    with pytest.raises(KernelArgumentError, match="coded_decode"):
        kernels.coded_decode(*args)
    assert kernels.coded_decode(*_coded_args()).shape == (1, 2, 16)  # a sound call still works


def test_degenerate_shapes_are_argument_errors(kernels):
    with pytest.raises(KernelArgumentError, match="rms_norm"):
        kernels.rms_norm(torch.randn(3, 0), torch.randn(0), 1e-5)
    with pytest.raises(KernelArgumentError, match="rms_norm"):
        kernels.rms_norm(torch.tensor(1.0), torch.randn(1), 1e-5)
    empty = torch.zeros(4, 8, 0, 16)
    with pytest.raises(KernelArgumentError, match="hold no key"):
        kernels.paged_decode(
            torch.randn(1, 4, 16),
            empty,
            empty,
            torch.tensor([[0]]),
            torch.tensor([1]),
            Scoring(0.25),
        )
    with pytest.raises(KernelArgumentError, match="unknown"):
        kernels.gather_rows(999, torch.zeros(4, 34, dtype=torch.uint8), torch.tensor([0]), 32)


@pytest.mark.slow
def test_a_compiler_without_link_time_optimisation_still_builds_the_same_kernels(
    kernels, tmp_path, monkeypatch
):
    """The build asks for -flto first; a compiler that refuses it gets the plain build,
    which computes the same bits, and later loads find that build without compiling."""
    from spnl_backend.settings.platform import find_c_compiler

    wrapper = tmp_path / "cc-without-lto"
    calls = tmp_path / "calls"
    wrapper.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n'
        'for a in "$@"; do [ "$a" = -flto ] && exit 1; done\n'
        f'exec {find_c_compiler()} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    plain = cpu.load_cpu_kernels.__wrapped__(str(wrapper), kernels.checks)
    assert plain is not None
    assert plain.path != kernels.path
    assert len(calls.read_text().splitlines()) == 2  # -flto refused, then the plain build
    assert cpu.load_cpu_kernels.__wrapped__(str(wrapper), kernels.checks).path == plain.path
    assert len(calls.read_text().splitlines()) == 2  # found, not compiled again
    weights = [_weights(Q.Q4_K), _weights(Q.Q5_0, rows=16, seed=1)]
    x = torch.randn(3, 512)
    assert torch.equal(quantized_matmuls(plain, x, weights), quantized_matmuls(kernels, x, weights))


@pytest.mark.slow
@pytest.mark.parametrize("march", ["haswell", "skylake-avx512"])
def test_an_older_cpus_build_gives_this_builds_bits(kernels, tmp_path, march):
    """The int8 products built for an older CPU give exactly this machine's build's bits,
    one row and many, at block counts that do and do not fill the one-row kernels' groups
    (2304 values: 9 k-quant blocks, a whole group of 8 and a rest, in runs of rows): AVX2
    alone (haswell: no AVX-512, none of its one-row kernels) and AVX-512 without
    VBMI and BITALG (skylake-avx512: the one-row Q5_0 and Q8_0 kernels' fallback)."""
    from spnl_backend.kernels.cpu import build
    from spnl_backend.settings.platform import find_c_compiler

    compiler = find_c_compiler()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    needs = {"haswell": " avx2", "skylake-avx512": " avx512bw"}[march]
    if platform.machine() != "x86_64" or compiler is None or needs not in flags:
        pytest.skip(f"needs an x86-64 CPU with{needs} and a C compiler")
    older = [f if f != "-march=native" else f"-march={march}" for f in build._BASE_FLAGS]
    target = tmp_path / "libspnlcpu.so"
    build._compile(compiler, [*older, *(build._CHECK_FLAGS if kernels.checks else [])], target)
    older_build = build._load(target)
    assert older_build.has_int8
    for cols in (256, 800, 1280, 2304):
        fits = [t for t in TYPES if cols % GGML_QUANT_SIZES[t][0] == 0]
        weights = [_weights(t, rows=40, cols=cols, seed=i) for i, t in enumerate(fits)]
        x = torch.randn(7, cols, generator=torch.Generator().manual_seed(cols))
        for rows in (1, 2, 7):
            native = quantized_matmuls(kernels, x[:rows], weights)
            assert torch.equal(quantized_matmuls(older_build, x[:rows], weights), native), (
                cols,
                rows,
            )


@pytest.mark.slow
def test_every_cpus_tuning_gives_this_builds_bits(kernels, tmp_path):
    """The per-CPU macros (`build._TUNING`: prefetch distances) move no bit: this CPU's
    build with each other CPU's tuning, and with none, gives this build's products."""
    from spnl_backend.kernels.cpu import build
    from spnl_backend.settings.platform import find_c_compiler

    compiler = find_c_compiler()
    if compiler is None or not kernels.has_int8:
        pytest.skip("needs a C compiler and the int8 products")
    checks = build._CHECK_FLAGS if kernels.checks else []
    ours = build.tuning_flags()
    others = [macros for macros in [[], *build._TUNING.values()] if macros != ours]
    assert others
    for i, macros in enumerate(others):
        target = tmp_path / f"tuned{i}" / "libspnlcpu.so"
        build._compile(compiler, [*build._BASE_FLAGS, *macros, *checks], target)
        tuned = build._load(target)
        for cols in (256, 2304):
            fits = [t for t in TYPES if cols % GGML_QUANT_SIZES[t][0] == 0]
            weights = [_weights(t, rows=40, cols=cols, seed=s) for s, t in enumerate(fits)]
            x = torch.randn(3, cols, generator=torch.Generator().manual_seed(cols))
            for rows in (1, 3):
                native = quantized_matmuls(kernels, x[:rows], weights)
                assert torch.equal(quantized_matmuls(tuned, x[:rows], weights), native), macros


@pytest.mark.parametrize(
    ("vendor", "family", "expected"),
    [
        ("AuthenticAMD", "25", ["-DROW1_PREFETCH=0"]),  # Zen 4 (and Zen 3, without AVX-512)
        ("AuthenticAMD", "26", []),  # Zen 5: the defaults were measured there
        ("GenuineIntel", "6", []),  # not measured: the defaults
    ],
)
def test_the_build_takes_the_tuning_measured_for_its_cpu(tmp_path, vendor, family, expected):
    from spnl_backend.kernels.cpu import build

    info = tmp_path / "cpuinfo"
    fields = f"vendor_id\t: {vendor}\ncpu family\t: {family}\nflags\t\t: avx2\n"
    info.write_text("\n".join(f"processor\t: {i}\n{fields}" for i in range(2)))
    assert build.tuning_flags(str(info)) == expected
    assert build.tuning_flags(str(tmp_path / "absent")) == []  # no /proc: the defaults
    odd = tmp_path / "odd"  # a model name that is not UTF-8 reads past, not raises
    odd.write_bytes(b"model name\t: \xff\xfe\n" + info.read_bytes())
    assert build.tuning_flags(str(odd)) == expected


@pytest.mark.parametrize("mode", ["int8", "exact"])
def test_grouped_products_are_each_rows_one_row_product(kernels, mode):
    """Products on their own rows in one call (`spnl_qmatmul_groups`: an expert with its
    tokens): each row bit for bit what a one-row call gives, the twin's numbers, and the
    rows no group writes left at zero."""
    native = dataclasses.replace(kernels, exact=mode == "exact")
    weights = [_weights(qtype, rows=40, cols=768, seed=i) for i, qtype in enumerate(TYPES)]
    x = torch.randn(6, 768, generator=torch.Generator().manual_seed(1))
    # (x_row, y_row, rows, col): one row, several, none, shared inputs, side by side
    layout = [(0, 0, 1, 0), (1, 1, 3, 0), (0, 4, 0, 0), (5, 4, 1, 40), (2, 5, 1, 0)]
    groups = [layout[i % len(layout)] for i in range(len(weights))]
    groups = [(xr, (yr + 6 * i) % 24, n, col) for i, (xr, yr, n, col) in enumerate(groups)]
    call = native.products([(w.qtype.value, w.data, w.shape[0]) for w in weights])
    together = call.groups(x, groups, y_rows=24)
    expected = torch.zeros_like(together)
    twin = torch.zeros_like(together)
    for w, (x_row, y_row, rows, col) in zip(weights, groups, strict=True):
        for r in range(rows):
            row = x[x_row + r : x_row + r + 1]
            expected[y_row + r, col : col + 40] = quantized_matmuls(native, row, [w])[0]
            twin[y_row + r, col : col + 40] = (row @ w.dequantize().T)[0]
    assert torch.equal(together, expected)
    # int8 activations: values near 27 in magnitude, each block rounded to 1/127 of its top
    torch.testing.assert_close(together, twin, rtol=0.05, atol=1.0 if mode == "int8" else 1e-3)
    with pytest.raises(KernelArgumentError, match="groups for"):
        call.groups(x, groups[:2], y_rows=24)
    huge = 2**62  # sums of such extents wrap around: refused all the same
    for bad in [(5, 0, 2, 0), (0, 23, 2, 0), (-1, 0, 1, 0), (0, 0, -1, 0), (huge, huge, huge, 0)]:
        with pytest.raises(KernelArgumentError, match="rejected"):
            call.groups(x, [bad, *groups[1:]], y_rows=24)


def _experts(count: int, hidden: int, inner: int, qtypes: tuple[Q, Q], seed: int = 0):
    """``count`` experts' (gate, up, down) as GGML blocks, and the same stacked in float
    (``w13 [E, 2I, H]``, ``w2 [E, H, I]``) for the twin."""
    gate_up_type, down_type = qtypes
    experts, w13, w2 = [], [], []
    for e in range(count):
        gate, up = (_weights(gate_up_type, inner, hidden, seed + 3 * e + i) for i in (0, 1))
        down = _weights(down_type, hidden, inner, seed + 3 * e + 2)
        experts.append(tuple((w.qtype.value, w.data, w.shape[0]) for w in (gate, up, down)))
        w13.append(torch.cat([gate.dequantize(), up.dequantize()]).float())
        w2.append(down.dequantize().float())
    return experts, torch.stack(w13), torch.stack(w2)


@pytest.mark.parametrize("mode", ["int8", "exact"])
@pytest.mark.parametrize(
    ("tokens", "count", "top_k", "renormalize", "qtypes"),
    [
        (1, 8, 2, True, (Q.Q8_0, Q.Q8_0)),
        (7, 16, 4, False, (Q.Q4_K, Q.Q6_K)),
        (300, 4, 1, True, (Q.Q4_0, Q.Q5_K)),  # more than one chunk of 256 tokens
    ],
)
def test_the_moe_layer_against_its_twin(kernels, mode, tokens, count, top_k, renormalize, qtypes):
    """`spnl_moe` (routing, the experts' grouped products, SiLU, the weighted sum) against
    torch: softmax, top-k and renormalising, then the fused-MoE twin on the dequantized
    experts; and every row as it would be alone."""
    from spnl_backend.kernels.cpu.moe import NativeMoe
    from spnl_backend.kernels.moe_ref import fused_moe_ref

    native = dataclasses.replace(kernels, exact=mode == "exact")
    hidden, inner = 256, 512
    experts, w13, w2 = _experts(count, hidden, inner, qtypes)
    gen = torch.Generator().manual_seed(5)
    router = torch.randn(count, hidden, generator=gen) / 8
    x = torch.randn(tokens, hidden, generator=gen)
    layer = NativeMoe(native, router, experts, top_k, renormalize)
    out = layer(x)
    weights, ids = torch.topk(torch.softmax(x @ router.T, dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    twin = fused_moe_ref(x, w13, w2, ids, weights)
    scale = twin.abs().max().item()
    tolerance = 0.05 * scale if mode == "int8" else 1e-4 * scale
    torch.testing.assert_close(out, twin, rtol=0, atol=tolerance)
    assert torch.equal(torch.cat([layer(row[None]) for row in x[:3]]), out[:3])


@pytest.mark.parametrize("mode", ["int8", "exact"])
@pytest.mark.parametrize("tokens", [1, 9])
def test_a_biased_clamped_mxfp4_moe_layer_against_its_twin(kernels, mode, tokens):
    """gpt-oss's layer: MXFP4 experts, a biased router and biased projections, the clamped
    SwiGLU (inputs large enough that both clamps bind), against torch on the dequantized
    experts (on the activations as the int8 products round them); every row as alone."""
    from spnl_backend.kernels.cpu.moe import Biases, NativeMoe
    from spnl_backend.models.mlp import ClampedSwiGLU

    native = dataclasses.replace(kernels, exact=mode == "exact")
    count, top_k, hidden, inner = 6, 2, 256, 128
    glu = ClampedSwiGLU(1.702, 7.0)
    gen = torch.Generator().manual_seed(7)
    gate, up, down = (
        [_mxfp4_weight(rows, cols, seed=3 * e + i) for e in range(count)]
        for i, (rows, cols) in enumerate([(inner, hidden), (inner, hidden), (hidden, inner)])
    )
    experts = [
        tuple((w.qtype.value, w.data, w.shape[0]) for w in ws)
        for ws in zip(gate, up, down, strict=True)
    ]
    router = torch.randn(count, hidden, generator=gen) / 8
    biases = Biases(
        torch.randn(count, generator=gen),
        torch.randn(count, 2 * inner, generator=gen),
        torch.randn(count, hidden, generator=gen),
    )
    x = torch.randn(tokens, hidden, generator=gen) * 4
    layer = NativeMoe(native, router, experts, top_k, True, biases, (glu.alpha, glu.limit))
    out = layer(x)

    rounded = native.exact or not native.has_int8
    acts = (lambda t: t) if rounded else (lambda t: int8_activations_ref(t, Q.MXFP4))
    weights, ids = torch.topk(torch.softmax(x @ router.T + biases.router, dim=-1), top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    twin = torch.zeros_like(x)
    binds = []
    for t in range(tokens):
        for j in ids[t].argsort():  # experts in id order
            e = int(ids[t, j])
            g = acts(x[t : t + 1]) @ gate[e].dequantize().T + biases.gate_up[e, :inner]
            u = acts(x[t : t + 1]) @ up[e].dequantize().T + biases.gate_up[e, inner:]
            binds.append(bool((g > glu.limit).any() and (u.abs() > glu.limit).any()))
            y = acts(glu(g, u)) @ down[e].dequantize().T + biases.down[e]
            twin[t] += weights[t, j] * y[0]
    assert any(binds)
    torch.testing.assert_close(out, twin, rtol=1e-4, atol=1e-3 * twin.abs().max().item())
    assert torch.equal(torch.cat([layer(row[None]) for row in x]), out)
    half = Biases(biases.router, torch.zeros(count, inner), biases.down)  # gate's only
    with pytest.raises(KernelArgumentError, match="gate_up bias"):
        NativeMoe(native, router, experts, top_k, True, half)


def test_the_moe_layer_refuses_what_it_cannot_run(kernels):
    from spnl_backend.kernels.cpu.moe import NativeMoe

    experts, _, _ = _experts(2, 256, 256, (Q.Q8_0, Q.Q8_0))
    router = torch.randn(2, 256)
    with pytest.raises(KernelArgumentError, match="top 3"):
        NativeMoe(kernels, router, experts, 3, True)
    with pytest.raises(KernelArgumentError, match="router"):
        NativeMoe(kernels, router.half(), experts, 1, True)
    other = _experts(1, 256, 512, (Q.Q8_0, Q.Q8_0))[0]
    with pytest.raises(KernelArgumentError, match="shapes"):
        NativeMoe(kernels, router, [experts[0], other[0]], 1, True)
    layer = NativeMoe(kernels, router, experts, 1, True)
    with pytest.raises(KernelArgumentError, match="columns"):
        layer(torch.randn(3, 128))
    x, out = torch.randn(2, 256), torch.empty(2, 256)
    small = torch.empty(layer.scratch_bytes(2) - 64, dtype=torch.uint8)
    status = kernels.library.spnl_moe(
        layer.args, x.data_ptr(), 2, out.data_ptr(), small.data_ptr(), small.numel(), 1, 0
    )
    assert status == -1  # too little scratch: refused before anything is written


def _mxfp4_weight(rows: int, cols: int, seed: int = 0) -> QuantizedWeight:
    """Random MXFP4 blocks (scales 2^-12 to 2^-1, the two denormal ones among them)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows * cols // 32, 17), dtype=torch.uint8, generator=gen)
    blocks[:, 0] = torch.randint(116, 128, (len(blocks),), dtype=torch.uint8, generator=gen)
    blocks[:2, 0] = torch.tensor([0, 1], dtype=torch.uint8)
    return QuantizedWeight(blocks.view(rows, -1), Q.MXFP4, (rows, cols))


@pytest.mark.parametrize("mode", ["int8", "exact"])
@pytest.mark.parametrize("rows", [1, 3, 7, 70])
def test_mxfp4_products_equal_the_twin_and_each_row_alone(kernels, mode, rows):
    """MXFP4 (gpt-oss's experts as stored), beside another format: the exact products
    against the dequantized twin, the int8 ones against it on the activations as rounded
    for 32-value blocks; every row bit for bit as it would be alone (7 and 70 rows take the
    int8 tiles of 16 weight rows, 1 and 3 the row-at-a-time kernel; 25 blocks a row end the
    chains mid-group)."""
    native = dataclasses.replace(kernels, exact=mode == "exact")
    weights = [_mxfp4_weight(48, 800), _weights(Q.Q8_0, rows=16, cols=800)]
    x = torch.randn(rows, 800)
    together = quantized_matmuls(native, x, weights)
    if native.exact or not native.has_int8:  # no AVX2: the int8 products are the exact ones
        torch.testing.assert_close(together, _twin(x, weights), rtol=1e-5, atol=1e-4)
    else:
        twin = torch.cat([_twin(int8_activations_ref(x, w.qtype), [w]) for w in weights], -1)
        torch.testing.assert_close(together, twin, rtol=1e-4, atol=1e-4)
        relative = (together - _twin(x, weights)).norm() / _twin(x, weights).norm()
        assert 0 < relative < 0.01  # rounded activations: close, not the same
    alone = torch.cat([quantized_matmuls(native, x[i : i + 1], weights) for i in range(rows)])
    assert torch.equal(together, alone)


def test_mxfp4_dequantizes_as_the_twin_bit_for_bit(kernels):
    weight = _mxfp4_weight(8, 256, seed=2)
    native = kernels.dequantize(Q.MXFP4.value, weight.data, *weight.shape)
    assert torch.equal(native, weight.dequantize())


def _delta_inputs(tokens: int, heads: int, dk: int, dv: int, seed: int = 0):
    """As the DeltaNet layer hands them over: unit keys, queries scaled by dk^-1/2, decays
    below 1, write strengths in (0, 1), and a state carried from earlier tokens."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(tokens, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(tokens, heads, dk, generator=gen), dim=-1)
    v = torch.randn(tokens, heads, dv, generator=gen)
    g = -torch.rand(tokens, heads, generator=gen)
    beta = torch.rand(tokens, heads, generator=gen)
    return q, k, v, g, beta, torch.randn(heads, dk, dv, generator=gen)


@pytest.mark.parametrize(
    ("tokens", "heads", "dk", "dv"),
    [(1, 4, 16, 16), (7, 3, 8, 24), (150, 5, 32, 16), (70, 2, 128, 128)],
)
def test_the_delta_rule_against_its_twin(kernels, tokens, heads, dk, dv):
    """Outputs and the state left behind, to float rounding (the sums over a head's rows
    take another order); T = 1 is decode, T > 64 crosses the chunked twin's chunk."""
    *inputs, start = _delta_inputs(tokens, heads, dk, dv)
    state, twin_state = start.clone(), start.clone()
    out = kernels.delta_rule_(*inputs, state)
    expected = delta_rule.recurrent(*inputs, twin_state)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, twin_state, atol=1e-5, rtol=1e-5)


def test_the_delta_rule_gives_the_same_bits_in_any_pieces(kernels):
    """Token by token, where a call starts never changes a token's arithmetic: the state
    layers compute in pieces, and a prefix hit must give the cold run's bits."""
    *inputs, start = _delta_inputs(100, 3, 16, 8)
    whole_state, pieces_state = start.clone(), start.clone()
    whole = kernels.delta_rule_(*inputs, whole_state)
    pieces = [
        kernels.delta_rule_(*(t[a:b] for t in inputs), pieces_state)
        for a, b in ((0, 1), (1, 32), (32, 64), (64, 100))
    ]
    assert torch.equal(torch.cat(pieces), whole)
    assert torch.equal(pieces_state, whole_state)


def test_the_delta_rule_reads_views(kernels):
    """q, k, v as views with gaps (the layer's split of one projection) are read as given."""
    q, k, v, g, beta, start = _delta_inputs(9, 2, 8, 8)
    packed = torch.cat([q, k, v], dim=-1)
    views = packed.split([8, 8, 8], dim=-1)
    state, twin_state = start.clone(), start.clone()
    assert torch.equal(
        kernels.delta_rule_(*views, g, beta, state),
        kernels.delta_rule_(q, k, v, g, beta, twin_state),
    )


def test_the_delta_rule_refuses_what_it_cannot_run(kernels):
    q, k, v, g, beta, state = _delta_inputs(4, 2, 8, 8)
    with pytest.raises(KernelArgumentError, match="v of shape"):
        kernels.delta_rule_(q, k, v[:, :, :4], g, beta, state)
    with pytest.raises(KernelArgumentError, match="state"):
        kernels.delta_rule_(q, k, v, g, beta, state.transpose(1, 2))
    with pytest.raises(KernelArgumentError, match="g"):
        kernels.delta_rule_(q, k, v, g.double(), beta, state)


def _ssd_inputs(tokens: int, heads: int, p: int, n: int, seed: int = 0):
    """As the Mamba-2 layer hands them over: positive steps, negative rates, a state
    carried from earlier tokens."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, p, generator=gen)
    dt = F.softplus(torch.randn(tokens, heads, generator=gen))
    a = -torch.rand(heads, generator=gen) - 0.1
    b, c = (torch.randn(tokens, heads, n, generator=gen) for _ in range(2))
    return x, dt, a, b, c, torch.randn(heads, p, n, generator=gen)


@pytest.mark.parametrize(
    ("tokens", "heads", "p", "n"),
    [(1, 4, 16, 16), (9, 3, 5, 4), (300, 2, 64, 128), (70, 8, 32, 48)],
)
def test_the_ssd_scan_against_its_twin(kernels, tokens, heads, p, n):
    """Outputs and the state left behind: the state to the bit (decay, write and add are
    element-wise, in the twin's order), the outputs to float rounding (their sums)."""
    *inputs, start = _ssd_inputs(tokens, heads, p, n)
    state, twin_state = start.clone(), start.clone()
    out = kernels.ssd_scan_(*inputs, state)
    expected = ssd.recurrent(*inputs, twin_state)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, twin_state, atol=1e-6, rtol=1e-6)


def test_the_ssd_scan_refuses_what_it_cannot_run(kernels):
    x, dt, a, b, c, state = _ssd_inputs(4, 2, 8, 8)
    with pytest.raises(KernelArgumentError, match="a of shape"):
        kernels.ssd_scan_(x, dt, a[:1], b, c, state)
    with pytest.raises(KernelArgumentError, match="c of shape"):
        kernels.ssd_scan_(x, dt, a, b, c[:, :, :4], state)


def _selective_inputs(tokens: int, channels: int, n: int, seed: int = 0):
    """As the Mamba-1 layer hands them over: positive steps, negative rates per channel
    and state element, a state carried from earlier tokens."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=gen)
    dt = F.softplus(torch.randn(tokens, channels, generator=gen))
    a = -torch.rand(channels, n, generator=gen) - 0.1
    b, c = (torch.randn(tokens, n, generator=gen) for _ in range(2))
    return x, dt, a, b, c, torch.randn(channels, n, generator=gen)


@pytest.mark.parametrize(
    ("tokens", "channels", "n"), [(1, 8, 16), (9, 70, 4), (130, 256, 16), (40, 129, 8)]
)
def test_the_selective_scan_against_its_twin(kernels, tokens, channels, n):
    """Outputs and the state left behind, over runs of channels that split unevenly."""
    *inputs, start = _selective_inputs(tokens, channels, n)
    state, twin_state = start.clone(), start.clone()
    out = kernels.selective_scan_(*inputs, state)
    expected = selective_scan.recurrent(*inputs, twin_state)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, twin_state, atol=1e-6, rtol=1e-6)


def test_the_selective_scan_refuses_what_it_cannot_run(kernels):
    x, dt, a, b, c, state = _selective_inputs(4, 8, 8)
    with pytest.raises(KernelArgumentError, match="a of shape"):
        kernels.selective_scan_(x, dt, a[:, :4], b, c, state)
    with pytest.raises(KernelArgumentError, match="dt of shape"):
        kernels.selective_scan_(x, dt[:, :4], a, b, c, state)
    with pytest.raises(KernelArgumentError, match="state"):
        kernels.selective_scan_(x, dt, a, b, c, state.double())


def test_the_build_cache_tells_cpus_apart_without_proc_cpuinfo(monkeypatch):
    """Where /proc/cpuinfo cannot be read (macOS, a locked-down container), the cached
    build is still keyed by what ``-march=native`` compiles for (the compiler's own
    macros: AVX-512 VBMI among them), so a cache shared between machines never hands
    one CPU's instructions to another."""
    from spnl_backend.kernels.cpu import build
    from spnl_backend.settings.platform import find_c_compiler

    compiler = find_c_compiler()
    if compiler is None:
        pytest.skip("needs a C compiler")
    real_open = open

    def no_cpuinfo(path, *args, **kwargs):
        if str(path) == "/proc/cpuinfo":
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_cpuinfo)
    build._native_macros.cache_clear()
    native = build._native_macros(compiler)
    assert native in build._cpu_identity(compiler)
    if platform.machine() == "x86_64":
        assert "__SSE2__" in native
    here = build._target(b"sources", compiler, build._BASE_FLAGS)
    # another CPU (the same compiler, other macros): another cache entry
    monkeypatch.setattr(build, "_native_macros", lambda _compiler: native + " __AVX512VBMI__")
    assert build._target(b"sources", compiler, build._BASE_FLAGS) != here
