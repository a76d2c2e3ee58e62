"""The quantized products on weights and activations that sit flush against an unreadable
page: a load past the end of the last weight row (or before the first) faults, where a
heap allocation would hand it the next object's bytes unnoticed. Large weights really lie
so (`memory.host_tensor` maps each on pages of its own, the pages around them unreadable,
so a weight whose size is a whole number of pages ends at its last readable byte).

Run as a script in a child process, so that a fault ends the child, not the test run:
``python guarded_products.py plain|checked``. It prints the package it tests, then each
case before running it, and exits 0 when every case gave the bits of the same product on
ordinary tensors."""

import ctypes
import dataclasses
import mmap
import sys

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

PAGE = mmap.PAGESIZE
PROT_NONE = 0
ROWS_W = (1, 17)  # weight rows: one, and a tile of 16 with a row over
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mprotect.restype = ctypes.c_int


def guarded(tensor: torch.Tensor, flush: str) -> torch.Tensor:
    """A copy of ``tensor`` between two unreadable pages: its last byte the last readable
    one (``flush="end"``), its first byte the first (``"start"``), or one byte past that
    (``"odd"``: a GGUF file's alignment may be 1). The mapping lives as long as the
    returned tensor."""
    nbytes = tensor.numel() * tensor.element_size()
    pages = -(-(nbytes + 1) // PAGE)
    region = mmap.mmap(-1, (pages + 2) * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    for page in (0, pages + 1):
        if _libc.mprotect(base + page * PAGE, PAGE, PROT_NONE):
            raise OSError(ctypes.get_errno(), "mprotect of a guard page failed")
    offset = PAGE + {"end": pages * PAGE - nbytes, "start": 0, "odd": 1}[flush]
    out = torch.frombuffer(region, dtype=tensor.dtype, count=tensor.numel(), offset=offset)
    return out.view(tensor.shape).copy_(tensor)


def _weight(qtype: Q, rows: int, cols: int, seed: int):
    from spnl_backend.quant.linear import QuantizedWeight

    gen = torch.Generator().manual_seed(seed)
    if qtype is not Q.MXFP4:
        return QuantizedWeight.from_float(torch.randn(rows, cols, generator=gen), qtype)
    blocks = torch.randint(0, 256, (rows * cols // 32, 17), dtype=torch.uint8, generator=gen)
    blocks[:, 0] = torch.randint(116, 128, (len(blocks),), dtype=torch.uint8, generator=gen)
    return QuantizedWeight(blocks.view(rows, -1), qtype, (rows, cols))


def cases():
    """(format, weight rows, k, activation rows): 1 to 9 blocks of the 32-value formats
    (whole groups of 4 and tails) and 16 and 19 (Q5_0's runs of 4 groups, and a run then
    groups and a tail), 1 and 2 of the k-quants; one weight row, and a tile of
    16 with a row over; one activation row (the one-row kernels) and 7 (the tiles, and
    4 then 3 rows for each weight row alone)."""
    from spnl_backend.quant.quantize import QUANTIZERS

    formats = [*sorted(QUANTIZERS, key=lambda t: t.value), Q.MXFP4]
    for qtype in formats:
        block = GGML_QUANT_SIZES[qtype][0]
        widths = [*range(1, 10), 16, 19] if block == 32 else range(1, 3)
        for rows_w in ROWS_W:
            for blocks in widths:
                for rows_x in (1, 7):
                    yield qtype, rows_w, block * blocks, rows_x


def main(build: str) -> int:
    import spnl_backend
    import spnl_backend.kernels.cpu as cpu
    from spnl_backend.kernels.matmuls import CpuMatmuls
    from spnl_backend.quant.linear import QuantizedWeight

    print("package", spnl_backend.__file__, flush=True)
    native = cpu.cpu_kernels(checks=build == "checked")
    if native is None:
        print("the CPU kernels did not build", flush=True)
        return 2
    made = {}  # one matrix per format and width, its first row alone for one row
    for qtype, rows_w, k, rows_x in cases():
        if (qtype, k) not in made:
            made[qtype, k] = _weight(qtype, max(ROWS_W), k, seed=k)
        weight = made[qtype, k].rows(slice(0, rows_w))
        x = torch.randn(rows_x, k, generator=torch.Generator().manual_seed(k))
        for exact in (False, True):
            kernels = dataclasses.replace(native, exact=exact)
            plain = CpuMatmuls(kernels)(x, [weight])
            for flush in ("end", "start", "odd"):
                print("case", qtype.name, rows_w, k, rows_x, exact, flush, flush=True)
                w = QuantizedWeight(guarded(weight.data, flush), qtype, weight.shape)
                xs = guarded(x, "start" if flush == "odd" else flush)  # floats stay aligned
                got = CpuMatmuls(kernels)(xs, [w])
                if not torch.equal(got, plain):
                    print("different bits on guarded memory", flush=True)
                    return 1
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
