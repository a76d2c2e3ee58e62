"""A tensor-parallel group as the model uses it, and each rank's share of a dimension."""

from typing import TYPE_CHECKING, Protocol

import torch

from ..kernels.lora_ref import LoraPair
from .step_attention import StepAttention

if TYPE_CHECKING:
    from .config import ModelConfig
    from .lora import LoraAdapter

# A step's rows by LoRA adapter: (slot, scale factor, row indices), as `LoraStep.groups`.
LoraGroups = list[tuple[int, float, torch.Tensor]]


class Collectives(Protocol):
    """A tensor-parallel group as the model uses it (`distributed.tensor_parallel`): this rank's
    place, the sum of a tensor over the ranks, every rank's columns side by side, the
    hooks where the first rank tells the others which step to run with it, and LoRA
    adapters' matrices cut as the projections they attach to (`lora_share`), which the
    first rank hands on to the others before the next step that may read them."""

    rank: int
    world: int
    kv_replicas: int  # ranks that hold each key/value head (1 unless fewer heads than ranks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_max(self, x: torch.Tensor) -> torch.Tensor: ...
    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor: ...
    def before_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: StepAttention,
        lora_groups: LoraGroups,
    ) -> None: ...
    def before_logits(self, hidden: torch.Tensor) -> None: ...
    @property
    def whole_config(self) -> "ModelConfig": ...  # the whole model's (not this rank's share)
    def whole_features(self, module: str, in_features: int, out_features: int) -> tuple[int, int]:
        """The whole model's (in, out) of projection ``module``, whose share here has these."""
        ...

    def lora_share(self, module: str, pair: LoraPair) -> LoraPair: ...
    def lora_attached(self, slot: int, adapter: "LoraAdapter") -> None: ...
    def lora_detached(self, slot: int) -> None: ...


def shard_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s share of ``size`` rows split ``world`` ways:
    equal shares of ``ceil(size / world)``, the last one shorter where it does not divide."""
    share = -(-size // world)
    return min(size, rank * share), min(size, (rank + 1) * share)
