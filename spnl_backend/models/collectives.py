"""A tensor-parallel group as the model uses it, and each rank's share of a dimension."""

from typing import Protocol

import torch

from .step_attention import StepAttention


class Collectives(Protocol):
    """A tensor-parallel group as the model uses it (`distributed.tensor_parallel`): this rank's
    place, the sum of a tensor over the ranks, every rank's columns side by side, and the
    hooks where the first rank tells the others which step to run with it."""

    rank: int
    world: int
    kv_replicas: int  # ranks that hold each key/value head (1 unless fewer heads than ranks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_max(self, x: torch.Tensor) -> torch.Tensor: ...
    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor: ...
    def before_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: StepAttention
    ) -> None: ...
    def before_logits(self, hidden: torch.Tensor) -> None: ...


def shard_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s share of ``size`` rows split ``world`` ways:
    equal shares of ``ceil(size / world)``, the last one shorter where it does not divide."""
    share = -(-size // world)
    return min(size, rank * share), min(size, (rank + 1) * share)
