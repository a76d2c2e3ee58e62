"""Q4_K matrices in tiles of 16 rows, for the CPU's products.

The bytes of every group of 16 rows are reordered once, at load: each block's 36 32-bit
words (144 bytes) of the 16 rows side by side, so that the native kernels
(``kernels/cpu/q4k_tiles.h``) read 16 weight rows in one vector and weigh their sums by
their scales 16 rows at a time. A one-row product then takes about 11 cycles a block on a
Zen 4 instead of 19; the results are the rows' to the bit. The tiles take the same bytes
as the rows; rows past the last whole tile stay rows.

`loader.tiling` makes them for a loaded model's projections where the compiled kernels
have their own tile kernel (`tileable`). This module's `tile` and `untile` are the torch
twin of the native reordering, and what a tiled weight's `dequantize` and `rows` read
through.
"""

import torch
from gguf import GGMLQuantizationType

from ..kernels.cpu import CpuKernels
from ..kernels.cpu.abi import Q4K_TILES

TILE_ROWS = 16
WORD_BYTES = 4
BLOCK_BYTES = 144  # Q4_K's, 256 values
TILED_Q4_K = Q4K_TILES  # the native kernels' format number of such a matrix (not GGML's)
MAX_COLUMNS = 65536  # the native fallbacks hold one row on the stack


def _reorder(data: torch.Tensor, to_tiles: bool) -> torch.Tensor:
    """``data`` [rows, row_bytes] with its whole tiles' words moved between the rows'
    order [tile, row, block, word] and the tiles' [tile, block, word, row]."""
    rows, row_bytes = data.shape
    tiled = rows // TILE_ROWS * TILE_ROWS
    n, r, b, w = tiled // TILE_ROWS, TILE_ROWS, row_bytes // BLOCK_BYTES, BLOCK_BYTES // WORD_BYTES
    shape, order = ((n, r, b, w), (0, 2, 3, 1)) if to_tiles else ((n, b, w, r), (0, 3, 1, 2))
    out = data.clone()
    words = data[:tiled].reshape(*shape, WORD_BYTES)
    out[:tiled] = words.permute(*order, 4).reshape(tiled, row_bytes)
    return out


def tile(data: torch.Tensor) -> torch.Tensor:
    """Q4_K rows ``[rows, row_bytes]`` uint8 as tiles (the same shape): tile t, block b,
    word w of row r at the place the native kernels read it."""
    return _reorder(data, to_tiles=True)


def untile(data: torch.Tensor) -> torch.Tensor:
    """`tile`'s inverse: the rows as GGUF stores them."""
    return _reorder(data, to_tiles=False)


def tileable(weight, native: CpuKernels | None) -> bool:
    """Whether ``weight`` (a `QuantizedWeight`) is worth tiling for ``native``'s products:
    Q4_K rows on the host, at least one whole tile, and a tile kernel compiled here."""
    return (
        native is not None
        and native.has_int8
        and not native.exact
        and native.q4k_tiles_native
        and weight.qtype == GGMLQuantizationType.Q4_K
        and not weight.tiled
        and weight.data.device.type == "cpu"
        and weight.shape[0] >= TILE_ROWS
        and weight.shape[1] <= MAX_COLUMNS
    )
