"""A machine's first rank: it checks that the model splits before any weight loads, starts
the machine's other ranks, joins the group and loads its share. On rank 0 (the head's
first rank, which serves the API) the engine is then built as for one process, the other
ranks are told its pool, hear a heartbeat while it idles and are stopped when it closes.
Any other first rank (a worker machine's, or every torchrun rank but 0) follows rank 0's
steps like the ranks it started."""

import os
from dataclasses import dataclass

import torch

from ..engine.engine import Engine
from ..errors import DistributedError
from ..loader.gguf_config import model_config_from_gguf
from ..loader.gguf_file import GGUFFile
from ..loader.hf_config import read_text_config
from ..loader.resolve import ModelSource
from ..log import get_logger
from ..quant.ggml import ggml_format
from ..settings import BackendSettings, PlatformDecisions
from ..settings.topology import Topology
from .launch import LocalRanks, store_port
from .sharding import RankSplit, check_shardable
from .tensor_parallel import Op, TensorParallel, join_group, serving

log = get_logger()


@dataclass
class Ranks:
    """What a first rank holds of its group: its end of it, and the ranks it started."""

    tp: TensorParallel
    local: LocalRanks | None
    threads_before: int  # this process's torch threads before it took its share

    def attach(self, engine: Engine, settings: BackendSettings) -> None:
        """Rank 0, its engine built (the others built their pools meanwhile): they hear
        how many blocks it schedules, then follow its steps."""
        info = engine.cache_info
        if info.kind != "paged" or info.num_blocks is None:
            raise DistributedError(
                "tensor parallelism runs on the paged KV cache, and this backend's cache is "
                f"{info.kind} (a compression method without a block-pool form?)"
            )
        self.tp.send(Op.POOL, info.num_blocks)
        serving(self.tp, settings)
        engine.on_idle.append(self.tp.idle)
        engine.on_close.append(self.stop)
        log.info("distributed.ready", world=self.tp.world, blocks=info.num_blocks)

    def stop(self) -> None:
        """Tell the others to stop (where the group still works), leave it, and wait for
        the ranks this process started (killed where they do not stop)."""
        healthy = self.tp.group.failed is None
        if healthy and self.tp.drives:
            try:
                self.tp.send(Op.STOP)
            except DistributedError:
                healthy = False
        self.tp.group.close()
        if self.local is not None:
            self.local.stop() if healthy else self.local.kill()
        torch.set_num_threads(self.threads_before)


def check_model_splits(source: ModelSource, world: int) -> None:
    """That the model splits ``world`` ways (heads, rows, stored blocks), from its config
    and tensor types alone: before any rank loads a weight."""
    if source.kind == "gguf":
        gguf = GGUFFile(source.path)
        config = model_config_from_gguf(gguf)
        stored = _stored_blocks(gguf)
        check_shardable(config, world, lambda kind: stored[kind])
        return
    config, _ = read_text_config(source.path)
    check_shardable(config, world)  # ISQ picks each share's type to fit its columns


def _stored_blocks(gguf: GGUFFile) -> dict[str, int]:
    """The largest block of the weights a split cuts by columns: attention outputs, downs."""
    blocks = {"o": 1, "down": 1}
    for name, info in gguf.tensors.items():
        kind = "o" if ".attn_output." in name else "down" if ".ffn_down" in name else None
        if kind is not None:
            blocks[kind] = max(blocks[kind], ggml_format(info.qtype).block_size)
    return blocks


def start_ranks(
    source: ModelSource,
    settings: BackendSettings,
    decisions: PlatformDecisions,
    topology: Topology,
) -> tuple[RankSplit, Ranks]:
    """Start this machine's other ranks and join the group with them (call on the thread
    that will run the model: the collectives keep one order)."""
    port = store_port(topology)
    threads, before = decisions.threads, torch.get_num_threads()
    torch.set_num_threads(threads)  # this process takes its share of the cores too
    local = None
    if topology.launcher == "spawn" and topology.local_world_size > 1:
        described = {"kind": source.kind, "path": os.fspath(source.path), "name": source.name}
        local = LocalRanks(topology, port, described, settings, threads)
    try:
        tp = join_group(
            topology,
            port,
            settings,
            torch.device(decisions.device),
            describe=local.describe if local is not None else lambda: "",
        )
    except BaseException:
        if local is not None:
            local.kill()
        torch.set_num_threads(before)
        raise
    log.info("distributed.joined", rank=topology.rank, world=topology.world_size)
    return RankSplit(tp), Ranks(tp, local, before)
