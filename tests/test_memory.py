import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from spnl_backend.loader.memory import release_file_pages, release_freed_memory

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="madvise on Linux only")


def _resident_kb() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        return next(int(line.split()[1]) for line in rollup if line.startswith("Rss:"))


def test_released_file_pages_leave_the_process_and_read_back_unchanged(tmp_path):
    weight = torch.randn(4096, 1024)
    save_file({"w": weight}, tmp_path / "m.safetensors")
    with safe_open(tmp_path / "m.safetensors", framework="pt") as f:
        mapped = f.get_tensor("w")
        assert torch.equal(mapped, weight)  # every page touched: 16 MB resident
        before = _resident_kb()
        release_file_pages(mapped)
        assert before - _resident_kb() > 12_000
        assert torch.equal(mapped, weight)  # faulted back in from the file


def test_memory_that_is_not_a_files_is_left_alone():
    anonymous = torch.randn(4096, 1024)
    copy = anonymous.clone()
    release_file_pages(anonymous)
    release_freed_memory()
    assert torch.equal(anonymous, copy)
