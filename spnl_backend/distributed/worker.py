"""A rank other than 0: it loads its share of the model, builds its KV pool as rank 0 says,
then runs each step rank 0 announces, until rank 0 stops it or the group fails.

    python -m spnl_backend.distributed.worker SPEC.json   (started by `launch.LocalRanks`)

Under torchrun, `follow` is what `load_backend` runs on every rank but the first.
"""

import json
import sys
from pathlib import Path

import torch

from ..engine.paged import PagedKVCache
from ..errors import DistributedError, SpnlError
from ..loader.build import LoadedModel, load_model
from ..loader.resolve import ModelSource
from ..log import get_logger
from ..settings import BackendSettings, detect_platform
from ..settings.topology import Topology
from .parallel import LOAD_TIMEOUT_S, Op, TensorParallel
from .split import RankSplit, join_group

log = get_logger()


def follow(loaded: LoadedModel, tp: TensorParallel) -> None:
    """Run rank 0's steps on this rank's share of the model until it says stop."""
    op, payload = tp.receive(LOAD_TIMEOUT_S)
    if op is Op.STOP:
        return
    if op is not Op.POOL:
        raise DistributedError(f"rank {tp.rank}: expected the pool's plan first, got {op.name}")
    num_blocks, block_size, dtype = payload  # type: ignore[misc]
    pool = PagedKVCache(loaded.config, num_blocks, block_size, getattr(torch, dtype), loaded.device)
    kernels, model = loaded.kernels.attention, loaded.model
    log.info("distributed.following", rank=tp.rank, blocks=num_blocks)
    with torch.inference_mode():
        while True:
            op, payload = tp.receive()
            if op is Op.FORWARD:
                input_ids, positions, meta = payload  # type: ignore[misc]
                device = loaded.device
                meta = _on(meta, device)
                model(input_ids.to(device), positions.to(device), pool.step(kernels, meta))
            elif op is Op.LOGITS:
                model.compute_logits(payload.to(loaded.device))  # type: ignore[union-attr]
            elif op is Op.STOP:
                return


def _on(meta, device: torch.device):
    if device.type == "cpu":
        return meta
    meta.block_tables = meta.block_tables.to(device)
    if meta.slot_mapping is not None:
        meta.slot_mapping = meta.slot_mapping.to(device)
    return meta


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    settings = BackendSettings(**spec["settings"])
    torch.set_num_threads(spec["threads"])
    topology = Topology(**spec["topology"])
    decisions = detect_platform(settings)
    source = ModelSource(
        spec["source"]["kind"], Path(spec["source"]["path"]), spec["source"]["name"]
    )
    tp = join_group(topology, spec["port"], settings, torch.device(decisions.device))
    try:
        loaded = load_model(source, settings.isq, decisions, lambda *_: None, split=RankSplit(tp))
        follow(loaded, tp)
    except SpnlError as exc:
        print(f"rank {topology.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        tp.group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
