"""Quantization to every GGML block format: gguf-py's bytes where it quantizes, and bounded
round-trip error everywhere, edge cases included."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

import spnl_backend.quant.quantize as quantize_module
from spnl_backend.quant.ggml import dequantize, ggml_format
from spnl_backend.quant.quantize import QUANTIZERS, quantize

GGUF_PY_QUANTIZES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
# Relative RMS round-trip error on standard normal weights: measured (bench/quant.py,
# against llama.cpp's own quantizers: within 0.1% of theirs for every type) plus room.
ROUND_TRIP_BOUND = {
    Q.Q2_K: 0.31,
    Q.Q3_K: 0.16,
    Q.Q4_K: 0.075,
    Q.Q5_K: 0.038,
    Q.Q6_K: 0.019,
    Q.Q4_0: 0.09,
    Q.Q4_1: 0.082,
    Q.Q5_0: 0.045,
    Q.Q5_1: 0.04,
    Q.Q8_0: 0.006,
    Q.Q8_1: 0.006,
}
ALL = sorted(QUANTIZERS, key=lambda t: t.value)


def _rows(block: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    width = max(block, 256) * 2
    return np.stack(
        [
            rng.normal(size=width),
            np.zeros(width),
            np.full(width, -3.25),
            np.concatenate([np.full(block, 7.0), rng.normal(size=width - block)]),
            rng.normal(size=width) * 1e4,
            rng.normal(size=width) * 1e-2,
            rng.normal(size=width) * 1e-6,  # scales below float16's normal range
            np.where(rng.random(width) < 0.01, 40.0, rng.normal(size=width)),
        ]
    ).astype(np.float32)


def _round_trip(x: np.ndarray, qtype: Q) -> np.ndarray:
    packed = quantize(torch.from_numpy(x), qtype)
    return dequantize(packed.reshape(-1), qtype, x.shape).numpy()


@pytest.mark.parametrize("qtype", GGUF_PY_QUANTIZES, ids=lambda t: t.name)
def test_bytes_equal_gguf_py(qtype):
    x = _rows(32)
    ours = quantize(torch.from_numpy(x), qtype).numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        theirs = quants.quantize(x, qtype)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_round_trip_error_on_gaussian_weights(qtype):
    x = np.random.default_rng(1).normal(size=(64, 1024)).astype(np.float32)
    back = _round_trip(x, qtype)
    error = np.sqrt(((back - x) ** 2).mean() / (x**2).mean())
    assert error < ROUND_TRIP_BOUND[qtype]


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_edge_cases(qtype):
    x = _rows(ggml_format(qtype).block_size)
    back = _round_trip(x, qtype)
    assert np.isfinite(back).all()
    np.testing.assert_array_equal(back[1], 0.0)  # all zeros stay zeros
    for row in (0, 2, 3, 4, 5, 7):  # scale-free error: the same bound at any magnitude
        error = np.sqrt(((back[row] - x[row]) ** 2).mean() / (x[row] ** 2).mean())
        assert error < 3 * ROUND_TRIP_BOUND[qtype], row
    # Tiny values: the float16 scales underflow (as in ggml), but nothing grows.
    assert np.abs(back[6]).max() <= 2 * np.abs(x[6]).max()


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_a_block_of_one_value_is_nearly_exact(qtype):
    x = np.full((2, 512), 0.7, dtype=np.float32)
    assert np.abs(_round_trip(x, qtype) - x).max() < 0.7 * 0.02


def test_q8_1_stores_the_scaled_sum():
    x = torch.randn(1, 32)
    packed = quantize(x, Q.Q8_1)
    d = packed[0, :2].view(torch.float16).float()
    s = packed[0, 2:4].view(torch.float16).float()
    q = packed[0, 4:].view(torch.int8).float()
    # ggml stores float16(d * sum) with the unrounded d: equal up to float16 rounding
    assert torch.allclose(s, q.sum() * d, rtol=2e-3)


def test_rows_that_do_not_split_into_blocks_are_refused():
    with pytest.raises(ValueError, match="do not split into Q4_K blocks of 256"):
        quantize(torch.randn(4, 640), Q.Q4_K)


@pytest.mark.parametrize("qtype", list(QUANTIZERS), ids=lambda t: t.name)
def test_quantizing_a_slice_of_rows_at_a_time_changes_no_byte(qtype, monkeypatch):
    weight = torch.randn(7, 512, generator=torch.Generator().manual_seed(3))
    whole = quantize(weight, qtype)
    monkeypatch.setattr(quantize_module, "QUANTIZE_SLICE_ELEMENTS", 2 * 512)
    assert torch.equal(quantize(weight, qtype), whole)
