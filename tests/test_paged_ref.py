"""The torch paged kernels against plain attention over contiguous K/V."""

import pytest
import torch
from paged_cases import CASES, contiguous_attention, paged_case, scoring_of, writes

from spnl_backend.kernels.attention_ref import attention_ref
from spnl_backend.kernels.paged_ref import FP8_MAX, paged_attention_ref, store_kv_ref
from spnl_backend.kernels.scoring import Scoring


def _paged_case(seq_lens, query_lens, kv_heads, heads, block_size):
    return paged_case(seq_lens, query_lens, kv_heads, heads, block_size)


def _expected(q, keys, values, seq_lens, query_lens, **options):
    return contiguous_attention(
        q, [k.float() for k in keys], [v.float() for v in values], seq_lens, query_lens, **options
    )


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    ("kv_heads", "heads"), [(4, 4), (2, 8), (1, 8), (1, 1)], ids=["mha", "gqa4", "mqa8", "single"]
)
@pytest.mark.parametrize("block_size", [8, 32])
def test_paged_attention_equals_contiguous(case, kv_heads, heads, block_size):
    seq_lens, query_lens = CASES[case]
    q, ck, cv, tables, keys, values = _paged_case(seq_lens, query_lens, kv_heads, heads, block_size)
    out = paged_attention_ref(q, ck, cv, tables, Scoring(0.17))
    torch.testing.assert_close(
        out, _expected(q, keys, values, seq_lens, query_lens, scale=0.17), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("case", ["decode", "mixed", "prefix hit"])
@pytest.mark.parametrize(
    "options",
    [{"sliding_window": 6}, {"softcap": 5.0}, {"sliding_window": 4, "softcap": 3.0}],
    ids=["window", "softcap", "both"],
)
def test_window_and_softcap(case, options):
    seq_lens, query_lens = CASES[case]
    q, ck, cv, tables, keys, values = _paged_case(seq_lens, query_lens, 2, 4, 8)
    out = paged_attention_ref(q, ck, cv, tables, scoring_of(0.5, options))
    torch.testing.assert_close(
        out,
        _expected(q, keys, values, seq_lens, query_lens, scale=0.5, **options),
        atol=1e-5,
        rtol=1e-5,
    )


def test_alibi_matches_explicit_bias():
    seq_lens, query_lens = [12], [5]
    q, ck, cv, tables, keys, values = _paged_case(seq_lens, query_lens, 2, 4, 8)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    out = paged_attention_ref(q, ck, cv, tables, Scoring(0.3), alibi_slopes=slopes)
    k, v = keys[0].repeat_interleave(2, dim=1), values[0].repeat_interleave(2, dim=1)
    q_pos, k_pos = torch.arange(7, 12), torch.arange(12)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.3
    scores = scores + slopes.view(4, 1, 1) * (k_pos - q_pos.unsqueeze(-1))
    scores = scores.masked_fill(k_pos > q_pos.unsqueeze(-1), float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_softcap_is_cap_times_tanh():
    q = torch.randn(3, 1, 8) * 4
    k, v = torch.randn(3, 1, 8) * 4, torch.randn(3, 1, 8)
    out = attention_ref(q, k, v, Scoring(1.0, softcap=2.0), context_len=0)
    scores = 2.0 * torch.tanh((q[:, 0] @ k[:, 0].T) / 2.0)
    scores = scores.masked_fill(torch.ones(3, 3).triu(1).bool(), float("-inf"))
    torch.testing.assert_close(out[:, 0], torch.softmax(scores, -1) @ v[:, 0])


def test_store_skips_padding_slots():
    cache_k = torch.zeros(2, 4, 1, 2)
    cache_v = torch.zeros(2, 4, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2)
    store_kv_ref(k, -k, cache_k, cache_v, writes(torch.tensor([5, -1, 0]), 4))
    assert cache_k.view(8, 2)[5].tolist() == [0.0, 1.0]
    assert cache_k.view(8, 2)[0].tolist() == [4.0, 5.0]
    assert cache_v.view(8, 2)[0].tolist() == [-4.0, -5.0]
    assert int((cache_k != 0).sum()) == 3  # the -1 token wrote nothing


def test_fp8_store_scales_and_clamps():
    cache_k = torch.zeros(1, 4, 1, 2, dtype=torch.float8_e4m3fn)
    cache_v = torch.zeros_like(cache_k)
    k = torch.tensor([[[1.0, -2.0]], [[1000.0, -0.5]]])
    store_kv_ref(k, k, cache_k, cache_v, writes(torch.tensor([0, 1]), 4), k_scale=2.0, v_scale=0.5)
    stored_k = cache_k.float().view(4, 2)
    assert stored_k[0].tolist() == [0.5, -1.0]  # value / scale
    assert stored_k[1, 0] == FP8_MAX  # clamped, not infinite
    assert cache_v.float().view(4, 2)[0].tolist() == [2.0, -4.0]


@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_fp8_cache_attends_like_the_rounded_values(case):
    seq_lens, query_lens = CASES[case]
    q, ck, cv, tables, keys, values = _paged_case(seq_lens, query_lens, 2, 4, 8)
    fk = torch.zeros_like(ck, dtype=torch.float8_e4m3fn)
    fv = torch.zeros_like(cv, dtype=torch.float8_e4m3fn)
    fk.copy_((ck / 0.5).to(torch.float8_e4m3fn))
    fv.copy_((cv / 0.25).to(torch.float8_e4m3fn))
    out = paged_attention_ref(q, fk, fv, tables, Scoring(0.2), k_scale=0.5, v_scale=0.25)
    rounded = [(k / 0.5).to(torch.float8_e4m3fn).float() * 0.5 for k in keys]
    rounded_v = [(v / 0.25).to(torch.float8_e4m3fn).float() * 0.25 for v in values]
    torch.testing.assert_close(
        out, _expected(q, rounded, rounded_v, seq_lens, query_lens, scale=0.2), atol=1e-5, rtol=1e-5
    )


def test_sinks_join_each_heads_denominator_alone():
    """gpt-oss's sinks against the formula written out: e^s over the visible keys' e^s plus
    the head's e^sink, the sink weighing no value."""
    seq_lens, query_lens = [12], [5]
    q, ck, cv, tables, keys, values = _paged_case(seq_lens, query_lens, 2, 4, 8)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out = paged_attention_ref(q, ck, cv, tables, Scoring(0.3, sinks=sinks))
    k, v = keys[0].repeat_interleave(2, dim=1), values[0].repeat_interleave(2, dim=1)
    q_pos, k_pos = torch.arange(7, 12), torch.arange(12)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.3
    weights = scores.exp().masked_fill(k_pos > q_pos.unsqueeze(-1), 0.0)
    weights = weights / (weights.sum(-1, keepdim=True) + sinks.exp().view(4, 1, 1))
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", weights, v))


@pytest.mark.parametrize("case", ["decode", "mixed", "prefix hit"])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 6}], ids=["full", "window"])
def test_sinks_paged_equal_contiguous(case, options):
    seq_lens, query_lens = CASES[case]
    q, ck, cv, tables, keys, values = _paged_case(seq_lens, query_lens, 2, 4, 8)
    sinks = torch.tensor([3.0, -2.0, 0.25, 1.0])
    out = paged_attention_ref(q, ck, cv, tables, scoring_of(0.5, options, sinks=sinks))
    expected = _expected(q, keys, values, seq_lens, query_lens, scale=0.5, sinks=sinks, **options)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    plain = paged_attention_ref(q, ck, cv, tables, scoring_of(0.5, options))
    assert not torch.allclose(out, plain)  # the sinks do take a share


@pytest.mark.parametrize("case", ["prefill", "decode", "mixed", "chunked prefill"])
@pytest.mark.parametrize(("chunk", "window"), [(5, None), (8, 5), (4, 9)])
def test_chunks_see_their_own_chunk_alone(case, chunk, window):
    """Llama 4's chunked attention against a mask written out: the key at ``j`` is seen
    from ``i`` where ``j <= i``, ``j // chunk == i // chunk`` and (with a window too)
    ``j > i - window``; a chunk's first query sees itself alone."""
    seq_lens, query_lens = CASES[case]
    q, ck, cv, tables, keys, values = _paged_case(seq_lens, query_lens, 2, 4, 8)
    out = paged_attention_ref(q, ck, cv, tables, Scoring(0.5, window=window, chunk=chunk))
    start = 0
    for k, v, n, m in zip(keys, values, seq_lens, query_lens, strict=True):
        i, j = torch.arange(n - m, n)[:, None], torch.arange(n)[None, :]
        visible = (j <= i) & (j // chunk == i // chunk)
        if window is not None:
            visible &= j > i - window
        k2, v2 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + m], k2) * 0.5
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        expected = torch.einsum("hqk,khd->qhd", weights, v2)
        torch.testing.assert_close(out[start : start + m], expected, atol=1e-5, rtol=1e-5)
        start += m
