"""Q4_K and Q6_K in tiles of 16 rows (`quant.tiles`, kernels/cpu/tiles.h): the same bytes
reordered, and every product, lookup and dequantization of them the rows' to the bit."""

import logging
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
# (rows, columns): one tile, tiles and rows past them (an odd number of blocks a row: Q6_K's
# tiles then start half a cache line on), fewer rows than a tile
SHAPES = [(16, 256), (40, 512), (33, 768), (8, 256)]
FORMATS = [Q.Q4_K, Q.Q6_K]
formats = pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)


def _weight(rows: int, cols: int, seed: int = 0, qtype: Q = Q.Q4_K) -> QuantizedWeight:
    torch.manual_seed(seed)
    return QuantizedWeight.from_float(torch.randn(rows, cols), qtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@formats
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_the_torch_twin_round_trips(rows, cols, qtype):
    weight = _weight(rows, cols, qtype=qtype)
    tiled = tiles.tile(weight.data, qtype)
    assert tiled.shape == weight.data.shape
    assert torch.equal(tiles.untile(tiled, qtype), weight.data)
    whole = rows // 16 * 16
    assert torch.equal(tiled[whole:], weight.data[whole:])  # rows past the tiles stay rows


def test_where_the_words_and_ds_go():
    """Word w of row r's block b sits in lane r of its slot's vector; Q6_K's d's (its last
    two bytes) end an even block's tile block and begin an odd one's."""
    weight = _weight(16, 512, qtype=Q.Q4_K)
    tiled = tiles.tile(weight.data, Q.Q4_K).reshape(-1)
    assert torch.equal(tiled[64 + 4 : 64 + 8], weight.data[1, 4:8])  # word 1, row 1
    weight = _weight(16, 512, qtype=Q.Q6_K)
    tiled = tiles.tile(weight.data, Q.Q6_K).reshape(-1)
    slot = tiles.slots(Q.Q6_K)
    assert sorted(slot) == list(range(52))
    assert slot[48:] == [0, 1, 2, 3]  # the scales first
    assert [slot[0], slot[8], slot[32], slot[1]] == [4, 5, 6, 7]  # ql j, ql 8 + j, qh j
    assert torch.equal(tiled[64 * slot[9] + 8 : 64 * slot[9] + 12], weight.data[2, 36:40])
    first_d, second = 52 * 64, 16 * 210  # block 0: 52 words, then d's; block 1: d's first
    assert torch.equal(tiled[first_d + 2 * 3 : first_d + 2 * 3 + 2], weight.data[3, 208:210])
    assert torch.equal(tiled[second + 2 * 3 : second + 2 * 3 + 2], weight.data[3, 418:420])
    word = second + 32 + 64 * slot[0]  # block 1's words start on a whole cache line
    assert torch.equal(tiled[word : word + 4], weight.data[0, 210:214])


@needs_int8
@formats
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_the_native_tiling_is_the_twin(rows, cols, threads, qtype):
    weight = _weight(rows, cols, qtype=qtype)
    native = replace(NATIVE, threads=threads)
    assert torch.equal(weight.as_tiles(native).data, tiles.tile(weight.data, qtype))


@needs_int8
@formats
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_tiling_in_place_is_the_twin(rows, cols, threads, qtype):
    """In place, each worker's tile goes through its own scratch: the twin's bytes, in the
    weight's own buffer, whatever the threads (rows past the tiles left where they are)."""
    weight = _weight(rows, cols, qtype=qtype)
    data = weight.data.clone()
    tiled = replace(NATIVE, threads=threads).tile(qtype, data, cols, in_place=True)
    assert tiled.data_ptr() == data.data_ptr()
    assert torch.equal(data, tiles.tile(weight.data, qtype))


@needs_int8
@formats
def test_tiling_refuses_an_overlap_that_is_not_in_place(qtype):
    weight = _weight(32, 512, qtype=qtype)
    data = weight.data.clone()
    call, n = NATIVE.library.spnl_tile, data.numel()
    for shift in (64, -64):  # dst a line past src, or before it: each would read its own writes
        room = torch.zeros(n + 64, dtype=torch.uint8)
        src = room[64:] if shift > 0 else room[:n]
        src.copy_(data.reshape(-1))
        assert call(qtype.value, src.data_ptr(), n, 32, 512, src.data_ptr() + shift, 2) == -1
        assert torch.equal(src, data.reshape(-1))  # refused before any write
    strided = torch.zeros(32, 2 * data.shape[1], dtype=torch.uint8)[:, ::2]
    with pytest.raises(KernelArgumentError, match="tile: weight is not contiguous"):
        NATIVE.tile(qtype, strided, 512, in_place=True)


@needs_int8
def test_a_weight_alone_with_its_bytes_is_tiled_in_place_and_a_shared_one_copied(caplog):
    """No second copy of a weight that alone holds its bytes; one whose tensor, or a view of
    it, something else holds is tiled into a buffer of its own, the holder's rows untouched."""
    from torch import nn

    from spnl_backend.kernels.matmuls import CpuMatmuls
    from spnl_backend.loader.tiling import tile_projections

    matmuls = CpuMatmuls(NATIVE)
    alone, viewed, held = (_weight(32, 512, seed=s) for s in range(3))
    stack = _weight(64, 512, seed=3)  # a part of a buffer nothing else holds: copied, so that
    part = QuantizedWeight(stack.data[32:], stack.qtype, (32, 512))  # the rest may be freed
    del stack
    view, tensor = viewed.data[:16], held.data  # a slice, and the very tensor, held elsewhere
    twin = QuantizedWeight(held.data, held.qtype, held.shape)  # a second weight of its bytes
    before = {id(w): (w.data.data_ptr(), w.data.clone()) for w in (alone, viewed, held, part)}
    weights = (alone, viewed, held, twin, part)
    model = nn.ModuleList(QuantLinear(w, matmuls=matmuls) for w in weights)
    x = torch.randn(3, 512)
    want = [_bits(m(x)) for m in model]
    for module in model:
        module.prepared.clear()  # tiling comes before any call is prepared (they hold weights)
    with caplog.at_level(logging.INFO, logger="spnl_backend"):
        assert tile_projections(model, NATIVE) == 4 * NATIVE.tiles_native(Q.Q4_K)
    if not NATIVE.tiles_native(Q.Q4_K):
        return
    assert "weights.tiled" in caplog.text
    assert "copied=3" in caplog.text  # the viewed, the held and the part; not the one alone
    assert not part.tiled
    assert torch.equal(part.data, before[id(part)][1])
    tiled_part = model[4].weight_q
    assert tiled_part.tiled
    assert tiled_part.data.untyped_storage().nbytes() == tiled_part.data.nbytes  # its own
    assert model[0].weight_q is alone
    assert alone.tiled
    assert alone.data.data_ptr() == before[id(alone)][0]  # in place
    for weight, kept in ((viewed, view), (held, tensor)):
        assert not weight.tiled
        assert torch.equal(weight.data, before[id(weight)][1])
        assert kept.data_ptr() == before[id(weight)][0]
    assert model[2].weight_q is model[3].weight_q  # the shared bytes tiled once
    assert model[1].weight_q.data.data_ptr() != before[id(viewed)][0]
    assert all(torch.equal(a, _bits(m(x))) for a, m in zip(want, model, strict=True))


@needs_int8
@formats
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "cols"), SHAPES[:3])
def test_products_on_tiles_are_the_rows_bits(rows, cols, threads, exact, qtype):
    native = replace(NATIVE, threads=threads, exact=exact)
    weight = _weight(rows, cols, qtype=qtype)
    tiled = weight.as_tiles(native)
    other = _weight(24, cols, seed=1).rows(slice(None))  # a Q4_K matrix kept as rows
    six = QuantizedWeight.from_float(torch.randn(24, cols), Q.Q6_K)
    torch.manual_seed(2)
    for m in (1, 2, 3, 4, 5, 9, 17):
        x = torch.randn(m, cols) * 3
        want = native.products([(qtype.value, weight.data, rows)])(x)
        got = native.products([(tiled.native_format, tiled.data, rows)])(x)
        assert torch.equal(_bits(got), _bits(want)), m
        mixed = [(Q.Q4_K.value, other.data, 24), (Q.Q6_K.value, six.data, 24)]
        want = native.products([(qtype.value, weight.data, rows), *mixed])(x)
        got = native.products([(tiled.native_format, tiled.data, rows), *mixed])(x)
        assert torch.equal(_bits(got), _bits(want)), m


@needs_int8
@formats
def test_extreme_values_on_tiles_are_the_rows_bits(qtype):
    """The integer sums at their bounds: every weight at its largest or smallest value and
    scale, activations at +-127 after their scaling."""
    torch.manual_seed(4)
    signs = torch.sign(torch.randn(32, 1024)).clamp(min=0) * 2 - 1
    weight = QuantizedWeight.from_float(signs * 100.0, qtype)
    tiled = weight.as_tiles(NATIVE)
    for x in (torch.ones(3, 1024) * 5, -torch.ones(3, 1024), signs[:3] * 7):
        want = NATIVE.products([(qtype.value, weight.data, 32)])(x)
        got = NATIVE.products([(tiled.native_format, tiled.data, 32)])(x)
        assert torch.equal(_bits(got), _bits(want))


@needs_int8
@formats
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_a_tiled_weight_reads_as_its_rows(rows, cols, qtype):
    weight = _weight(rows, cols, qtype=qtype)
    tiled = weight.as_tiles(NATIVE)
    assert tiled.tiled
    assert tiled.native_format == tiles.tiled_format(qtype) == {Q.Q4_K: 1012, Q.Q6_K: 1014}[qtype]
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
@formats
def test_tiling_refuses_what_it_cannot_tile(qtype):
    weight = _weight(32, 512, qtype=qtype)
    with pytest.raises(KernelArgumentError, match="do not hold 256 weights"):
        NATIVE.tile(qtype, weight.data, 256)
    with pytest.raises(KernelArgumentError, match="Q8_0 has no tiles; accepted: Q4_K, Q6_K"):
        NATIVE.tile(Q.Q8_0, weight.data, 512)
    out = torch.empty_like(weight.data)
    call, at, n = NATIVE.library.spnl_tile, weight.data.data_ptr(), weight.data.numel()
    assert call(qtype.value, at, n, 32, 500, out.data_ptr(), 1) == -1
    assert call(qtype.value, at, 100, 32, 512, out.data_ptr(), 1) == -3  # too few bytes
    assert call(Q.Q5_K.value, at, n, 32, 512, out.data_ptr(), 1) == -1  # no tiles
    wide = 65536 + 256
    assert call(qtype.value, at, n, 0, wide, out.data_ptr(), 1) == -1


def test_a_format_without_tiles_cannot_be_marked_tiled():
    weight = _weight(16, 256, qtype=Q.Q5_K)
    with pytest.raises(ValueError, match="Q5_K has no tiles; tiled weights are Q4_K, Q6_K"):
        QuantizedWeight(weight.data, Q.Q5_K, weight.shape, tiled=True)


def test_what_is_worth_tiling():
    weight = _weight(32, 512)
    assert not tiles.tileable(weight, None)
    assert not tiles.tileable(_weight(8, 256), NATIVE)  # less than one tile
    assert not tiles.tileable(_weight(32, 256, qtype=Q.Q5_K), NATIVE)
    if NATIVE is not None:
        assert not tiles.tileable(weight, replace(NATIVE, exact=True))
        for qtype in FORMATS:
            have = NATIVE.has_int8 and NATIVE.tiles_native(qtype)
            assert tiles.tileable(_weight(32, 512, qtype=qtype), NATIVE) == have


@needs_int8
@pytest.mark.parametrize("isq", ["Q4_K", "Q6_K"])
def test_a_model_on_tiles_gives_its_rows_logits(tiny, monkeypatch, isq):
    """ISQ's Q4_K gives the projections Q4_K and the head Q6_K; its Q6_K, everything Q6_K.
    The embedding (not tied here) stays rows."""
    path = str(tiny.trained().path)
    settings = BackendSettings(device="cpu", isq=isq, prefix_cache_n=0)
    on_tiles = load_backend(path, settings=settings)
    layers = [m for m in on_tiles.model.modules() if isinstance(m, QuantLinear | QuantEmbedding)]
    projections = [
        m
        for m in layers
        if isinstance(m, QuantLinear) and m.weight_q.qtype in FORMATS and m.in_features % 256 == 0
    ]
    expected = {Q.Q4_K, Q.Q6_K} if isq == "Q4_K" else {Q.Q6_K}
    assert {m.weight_q.qtype for m in projections} == expected
    native = NATIVE.tiles_native(Q.Q4_K)
    assert [m for m in layers if m.weight_q.tiled] == projections * native
    monkeypatch.setattr("spnl_backend.loader.model.tile_projections", lambda *args: 0)
    on_rows = load_backend(path, settings=settings)
    assert not any(m.weight_q.tiled for m in on_rows.model.modules() if hasattr(m, "weight_q"))
    ids = on_rows.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert torch.equal(_bits(engine_logits(on_tiles, ids)), _bits(engine_logits(on_rows, ids)))
    for backend in (on_tiles, on_rows):
        backend.close()


@needs_int8
def test_a_tied_head_is_tiled_and_other_embeddings_stay_rows():
    """The embedding that is also the output projection is tiled, and its lookups read the
    tiles; an embedding only looked up stays rows, and so does a projection sharing its
    bytes."""
    from torch import nn

    from spnl_backend.kernels.dispatch import KernelChoice
    from spnl_backend.kernels.matmuls import CpuMatmuls
    from spnl_backend.loader.tiling import tile_projections

    choice = KernelChoice(native=NATIVE, matmuls=CpuMatmuls(NATIVE))
    head = QuantEmbedding(_weight(48, 512, qtype=Q.Q6_K), torch.float32, choice)
    table = QuantEmbedding(_weight(32, 512, seed=1, qtype=Q.Q6_K), torch.float32, choice)
    sharing = QuantLinear(table.weight_q, matmuls=choice.matmuls)
    own = QuantLinear(_weight(32, 512, seed=2), matmuls=choice.matmuls)
    model = nn.ModuleList([head, table, sharing, own])
    ids = torch.tensor([[47, 0, 16, 5]])
    x = torch.randn(3, 512)
    want = head(ids), head.project(x)
    head.prepared.clear()
    assert tile_projections(model, NATIVE, tied_head=head) == 2 * NATIVE.tiles_native(Q.Q6_K)
    assert [m.weight_q.tiled for m in model] == [NATIVE.tiles_native(Q.Q6_K), False, False, True]
    assert torch.equal(head(ids), want[0])
    assert torch.equal(_bits(head.project(x)), _bits(want[1]))
    untied = nn.ModuleList([QuantEmbedding(_weight(48, 512, qtype=Q.Q6_K), torch.float32, choice)])
    assert tile_projections(untied, NATIVE) == 0


@needs_int8
@formats
def test_tiles_wider_than_any_made_are_refused(qtype):
    """The fallbacks hold a tiled row on the stack: a hand-made call of tiles wider than
    `tiles.MAX_COLUMNS` is a bad argument, not a stack overflow."""
    wide = tiles.MAX_COLUMNS + 256
    data = torch.zeros((16, wide // 256 * tiles.BLOCK_BYTES[qtype]), dtype=torch.uint8)
    with pytest.raises(KernelArgumentError):
        NATIVE.products([(tiles.tiled_format(qtype), data, 16)])(torch.zeros(1, wide))


@needs_int8
def test_grouped_products_on_tiles_are_the_rows_bits():
    """A mixture's experts go through the grouped call (`spnl_qmatmul_groups`)."""
    first, second = _weight(40, 512), _weight(32, 512, seed=1, qtype=Q.Q6_K)
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
@formats
def test_prefill_off_batch_invariance_reads_tiles_as_rows(qtype):
    """Without batch invariance many rows take torch's GEMM on the matrix dequantized a
    slice at a time; of tiles, whole tiles at a time (the native dequantization's rows of
    a slice past the first tile included)."""
    from spnl_backend.kernels.matmuls import CpuMatmuls
    from spnl_backend.kernels.thresholds import NATIVE_MAX_ROWS

    weight = _weight(40, 512, qtype=qtype)
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
