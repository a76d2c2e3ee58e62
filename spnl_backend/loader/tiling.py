"""A loaded model's Q4_K and Q6_K projections made tiles of 16 rows (`quant.tiles`) for the
CPU's products, one weight at a time."""

import torch
from torch import nn

from ..kernels.cpu import CpuKernels
from ..log import get_logger
from ..quant.linear import QuantEmbedding, QuantizedWeight, QuantLinear
from ..quant.tiles import TILE_ROWS, tileable

log = get_logger()


def tile_projections(
    model: nn.Module, native: CpuKernels | None, tied_head: nn.Module | None = None
) -> int:
    """Every Q4_K and Q6_K projection of ``model`` in tiles, where `tileable`: its
    `QuantLinear` layers, and ``tied_head``, the embedding that is also its output
    projection; the number of weights tiled. Before any product is prepared: the layers'
    prepared calls hold the weights they were made with. Other embeddings stay rows: only
    looked up, they gain nothing, and tiling one would read in the whole of a table that
    lookups touch a few rows of; so does a projection whose bytes such an embedding shares. A
    mixture's experts are stacked only for the Triton kernels (`models.moe`), where nothing
    is tiled, and a stack refuses tiles (`QuantizedExperts.stackable`)."""
    heads = [tied_head] if isinstance(tied_head, QuantEmbedding) else []
    looked_up = {
        m.weight_q.data.untyped_storage().data_ptr()
        for m in model.modules()
        if isinstance(m, QuantEmbedding) and m not in heads
    }
    layers: dict[tuple, tuple] = {}  # by bytes: a weight several layers read, tiled once
    for module in [*(m for m in model.modules() if isinstance(m, QuantLinear)), *heads]:
        weight = module.weight_q
        layers.setdefault(_bytes_of(weight), (weight, []))[1].append(module)
    tiled: dict[str, int] = {}
    copied = 0  # weights `_sole_holder` keeps from tiles in place: tiled into buffers of their own
    while layers:  # each weight's rows let go as its tiles replace them: one at a time
        weight, modules = layers.popitem()[1]
        if not tileable(weight, native) or weight.data.untyped_storage().data_ptr() in looked_up:
            continue
        assert native is not None
        if _sole_holder(weight):  # no second copy: the peak stays the model's size
            weight.tile_in_place(native)
            tiles = weight
        else:
            tiles = weight.as_tiles(native)
            copied += 1
        for module in modules:
            module.weight_q = tiles
        tiled[weight.qtype.name] = tiled.get(weight.qtype.name, 0) + 1
        del weight, modules, tiles
    if tiled:
        log.info("weights.tiled", weights=tiled, rows=TILE_ROWS, copied=copied)
    return sum(tiled.values())


def _sole_holder(weight: QuantizedWeight) -> bool:
    """Whether ``weight`` alone holds its bytes, so that they may become tiles in place: its
    bytes are its storage's whole (a part of a larger buffer, such as one expert of a stack
    or one projection of a fused tensor, is copied instead, so that the rest can be freed),
    and no other tensor views them (none left by the loader, no shard, slice, or second
    weight made of the same tensor). Other holders of ``weight`` itself see its `tiled`
    change with its bytes. Unsure means no. ``weight.data`` becomes an alias of the same
    bytes that is no view of the tensor it was cut from, whose hold on them would otherwise
    count."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    data = weight.data
    storage = data.untyped_storage()
    whole = data.storage_offset() == 0 and data.nbytes == storage.nbytes()
    if use_count is None or not data.is_contiguous() or not whole:
        return False
    weight.data = torch.empty(0, dtype=data.dtype).set_(storage, 0, data.shape, data.stride())
    del data, storage
    # the alias, and the storage's Python handle the count is asked through
    return use_count(weight.data.untyped_storage()._cdata) == 2


def _bytes_of(weight: QuantizedWeight) -> tuple:
    """What identifies a weight's bytes: their place and shape."""
    return weight.data.data_ptr(), tuple(weight.data.shape), weight.qtype
