"""KV events in vLLM's wire format, so that KV-aware routers (vllm-router's ``kv_aware``,
llm-d's precise prefix scorer, Dynamo's KV router) see which blocks this replica holds.

The block manager tells a `KvEventPublisher` (on the engine's thread) of each block it
registers, evicts or clears at once; the publisher only queues the event (a bounded
queue: when it is full the event is dropped and counted, the engine never waits). Its own
thread batches what is queued and sends each batch on a ZMQ PUB socket as three frames:
the topic, an 8-byte big-endian sequence number (0, 1, ...) and the msgpack batch. The
last batches are kept for a ROUTER replay socket: a subscriber that joined late sends
``[b"", start_seq (8 bytes, big-endian)]`` and gets ``[b"", seq, batch]`` for each kept
batch from there, then ``[b"", -1 (8 bytes, signed), b""]``.

The msgpack shapes are vLLM's (`vllm/distributed/kv_events.py`: msgspec structs, the
batch an array, each event a map tagged by its class name under ``type``; defaults left
out), as vllm-router decodes them::

    batch        [ts (float seconds), [event, ...], data_parallel_rank (0)]
    BlockStored  {type: "BlockStored", block_hashes, parent_block_hash, token_ids,
                  block_size, lora_id: None, medium, lora_name: None(, extra_keys)}
    BlockRemoved {type: "BlockRemoved", block_hashes, medium}
    AllBlocksCleared {type: "AllBlocksCleared"}

(Earlier vLLM releases sent each event as an array of the same fields in this order;
vllm-router 0.1.17 refuses those, and a batch sent as a map.)

Hashes are the prefix cache's own 64-bit keys (unsigned): a block's key chains its
parent's, so a consumer that indexes the chain of (parent, tokens) the events announce
finds the replica holding a prompt's longest cached prefix. ``medium`` is ``"GPU"`` for
the block pool whatever its device (vLLM's name for the tier a request reads directly)
and ``"DISK"`` for the KV tier (`engine.kv_tier`): each entry the tier writes is a
BlockStored on ``"DISK"`` (its parent and tokens as the pool announced them), each entry
it removes a BlockRemoved from ``"DISK"``, and a block read back from it into the pool a
BlockStored on ``"GPU"``, as any registration.
A PIC block (`engine.pic_blocks`) is announced with no parent (its key ignores what came
before its span) and ``extra_keys`` ``[["spnl-pic"]]``: a consumer that hashes
extra keys with the tokens never mistakes it for a plain prefix, and one that knows the
tag can route a span query to the replica holding its documents.
"""

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import count
from typing import Any

from ..engine.block_manager import POOL, TIER
from ..errors import SettingsError
from ..log import get_logger

log = get_logger()

# vLLM's medium names: "GPU" for the blocks requests read directly (vLLM's own pool),
# "CPU" for its host-memory offload; vllm-router also reads "DISK" (its disk tier, credited
# less than the pool). spnl's KV tier is a directory on disk.
MEDIUMS = {POOL: "GPU", TIER: "DISK"}
PIC_TAG = "spnl-pic"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_QUEUED = 100_000  # events waiting for the publisher thread
REPLAY_BATCHES = 10_000  # batches kept for the replay socket
MAX_BATCH = 1024  # events sent in one batch at most
POLL_S = 0.05


@dataclass(frozen=True)
class KvEventsConfig:
    endpoint: str  # PUB address: bound when it has a ``*``, ``::``, ipc:// or inproc://
    replay_endpoint: str | None = None  # ROUTER address for late joiners (always bound)
    topic: str = ""


def check_kv_events_installed() -> None:
    """A clear error, before anything starts, where pyzmq or msgpack is missing."""
    _zmq_and_msgpack()


def _zmq_and_msgpack() -> tuple[Any, Any]:
    try:
        import msgpack
        import zmq
    except ImportError as exc:
        raise SettingsError(
            f"--kv-events needs pyzmq and msgpack ({exc.name} is not installed): "
            "pip install 'spnl-backend[kv-events]'"
        ) from None
    return zmq, msgpack


class KvEventPublisher:
    """`engine.block_manager.BlockEvents` published over ZMQ (see the module's doc)."""

    def __init__(self, config: KvEventsConfig, block_size: int) -> None:
        zmq, msgpack = _zmq_and_msgpack()
        self.config, self.block_size = config, block_size
        self.dropped = 0  # events the full queue refused
        self._dropped_lock = threading.Lock()
        self.sent = 0  # batches sent
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._queue: queue.Queue[list[Any]] = queue.Queue(MAX_QUEUED)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._seq = count()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            self._replay = None
            if config.replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._context.destroy(linger=0)
            raise SettingsError(f"--kv-events: cannot open {config}: {exc}") from None
        self._zmq = zmq
        self._running = True
        self._thread = threading.Thread(target=self._run, name="spnl-kv-events", daemon=True)
        self._thread.start()
        log.info("kv_events.publishing", endpoint=config.endpoint, replay=config.replay_endpoint)

    # ---- BlockEvents: on the engine's thread, never blocking ------------------------------

    def stored(
        self,
        digest: int,
        parent: int | None,
        tokens: tuple[int, ...],
        pic: bool,
        medium: str = POOL,
    ) -> None:
        self._put(["BlockStored", digest, parent, tokens, pic, MEDIUMS[medium]])

    def removed(self, digest: int, medium: str = POOL) -> None:
        self._put(["BlockRemoved", digest, MEDIUMS[medium]])

    def cleared(self) -> None:
        self._put(["AllBlocksCleared"])

    def _put(self, event: list[Any]) -> None:
        try:
            if not self._running:
                raise queue.Full
            self._queue.put_nowait(event)
        except queue.Full:
            with self._dropped_lock:  # the engine's and the tier's threads both put
                self.dropped += 1
                dropped = self.dropped
            if dropped in (1, 1000) or dropped % 100_000 == 0:
                log.warning("kv_events.dropped", dropped=dropped)

    # ---- the publisher thread -------------------------------------------------------------

    def close(self) -> None:
        """Send what is queued, then stop and close the sockets."""
        self._running = False
        self._thread.join(timeout=5)
        self._context.destroy(linger=0)

    def _run(self) -> None:
        while self._running or not self._queue.empty():
            try:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                events = self._take()
                if events:
                    self._send(events)
            except Exception as exc:  # a send that failed: logged, the next batch goes on
                log.error("kv_events.send_failed", error=f"{type(exc).__name__}: {exc}")
                time.sleep(POLL_S)

    def _take(self) -> list[Any]:
        try:
            events = [self._queue.get(timeout=POLL_S)]
        except queue.Empty:
            return []
        while len(events) < MAX_BATCH:
            try:
                events.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return events

    def _send(self, events: list[Any]) -> None:
        payload = self._pack([time.time(), self._encoded(events), 0])  # ts, events, dp rank
        seq = next(self._seq)
        self._pub.send_multipart([self.config.topic.encode(), seq.to_bytes(8, "big"), payload])
        self._kept.append((seq, payload))
        self.sent += 1

    def _encoded(self, events: list[Any]) -> list[dict[str, Any]]:
        """vLLM's events; a run of stored blocks of one medium that chain one another is
        one BlockStored, and a run of removals from one medium one BlockRemoved (as vLLM
        sends them)."""
        out: list[dict[str, Any]] = []
        for kind, *rest in events:
            last = out[-1] if out else {"type": None}
            same = kind != "AllBlocksCleared" and last["type"] == kind
            same = same and last["medium"] == rest[-1]
            if kind == "BlockStored":
                digest, parent, tokens, pic, medium = rest
                chained = same and last["block_hashes"][-1] == parent
                if chained and not pic and "extra_keys" not in last:
                    last["block_hashes"].append(digest)
                    last["token_ids"].extend(tokens)
                    continue
                out.append(self._stored(digest, parent, tokens, pic, medium))
            elif kind == "BlockRemoved":
                digest, medium = rest
                if same:
                    last["block_hashes"].append(digest)
                    continue
                out.append({"type": kind, "block_hashes": [digest], "medium": medium})
            else:
                out.append({"type": kind})
        return out

    def _stored(
        self, digest: int, parent: int | None, tokens: tuple[int, ...], pic: bool, medium: str
    ) -> dict[str, Any]:
        stored = {
            "type": "BlockStored",
            "block_hashes": [digest],
            "parent_block_hash": parent,
            "token_ids": list(tokens),
            "block_size": self.block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
        }
        if pic:
            stored["extra_keys"] = [[PIC_TAG]]  # one entry per block
        return stored

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()  # type: ignore[union-attr]
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv_events.bad_replay_request", frames=len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._kept):
            if seq >= first:
                self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])  # type: ignore[union-attr]
        self._replay.send_multipart([client, b"", END_SEQ, b""])  # type: ignore[union-attr]


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or local address is bound, any other is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
