"""Two replicas behind the real routers from PyPI: through sglang-router and vllm-router
(`cache_aware`) every answer equals the replica's own, token for token; vllm-router's
`kv_aware`, fed by the replicas' KV events, sends a repeated long prefix to the replica
that holds it. One fleet for the module; the routers are started once each."""

import json
import re
import time

import httpx
import msgpack
import pytest
import zmq
from live_server import TEMPLATE
from replica_fleet import (
    MODEL,
    STARTUP_S,
    Fleet,
    Router,
    sglang_router_command,
    vllm_router_binary,
)

from spnl_backend.server.kv_events import END_SEQ

pytestmark = pytest.mark.slow

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def fleet(tiny, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fleet")
    fleet = Fleet(tiny.hf("llama").path, logs, 2, kv_events=True, chat_template=TEMPLATE)
    yield fleet
    fleet.close()


def _started(fleet: Fleet, router: Router) -> Router:
    fleet.wait_router(router)
    return router


@pytest.fixture(scope="module")
def sglang_cache_aware(fleet) -> Router:
    args = ("--policy", "cache_aware", "--log-level", "warn")
    return _started(fleet, fleet.start_router(sglang_router_command(), "sglang", *args))


@pytest.fixture(scope="module")
def vllm_cache_aware(fleet) -> Router:
    args = ("--policy", "cache_aware", "--log-level", "warning")
    return _started(fleet, fleet.start_router([vllm_router_binary()], "vllm-cache", *args))


@pytest.fixture(scope="module")
def vllm_kv_aware(fleet, tiny) -> Router:
    """kv_aware over the replicas' KV events (and their replay). Its debug log says which
    event batch it has applied, which the test waits for."""
    args = ["--policy", "kv_aware", "--log-level", "debug"]
    for url, events, replay in zip(fleet.urls, fleet.events, fleet.replays, strict=True):
        args += ["--kv-event-source", f"{url}={events}"]
        args += ["--kv-event-replay-source", f"{url}={replay}"]
    info = httpx.get(fleet.urls[0] + "/get_server_info", timeout=10).json()
    args += ["--kv-event-block-size", str(info["page_size"])]
    args += ["--kv-event-model", str(tiny.hf("llama").path)]
    return _started(fleet, fleet.start_router([vllm_router_binary()], "vllm-kv", *args))


# ---- routed answers equal the replica's own ----


def _body(endpoint: str, stream: bool) -> dict:
    """A greedy request that asks for each token (logprobs), distinct per case so that no
    answer is a prefix-cache replay of another case's."""
    text = f"Tell me about {endpoint}, {'streamed' if stream else 'whole'}."
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        return body | {"messages": [{"role": "user", "content": text}], "logprobs": True}
    return body | {"prompt": text, "logprobs": 1}


def _answer(url: str, endpoint: str, stream: bool) -> dict:
    """The answer's text, its tokens, why it finished and the token counts."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    reply = httpx.post(url + path, json=_body(endpoint, stream), timeout=120)
    assert reply.status_code == 200, reply.text
    if stream:
        assert reply.text.rstrip().endswith("data: [DONE]"), reply.text[-500:]
        chunks = [
            json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")
        ]
    else:
        chunks = [reply.json()]
    text, tokens, finishes, usage = "", [], [], None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            if endpoint == "chat":
                part = choice["delta"] if stream else choice["message"]
                text += part.get("content") or ""
                logprobs = choice["logprobs"]
                tokens += [t["bytes"] for t in logprobs["content"]] if logprobs else []
            else:
                text += choice["text"]
                tokens += choice["logprobs"]["tokens"] if choice["logprobs"] else []
            finishes += [choice["finish_reason"]] if choice["finish_reason"] else []
    assert usage is not None, chunks
    counts = (usage["prompt_tokens"], usage["completion_tokens"])
    return {"text": text, "tokens": tokens, "finishes": finishes, "counts": counts}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("router", ["sglang_cache_aware", "vllm_cache_aware"])
def test_a_routed_answer_equals_the_replicas_own(request, fleet, router, endpoint, stream):
    routed = request.getfixturevalue(router)
    direct = _answer(fleet.urls[0], endpoint, stream)
    assert len(direct["tokens"]) == direct["counts"][1] > 0, direct
    assert direct["text"], direct
    assert direct["finishes"] in (["length"], ["stop"]), direct
    assert _answer(routed.url, endpoint, stream) == direct


# ---- kv_aware: a repeated prefix goes where it is cached ----


def _tokens(url: str, prompt: str) -> list[int]:
    reply = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def _complete(url: str, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]


def _announced_in(replay: str, prompt_ids: list[int], block_size: int) -> int:
    """The last sequence number of the batches in which the replica announced the prompt's
    full blocks, asked of its replay endpoint until all of them are there (the replica
    publishes from a thread of its own, which may send them after the reply)."""
    wanted = {
        tuple(prompt_ids[at : at + block_size])
        for at in range(0, len(prompt_ids) - block_size + 1, block_size)
    }
    deadline = time.monotonic() + STARTUP_S
    with zmq.Context() as context:
        while time.monotonic() < deadline:
            seen = {}
            dealer = context.socket(zmq.DEALER)
            dealer.connect(replay)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                assert dealer.poll(STARTUP_S * 1000), f"no answer from {replay}"
                _, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    break
                for event in msgpack.unpackb(payload)[1]:
                    if event["type"] != "BlockStored":
                        continue
                    stored = event["token_ids"]  # a chain of blocks: all their tokens
                    for at in range(0, len(stored), block_size):
                        block = tuple(stored[at : at + block_size])
                        if block in wanted:
                            seen[block] = int.from_bytes(seq, "big")
            dealer.close(linger=0)
            if len(seen) == len(wanted):
                return max(seen.values())
            time.sleep(0.2)
    pytest.fail(f"{replay} announced {len(seen)} of the prompt's {len(wanted)} blocks")


def _wait_applied(router: Router, worker: str, seq: int) -> None:
    """Wait until the router's log says it has applied ``worker``'s event batch ``seq``
    (vllm-router logs each live batch it applies, at debug level)."""
    applied = re.compile(
        rf"kv_index live sequence advanced source={re.escape(worker)} rank=\d+ seq=(\d+)"
    )
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if any(int(s) >= seq for s in applied.findall(router.log_text())):
            return
        assert router.process.poll() is None, router.log_text()[-2000:]
        time.sleep(0.2)
    pytest.fail(f"the router never applied {worker}'s batch {seq}: {router.log_text()[-2000:]}")


def _counters(fleet: Fleet) -> list[tuple[float, float]]:
    """Each replica's prompt tokens looked up in and found in its prefix cache."""
    names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    return [tuple(fleet.metric(url, name) for name in names) for url in fleet.urls]


def test_kv_aware_sends_a_repeated_long_prefix_to_the_replica_holding_it(fleet, vllm_kv_aware):
    block_size = httpx.get(fleet.urls[0] + "/get_server_info", timeout=10).json()["page_size"]
    # a prefix of several blocks, its own on each replica, put there directly (the router
    # never saw it: only the replicas' events can tell it where each one is)
    prefixes = [" ".join(f"r{i}w{n}" for n in range(50)) for i in range(len(fleet.urls))]
    for url, replay, prefix in zip(fleet.urls, fleet.replays, prefixes, strict=True):
        seed = prefix + " and the first question"
        assert len(_tokens(url, seed)) >= 6 * block_size
        _complete(url, seed)
        _wait_applied(vllm_kv_aware, url, _announced_in(replay, _tokens(url, seed), block_size))
    # an order that neither a fixed choice nor taking turns would give
    for n, holder in enumerate([1, 1, 0, 0]):
        prompt = f"{prefixes[holder]} and question {n}"
        shared = len(_tokens(fleet.urls[holder], prefixes[holder] + " and "))
        before = _counters(fleet)
        usage = _complete(vllm_kv_aware.url, prompt)
        after = _counters(fleet)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= shared // block_size * block_size, (n, usage)
        queries, hits = (a - b for a, b in zip(after[holder], before[holder], strict=True))
        assert (queries, hits) == (usage["prompt_tokens"], cached), (n, before, after)
        others = [i for i in range(len(fleet.urls)) if i != holder]
        assert [after[i] for i in others] == [before[i] for i in others], (n, before, after)
