"""``spnl-backend serve`` as a user runs it: a process that listens before the model
loads, says so on /health, and stops on SIGTERM with its requests finished or aborted,
exit status 0."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(model_path, *args: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "MISTRALRS_DEVICE": "cpu"}
    command = [sys.executable, "-m", "spnl_backend.cli", "serve", "--port", str(port)]
    child = subprocess.Popen(
        [*command, "--model", str(model_path), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return child, f"http://127.0.0.1:{port}"


def _wait_ready(child, url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert child.poll() is None, child.communicate()[1][-2000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not become ready")


@pytest.fixture
def model(tiny):
    return tiny.hf("llama").path


def test_sigterm_lets_running_requests_finish_then_exits_0(model):
    child, url = _start(model, "--grace", "30")
    try:
        _wait_ready(child, url)
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        assert name == model.name
        body = {
            "model": name,
            "prompt": "Once upon",
            "max_tokens": 400,
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data:")
            child.send_signal(signal.SIGTERM)
            events = [line for line in lines if line.startswith("data:")]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] in ("length", "stop")
        assert child.wait(60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        child.kill()


def test_after_the_grace_period_what_is_left_is_aborted_with_an_error(model):
    child, url = _start(model, "--grace", "1")
    try:
        _wait_ready(child, url)
        prompts = ["Once"] * 64  # 64 x 400 tokens: far more than a second's work
        body = {"model": model.name, "prompt": prompts, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data:")
            child.send_signal(signal.SIGTERM)
            assert child.wait(120) == 0  # the grace (1 s), then what is left is aborted
            events = [line for line in lines if line.startswith("data:")]
        last = json.loads(events[-1].removeprefix("data: "))
        assert last["error"]["code"] == "aborted", events[-3:]
        err = child.communicate()[1]
        assert "Traceback" not in err, err[-3000:]
        assert "server.grace_expired" in err, err[-3000:]
    finally:
        child.kill()


def test_a_port_in_use_is_a_clear_error(model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "spnl_backend.cli",
                "serve",
                "--port",
                str(port),
                "--model",
                str(model),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


def test_start_up_and_stop_are_info_events_shown_by_default(model):
    child, url = _start(model)
    try:
        _wait_ready(child, url)
        child.send_signal(signal.SIGTERM)
        assert child.wait(60) == 0
        err = child.communicate()[1]
    finally:
        child.kill()
    for event in ("server.listening", "server.ready", "server.stopped"):
        (line,) = [line for line in err.splitlines() if f"] {event}" in line]
        assert line.startswith("[info"), err
    assert "[warning" not in err, err
