"""Q4_K and Q6_K matrices in tiles of 16 rows, for the CPU's products.

The bytes of every group of 16 rows are reordered once, at load: each block's 32-bit words
of the 16 rows side by side, then the bytes past its last whole word (Q6_K's float16 ``d``,
2 a row) of the 16 rows one after another. The native kernels (``kernels/cpu/tiles.h``)
then read 16 weight rows in one vector and weigh their sums by their scales 16 rows at a
time. A one-row Q4_K product takes about 11 cycles a block on a Zen 4 instead of 19; the
results are the rows' to the bit. Q6_K's words are in the order its kernel reads them
(`slots`), so that it reads a tile from start to end, as the hardware prefetchers expect.
Its tile blocks (3,360 bytes) are half a cache line past a whole number of lines, so its
rows' ``d`` end an even block and begin an odd one: every block's words then start on a line.
The tiles take the same bytes as the rows; rows past the last whole tile stay rows.

`loader.tiling` makes them for a loaded model's projections where the compiled kernels
have their own tile kernel (`tileable`). This module's `tile` and `untile` are the torch
twin of the native reordering, and what a tiled weight's `dequantize` and `rows` read
through.
"""

import torch
from gguf import GGMLQuantizationType

from ..kernels.cpu import CpuKernels
from ..kernels.cpu.abi import TILED_FORMATS

TILE_ROWS = 16
WORD_BYTES = 4
BLOCK_BYTES = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q6_K: 210}  # 256 values
MAX_COLUMNS = 65536  # the native fallbacks hold one row on the stack


def tiled_format(qtype: GGMLQuantizationType) -> int:
    """The native kernels' format number (not GGML's) of ``qtype``'s tiles."""
    return TILED_FORMATS[qtype.value]


def slots(qtype: GGMLQuantizationType) -> list[int]:
    """Where each of a block's words goes among its tile block's: Q6_K's (32 of ``ql``, 16
    of ``qh``, 4 of scales) its scales first, then for each half ``h`` and ``j < 8`` the
    ``ql`` words ``16h + j``, ``16h + 8 + j`` and the ``qh`` word ``32 + 8h + j``; Q4_K's
    in their order."""
    words = BLOCK_BYTES[qtype] // WORD_BYTES
    if qtype != GGMLQuantizationType.Q6_K:
        return list(range(words))
    ql = [4 + 24 * (w // 16) + 3 * (w % 8) + (w % 16) // 8 for w in range(32)]
    qh = [4 + 24 * (w // 8) + 3 * (w % 8) + 2 for w in range(16)]
    return ql + qh + [0, 1, 2, 3]


def _split(block_bytes: int) -> tuple[int, int]:
    """A block's whole words and the bytes past them."""
    return block_bytes // WORD_BYTES, block_bytes % WORD_BYTES


def tile(data: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """``qtype`` rows ``[rows, row_bytes]`` uint8 as tiles (the same shape): tile t, block
    b, word w of row r at the place the native kernels read it."""
    out = data.clone()
    n, blocks, (words, _) = *_counts(data, qtype), _split(BLOCK_BYTES[qtype])
    if not n:
        return out
    rows = data[: n * TILE_ROWS].reshape(n, TILE_ROWS, blocks, BLOCK_BYTES[qtype])
    by_word = rows[..., : words * WORD_BYTES].reshape(n, TILE_ROWS, blocks, words, WORD_BYTES)
    order = torch.argsort(torch.tensor(slots(qtype)))  # the word at each slot
    by_word = by_word[:, :, :, order].permute(0, 2, 3, 1, 4).reshape(n, blocks, -1)
    tails = rows[..., words * WORD_BYTES :].permute(0, 2, 1, 3).reshape(n, blocks, -1)
    odd = _odd_blocks(blocks)
    tiled = torch.where(odd, torch.cat([tails, by_word], -1), torch.cat([by_word, tails], -1))
    out[: n * TILE_ROWS] = tiled.reshape(n * TILE_ROWS, -1)
    return out


def untile(data: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """`tile`'s inverse: the rows as GGUF stores them."""
    out = data.clone()
    n, blocks, (words, tail) = *_counts(data, qtype), _split(BLOCK_BYTES[qtype])
    if not n:
        return out
    tiled = data[: n * TILE_ROWS].reshape(n, blocks, TILE_ROWS * BLOCK_BYTES[qtype])
    odd = _odd_blocks(blocks)
    word_bytes, tail_bytes = TILE_ROWS * words * WORD_BYTES, TILE_ROWS * tail
    by_word = torch.where(odd, tiled[..., tail_bytes:], tiled[..., :word_bytes])
    tails = torch.where(odd, tiled[..., :tail_bytes], tiled[..., word_bytes:])
    by_word = by_word.reshape(n, blocks, words, TILE_ROWS, WORD_BYTES).permute(0, 3, 1, 2, 4)
    by_word = by_word[:, :, :, slots(qtype)]
    tails = tails.reshape(n, blocks, TILE_ROWS, tail).permute(0, 2, 1, 3)
    rows = torch.cat([by_word.reshape(n, TILE_ROWS, blocks, -1), tails], -1)
    out[: n * TILE_ROWS] = rows.reshape(n * TILE_ROWS, -1)
    return out


def _odd_blocks(blocks: int) -> torch.Tensor:
    """Which tile blocks begin with their tail (odd ones), as a mask over [tile, block, byte]."""
    return (torch.arange(blocks) % 2 == 1).view(1, blocks, 1)


def _counts(data: torch.Tensor, qtype: GGMLQuantizationType) -> tuple[int, int]:
    """Whole tiles in ``data`` and blocks a row."""
    rows, row_bytes = data.shape
    return rows // TILE_ROWS, row_bytes // BLOCK_BYTES[qtype]


def tileable(weight, native: CpuKernels | None) -> bool:
    """Whether ``weight`` (a `QuantizedWeight`) is worth tiling for ``native``'s products:
    Q4_K or Q6_K rows on the host, at least one whole tile, and a tile kernel compiled
    here."""
    return (
        native is not None
        and native.has_int8
        and not native.exact
        and weight.qtype in BLOCK_BYTES
        and native.tiles_native(weight.qtype)
        and not weight.tiled
        and weight.data.device.type == "cpu"
        and weight.shape[0] >= TILE_ROWS
        and weight.shape[1] <= MAX_COLUMNS
    )
