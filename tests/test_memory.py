import gc
import mmap
import sys
from pathlib import Path

import pytest
import torch

from spnl_backend.memory import (
    HUGE_PAGE_BYTES,
    HUGE_PAGE_MIN_BYTES,
    host_tensor,
    release_freed_memory,
)

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="malloc_trim and huge pages: on Linux only"
)


def test_releasing_freed_memory_leaves_live_memory_alone():
    anonymous = torch.randn(4096, 1024)
    copy = anonymous.clone()
    release_freed_memory()
    assert torch.equal(anonymous, copy)


def _mapping_flags(address: int) -> list[str] | None:
    """The VmFlags of this process's mapping that holds ``address``; None if none does."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            mapping = low <= address < high
        elif mapping and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


def _vm_flags(address: int) -> list[str]:
    flags = _mapping_flags(address)
    if flags is None:
        raise AssertionError(f"no mapping holds {address:#x}")
    return flags


def test_a_large_host_tensor_is_zeroed_and_on_huge_pages_where_linux_offers_them():
    tensor = host_tensor((3, HUGE_PAGE_MIN_BYTES // 4), torch.float16)
    assert (tensor.shape, tensor.dtype, tensor.is_contiguous()) == (
        (3, HUGE_PAGE_MIN_BYTES // 4),
        torch.float16,
        True,
    )
    gc.collect()  # the tensor alone keeps its mapping alive
    assert not tensor.any()
    tensor.fill_(1.5)
    assert float(tensor.sum(dtype=torch.float64)) == 1.5 * tensor.numel()
    if hasattr(mmap, "MADV_HUGEPAGE") and Path("/proc/self/smaps").exists():
        assert "hg" in _vm_flags(tensor.data_ptr())  # marked for transparent huge pages


def test_a_small_host_tensor_comes_from_torch():
    tensor = host_tensor((5, 7), torch.float32)
    assert tensor.shape == (5, 7)
    assert not tensor.any()
    if Path("/proc/self/smaps").exists():
        assert "hg" not in _vm_flags(tensor.data_ptr())


@pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE") or not Path("/proc/self/smaps").exists(),
    reason="transparent huge pages: Linux with MADV_HUGEPAGE",
)
def test_a_large_host_tensor_starts_on_a_huge_page_and_nothing_around_it_is_readable():
    # an odd size: its last part of a huge page stays on small pages, unadvised
    tensor = host_tensor((2 * HUGE_PAGE_BYTES + 12_345,), torch.uint8)
    start, last = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes - 1
    assert start % HUGE_PAGE_BYTES == 0
    assert "hg" in _vm_flags(start)
    assert "hg" in _vm_flags(start + 2 * HUGE_PAGE_BYTES - 1)
    assert "hg" not in _vm_flags(last)
    assert "rd" in _vm_flags(last)
    # a load past the last page (or before the first) faults, as on a mapping of its own
    past = (last // mmap.PAGESIZE + 1) * mmap.PAGESIZE
    assert _mapping_flags(past) is None or "rd" not in _vm_flags(past)
    assert _mapping_flags(start - 1) is None or "rd" not in _vm_flags(start - 1)
    assert not tensor.any()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps")
def test_freeing_a_large_host_tensor_unmaps_it():
    tensor = host_tensor((2 * HUGE_PAGE_BYTES,), torch.uint8)
    tensor.fill_(7)
    address = tensor.data_ptr()
    view = tensor[HUGE_PAGE_BYTES:]  # a view keeps the mapping as the tensor does
    del tensor
    gc.collect()
    assert _mapping_flags(address) is not None
    assert int(view[0]) == 7
    del view
    gc.collect()
    assert _mapping_flags(address) is None


@pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE") or not Path("/proc/self/smaps").exists(),
    reason="transparent huge pages: Linux with MADV_HUGEPAGE",
)
def test_q_rows_put_in_rotate_half_order_stay_on_huge_pages():
    from gguf import GGMLQuantizationType

    from spnl_backend.models.arch.family import pairs_to_halves
    from spnl_backend.quant.linear import QuantizedWeight

    heads, head_dim, blocks = 16, 64, 128  # 1024 rows of 128 Q8_0 blocks: 4.25 MiB
    rows = torch.randint(0, 256, (heads * head_dim, 34 * blocks), dtype=torch.uint8)
    weight = QuantizedWeight(rows, GGMLQuantizationType.Q8_0, (heads * head_dim, 32 * blocks))
    moved = pairs_to_halves(weight, heads)
    within = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    order = (torch.arange(heads)[:, None] * head_dim + within).flatten()
    assert torch.equal(moved.data, rows[order])
    assert moved.data.data_ptr() % HUGE_PAGE_BYTES == 0
    assert "hg" in _vm_flags(moved.data.data_ptr())
