"""Our dequantization equals gguf-py's on the same bytes, for every type, edge cases included."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from spnl_backend.quant.ggml import DEQUANTIZERS, FLOAT_TYPES, dequantize, ggml_format

# gguf-py dequantizes every type but Q8_1 (ggml's activation format; gguf-py lists an older
# 40-byte layout for it and has no dequantizer).
QUANTIZED = sorted((t for t in DEQUANTIZERS if t != Q.Q8_1), key=lambda t: t.value)


def _edge_rows(block: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    rows = [
        np.zeros(block * 4),
        np.full(block * 4, 0.37),
        np.concatenate([np.full(block, -2.5), rng.normal(size=3 * block)]),
        rng.normal(size=block * 4) * 1e4,
        rng.normal(size=block * 4) * 1e-6,
        np.where(rng.random(block * 4) < 0.02, 50.0, rng.normal(size=block * 4)),
    ]
    return np.stack(rows).astype(np.float32)


def _reference(raw: np.ndarray, qtype: Q) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return quants.dequantize(raw, qtype)


def _ours(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    return dequantize(torch.from_numpy(raw.copy()), qtype, shape).numpy()


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_random_bytes_dequantize_like_gguf_py(qtype):
    """Arbitrary bit patterns, including scales that are NaN or infinite halves."""
    fmt = ggml_format(qtype)
    raw = np.random.default_rng(qtype.value).integers(
        0, 256, (16, 4 * fmt.type_size), dtype=np.uint8
    )
    ref = _reference(raw, qtype)
    np.testing.assert_array_equal(_ours(raw, qtype, ref.shape), ref)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_quantized_edge_cases_dequantize_like_gguf_py(qtype):
    fmt = ggml_format(qtype)
    data = _edge_rows(fmt.block_size)
    try:
        raw = quants.quantize(data, qtype)
    except NotImplementedError:  # gguf-py quantizes only some types; make the bytes ourselves
        raw = _random_valid_blocks(qtype, data.shape[0], data.shape[1] // fmt.block_size)
    ref = _reference(raw, qtype)
    np.testing.assert_array_equal(_ours(raw, qtype, ref.shape), ref)


def _random_valid_blocks(qtype: Q, rows: int, blocks: int) -> np.ndarray:
    """Random blocks whose float16 scales are finite (bytes of small positive halves)."""
    fmt = ggml_format(qtype)
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (rows, blocks, fmt.type_size), dtype=np.uint8)
    halves = (
        np.float16(rng.uniform(0.001, 0.1, (rows, blocks))).view(np.uint8).reshape(rows, blocks, 2)
    )
    for offset in _half_offsets(qtype):
        raw[:, :, offset : offset + 2] = halves
    return raw.reshape(rows, -1)


def _half_offsets(qtype: Q) -> tuple[int, ...]:
    return {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}.get(
        qtype, (0,)
    )


@pytest.mark.parametrize("qtype", list(FLOAT_TYPES), ids=lambda t: t.name)
def test_float_types(qtype):
    values = torch.randn(3, 8).to(FLOAT_TYPES[qtype])
    raw = values.contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(dequantize(raw, qtype, (3, 8)), values.float())


def test_q8_0_round_trip_is_close():
    data = np.random.default_rng(0).normal(size=(4, 256)).astype(np.float32)
    out = _ours(quants.quantize(data, Q.Q8_0), Q.Q8_0, data.shape)
    assert np.abs(out - data).max() < np.abs(data).max() / 127


def test_openai_microscaling_tensors_are_ggml_mxfp4_blocks():
    """gpt-oss's safetensors ``*_blocks``/``*_scales`` repacked as ggml's MXFP4 blocks hold
    the values transformers' own converter gives (which it transposes to [E, in, out])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from spnl_backend.quant.ggml import mxfp4_from_microscaling

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 135, (2, 6, 4), dtype=torch.uint8, generator=gen)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    ggml = mxfp4_from_microscaling(blocks, scales)
    ours = dequantize(ggml.reshape(-1, 17), Q.MXFP4, (2, 6, 128))
    assert torch.equal(ours, theirs.transpose(1, 2))
