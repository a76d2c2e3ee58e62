import sys

import pytest
import torch

from spnl_backend.memory import release_freed_memory

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="malloc_trim on Linux only")


def test_releasing_freed_memory_leaves_live_memory_alone():
    anonymous = torch.randn(4096, 1024)
    copy = anonymous.clone()
    release_freed_memory()
    assert torch.equal(anonymous, copy)
