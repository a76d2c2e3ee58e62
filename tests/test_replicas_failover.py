"""Replicas behind the real vllm-router, one killed mid-run: the requests it was serving
end with an error (never a hang), later requests are answered by the survivor."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

MODEL = "tiny-llama"
STARTUP_S = 60  # a replica's or the router's start, on a loaded machine
ENDED_S = 15  # how long a stream cut by the kill may take to end at the client

pytestmark = pytest.mark.slow


def _router_binary() -> str:
    """vllm-router's launcher: SPNL_VLLM_ROUTER, else beside this Python, else on PATH."""
    named = os.environ.get("SPNL_VLLM_ROUTER")
    if named:
        return named
    beside = Path(sys.executable).parent / "vllm-router"
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router; a dev dependency)")
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{url} exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{url} not ready in {STARTUP_S} s: {log.read_text()[-2000:]}")


class _Fleet:
    """Replicas of the tiny model (separate processes) and vllm-router in front of them."""

    def __init__(self, model: Path, logs: Path, replicas: int) -> None:
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = []
        env = {**os.environ, "MISTRALRS_DEVICE": "cpu", "MISTRALRS_NUM_THREADS": "1"}
        for i in range(replicas):
            port = _free_port()
            argv = [sys.executable, "-m", "spnl_backend.cli", "serve", "--model", str(model)]
            argv += ["--port", str(port), "--served-model-name", MODEL, "--grace", "1"]
            self._start(argv, logs / f"replica{i}.log", env)
            self.urls.append(f"http://127.0.0.1:{port}")
        for url, process in zip(self.urls, self.processes, strict=True):
            _wait_ready(url, process, logs / f"replica{self.urls.index(url)}.log")
        port = _free_port()
        argv = [_router_binary(), "--worker-urls", *self.urls, "--policy", "round_robin"]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        # dead workers found within a second or two; one request never retried on another
        # replica mid-stream (the router cannot), a refused connect may be
        argv += ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
        argv += ["--health-check-timeout-secs", "1", "--request-timeout-secs", "30"]
        self.router = self._start(argv, logs / "router.log", dict(os.environ))
        self.url = f"http://127.0.0.1:{port}"
        _wait_ready(self.url, self.router, logs / "router.log")

    def _start(self, argv: list[str], log: Path, env: dict) -> subprocess.Popen:
        with log.open("wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.processes.append(process)
        return process

    def running(self, url: str) -> int:
        (load,) = httpx.get(url + "/get_load", timeout=5).json()
        return load["num_reqs"]

    def answered(self, url: str) -> float:
        """Completions the replica has answered (its TTFT histogram's count)."""
        text = httpx.get(url + "/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith("spnl_time_to_first_token_seconds_count"):
                return float(line.split()[-1])
        raise AssertionError(f"no TTFT count on {url}/metrics")

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait(10)


@pytest.fixture
def fleet(tiny, tmp_path):
    fleet = _Fleet(tiny.hf("llama").path, tmp_path, replicas=2)
    yield fleet
    fleet.close()


def _complete(url: str, prompt: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


def test_a_killed_replicas_stream_fails_and_the_survivor_answers_the_rest(fleet):
    outcome: dict[str, object] = {}
    first_chunk = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "a long one", "max_tokens": 3000, "stream": True}
        body |= {"ignore_eos": True, "temperature": 0}
        started = time.monotonic()
        finishes, done = [], False
        try:
            with httpx.stream(
                "POST", fleet.url + "/v1/completions", json=body, timeout=ENDED_S
            ) as reply:
                outcome["status"] = reply.status_code
                for line in reply.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        first_chunk.set()
                        choices = json.loads(line[6:])["choices"]
                        finishes += [c["finish_reason"] for c in choices if c["finish_reason"]]
        except httpx.HTTPError as exc:  # the connection cut: the clean failure wanted
            outcome["error"] = type(exc).__name__
        outcome.update(seconds=time.monotonic() - started, finishes=finishes, done=done)
        first_chunk.set()

    client = threading.Thread(target=stream)
    client.start()
    assert first_chunk.wait(30), "the stream never started"
    serving = [url for url in fleet.urls if fleet.running(url)]
    assert len(serving) == 1, "the stream runs on exactly one replica"
    (doomed,) = serving
    survivor = next(url for url in fleet.urls if url != doomed)
    victim = fleet.processes[fleet.urls.index(doomed)]
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    client.join(ENDED_S + 5)
    assert not client.is_alive(), "the cut stream hung"
    assert time.monotonic() - killed_at < ENDED_S + 5
    # it ended without a normal finish: an error, or a stream closed without [DONE]
    assert outcome["finishes"] == [], outcome
    assert outcome["done"] is False, outcome
    assert "status" in outcome, outcome  # the stream had begun before the kill
    # later requests: every one answered, by the survivor
    before = fleet.answered(survivor)
    replies = [_complete(fleet.url, f"question {i}") for i in range(6)]
    assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
    assert all(r.json()["choices"][0]["text"] for r in replies)
    assert fleet.answered(survivor) - before == 6
    assert fleet.running(survivor) == 0
