"""A tensor-parallel model's rank: joining its group, the collectives its layers call, and
the messages by which rank 0 (which schedules, samples and answers the API) has the other
ranks run each step with it.

Rank 0 runs the engine as one process would; its model, whose every forward pass and every
logits call is also the others', announces each (the step's tokens, positions, paged
metadata and which rows take which LoRA adapter; the rows to take logits of) before
running it, and before a step the LoRA adapters attached or detached since the last. The
other ranks hold no sequences: they run what they are told, over their own pools, in the
same order, and never sample. Their logits reach rank 0 as its share of the vocabulary
gathered. While idle, rank 0 sends a heartbeat now and then, so that a rank waiting for
the next step never mistakes a quiet engine for a dead one.
"""

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed

from ..kernels.lora_ref import LoraPair
from ..models.collectives import LoraGroups
from ..models.config import ModelConfig
from ..models.lora import LoraAdapter
from ..models.step_attention import StepAttention
from ..settings import BackendSettings
from ..settings.topology import Topology
from .group import Group

if TYPE_CHECKING:
    from .sharding import Shard

LOAD_TIMEOUT_S = 3600.0  # how long ranks wait for each other to load (not a step's timeout)
# Rank 0 sends a heartbeat when idle this share of the collective timeout.
HEARTBEAT_SHARE = 0.25


class Op(enum.IntEnum):
    FORWARD = 1  # (input_ids, positions, paged metadata)
    LOGITS = 2  # the hidden rows to take logits of
    HEARTBEAT = 3
    STOP = 4
    POOL = 5  # how many blocks rank 0 schedules (each rank built its own pool meanwhile)
    ADAPTERS = 6  # LoRA adapters attached and detached since: [(slot, adapter or None)]


# A change to the LoRA adapters held: an adapter attached in a slot, or (None) the slot freed.
AdapterChange = tuple[int, LoraAdapter | None]


@dataclass
class TensorParallel:
    """This rank's place in the group, as the model's layers use it (`models.collectives.
    Collectives`); ``drives``: rank 0, which announces each step to the others."""

    group: Group
    kv_replicas: int
    drives: bool
    heartbeat_s: float
    last_sent: float = 0.0
    # Off while the ranks load and build in lockstep (each runs its own calibration pass
    # at the same point); on once rank 0 serves and the others follow what it announces.
    announcing: bool = False
    shard: "Shard | None" = None  # this rank's share of the model (`RankSplit` sets it)
    # Rank 0: LoRA adapters attached and detached since the others last heard, sent before
    # the next step (adapters attached while the ranks build are sent once they serve).
    adapter_changes: list[AdapterChange] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world(self) -> int:
        return self.group.world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce_(x.contiguous())

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce_(x.contiguous(), torch.distributed.ReduceOp.MAX)

    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Every rank's columns of ``x`` side by side, cut to ``total`` (the last rank's
        share may be short: each is padded to the first's width to travel)."""
        share = -(-total // self.world)
        if x.shape[-1] < share:
            x = torch.nn.functional.pad(x, (0, share - x.shape[-1]))
        return torch.cat(self.group.all_gather(x.contiguous()), dim=-1)[..., :total]

    def before_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: StepAttention,
        lora_groups: LoraGroups,
    ) -> None:
        if self.drives and self.announcing:
            meta = getattr(backend, "meta", None)
            if meta is None:
                raise TypeError("tensor parallelism runs on the paged cache's steps")
            if self.adapter_changes:
                self.send(Op.ADAPTERS, [(slot, _on_cpu(a)) for slot, a in self.adapter_changes])
                self.adapter_changes = []
            cpu = torch.device("cpu")  # the trip's (and without rank 0's memo of plans)
            groups = [(slot, factor, rows.cpu()) for slot, factor, rows in lora_groups]
            self.send(Op.FORWARD, (input_ids.cpu(), positions.cpu(), meta.to(cpu), groups))

    def before_logits(self, hidden: torch.Tensor) -> None:
        if self.drives and self.announcing:
            self.send(Op.LOGITS, hidden.cpu())

    # ---- LoRA adapters: cut as the projections they attach to -------------------------

    @property
    def whole_config(self) -> ModelConfig:
        return self._shard().config

    def whole_features(self, module: str, in_features: int, out_features: int) -> tuple[int, int]:
        return self._shard().whole_features(module, in_features, out_features)

    def lora_share(self, module: str, pair: LoraPair) -> LoraPair:
        return self._shard().lora_share(module, pair)

    def lora_attached(self, slot: int, adapter: LoraAdapter) -> None:
        """Rank 0: the whole ``adapter`` to be sent (each rank takes its share itself)."""
        if self.drives:
            self.adapter_changes.append((slot, adapter))

    def lora_detached(self, slot: int) -> None:
        """Rank 0: ``slot`` to be freed on the others, or its adapter never sent."""
        if not self.drives:
            return
        pending = [i for i, (s, _) in enumerate(self.adapter_changes) if s == slot]
        if pending and self.adapter_changes[pending[-1]][1] is not None:
            del self.adapter_changes[pending[-1]]  # attached since they last heard
        else:
            self.adapter_changes.append((slot, None))

    def _shard(self) -> "Shard":
        if self.shard is None:
            raise RuntimeError("this rank's share is set as its model loads (`RankSplit`)")
        return self.shard

    def send(self, op: Op, payload: object = None, timeout_s: float | None = None) -> None:
        self.group.send_object((int(op), payload), timeout_s)
        self.last_sent = time.monotonic()

    def idle(self) -> None:
        """Rank 0 between steps: a heartbeat when the others have heard nothing lately
        (nothing once the group has failed: its error was raised already)."""
        if self.group.failed is not None or not self.drives:
            return
        if time.monotonic() - self.last_sent >= self.heartbeat_s:
            self.send(Op.HEARTBEAT)

    def receive(self, timeout_s: float | None = None) -> tuple[Op, object]:
        op, payload = self.group.receive_object(timeout_s)  # type: ignore[misc]
        return Op(op), payload


def join_group(
    topology: Topology,
    port: int,
    settings: BackendSettings,
    device: torch.device,
    describe=lambda: "",
) -> TensorParallel:
    """This rank in its model's group (waits for every rank to join)."""
    timeout = settings.collective_timeout_s
    if device.type == "cuda":  # NCCL works on the current device: this rank's GPU
        torch.cuda.set_device(device)
    group = Group(topology, port, timeout, device, describe)
    group.set_timeout(max(timeout, LOAD_TIMEOUT_S))  # until the ranks serve: see `serving`
    return TensorParallel(
        group, kv_replicas=1, drives=topology.rank == 0, heartbeat_s=timeout * HEARTBEAT_SHARE
    )


def serving(tp: TensorParallel, settings: BackendSettings) -> None:
    """The ranks have loaded and built: steps run under the collective timeout, and rank
    0 announces each."""
    tp.group.set_timeout(settings.collective_timeout_s)
    tp.announcing = True


def _on_cpu(adapter: LoraAdapter | None) -> LoraAdapter | None:
    """``adapter`` with its matrices on the CPU, for the trip to the other ranks."""
    if adapter is None:
        return None
    pairs = {name: LoraPair(p.a.cpu(), p.b.cpu(), p.scale) for name, p in adapter.pairs.items()}
    return dataclasses.replace(adapter, pairs=pairs)
