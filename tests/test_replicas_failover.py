"""Replicas behind the real vllm-router, one killed mid-run: the requests it was serving
end with an error (never a hang), later requests are answered by the survivor."""

import json
import os
import signal
import threading
import time

import httpx
import pytest
from replica_fleet import MODEL, Fleet, Router, vllm_router_binary

ENDED_S = 15  # how long a stream cut by the kill may take to end at the client

pytestmark = pytest.mark.slow


@pytest.fixture
def fleet(tiny, tmp_path):
    fleet = Fleet(tiny.hf("llama").path, tmp_path, replicas=2)
    yield fleet
    fleet.close()


@pytest.fixture
def router(fleet) -> Router:
    """vllm-router in front of the fleet, round robin."""
    # dead workers found within a second or two; one request never retried on another
    # replica mid-stream (the router cannot), a refused connect may be
    router = fleet.start_router(
        [vllm_router_binary()],
        "router",
        *("--policy", "round_robin", "--log-level", "warning"),
        *("--health-check-interval-secs", "1", "--health-failure-threshold", "1"),
        *("--health-check-timeout-secs", "1", "--request-timeout-secs", "30"),
    )
    fleet.wait_router(router)
    return router


def _complete(url: str, prompt: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


def test_a_killed_replicas_stream_fails_and_the_survivor_answers_the_rest(fleet, router):
    outcome: dict[str, object] = {}
    first_chunk = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "a long one", "max_tokens": 3000, "stream": True}
        body |= {"ignore_eos": True, "temperature": 0}
        started = time.monotonic()
        finishes, done = [], False
        try:
            with httpx.stream(
                "POST", router.url + "/v1/completions", json=body, timeout=ENDED_S
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
    replies = [_complete(router.url, f"question {i}") for i in range(6)]
    assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
    assert all(r.json()["choices"][0]["text"] for r in replies)
    assert fleet.answered(survivor) - before == 6
    assert fleet.running(survivor) == 0
