"""Replicas of the tiny model as separate `spnl-backend serve` processes, and the real
routers from PyPI (vllm-router, sglang-router) started in front of them, for the tests
that run a fleet (tests/test_replicas_*.py). The routers are development dependencies;
a test skips where one is not installed (they ship for Linux on x86-64 only)."""

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

MODEL = "tiny-llama"
# a replica's or a router's start, and a KV event's way to a router: generous, for a
# loaded machine (a replica takes some 35 s to start on two busy cores)
STARTUP_S = 180


def vllm_router_binary() -> str:
    """vllm-router's launcher: SPNL_VLLM_ROUTER, else beside this Python, else on PATH."""
    named = os.environ.get("SPNL_VLLM_ROUTER")
    if named:
        return named
    beside = Path(sys.executable).parent / "vllm-router"
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router; a dev dependency)")
    return found


def sglang_router_command() -> list[str]:
    """sglang-router's launcher, run by this Python."""
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed (pip install sglang-router; a dev dependency)")
    return [sys.executable, "-m", "sglang_router.launch_router"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, log: Path) -> None:
    """Wait for ``url``'s /health to answer 200; fail with the log's tail if the process
    exits or the time runs out."""
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{url} exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{url} not ready in {STARTUP_S} s: {log.read_text()[-2000:]}")


@dataclass(frozen=True)
class Router:
    url: str
    process: subprocess.Popen
    log: Path

    def log_text(self) -> str:
        """The router's log, terminal colours taken out."""
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))


class Fleet:
    """``replicas`` replicas of ``model``, each its own process with one thread.

    ``kv_events``: each replica publishes its KV events (`serve --kv-events`) and
    serves their replay; ``events[i]`` and ``replays[i]`` are replica i's endpoints."""

    def __init__(
        self,
        model: Path,
        logs: Path,
        replicas: int,
        *,
        kv_events: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.logs = logs
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.events: list[str] = []
        self.replays: list[str] = []
        try:
            self._start_replicas(model, replicas, kv_events, chat_template)
        except BaseException:  # a replica that failed to start: the others end here
            self.close()
            raise

    def _start_replicas(
        self, model: Path, replicas: int, kv_events: bool, chat_template: str | None
    ) -> None:
        env = {**os.environ, "MISTRALRS_DEVICE": "cpu", "MISTRALRS_NUM_THREADS": "1"}
        for i in range(replicas):
            port = free_port()
            argv = [sys.executable, "-m", "spnl_backend.cli", "serve", "--model", str(model)]
            argv += ["--port", str(port), "--served-model-name", MODEL, "--grace", "1"]
            if kv_events:
                events, replay = free_port(), free_port()
                argv += ["--kv-events", f"tcp://*:{events}", "--kv-events-replay"]
                argv += [f"tcp://*:{replay}"]
                self.events.append(f"tcp://127.0.0.1:{events}")
                self.replays.append(f"tcp://127.0.0.1:{replay}")
            if chat_template is not None:
                argv += ["--chat-template", chat_template]
            self._start(argv, self.logs / f"replica{i}.log", env)
            self.urls.append(f"http://127.0.0.1:{port}")
        for i, (url, process) in enumerate(zip(self.urls, self.processes, strict=True)):
            wait_ready(url, process, self.logs / f"replica{i}.log")

    def start_router(self, command: list[str], name: str, *args: str) -> Router:
        """A router (``command``: its launcher) in front of every replica, on its own port
        and metrics port; wait for it with `wait_router`."""
        port = free_port()
        argv = [*command, "--worker-urls", *self.urls, "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--prometheus-host", "127.0.0.1"]
        argv += ["--prometheus-port", str(free_port()), *args]
        log = self.logs / f"{name}.log"
        return Router(f"http://127.0.0.1:{port}", self._start(argv, log, dict(os.environ)), log)

    @staticmethod
    def wait_router(router: Router) -> None:
        wait_ready(router.url, router.process, router.log)

    def _start(self, argv: list[str], log: Path, env: dict) -> subprocess.Popen:
        with log.open("wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.processes.append(process)
        return process

    def running(self, url: str) -> int:
        (load,) = httpx.get(url + "/get_load", timeout=10).json()
        return load["num_reqs"]

    def metric(self, url: str, name: str) -> float:
        """The value of the sample ``name`` (with its labels, if any) on ``url``/metrics."""
        text = httpx.get(url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.split()[-1])
        raise AssertionError(f"no {name} on {url}/metrics")

    def answered(self, url: str) -> float:
        """Completions the replica has answered (its TTFT histogram's count)."""
        return self.metric(url, "spnl_time_to_first_token_seconds_count")

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait(30)
