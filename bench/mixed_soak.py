"""Do streams keep their pace while embeddings, Ollama requests and span queries arrive?
A bounded soak of the mix, every inter-token gap of every stream recorded.

    python bench/mixed_soak.py [--minutes 5] [--streams 2] [--threads 2] [--gguf GGUF]
        [--markdown FILE]

The server (`spnl-backend serve`, the default model unless ``--gguf``) runs as a child
on 127.0.0.1 with ``--threads`` threads. For ``--minutes``, clients send one request after
another (a new one as the last ends, none after the deadline):

- streams, ``--streams`` clients of each kind, every gap between two chunks that carry
  text recorded: OpenAI chat (``POST /v1/chat/completions``, 256 tokens, ``ignore_eos``),
  Ollama chat (``POST /api/chat``, ``num_predict`` 256, greedy) and spnl's span query
  (``POST /v1/query/execute?stream=true``, three plus documents, 64 tokens);
- beside them, one client each: ``POST /v1/embeddings`` of 64, 128, 256 and 512 texts
  of some 64 tokens in turn, Ollama's ``POST /api/embed`` of 16 texts, and Ollama's
  ``POST /api/generate`` (32 tokens, not streamed);
- ``GET /health`` polled every 50 ms.

Per stream kind: its tokens (chunks that carry text), largest gap, 99th-percentile gap
and the share of gaps over 1 s; per other kind: requests, failures and seconds;
`/health`'s largest latency; the largest gaps, one per stall, with the requests in flight
across them (a stream's "start" is its time to first token: its prefill). The load
average at the start and the end is noted: the seconds mean little on a machine that is
busy with other work. Issue 53's target: every gap under 1 s on 2 cores.
"""

import argparse
import asyncio
import itertools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import harness
import httpx
from embed_stall import health_latencies, texts
from serve import model_id, percentile, serving_ours, wait_ready

READY_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 300
SLOW_GAP_S = 1.0  # the target: every gap under it
WORDS = 58  # some 64 tokens a text
EMBED_BATCHES = (64, 128, 256, 512)
OLLAMA_EMBED_TEXTS = 16
STREAM_TOKENS = 256
SPAN_TOKENS = 64
GENERATE_TOKENS = 32
RETRY_S = 1.0  # after a failed request: no loop of instant failures
WORST_SHOWN = 5
STORY = "Tell me a long story about a lighthouse keeper and the sea."
STREAM_KINDS = ("OpenAI chat", "Ollama chat", "span query")
OTHER_KINDS = ("embeddings", "Ollama embed", "Ollama generate")


@dataclass
class Record:
    """One request: its kind, when it was sent and ended, its status, and (a stream) the
    arrival times of its chunks that carried text."""

    kind: str
    start: float
    end: float = 0.0
    status: int = 0  # 0: no response
    arrivals: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200


# ---- the requests -------------------------------------------------------------------------


def stream_request(kind: str, model: str, i: int) -> tuple[str, dict]:
    """Stream ``i`` of ``kind``: its path and body."""
    if kind == "OpenAI chat":
        messages = [{"role": "user", "content": f"{i}: {STORY}"}]
        body = {"model": model, "messages": messages, "max_tokens": STREAM_TOKENS}
        return "/v1/chat/completions", body | {"temperature": 0, "ignore_eos": True, "stream": True}
    if kind == "Ollama chat":
        messages = [{"role": "user", "content": f"{i}: {STORY}"}]
        options = {"num_predict": STREAM_TOKENS, "temperature": 0}
        return "/api/chat", {"model": model, "messages": messages, "options": options}
    return "/v1/query/execute?stream=true", span_query(model, i)


def span_query(model: str, i: int) -> dict:
    """spnl's span query (as bench/soak.py sends it): three plus documents, then a question."""
    docs = [{"user": f"Document {j} of set {i % 50}: a short text."} for j in range(3)]
    cross = [{"system": "Answer from the documents."}, {"plus": docs}, {"user": "Summarize them."}]
    g = {"model": model, "input": {"cross": cross}, "max_tokens": SPAN_TOKENS, "temperature": 0}
    return {"repeat": {"n": 1, "g": g}}


def other_request(kind: str, model: str, i: int) -> tuple[str, dict]:
    """Request ``i`` of a kind that is not streamed: its path and body."""
    if kind == "embeddings":
        count = EMBED_BATCHES[i % len(EMBED_BATCHES)]
        return "/v1/embeddings", {"model": model, "input": texts(count, WORDS)}
    if kind == "Ollama embed":
        return "/api/embed", {"model": model, "input": texts(OLLAMA_EMBED_TEXTS, WORDS)}
    options = {"num_predict": GENERATE_TOKENS, "temperature": 0}
    prompt = f"{i}: Once upon a time"
    return "/api/generate", {"model": model, "prompt": prompt, "stream": False, "options": options}


def piece(kind: str, line: str) -> str:
    """The text a streamed line carries ("" for none: a role, a usage, [DONE], the end)."""
    if kind == "Ollama chat":
        answer = json.loads(line) if line.strip() else {}
        return "" if answer.get("done") else answer.get("message", {}).get("content", "")
    if not line.startswith("data:") or line.strip() == "data: [DONE]":
        return ""
    choices = json.loads(line[len("data:") :]).get("choices") or []
    return "".join(c.get("delta", {}).get("content") or c.get("text") or "" for c in choices)


# ---- the statistics -----------------------------------------------------------------------


def gaps(arrivals: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(arrivals)]


def gap_stats(all_gaps: list[float]) -> dict:
    """Count, largest, 99th percentile and the share over `SLOW_GAP_S`."""
    slow = sum(gap > SLOW_GAP_S for gap in all_gaps)
    return {
        "gaps": len(all_gaps),
        "max_s": max(all_gaps, default=None),
        "p99_s": percentile(all_gaps, 99),
        "slow_share": slow / len(all_gaps) if all_gaps else None,
    }


def in_flight(records: list[Record], start: float, end: float) -> list[str]:
    """The kinds of request that ran across ``[start, end]``, a stream's prefill (sent to
    its first chunk) as its "start"."""
    found = set()
    for r in records:
        if r.arrivals and r.start < end and r.arrivals[0] > start:
            found.add(f"{r.kind} start")
        elif not r.arrivals and r.start < end and r.end > start:
            found.add(r.kind)
    return sorted(found)


def worst_gaps(records: list[Record], count: int) -> list[dict]:
    """The ``count`` largest gaps, one per stall (a gap that overlaps a larger one shown is
    the same stall, seen by another stream): stream kind, seconds, when (from the first
    request) and what else ran across it."""
    origin = min((r.start for r in records), default=0.0)
    every = [(b - a, r.kind, a, b) for r in records for a, b in itertools.pairwise(r.arrivals)]
    shown: list[tuple] = []
    for gap in sorted(every, reverse=True):
        if len(shown) < count and not any(gap[2] < b and a < gap[3] for _, _, a, b in shown):
            shown.append(gap)
    return [
        {"kind": kind, "gap_s": gap, "at_s": a - origin, "with": in_flight(records, a, b)}
        for gap, kind, a, b in shown
    ]


def summary(records: list[Record], health_s: list[float], loads: tuple) -> dict:
    streams = {
        kind: gap_stats([g for r in records if r.kind == kind for g in gaps(r.arrivals)])
        | {
            "requests": sum(r.kind == kind for r in records),
            "tokens": sum(len(r.arrivals) for r in records if r.kind == kind),
        }
        for kind in STREAM_KINDS
    }
    others = {kind: request_stats([r for r in records if r.kind == kind]) for kind in OTHER_KINDS}
    return {
        "streams": streams,
        "others": others,
        "failed": sum(not r.ok for r in records),
        "health_max_s": max(health_s, default=None),
        "health_p99_s": percentile(health_s, 99),
        "worst": worst_gaps(records, WORST_SHOWN),
        "load_start": loads[0],
        "load_end": loads[1],
    }


def request_stats(records: list[Record]) -> dict:
    seconds = [r.end - r.start for r in records if r.ok]
    return {
        "requests": len(records),
        "failed": sum(not r.ok for r in records),
        "median_s": percentile(seconds, 50),
        "max_s": max(seconds, default=None),
    }


# ---- the clients --------------------------------------------------------------------------


async def streamed(client: httpx.AsyncClient, base: str, kind: str, model: str, i: int) -> Record:
    path, body = stream_request(kind, model, i)
    record = Record(kind, time.perf_counter())
    try:
        async with client.stream("POST", base + path, json=body) as reply:
            record.status = reply.status_code
            async for line in reply.aiter_lines():
                if reply.status_code == 200 and piece(kind, line):
                    record.arrivals.append(time.perf_counter())
    except httpx.HTTPError:
        record.status = 0
    record.end = time.perf_counter()
    return record


async def posted(client: httpx.AsyncClient, base: str, kind: str, model: str, i: int) -> Record:
    path, body = other_request(kind, model, i)
    record = Record(kind, time.perf_counter())
    try:
        record.status = (await client.post(base + path, json=body)).status_code
    except httpx.HTTPError:
        record.status = 0
    record.end = time.perf_counter()
    return record


async def loop(send: Callable, deadline: float, first: int, records: list[Record]) -> None:
    """``send(i)`` for i = first, first + 1, ... one after another until ``deadline``."""
    for i in itertools.count(first):
        if time.perf_counter() >= deadline:
            return
        record = await send(i)
        records.append(record)
        if not record.ok:
            await asyncio.sleep(RETRY_S)


def clients(client: httpx.AsyncClient, base: str, model: str, streams: int) -> list:
    """(send, first index) per client: ``streams`` of each stream kind, one of each other
    kind; their indexes apart, so that no two streams share a prompt."""
    kinds = [kind for kind in STREAM_KINDS for _ in range(streams)] + list(OTHER_KINDS)
    return [(sender(client, base, kind, model), 100_000 * n) for n, kind in enumerate(kinds)]


def sender(client: httpx.AsyncClient, base: str, kind: str, model: str) -> Callable:
    """``send(i)``: request ``i`` of ``kind``, its `Record`."""
    send = streamed if kind in STREAM_KINDS else posted
    return lambda i: send(client, base, kind, model, i)


async def soak(base: str, process, args: argparse.Namespace) -> dict:
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=64)) as c:
        await wait_ready(c, base, READY_TIMEOUT_S, process)
        model = await model_id(c, base)
        await posted(c, base, "Ollama generate", model, -1)  # warm-up, untimed
        loads = [os.getloadavg()[0]]
        deadline = time.perf_counter() + 60 * args.minutes
        records: list[Record] = []
        running = [
            loop(send, deadline, first, records)
            for send, first in clients(c, base, model, args.streams)
        ]
        everyone = asyncio.gather(*running)
        health_s = await health_latencies(c, base, everyone)
        await everyone
        loads.append(os.getloadavg()[0])
    return summary(records, health_s, tuple(loads))


# ---- the report ---------------------------------------------------------------------------


def ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{1000 * seconds:,.0f} ms"


def share(value: float | None) -> str:
    return "" if value is None else f"{value:.2%}"


def stream_rows(streams: dict) -> list[list]:
    return [
        [
            kind,
            s["requests"],
            f"{s['tokens']:,}",
            ms(s["max_s"]),
            ms(s["p99_s"]),
            share(s["slow_share"]),
        ]
        for kind, s in streams.items()
    ]


def other_rows(others: dict) -> list[list]:
    seconds = lambda v: "" if v is None else f"{v:.2f} s"  # noqa: E731
    return [
        [kind, o["requests"], o["failed"], seconds(o["median_s"]), seconds(o["max_s"])]
        for kind, o in others.items()
    ]


def worst_rows(worst: list[dict]) -> list[list]:
    return [[w["kind"], ms(w["gap_s"]), f"{w['at_s']:.0f} s", ", ".join(w["with"])] for w in worst]


def verdict(result: dict) -> str:
    largest = max((s["max_s"] or 0.0 for s in result["streams"].values()), default=0.0)
    if largest < SLOW_GAP_S:
        return f"Every stream's gap stayed under 1 s: the largest was {ms(largest)}."
    return f"Not every gap stayed under 1 s: the largest was {ms(largest)}."


def report(result: dict, args: argparse.Namespace) -> str:
    head = (
        f"{args.minutes:g} minutes, {args.threads} threads, {args.streams} streams of each "
        f"kind; load average {result['load_start']:.2f} at the start, "
        f"{result['load_end']:.2f} at the end; {result['failed']} requests failed."
    )
    tables = [
        harness.md_table(
            ["stream", "requests", "tokens", "max gap", "p99 gap", "gaps over 1 s"],
            stream_rows(result["streams"]),
        ),
        harness.md_table(
            ["request", "sent", "failed", "median", "max"], other_rows(result["others"])
        ),
        f"`/health`: largest latency {ms(result['health_max_s'])}, "
        f"p99 {ms(result['health_p99_s'])}.",
        "The largest gaps:\n\n"
        + harness.md_table(["stream", "gap", "at", "in flight"], worst_rows(result["worst"])),
        verdict(result),
    ]
    return head + "\n\n" + "\n\n".join(tables)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.arguments(__doc__)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--streams", type=int, default=2, help="clients of each stream kind")
    parser.add_argument("--gguf", type=Path)
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.streams < 1:
        parser.error("--minutes must be > 0 and --streams >= 1")
    return args


def main() -> None:
    args = parse_args()
    with serving_ours(args.gguf or harness.default_gguf(), args.threads) as (base, process):
        result = asyncio.run(soak(base, process, args))
    harness.publish(report(result, args), args.markdown)


if __name__ == "__main__":
    main()
