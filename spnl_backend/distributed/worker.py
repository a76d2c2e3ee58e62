"""A rank other than 0: it loads its share of the model, builds its KV pool as rank 0 says,
then runs each step rank 0 announces, until rank 0 stops it or the group fails.

    python -m spnl_backend.distributed.worker SPEC.json   (started by `launch.LocalRanks`)

Under torchrun, `follow` is what `load_backend` runs on every rank but the first.
"""

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from ..engine.build import build_cache
from ..errors import DistributedError, SpnlError
from ..loader.model import LoadedModel, load_model
from ..loader.resolve import ModelSource
from ..log import get_logger
from ..models.collectives import LoraGroups
from ..models.lora import LoraAdapters
from ..models.transformer import CausalLM
from ..settings import BackendSettings, PlatformDecisions, detect_platform
from ..settings.topology import Topology
from .sharding import RankSplit
from .tensor_parallel import AdapterChange, Op, TensorParallel, join_group, serving

log = get_logger()


def follow(
    loaded: LoadedModel,
    tp: TensorParallel,
    settings: BackendSettings,
    decisions: PlatformDecisions,
) -> None:
    """Build this rank's pool as rank 0 builds its own (in lockstep: a calibrated pool's
    pass over the reference text is the group's), then run rank 0's steps on it until it
    says stop."""
    cache, info = build_cache(loaded, settings, decisions)
    op, payload = tp.receive()
    if op is Op.STOP:
        return
    if op is not Op.POOL:
        raise DistributedError(f"rank {tp.rank}: expected the pool's size first, got {op.name}")
    if info.num_blocks is None or info.num_blocks < payload:  # type: ignore[operator]
        raise DistributedError(
            f"rank {tp.rank}'s KV pool holds {info.num_blocks} blocks, fewer than the "
            f"{payload} rank 0 schedules: set the budget in tokens "
            "(MISTRALRS_PAGED_ATTN_CONTEXT_LEN) so that every rank holds the same"
        )
    serving(tp, settings)
    storage, kernels, model = cache.cache, cache.kernels, loaded.model  # type: ignore[attr-defined]
    log.info("distributed.following", rank=tp.rank, blocks=info.num_blocks)
    with torch.inference_mode():
        while True:
            op, payload = tp.receive()
            if op is Op.FORWARD:
                input_ids, positions, meta, groups = payload  # type: ignore[misc]
                device = loaded.device
                step = storage.step(kernels, meta.to(device))
                with _adapter_rows(model, groups, device):
                    model(input_ids.to(device), positions.to(device), step)
            elif op is Op.ADAPTERS:
                _change_adapters(model, payload, tp.rank)  # type: ignore[arg-type]
            elif op is Op.LOGITS:
                model.compute_logits(payload.to(loaded.device))  # type: ignore[union-attr]
            elif op is Op.STOP:
                return


def _change_adapters(model: CausalLM, changes: list[AdapterChange], rank: int) -> None:
    """Rank 0's LoRA adapters attached and detached since the last step, in the same
    slots here (each projection takes this rank's share as it attaches)."""
    if model.adapters is None:
        model.adapters = LoraAdapters()
    held = model.adapters
    for slot, adapter in changes:
        if adapter is not None:
            held.attach(model, adapter, slot)
            continue
        name = held.named_at(slot)
        if name is None:
            raise DistributedError(f"rank {rank}: rank 0 freed LoRA slot {slot}, empty here")
        held.detach(model, name)


@contextlib.contextmanager
def _adapter_rows(model: CausalLM, groups: LoraGroups, device: torch.device) -> Iterator[None]:
    """The step's rows by LoRA adapter, as rank 0 runs it, set for its pass alone."""
    if not groups:
        yield
        return
    if model.adapters is None:
        raise DistributedError("rank 0 runs rows through LoRA adapters this rank never got")
    step = model.adapters.step
    step.groups = [(slot, factor, rows.to(device)) for slot, factor, rows in groups]
    try:
        yield
    finally:
        step.groups = []


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
        loaded = load_model(
            source,
            settings.isq,
            decisions,
            lambda *_: None,
            split=RankSplit(tp),
            model_impl=settings.model_impl,
        )
        follow(loaded, tp, settings, decisions)
    except SpnlError as exc:
        print(f"rank {topology.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        tp.group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
