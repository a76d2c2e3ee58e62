import gc
import mmap
import sys
from pathlib import Path

import pytest
import torch

from spnl_backend.memory import HUGE_PAGE_MIN_BYTES, host_tensor, release_freed_memory

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="malloc_trim and huge pages: on Linux only"
)


def test_releasing_freed_memory_leaves_live_memory_alone():
    anonymous = torch.randn(4096, 1024)
    copy = anonymous.clone()
    release_freed_memory()
    assert torch.equal(anonymous, copy)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address``."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            mapping = low <= address < high
        elif mapping and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


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
