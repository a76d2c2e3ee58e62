"""bench/decode_gap.py's plain read (bench/read_bound.c): every byte read exactly once, at
any thread count, whether the threads share the tensors whole or each one."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import decode_gap


def xor_of_words(tensors: list[torch.Tensor]) -> int:
    folded = 0
    for t in tensors:
        for word in t.view(torch.int64).tolist():
            folded ^= word & (2**64 - 1)
    return folded


@pytest.fixture(scope="module")
def reader():
    from spnl_backend.settings.platform import find_c_compiler

    if find_c_compiler() is None:
        pytest.skip("no C compiler")
    return decode_gap.build_reader()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("mode", [0, 1])
def test_every_byte_is_read_once(reader, threads: int, mode: int):
    generator = torch.Generator().manual_seed(threads * 2 + mode)
    sizes = [256, 4096, 256 * 37, 256 * 3]
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in sizes]

    class Set:  # what decode_gap.reader reads from a product set
        weights = tensors

    read = decode_gap.reader(reader, [Set], threads, mode)
    before = xor_of_words(tensors)
    assert read() == before
    tensors[2][100] ^= 1  # a byte in the middle of a thread's share is read too
    assert read() == xor_of_words(tensors) != before
