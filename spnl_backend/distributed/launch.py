"""Starting a machine's other ranks: each a Python process running
`spnl_backend.distributed.worker` with this rank's model, settings and topology, its
output kept in a file whose end is quoted when it fails. Rank 0 watches them: a rank that
exits is named in the error of the collective that missed it, and closing the backend
stops them all."""

import json
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from ..errors import SettingsError
from ..log import get_logger
from ..settings import BackendSettings, PlatformDecisions
from ..settings.topology import LOCALHOST, Topology

log = get_logger()
_STOP_WAIT_S = 10.0
_SETTLE_S = 2.0
_TAIL_BYTES = 4000


def store_port(topology: Topology) -> int:
    """The port rank 0's store listens on: the topology's, checked free (a port in use is
    an error before any weight loads), or one the system picks on loopback."""
    port = topology.master_port
    if port is None:
        with socket.socket() as probe:
            probe.bind((LOCALHOST, 0))
            return probe.getsockname()[1]
    if topology.rank == 0 and not topology.store_is_external:
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError as exc:
                raise SettingsError(
                    f"the head's port {port} cannot be listened on ({exc.strerror}): "
                    "another process holds it; choose another MISTRALRS_MN_HEAD_PORT"
                ) from None
    return port


def rank_decisions(decisions: PlatformDecisions, topology: Topology) -> PlatformDecisions:
    """``decisions`` for one of this machine's ranks: its share of the process's threads."""
    ranks = topology.local_world_size
    if ranks == 1:
        return decisions
    threads = max(1, decisions.threads // ranks)
    why = f"{decisions.threads_reason}, shared by {ranks} local ranks"
    return replace(decisions, threads=threads, threads_reason=why)


class LocalRanks:
    """The ranks this process starts beside itself on this machine."""

    def __init__(
        self,
        topology: Topology,
        port: int,
        source: dict,
        settings: BackendSettings,
        threads: int,
    ) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="spnl-ranks-"))
        first = topology.rank
        self.ranks = list(range(first + 1, first + topology.local_world_size))
        self.processes: dict[int, subprocess.Popen] = {}
        for rank in self.ranks:
            spec = self.workdir / f"rank-{rank}.json"
            spec.write_text(
                json.dumps(
                    {
                        "source": source,
                        "settings": _rank_settings(settings, topology, rank, threads),
                        "topology": asdict(topology.for_rank(rank)),
                        "port": port,
                        "threads": threads,
                    }
                )
            )
            output = (self.workdir / f"rank-{rank}.log").open("wb")
            self.processes[rank] = subprocess.Popen(
                [sys.executable, "-m", "spnl_backend.distributed.worker", str(spec)],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
            )
            output.close()
        log.info("distributed.ranks_started", ranks=self.ranks, logs=str(self.workdir))

    def describe(self) -> str:
        """Which of them exited, with how and the end of what it printed (after a moment
        for the system to report one that is exiting: a collective often fails first)."""
        deadline = time.monotonic() + _SETTLE_S
        while time.monotonic() < deadline and all(
            p.poll() is None for p in self.processes.values()
        ):
            time.sleep(0.05)
        parts = []
        for rank, process in self.processes.items():
            code = process.poll()
            if code is not None:
                parts.append(f"rank {rank} (pid {process.pid}) exited with {_exit(code)}")
                tail = self.tail(rank)
                if tail:
                    parts.append(f"its last output: {tail}")
        return "; ".join(parts) or "the other local ranks are running"

    def tail(self, rank: int) -> str:
        path = self.workdir / f"rank-{rank}.log"
        try:
            with path.open("rb") as f:
                f.seek(max(0, path.stat().st_size - _TAIL_BYTES))
                return f.read().decode(errors="replace").strip()[-_TAIL_BYTES:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop every one still running (asked first, then killed), and wait for them."""
        deadline = time.monotonic() + _STOP_WAIT_S
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for path in self.workdir.iterdir():
            path.unlink(missing_ok=True)
        self.workdir.rmdir()

    def kill(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
        self.stop()


def _rank_settings(settings: BackendSettings, topology: Topology, rank: int, threads: int) -> dict:
    """``settings`` for ``rank``: the same, its share of the threads, on its own GPU where
    there are GPUs."""
    values = settings.model_dump(mode="json", exclude_defaults=True) | {"num_threads": threads}
    if topology.dist_backend == "nccl":
        values["device"] = f"cuda:{rank % topology.local_world_size}"
    return values


def _exit(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"code {code}"
