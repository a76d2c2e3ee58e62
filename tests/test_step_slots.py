"""The once-a-step check that every block and slot a step names lies in the pool
(`kernels.sets.check_step_slots`), before the native kernels follow them."""

import pytest
import torch

from spnl_backend.kernels.cpu import KernelArgumentError
from spnl_backend.kernels.metadata import PagedMetadata
from spnl_backend.kernels.sets import check_step_slots

POOL = torch.empty(4, 8, 1, 2)  # 4 blocks of 8 slots


def _meta(tables: list[list[int]], slots: list[int], seq_lens: list[int]) -> PagedMetadata:
    return PagedMetadata(
        torch.tensor(tables), seq_lens, [1] * len(seq_lens), 8, torch.tensor(slots)
    )


def test_a_step_inside_the_pool_passes():
    check_step_slots(_meta([[0, 3], [2, 1]], [11, -1], [12, 16]), POOL)


@pytest.mark.parametrize(
    ("tables", "slots", "message"),
    [
        ([[0, 4]], [3], r"block 4 or 0, outside the pool of 4 blocks"),
        ([[-2, 1]], [3], r"block 1 or -2"),
        ([[0, 1]], [32], r"slot 32 or 32"),
        ([[0, 1]], [-2], r"slot -2 or -2"),
    ],
)
def test_a_block_or_slot_outside_the_pool_is_refused(tables, slots, message):
    with pytest.raises(KernelArgumentError, match=message):
        check_step_slots(_meta(tables, slots, [9]), POOL)


def test_a_sequence_longer_than_its_table_is_refused():
    with pytest.raises(KernelArgumentError, match="longer than its block table"):
        check_step_slots(_meta([[0, 1]], [3], [17]), POOL)
