"""This rank's share of a model, as the loader takes it (`loader.build.ModelSplit`), and
the group it runs in."""

import torch

from ..models.config import ModelConfig
from ..settings import BackendSettings
from ..settings.topology import Topology
from .group import Group
from .parallel import LOAD_TIMEOUT_S, TensorParallel
from .sharding import NamedWeights, Shard

# Rank 0 sends a heartbeat when idle this share of the collective timeout.
HEARTBEAT_SHARE = 0.25


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


class RankSplit:
    """How this rank takes its share: the model's config cut to its heads and rows, each
    weight cut as it streams in, and the group its layers sum over."""

    def __init__(self, tp: TensorParallel) -> None:
        self.collectives = tp

    def local_config(self, config: ModelConfig) -> ModelConfig:
        shard = Shard(config, self.collectives.rank, self.collectives.world)
        self.collectives.kv_replicas = shard.kv_replicas
        return shard.local_config()

    def weights(self, config: ModelConfig, weights: NamedWeights) -> NamedWeights:
        return Shard(config, self.collectives.rank, self.collectives.world).weights(weights)
