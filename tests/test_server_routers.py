"""Serving behind sglang-router and vllm-router: the fields they add to every request they
forward, the routes they probe, and KV events in vLLM's format for KV-aware routing."""

import socket
import threading
import time

import httpx
import msgpack
import pytest
import zmq
from helpers import PROMPT
from live_server import MODEL, served_backend

from spnl_backend.engine.block_manager import BlockManager
from spnl_backend.server import kv_events
from spnl_backend.server.kv_events import END_SEQ, KvEventPublisher, KvEventsConfig


@pytest.fixture(scope="module")
def backend(tiny):
    backend = served_backend(tiny)
    yield backend
    backend.close()


# What the routers forward, as captured from sglang-router 0.3.2 and vllm-router 0.1.17
# in front of a recording server (the client sent only model, prompt/messages and
# max_tokens); vllm-router adds include_reasoning to chat.
SGLANG_COMPLETION = {
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
SGLANG_CHAT = {
    "logprobs": False,
    "stream": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
VLLM_CHAT = {**SGLANG_CHAT, "include_reasoning": True}


def _completion(live, **body) -> httpx.Response:
    return live.post("/v1/completions", {"model": MODEL, "temperature": 0, **body})


def _text(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_a_routers_completion_fields_are_taken_and_change_nothing(live):
    plain = _text(_completion(live, prompt=PROMPT, max_tokens=8))
    routed = _text(_completion(live, prompt=PROMPT, max_tokens=8, **SGLANG_COMPLETION))
    assert routed == plain


@pytest.mark.parametrize("added", [SGLANG_CHAT, VLLM_CHAT], ids=["sglang", "vllm"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_routers_chat_fields_are_taken_and_change_nothing(live, added, stream):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    body["max_completion_tokens"] = 6
    plain = live.post("/v1/chat/completions", {**body, "stream": stream})
    routed = live.post("/v1/chat/completions", {**body, **added, "stream": stream})
    assert plain.status_code == routed.status_code == 200, routed.text
    if stream:
        assert _streamed(routed.text) == _streamed(plain.text) != ""
    else:
        content = [r.json()["choices"][0]["message"]["content"] for r in (plain, routed)]
        assert content[0] == content[1]


def _streamed(sse: str) -> str:
    import json

    pieces = []
    for line in sse.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                pieces.append(choice["delta"].get("content") or "")
    return "".join(pieces)


def _a_stop(text: str) -> tuple[str, int]:
    """A one-character stop string in ``text`` after its first two characters, and where
    it first occurs."""
    for at, char in enumerate(text):
        if at >= 2 and char.isascii() and char.isalnum() and text.index(char) == at:
            return char, at
    pytest.skip(f"no usable stop character in the greedy text {text!r}")


@pytest.mark.parametrize("name", ["no_stop_trim", "include_stop_str_in_output"])
@pytest.mark.parametrize("stream", [False, True])
def test_no_stop_trim_keeps_the_stop_string(live, name, stream):
    whole = _text(_completion(live, prompt=PROMPT, max_tokens=16))
    stop, at = _a_stop(whole)
    asked = {"prompt": PROMPT, "max_tokens": 16, "stop": [stop], "stream": stream}
    trimmed = _completion(live, **asked, **{name: False})
    kept = _completion(live, **asked, **{name: True})
    if stream:
        pieces = [_streamed_text(r.text) for r in (trimmed, kept)]
    else:
        pieces = [_text(r) for r in (trimmed, kept)]
    assert pieces == [whole[:at], whole[: at + 1]]


def _streamed_text(sse: str) -> str:
    import json

    return "".join(
        json.loads(line[6:])["choices"][0]["text"]
        for line in sse.splitlines()
        if line.startswith("data: {") and json.loads(line[6:])["choices"]
    )


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("no_stop_trim", "yes", "expected true or false"),
        ("skip_special_tokens", False, "only its default"),
        ("separate_reasoning", False, "only its default"),
        ("include_reasoning", False, "only its default"),
        ("return_hidden_states", True, "only its default"),
        ("continue_final_message", True, "only its default"),
        ("no_such_field", 1, "unknown or unsupported parameter"),
    ],
)
def test_what_the_allow_list_does_not_honour_is_a_400(live, field, value, words):
    reply = _completion(live, prompt="hi", max_tokens=2, **{field: value})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field, error
    assert words in error["message"], error


def test_the_two_stop_trim_names_must_agree(live):
    reply = _completion(
        live, prompt="hi", max_tokens=2, no_stop_trim=True, include_stop_str_in_output=False
    )
    assert reply.status_code == 400
    assert "opposite" in reply.json()["error"]["message"]


# ---- the routes routers probe ----------------------------------------------------------


def test_model_server_info_and_load(live, backend):
    cache = backend.cache_info()
    for path in ("/get_model_info", "/model_info"):
        info = httpx.get(live.url + path).json()
        assert info["model_path"] == str(backend.source.path)
        assert info["served_model_name"] == MODEL
        assert info["is_generation"] is True
        assert info["max_context_length"] == backend.max_model_len
    for path in ("/get_server_info", "/server_info"):
        info = httpx.get(live.url + path).json()
        assert info["page_size"] == cache.block_size
        assert info["vllm_config"]["cache_config"]["block_size"] == cache.block_size
        assert info["vllm_config"]["model_config"]["model"] == MODEL
        assert info["kv_events"] is None
    (load,) = httpx.get(live.url + "/get_load").json()
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


def test_get_load_counts_a_running_request(live):
    done = threading.Event()

    def long_stream() -> None:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
        with httpx.stream("POST", live.url + "/v1/completions", json={**body, "stream": True}):
            done.wait(30)

    thread = threading.Thread(target=long_stream)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            (load,) = httpx.get(live.url + "/get_load").json()
            if load["num_reqs"]:
                break
            assert time.monotonic() < deadline, load
            time.sleep(0.02)
        assert load["num_reqs"] == 1
        assert load["num_tokens"] > 0
        scraped = _scraped(live)
        assert scraped["vllm:num_requests_running", (("model_name", MODEL),)] == 1
        assert scraped["vllm:kv_cache_usage_perc", (("model_name", MODEL),)] > 0
    finally:
        done.set()
        thread.join(30)


def test_tokenize_gives_the_ids_the_engine_computes(live, backend):
    reply = live.post("/tokenize", {"model": MODEL, "prompt": PROMPT})
    (ids,), _ = backend.prompt_ids([PROMPT], None)
    assert reply.json() == {
        "count": len(ids),
        "max_model_len": backend.max_model_len,
        "tokens": list(ids),
        "token_strs": None,
    }
    messages = [{"role": "user", "content": "hi"}]
    # vllm-router's body for a chat request
    body = {"model": MODEL, "continue_final_message": False, "messages": messages}
    reply = live.post("/tokenize", body)
    assert reply.json()["tokens"] == list(backend.chat_prompt_ids(messages, None, None))
    refused = live.post("/tokenize", {**body, "add_generation_prompt": False})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "add_generation_prompt"


def test_flush_cache_forgets_the_prefix_cache(live, backend):
    _text(_completion(live, prompt=PROMPT * 4, max_tokens=2))
    assert backend.stats().pool.cached > 0
    reply = httpx.post(live.url + "/flush_cache")
    assert reply.status_code == 200
    assert reply.json()["forgotten"] > 0
    assert backend.stats().pool.cached == 0


def _scraped(live) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(live.url + "/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_load_is_on_metrics_under_vllms_names(live, backend):
    _text(_completion(live, prompt=PROMPT * 2, max_tokens=2))
    _text(_completion(live, prompt=PROMPT * 2, max_tokens=2))  # a prefix hit
    scraped = _scraped(live)
    named = (("model_name", MODEL),)
    stats = backend.stats()
    assert scraped["vllm:num_requests_running", named] == 0
    assert scraped["vllm:num_requests_waiting", named] == 0
    assert scraped["vllm:kv_cache_usage_perc", named] == 0
    hits = scraped["vllm:prefix_cache_hits_total", named]
    assert hits == stats.prefix_cache_hits == scraped["spnl_prefix_cache_hits_total", ()] > 0
    assert scraped["vllm:prefix_cache_queries_total", named] == stats.prefix_cache_queries
    ttft = scraped["vllm:time_to_first_token_seconds_count", named]
    assert ttft == scraped["spnl_time_to_first_token_seconds_count", ()] >= 2


def test_health_generate_generates(live):
    reply = httpx.get(live.url + "/health_generate", timeout=60)
    assert reply.status_code == 200
    assert reply.json() == {"status": "ok", "generated": 1}


# ---- KV events ---------------------------------------------------------------------------


CLEARED = {"type": "AllBlocksCleared"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Subscriber:
    """A ZMQ SUB socket on the publisher's endpoint, decoding vLLM's frames."""

    def __init__(self, port: int, topic: str = "") -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.topic = topic.encode()

    def batches(self, timeout_s: float = 0.5) -> list[tuple[int, list]]:
        got = []
        while self.sub.poll(int(timeout_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic
            ts, events, rank = msgpack.unpackb(payload)  # vLLM's EventBatch, as an array
            assert isinstance(ts, float)
            assert abs(ts - time.time()) < 60
            assert rank == 0
            got.append((int.from_bytes(seq, "big"), events))
        return got

    def close(self) -> None:
        self.context.destroy(linger=0)


def _joined(sub: _Subscriber, publisher: KvEventPublisher) -> list[tuple[int, list]]:
    """Announce clears until the subscriber hears one (a PUB drops what it sends before a
    subscription arrives); the batches heard."""
    deadline = time.monotonic() + 10
    while True:
        publisher.cleared()
        heard = sub.batches(0.2)
        if heard:
            return heard
        assert time.monotonic() < deadline, "the subscriber never joined"


def _events(batches: list[tuple[int, list]]) -> list[list]:
    return [event for _, events in batches for event in events]


def _registered(backend) -> dict[int, tuple[int, ...]]:
    def read(engine):
        return {b.hash: b.token_ids for b in engine.cache.blocks.blocks if b.hash is not None}

    return backend._open_loop().call(read)


def test_stored_and_cleared_events_match_the_pool(backend):
    port = _free_port()
    publisher = KvEventPublisher(KvEventsConfig(f"tcp://*:{port}", topic="kv"), 32)
    sub = _Subscriber(port, "kv")
    try:
        assert backend.watch_blocks(publisher) == backend.cache_info().block_size == 32
        backend.reset_prefix_cache()
        heard = _joined(sub, publisher)
        backend.generate(PROMPT * 4, max_tokens=2, temperature=0)
        heard += sub.batches()
        seqs = [seq for seq, _ in heard]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # numbered without gaps
        events = _events(heard)
        assert CLEARED in events
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert len(stored) == 1  # the prompt's chain, in one event as vLLM sends it
        hashes, tokens = stored[0]["block_hashes"], stored[0]["token_ids"]
        assert stored[0] == {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": tokens,
            "block_size": 32,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        pool = _registered(backend)
        assert set(hashes) == set(pool)  # every block registered, and no other
        assert tokens == [t for h in hashes for t in pool[h]]
        assert len(tokens) == 32 * len(hashes)
        assert len(hashes) >= 2
        assert backend.reset_prefix_cache() == len(hashes)
        assert _events(sub.batches()) == [CLEARED]
    finally:
        backend.watch_blocks(None)
        publisher.close()
        sub.close()


def test_evictions_are_removed_events_and_a_late_joiner_replays(monkeypatch):
    port, replay_port = _free_port(), _free_port()
    config = KvEventsConfig(f"tcp://*:{port}", f"tcp://*:{replay_port}")
    publisher = KvEventPublisher(config, 2)
    sub = _Subscriber(port)
    blocks = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    blocks.events = publisher
    try:
        _joined(sub, publisher)
        first = _fill(blocks, [1, 2, 3, 4])  # two blocks, chained
        heard = sub.batches()
        _fill(blocks, [9, 8, 7, 6])  # needs both of the first's: it evicts them
        heard += sub.batches()
        events = _events(heard)
        stored = next(e for e in events if e["type"] == "BlockStored")
        assert stored["block_hashes"] == first
        assert stored["parent_block_hash"] is None
        assert stored["token_ids"] == [1, 2, 3, 4]
        removals = [e for e in events if e["type"] == "BlockRemoved"]
        assert sorted(h for e in removals for h in e["block_hashes"]) == sorted(first)
        assert all(e["medium"] == "GPU" for e in removals)
        # a router that joins now asks the replay socket for everything from batch 0
        late = zmq.Context().socket(zmq.DEALER)
        late.connect(f"tcp://127.0.0.1:{replay_port}")
        late.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert late.poll(5000)
            _, seq, payload = late.recv_multipart()
            if seq == END_SEQ:
                break
            replayed.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]))
        late.close(linger=0)
        live_seqs = [seq for seq, _ in heard]
        assert [seq for seq, _ in replayed][-len(live_seqs) :] == live_seqs
        assert _events(replayed)[-len(events) :] == events
    finally:
        publisher.close()
        sub.close()


def _fill(blocks: BlockManager, tokens: list[int]) -> list[int]:
    """A sequence of ``tokens`` computed, registered and let go; its block hashes."""
    from spnl_backend.engine.block_manager import BlockTable

    table = BlockTable()
    table.block_ids.extend(blocks.take() for _ in range(blocks.blocks_for(len(tokens))))
    blocks.register_full_blocks(table, tokens, len(tokens))
    hashes = list(table.hashes)
    blocks.release(table)
    return hashes


def test_a_full_queue_drops_events_and_never_blocks_the_engine(monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_QUEUED", 4)
    stuck = threading.Event()
    monkeypatch.setattr(KvEventPublisher, "_send", lambda self, events: stuck.wait(10))
    publisher = KvEventPublisher(KvEventsConfig(f"tcp://*:{_free_port()}"), 16)
    try:
        started = time.monotonic()
        for digest in range(100):
            publisher.removed(digest)
        assert time.monotonic() - started < 1.0
        # one batch taken by the stuck thread (up to MAX_BATCH events), four queued
        assert 100 - 4 - kv_events.MAX_BATCH <= publisher.dropped <= 100 - 4
        assert publisher.dropped >= 90
    finally:
        stuck.set()
        publisher.close()


def test_pic_blocks_are_announced_without_a_parent_and_tagged():
    port = _free_port()
    publisher = KvEventPublisher(KvEventsConfig(f"tcp://*:{port}"), 2)
    sub = _Subscriber(port)
    blocks = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    blocks.events = publisher
    try:
        _joined(sub, publisher)
        a, b = blocks.take(), blocks.take()
        blocks.register(a, 111, (5, 6), position=40)
        blocks.register(b, 222, (7, 8), position=42, parent=111)
        stored = [e for e in _events(sub.batches()) if e["type"] == "BlockStored"]
        keys = ("block_hashes", "parent_block_hash", "token_ids", "extra_keys")
        assert [tuple(e[k] for k in keys) for e in stored] == [
            ([111], None, [5, 6], [["spnl-pic"]]),
            ([222], 111, [7, 8], [["spnl-pic"]]),
        ]
    finally:
        publisher.close()
        sub.close()


def test_kv_events_settings_are_checked_before_anything_starts():
    from spnl_backend.errors import SettingsError
    from spnl_backend.server.run import _events_config

    assert _events_config(None, None, "", None) is None
    with pytest.raises(SettingsError, match="give both"):
        _events_config(None, "tcp://*:5558", "", None)
    with pytest.raises(SettingsError, match="expected a ZMQ address"):
        _events_config("localhost:5557", None, "", None)
    config = _events_config("tcp://*:5557", "tcp://*:5558", "kv", None)
    assert config == KvEventsConfig("tcp://*:5557", "tcp://*:5558", "kv")


def test_without_pyzmq_the_setting_says_what_to_install(monkeypatch):
    import builtins

    from spnl_backend.errors import SettingsError

    real = builtins.__import__

    def no_zmq(name, *args, **kw):
        if name == "zmq":
            raise ImportError("No module named 'zmq'", name="zmq")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_zmq)
    wanted = r"pyzmq and msgpack \(zmq is not installed\).*kv-events"
    with pytest.raises(SettingsError, match=wanted):
        kv_events.check_kv_events_installed()


# ---- KV tier events ----------------------------------------------------------------------


def _split(stored: dict) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """A BlockStored chain as each block's (parent, tokens), keyed by its hash."""
    size, hashes = stored["block_size"], stored["block_hashes"]
    parents = [stored["parent_block_hash"], *hashes[:-1]]
    tokens = stored["token_ids"]
    return {
        digest: (parent, tuple(tokens[i * size : (i + 1) * size]))
        for i, (digest, parent) in enumerate(zip(hashes, parents, strict=True))
    }


def _stored_on(events: list, medium: str) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    found: dict[int, tuple[int | None, tuple[int, ...]]] = {}
    for event in events:
        if event["type"] == "BlockStored" and event["medium"] == medium:
            found |= _split(event)
    return found


def test_tier_writes_are_disk_blocks_and_promotions_pool_blocks(tiny, tmp_path):
    from helpers import engine_internals

    from spnl_backend import BackendSettings, load_backend

    settings = BackendSettings(device="cpu", paged_attn_block_size=16, kv_tier_dir=str(tmp_path))
    backend = load_backend(str(tiny.hf("llama").path), settings=settings)
    port = _free_port()
    publisher = KvEventPublisher(KvEventsConfig(f"tcp://*:{port}"), 16)
    sub = _Subscriber(port)
    tier = engine_internals(backend).cache.tier.tier
    try:
        backend.watch_blocks(publisher)
        _joined(sub, publisher)
        backend.generate(PROMPT * 3, max_tokens=2, temperature=0)
        backend._open_loop().call(lambda engine: tier.flush())
        events = _events(sub.batches())
        pool, disk = _stored_on(events, "GPU"), _stored_on(events, "DISK")
        assert len(pool) >= 3
        assert disk == pool  # every pool block written, announced with its parent and tokens
        assert set(disk) == tier.written
        # a reset forgets the pool; the next request promotes the tier's blocks into it
        backend.reset_prefix_cache()
        backend.generate(PROMPT * 3, max_tokens=2, temperature=0)
        events = _events(sub.batches())
        assert events[0] == CLEARED
        promoted = _stored_on(events, "GPU")
        assert backend.stats().tier.hits >= len(pool) - 1
        assert set(pool) <= set(promoted)  # back in the pool, with the chain they had
        assert all(promoted[digest] == pool[digest] for digest in pool)
        assert _stored_on(events, "DISK") == {}  # already on disk: not written again
    finally:
        backend.watch_blocks(None)
        backend.close()
        publisher.close()
        sub.close()


def test_tier_evictions_are_removed_from_disk():
    import tempfile
    from pathlib import Path

    import torch

    from spnl_backend.engine.kv_tier import KvTier, TierEntry

    port = _free_port()
    publisher = KvEventPublisher(KvEventsConfig(f"tcp://*:{port}"), 1)
    sub = _Subscriber(port)
    with tempfile.TemporaryDirectory() as directory:
        tier = KvTier(Path(directory), 3500, bytes(32))  # room for three entries of ~1 KB
        tier.events = publisher
        try:
            _joined(sub, publisher)
            for key in range(1, 6):
                payload = torch.full((1000,), key, dtype=torch.uint8)
                tier.offer(TierEntry(key, (key,), None, payload, parent=key - 1 or None))
                tier.flush()
                time.sleep(0.01)  # distinct modification times: the oldest go first
            events = _events(sub.batches())
        finally:
            tier.close()
            publisher.close()
            sub.close()
    assert tier.stats().evictions == 2
    stored = _stored_on(events, "DISK")
    assert stored == {key: (key - 1 or None, (key,)) for key in range(1, 6)}
    removed = [e for e in events if e["type"] == "BlockRemoved"]
    assert [h for e in removed for h in e["block_hashes"]] == [1, 2]  # the oldest two
    assert all(e["medium"] == "DISK" for e in events if e["type"] != "AllBlocksCleared")
