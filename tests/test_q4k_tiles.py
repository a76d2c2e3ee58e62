"""Q4_K in tiles of 16 rows (`quant.tiles`, kernels/cpu/q4k_tiles.h): the same bytes
reordered, and every product, lookup and dequantization of them the rows' to the bit."""

from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import engine_logits

from spnl_backend import BackendSettings, load_backend
from spnl_backend.kernels.cpu import cpu_kernels
from spnl_backend.kernels.cpu.checks import KernelArgumentError
from spnl_backend.quant import tiles
from spnl_backend.quant.linear import QuantEmbedding, QuantizedWeight, QuantLinear

NATIVE = cpu_kernels()
needs_int8 = pytest.mark.skipif(
    NATIVE is None or not NATIVE.has_int8, reason="no compiled int8 products here"
)
# (rows, columns): one tile, tiles and rows past them, fewer rows than a tile
SHAPES = [(16, 256), (40, 512), (33, 768), (8, 256)]


def _weight(rows: int, cols: int, seed: int = 0) -> QuantizedWeight:
    torch.manual_seed(seed)
    return QuantizedWeight.from_float(torch.randn(rows, cols), Q.Q4_K)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_the_torch_twin_round_trips(rows, cols):
    weight = _weight(rows, cols)
    tiled = tiles.tile(weight.data)
    assert tiled.shape == weight.data.shape
    assert torch.equal(tiles.untile(tiled), weight.data)
    whole = rows // 16 * 16
    assert torch.equal(tiled[whole:], weight.data[whole:])  # rows past the tiles stay rows
    if whole:  # word 1 of row 1's first block sits in lane 1 of the tile's second word
        assert torch.equal(tiled[0, 64 + 4 : 64 + 8], weight.data[1, 4:8])


@needs_int8
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_the_native_tiling_is_the_twin(rows, cols, threads):
    weight = _weight(rows, cols)
    native = replace(NATIVE, threads=threads)
    assert torch.equal(weight.as_tiles(native).data, tiles.tile(weight.data))


@needs_int8
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "cols"), SHAPES[:3])
def test_products_on_tiles_are_the_rows_bits(rows, cols, threads, exact):
    native = replace(NATIVE, threads=threads, exact=exact)
    weight = _weight(rows, cols)
    tiled = weight.as_tiles(native)
    other = _weight(24, cols, seed=1).rows(slice(None))  # a Q4_K matrix kept as rows
    six = QuantizedWeight.from_float(torch.randn(24, cols), Q.Q6_K)
    torch.manual_seed(2)
    for m in (1, 2, 3, 4, 5, 9, 17):
        x = torch.randn(m, cols) * 3
        want = native.products([(Q.Q4_K.value, weight.data, rows)])(x)
        got = native.products([(tiled.native_format, tiled.data, rows)])(x)
        assert torch.equal(_bits(got), _bits(want)), m
        mixed = [(Q.Q4_K.value, other.data, 24), (Q.Q6_K.value, six.data, 24)]
        want = native.products([(Q.Q4_K.value, weight.data, rows), *mixed])(x)
        got = native.products([(tiled.native_format, tiled.data, rows), *mixed])(x)
        assert torch.equal(_bits(got), _bits(want)), m


@needs_int8
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_a_tiled_weight_reads_as_its_rows(rows, cols):
    weight = _weight(rows, cols)
    tiled = weight.as_tiles(NATIVE)
    assert tiled.tiled
    assert tiled.native_format == tiles.TILED_Q4_K
    dense = weight.dequantize()
    assert torch.equal(tiled.dequantize(), dense)
    assert torch.equal(NATIVE.dequantize(tiled.native_format, tiled.data, rows, cols), dense)
    ids = torch.tensor([rows - 1, 0, rows // 2, 1])
    assert torch.equal(NATIVE.gather_rows(tiled.native_format, tiled.data, ids, cols), dense[ids])
    assert torch.equal(tiled.rows(ids).dequantize(), dense[ids])
    for part in (slice(0, 16), slice(16, None), slice(3, rows), slice(0, rows, 2)):
        sliced = tiled.rows(part)
        assert torch.equal(sliced.dequantize(), dense[part]), part
        whole_tiles = part == slice(0, 16) or (part == slice(16, None) and rows >= 16)
        assert sliced.tiled == whole_tiles, part
    assert tiled.to(torch.device("cpu")).tiled


@needs_int8
def test_tiling_refuses_what_it_cannot_tile():
    weight = _weight(32, 512)
    with pytest.raises(KernelArgumentError, match="do not hold 256 weights"):
        NATIVE.tile_q4k(weight.data, 256)
    out = torch.empty_like(weight.data)
    call = NATIVE.library.spnl_q4k_tile
    assert call(weight.data.data_ptr(), weight.data.numel(), 32, 500, out.data_ptr(), 1) == -1
    assert call(weight.data.data_ptr(), 100, 32, 512, out.data_ptr(), 1) == -3  # too few bytes
    wide = 65536 + 256
    assert call(weight.data.data_ptr(), weight.data.numel(), 0, wide, out.data_ptr(), 1) == -1


def test_what_is_worth_tiling():
    weight = _weight(32, 512)
    assert not tiles.tileable(weight, None)
    assert not tiles.tileable(_weight(8, 256), NATIVE)  # less than one tile
    assert not tiles.tileable(QuantizedWeight.from_float(torch.randn(32, 256), Q.Q6_K), NATIVE)
    if NATIVE is not None:
        assert not tiles.tileable(weight, replace(NATIVE, exact=True))
        assert tiles.tileable(weight, NATIVE) == (NATIVE.has_int8 and NATIVE.q4k_tiles_native)


@needs_int8
def test_a_model_on_tiles_gives_its_rows_logits(tiny, monkeypatch):
    path = str(tiny.trained().path)
    settings = BackendSettings(device="cpu", isq="Q4_K", prefix_cache_n=0)
    on_tiles = load_backend(path, settings=settings)
    layers = [m for m in on_tiles.model.modules() if isinstance(m, QuantLinear | QuantEmbedding)]
    projections = [m for m in layers if isinstance(m, QuantLinear) and m.weight_q.qtype == Q.Q4_K]
    assert projections  # the Q4_K projections, tiled where the kernels have tiles
    assert [m for m in layers if m.weight_q.tiled] == projections * NATIVE.q4k_tiles_native
    monkeypatch.setattr("spnl_backend.loader.model.tile_projections", lambda model, native: 0)
    on_rows = load_backend(path, settings=settings)
    assert not any(m.weight_q.tiled for m in on_rows.model.modules() if hasattr(m, "weight_q"))
    ids = on_rows.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert torch.equal(_bits(engine_logits(on_tiles, ids)), _bits(engine_logits(on_rows, ids)))
    for backend in (on_tiles, on_rows):
        backend.close()


@needs_int8
def test_tiles_wider_than_any_made_are_refused():
    """The fallbacks hold a tiled row on the stack: a hand-made call of tiles wider than
    `tiles.MAX_COLUMNS` is a bad argument, not a stack overflow."""
    wide = tiles.MAX_COLUMNS + 256
    data = torch.zeros((16, wide // 256 * 144), dtype=torch.uint8)
    with pytest.raises(KernelArgumentError):
        NATIVE.products([(tiles.TILED_Q4_K, data, 16)])(torch.zeros(1, wide))


@needs_int8
def test_grouped_products_on_tiles_are_the_rows_bits():
    """A mixture's experts go through the grouped call (`spnl_qmatmul_groups`)."""
    first, second = _weight(40, 512), _weight(32, 512, seed=1)
    torch.manual_seed(3)
    x = torch.randn(6, 512)
    groups = [(0, 0, 1, 0), (1, 1, 5, 40)]  # one row alone, five rows together

    def grouped(weights):
        call = NATIVE.products([(w.native_format, w.data, w.shape[0]) for w in weights])
        return call.groups(x, groups, 6)

    want = grouped([first, second])
    got = grouped([first.as_tiles(NATIVE), second.as_tiles(NATIVE)])
    assert torch.equal(_bits(got), _bits(want))


@needs_int8
def test_prefill_off_batch_invariance_reads_tiles_as_rows():
    """Without batch invariance many rows take torch's GEMM on the matrix dequantized a
    slice at a time; of tiles, whole tiles at a time (the native dequantization's rows of
    a slice past the first tile included)."""
    from spnl_backend.kernels.matmuls import CpuMatmuls
    from spnl_backend.kernels.thresholds import NATIVE_MAX_ROWS

    weight = _weight(40, 512)
    tiled = weight.as_tiles(NATIVE)
    part = tiled.rows(slice(16, 40))
    assert part.tiled
    dense = NATIVE.dequantize(part.native_format, part.data, 24, 512)
    assert torch.equal(dense, weight.dequantize()[16:40])
    matmuls = CpuMatmuls(NATIVE, gemm_dtype=torch.float32)
    x = torch.randn(NATIVE_MAX_ROWS + 3, 512)
    assert torch.equal(_bits(matmuls(x, [tiled])), _bits(matmuls(x, [weight])))
    exact = replace(NATIVE, exact=True)  # more rows than the float kernels meet at once
    x = torch.randn(70, 512)
    want = exact.products([(weight.native_format, weight.data, 40)])(x)
    assert torch.equal(
        _bits(exact.products([(tiled.native_format, tiled.data, 40)])(x)), _bits(want)
    )


def test_tiles_are_not_stacked_as_experts():
    from spnl_backend.quant.linear import QuantizedExperts

    rows = [[_weight(16, 256)], [_weight(16, 256, seed=1)]]
    assert QuantizedExperts.stackable(rows)
    as_tiles = [[QuantizedWeight(w.data, w.qtype, w.shape, tiled=True)] for [w] in rows]
    assert not QuantizedExperts.stackable(as_tiles)
