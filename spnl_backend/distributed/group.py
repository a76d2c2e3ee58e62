"""One model's ranks as a torch.distributed process group: gloo on the CPU, NCCL between
GPUs, made from a TCP store of its own rather than torch's global default group (a host
process may hold several backends, and torchrun's store may be there already).

Every collective waits at most the group's timeout; a failure (a rank gone, a rank
silent past the timeout) raises `DistributedError` and leaves the group unusable.
"""

import pickle
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import DistributedError
from ..log import get_logger
from ..settings.topology import LOCALHOST, Topology

log = get_logger()
_STORE_PREFIX = "spnl-backend"


class Group:
    """This rank's end of the group: tensors summed, broadcast and gathered over it, and
    pickled objects broadcast from rank 0."""

    def __init__(
        self,
        topology: Topology,
        port: int,
        timeout_s: float,
        device: torch.device,
        describe: Callable[[], str] = lambda: "",
    ) -> None:
        """``port``: the store's (rank 0 listens on it); ``describe()``: what is known of
        the other ranks, for the message of a failure (the local ranks' exit codes)."""
        self.rank, self.world, self.device = topology.rank, topology.world_size, device
        self.timeout = timedelta(seconds=timeout_s)
        self.describe = describe
        self.failed: DistributedError | None = None
        host = LOCALHOST if topology.master_addr == "0.0.0.0" else topology.master_addr
        store = dist.TCPStore(
            host,
            port,
            self.world,
            is_master=topology.rank == 0 and not topology.store_is_external,
            timeout=self.timeout,
            wait_for_workers=False,
        )
        self.store = dist.PrefixStore(_STORE_PREFIX, store)
        self.pg = self._guarded(lambda: _process_group(topology, self.store, self.timeout))

    def set_timeout(self, seconds: float) -> None:
        """How long each later collective waits (loading waits longer than a step)."""
        self.timeout = timedelta(seconds=seconds)

    # ---- collectives -------------------------------------------------------------------

    def all_reduce_(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """``tensor`` summed (or reduced by ``op``) over the ranks, in place (contiguous)."""
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._wait(lambda: self.pg.allreduce([tensor], options))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (each the same shape), in rank order."""
        out = [[torch.empty_like(tensor) for _ in range(self.world)]]
        self._wait(lambda: self.pg.allgather(out, [tensor]))
        return out[0]

    def broadcast_(self, tensor: torch.Tensor, timeout_s: float | None = None) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank, in place (waiting ``timeout_s`` at most
        where given, else the group's timeout)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._wait(lambda: self.pg.broadcast([tensor], options), timeout_s)
        return tensor

    def send_object(self, obj: object, timeout_s: float | None = None) -> None:
        """Rank 0: ``obj`` to every other rank (they call `receive_object`)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.broadcast_(torch.tensor([data.numel()], dtype=torch.int64), timeout_s)
        self.broadcast_(data.to(self.device), timeout_s)

    def receive_object(self, timeout_s: float | None = None) -> object:
        size = self.broadcast_(torch.zeros(1, dtype=torch.int64), timeout_s)
        data = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        return pickle.loads(self.broadcast_(data, timeout_s).cpu().numpy().tobytes())

    def close(self) -> None:
        """Leave the group (the other ranks' next collective fails)."""
        try:
            self.pg.shutdown()
        except Exception as exc:  # shutting down a failed group: nothing left to save
            log.debug("distributed.shutdown_failed", error=str(exc))

    # ---- failures ----------------------------------------------------------------------

    def _wait(self, start: Callable[[], dist.Work], timeout_s: float | None = None) -> None:
        timeout = self.timeout if timeout_s is None else timedelta(seconds=timeout_s)
        self._guarded(lambda: start().wait(timeout))

    def _guarded(self, call):
        if self.failed is not None:
            raise self.failed
        try:
            return call()
        except (RuntimeError, dist.DistBackendError) as exc:
            self.failed = DistributedError(self._message(exc))
            self.failed.__cause__ = exc
            raise self.failed from exc

    def _message(self, exc: BaseException) -> str:
        text = str(exc).strip()
        # gloo's own first sentence (its advice after it is about its own logs)
        first = text.splitlines()[0].split(". This is typically")[0] if text else type(exc).__name__
        known = self.describe()
        return (
            f"the tensor-parallel group failed on rank {self.rank} of {self.world} "
            f"(collective timeout {self.timeout.total_seconds():g} s): {first}"
            + (f"; {known}" if known else "")
            + "; load a new backend"
        )


def _process_group(topology: Topology, store: dist.Store, timeout: timedelta):
    if topology.dist_backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, topology.rank, topology.world_size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [_gloo_device(topology)]
    return dist.ProcessGroupGloo(store, topology.rank, topology.world_size, options)


def _gloo_device(topology: Topology):
    """The interface gloo's connections use: loopback on one machine, else the one named
    by GLOO_SOCKET_IFNAME (read with torchrun's variables), else the host name's."""
    if topology.nodes == 1:
        return dist.ProcessGroupGloo.create_device(hostname=LOCALHOST)
    if topology.gloo_interface:
        return dist.ProcessGroupGloo.create_device(interface=topology.gloo_interface)
    return dist.ProcessGroupGloo.create_default_device()
