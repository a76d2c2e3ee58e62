"""How many processes one model spans, and which one this is: mistral.rs's variables
(`MISTRALRS_NO_NCCL`, the `MISTRALRS_MN_*` set) or torchrun's, decided once, before any
weight loads.

- torchrun (``WORLD_SIZE`` > 1, with ``RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``): every rank is started by torchrun, on one machine or several.
- ``MISTRALRS_MN_GLOBAL_WORLD_SIZE``: several machines, each contributing
  ``MISTRALRS_MN_LOCAL_WORLD_SIZE`` ranks; the head (``MISTRALRS_MN_HEAD_NUM_WORKERS``,
  ``MISTRALRS_MN_HEAD_PORT``) serves the API, each worker machine
  (``MISTRALRS_MN_WORKER_SERVER_ADDR``, ``MISTRALRS_MN_WORKER_ID``) follows it.
- otherwise one machine: ``MISTRALRS_MN_LOCAL_WORLD_SIZE`` ranks, or on CUDA every visible
  GPU where the device is not pinned to one.

In the last two the process that calls `load_backend` is its machine's first rank and
starts the machine's other ranks itself. ``MISTRALRS_NO_NCCL=1`` keeps one process. The
world size is a power of two, as mistral.rs requires. Tensors travel on torch.distributed:
NCCL between GPUs, gloo on the CPU.
"""

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..errors import SettingsError
from .backend_settings import BackendSettings, env_name

if TYPE_CHECKING:
    from .platform import PlatformDecisions

Launcher = Literal["none", "spawn", "torchrun"]
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Also read with them: whether torchrun's agent holds the store the ranks meet in, and the
# network interface gloo is told to use.
_AGENT_STORE, _GLOO_INTERFACE = "TORCHELASTIC_USE_AGENT_STORE", "GLOO_SOCKET_IFNAME"
LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class Topology:
    """The processes one model spans and this process's place among them."""

    world_size: int = 1
    rank: int = 0
    local_world_size: int = 1
    node: int = 0  # this machine: 0 is the head, whose first rank serves the API
    dist_backend: Literal["gloo", "nccl"] | None = None  # torch.distributed's collectives
    master_addr: str = LOCALHOST
    master_port: int | None = None  # None: a free port, chosen when the ranks start
    launcher: Launcher = "none"
    why: str = "one process"
    store_is_external: bool = False  # torchrun's agent serves the store rank 0 would
    gloo_interface: str | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world_size

    def for_rank(self, rank: int) -> "Topology":
        """The same topology as seen by ``rank`` (a local rank this process starts)."""
        return dataclasses.replace(self, rank=rank)


def launch_environment() -> dict[str, str]:
    """torchrun's variables, and gloo's interface, where set (they are not ours: read
    here, when deciding)."""
    names = (*_TORCHRUN, _AGENT_STORE, _GLOO_INTERFACE)
    return {name: os.environ[name] for name in names if os.environ.get(name)}


def decide_topology(
    settings: BackendSettings,
    device_type: str,
    cuda_count: int,
    launch: Mapping[str, str],
) -> Topology:
    """The topology (pure): raises SettingsError naming the variables that disagree."""
    dist_backend = "nccl" if device_type == "cuda" else "gloo"
    multi_node = settings.mn_global_world_size is not None
    torchrun = int(launch.get("WORLD_SIZE", "1") or 1) > 1
    if settings.no_nccl:
        _check_no_parallelism(settings, torchrun)
        return Topology(why=f"{env_name('no_nccl')}=1: one process, no tensor parallelism")
    if torchrun:
        topology = _torchrun(settings, launch, dist_backend)
    elif multi_node:
        topology = _multi_node(settings, dist_backend)
    else:
        topology = _one_machine(settings, dist_backend, device_type, cuda_count)
    _check_devices(topology, device_type, cuda_count)
    return dataclasses.replace(
        topology,
        store_is_external=launch.get(_AGENT_STORE, "").lower() == "true",
        gloo_interface=launch.get(_GLOO_INTERFACE),
    )


def _check_no_parallelism(settings: BackendSettings, torchrun: bool) -> None:
    if settings.mn_global_world_size is not None or torchrun:
        started = (
            "torchrun started several ranks"
            if torchrun
            else f"{env_name('mn_global_world_size')} asks for several machines"
        )
        raise SettingsError(
            f"{env_name('no_nccl')}=1 turns tensor parallelism off, but {started}; "
            "unset one of them"
        )


def _torchrun(settings: BackendSettings, launch: Mapping[str, str], dist_backend: str) -> Topology:
    if settings.mn_global_world_size is not None:
        raise SettingsError(
            f"torchrun started this process (WORLD_SIZE={launch['WORLD_SIZE']}) and "
            f"{env_name('mn_global_world_size')} is set too: use one launcher"
        )
    missing = [name for name in _TORCHRUN if name not in launch]
    if missing:
        raise SettingsError(
            f"WORLD_SIZE={launch['WORLD_SIZE']} says torchrun started this process, but "
            + ", ".join(missing)
            + " are not set (torchrun sets RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
        )
    world, rank = _whole(launch, "WORLD_SIZE"), _whole(launch, "RANK")
    local, port = _whole(launch, "LOCAL_WORLD_SIZE"), _whole(launch, "MASTER_PORT")
    if not (0 <= rank < world and 0 < local <= world and world % local == 0):
        raise SettingsError(
            f"torchrun's RANK={rank}, WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local} do not "
            "fit together (a rank below the world size, whole machines of local ranks)"
        )
    if settings.mn_local_world_size not in (None, local):
        raise SettingsError(
            f"{env_name('mn_local_world_size')}={settings.mn_local_world_size} but torchrun "
            f"started LOCAL_WORLD_SIZE={local} ranks on this machine"
        )
    topology = Topology(
        world_size=world,
        rank=rank,
        local_world_size=local,
        node=rank // local,
        dist_backend=dist_backend,  # type: ignore[arg-type]
        master_addr=launch["MASTER_ADDR"],
        master_port=port,
        launcher="torchrun",
        why=f"torchrun: rank {rank} of {world}, {local} on this machine",
    )
    _check_power_of_two(world, "torchrun's WORLD_SIZE")
    return topology


def _multi_node(settings: BackendSettings, dist_backend: str) -> Topology:
    world = settings.mn_global_world_size
    local = settings.mn_local_world_size
    assert world is not None
    if local is None:
        raise SettingsError(
            f"{env_name('mn_global_world_size')}={world} needs "
            f"{env_name('mn_local_world_size')} (the ranks each machine contributes)"
        )
    if world % local or local > world:
        raise SettingsError(
            f"{env_name('mn_global_world_size')}={world} is not a whole number of machines "
            f"of {env_name('mn_local_world_size')}={local} ranks"
        )
    _check_power_of_two(world, env_name("mn_global_world_size"))
    nodes = world // local
    head = settings.mn_head_num_workers is not None or settings.mn_head_port is not None
    worker = settings.mn_worker_server_addr is not None or settings.mn_worker_id is not None
    if head == worker:
        raise SettingsError(
            f"{env_name('mn_global_world_size')}={world} needs this machine to be the head "
            f"({env_name('mn_head_num_workers')} and {env_name('mn_head_port')}) or a worker "
            f"({env_name('mn_worker_server_addr')} and {env_name('mn_worker_id')}), "
            + ("not both" if head else "and neither is set")
        )
    common = dict(
        world_size=world, local_world_size=local, dist_backend=dist_backend, launcher="spawn"
    )
    if head:
        return _head(settings, nodes, common)
    return _worker(settings, nodes, common)


def _head(settings: BackendSettings, nodes: int, common: dict) -> Topology:
    workers, port = _both(settings, "the head machine", "mn_head_num_workers", "mn_head_port")
    if workers != nodes - 1:
        raise SettingsError(
            f"{env_name('mn_head_num_workers')}={workers}, but "
            f"{env_name('mn_global_world_size')}={common['world_size']} over "
            f"{env_name('mn_local_world_size')}={common['local_world_size']} makes "
            f"{nodes} machines: {nodes - 1} workers besides the head"
        )
    return Topology(
        **common,
        node=0,
        master_addr="0.0.0.0",  # listens on every interface for the workers
        master_port=port,
        why=f"multi-node head: {nodes} machines of {common['local_world_size']} ranks",
    )


def _worker(settings: BackendSettings, nodes: int, common: dict) -> Topology:
    address, worker = _both(settings, "a worker machine", "mn_worker_server_addr", "mn_worker_id")
    if worker >= nodes - 1:
        raise SettingsError(
            f"{env_name('mn_worker_id')}={worker} is out of range: {nodes} machines make "
            f"workers 0 to {nodes - 2}"
            if nodes > 1
            else f"{env_name('mn_worker_id')}={worker}: one machine has no workers"
        )
    host, _, port = address.rpartition(":")
    node = worker + 1
    return Topology(
        **common,
        rank=node * common["local_world_size"],
        node=node,
        master_addr=host.strip("[]"),
        master_port=int(port),
        why=f"multi-node worker {worker}: machine {node} of {nodes}",
    )


def _both(settings: BackendSettings, who: str, first: str, second: str) -> tuple:
    values = getattr(settings, first), getattr(settings, second)
    if None in values:
        raise SettingsError(f"{who} needs both {env_name(first)} and {env_name(second)}")
    return values


def _one_machine(
    settings: BackendSettings, dist_backend: str, device_type: str, cuda_count: int
) -> Topology:
    local = settings.mn_local_world_size
    why = f"{env_name('mn_local_world_size')}={local}"
    if local is None:
        pinned = settings.device not in ("auto", "cuda")
        if device_type == "cuda" and cuda_count > 1 and not pinned:
            local, why = cuda_count, f"{cuda_count} visible CUDA GPUs"
        else:
            return Topology()
    if local == 1:
        return Topology(why=f"{why}: one process")
    _check_power_of_two(local, env_name("mn_local_world_size"))
    return Topology(
        world_size=local,
        local_world_size=local,
        dist_backend=dist_backend,  # type: ignore[arg-type]
        launcher="spawn",
        why=f"{why}: tensor parallelism over {local} local ranks ({dist_backend})",
    )


def _check_devices(topology: Topology, device_type: str, cuda_count: int) -> None:
    local = topology.local_world_size
    if not topology.distributed:
        return
    if device_type == "mps":
        raise SettingsError(
            f"{local} local ranks on Metal: tensor parallelism runs on CUDA GPUs or the CPU"
        )
    if device_type == "cuda" and local > cuda_count:
        raise SettingsError(
            f"{local} ranks on this machine, but it has {cuda_count} visible CUDA GPU(s): "
            "one rank per GPU"
        )


def _check_power_of_two(world: int, what: str) -> None:
    if world & (world - 1):
        raise SettingsError(
            f"{what}={world}: the world size must be a power of two (1, 2, 4, 8, ...)"
        )


def _whole(launch: Mapping[str, str], name: str) -> int:
    text = launch[name].strip()
    if not text.isdigit():
        raise SettingsError(f"{name}={launch[name]!r}: expected a whole number (torchrun's)")
    return int(text)


def check_distributed_settings(settings: BackendSettings, decisions: "PlatformDecisions") -> None:
    """What tensor parallelism does not run with, refused before anything starts."""
    if not decisions.paged_attn:
        raise SettingsError(
            "tensor parallelism runs on the paged KV cache (each rank keeps its heads' "
            f"pool), and paged attention is off ({decisions.paged_attn_reason}); turn it on, "
            f"or set {env_name('no_nccl')}=1 for one process"
        )


@dataclass(frozen=True)
class LayerMap:
    """Layer mapping: consecutive layers on each device, the embedding on the first and
    the final norm and LM head on the last; activations move at the boundaries, and each
    device's KV pool holds its layers."""

    spans: tuple[tuple[str, int], ...]  # (device, layers), in order
    why: str

    def layer_devices(self, num_layers: int) -> list[str]:
        """Each layer's device (the counts must add up to the model's layers)."""
        devices = [device for device, count in self.spans for _ in range(count)]
        if len(devices) != num_layers:
            raise SettingsError(
                f"{env_name('device_layers')} maps {len(devices)} layers "
                f"({_spans(self.spans)}), but the model has {num_layers}"
            )
        return devices


def decide_layer_map(
    settings: BackendSettings, topology: Topology, device_type: str, cuda_count: int
) -> LayerMap | None:
    """The layer mapping the settings ask for, if any (pure): ``MISTRALRS_DEVICE_LAYERS``,
    or with ``MISTRALRS_NO_NCCL=1`` every visible GPU (layers shared out evenly), as
    mistral.rs maps them when tensor parallelism is off."""
    asked = settings.device_layers
    if asked is not None and topology.distributed:
        raise SettingsError(
            f"{env_name('device_layers')} maps layers to devices, and {topology.why}: "
            f"layer mapping runs in one process (set {env_name('no_nccl')}=1)"
        )
    if asked is None:
        pinned = settings.device not in ("auto", "cuda")
        if settings.no_nccl and device_type == "cuda" and cuda_count > 1 and not pinned:
            return LayerMap(
                tuple((f"cuda:{i}", 0) for i in range(cuda_count)),
                f"{env_name('no_nccl')}=1 with {cuda_count} visible CUDA GPUs",
            )
        return None
    if device_type == "cuda":
        beyond = [ordinal for ordinal, _ in asked if ordinal >= cuda_count]
        if beyond:
            raise SettingsError(
                f"{env_name('device_layers')} names device(s) {beyond}, but this machine "
                f"has {cuda_count} visible CUDA GPU(s)"
            )
        spans = tuple((f"cuda:{ordinal}", count) for ordinal, count in asked)
    elif device_type == "mps" and len(asked) > 1:
        raise SettingsError(f"{env_name('device_layers')}: Metal has one device")
    else:  # the CPU's "devices" are one memory: each keeps its own layers and pool
        spans = tuple((device_type, count) for _, count in asked)
    return LayerMap(spans, f"{env_name('device_layers')}={_spans(asked)}")


def even_spans(layer_map: LayerMap, num_layers: int) -> LayerMap:
    """An automatic map (counts 0) with the model's layers shared out evenly, the first
    devices taking one more where they do not divide."""
    if any(count for _, count in layer_map.spans):
        return layer_map
    devices = len(layer_map.spans)
    counts = [num_layers // devices + (i < num_layers % devices) for i in range(devices)]
    spans = tuple((device, n) for (device, _), n in zip(layer_map.spans, counts, strict=True))
    return LayerMap(tuple(span for span in spans if span[1]), layer_map.why)


def _spans(spans) -> str:
    return ";".join(f"{device}:{count}" for device, count in spans)


def check_layer_map_settings(settings: BackendSettings, decisions: "PlatformDecisions") -> None:
    """Layer mapping keeps each device's layers in its own part of the paged pool: a
    cache of another kind is refused by name before anything loads."""
    if not decisions.paged_attn:
        raise SettingsError(
            f"layer mapping ({env_name('device_layers')}, or {env_name('no_nccl')}=1 over "
            f"several GPUs) runs on the paged KV cache, and paged attention is off "
            f"({decisions.paged_attn_reason})"
        )
    if settings.kv_cache_compression != "none":
        raise SettingsError(
            f"layer mapping does not run with {env_name('kv_cache_compression')}="
            f"{settings.kv_cache_compression} (its pool is on one device); use the plain "
            "or FP8 pool"
        )
