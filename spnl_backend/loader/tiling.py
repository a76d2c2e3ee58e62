"""A loaded model's Q4_K projections made tiles of 16 rows (`quant.tiles`) for the CPU's
products, one weight at a time."""

from torch import nn

from ..kernels.cpu import CpuKernels
from ..log import get_logger
from ..quant.linear import QuantEmbedding, QuantLinear
from ..quant.tiles import TILE_ROWS, tileable

log = get_logger()


def tile_projections(model: nn.Module, native: CpuKernels | None) -> int:
    """Every Q4_K projection of ``model`` (its `QuantLinear` layers) in tiles, where
    `tileable`; the number tiled. Before any product is prepared: the layers' prepared
    calls hold the weights they were made with. A projection whose bytes an embedding
    shares stays rows (its lookups, a tied head, read rows). A mixture's experts are stacked
    only for the Triton kernels (`models.moe`), where nothing is tiled, and a stack refuses
    tiles (`QuantizedExperts.stackable`)."""
    shared = {
        m.weight_q.data.untyped_storage().data_ptr()
        for m in model.modules()
        if isinstance(m, QuantEmbedding)
    }
    layers: dict[int, tuple] = {}  # by weight: a weight several layers share, tiled once
    for module in model.modules():
        if isinstance(module, QuantLinear):
            weight = module.weight_q
            layers.setdefault(id(weight), (weight, []))[1].append(module)
    tiled = 0
    while layers:  # each weight's rows let go as its tiles replace them: one at a time
        weight, modules = layers.popitem()[1]
        if not tileable(weight, native) or weight.data.untyped_storage().data_ptr() in shared:
            continue
        assert native is not None
        tiles = weight.as_tiles(native)
        for module in modules:
            module.weight_q = tiles
        tiled += 1
        del weight, modules, tiles
    if tiled:
        log.info("weights.tiled", projections=tiled, format="Q4_K", rows=TILE_ROWS)
    return tiled
