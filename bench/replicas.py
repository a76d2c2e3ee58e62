"""Replicas behind vllm-router: how much of the prompt each routing policy finds cached.

    python bench/replicas.py [--model PATH] [--replicas 3] [--threads 1]
        [--policies round_robin cache_aware kv_aware] [--tier-policy round_robin]
        [--sessions 8] [--turns 4] [--markdown FILE] [--smoke]

Three `spnl-backend serve` replicas of the model (default: the embedded default model),
each with ``--threads`` threads and KV events on, behind ``vllm-router`` started once per
policy. The workload: ``--sessions`` RAG sessions run at once, each a conversation of
``--turns`` questions over its documents, sent as spnl's ``openai/`` provider sends a
RAG query (system, the documents, the question, as one streamed chat completion).
Sessions ``i`` and ``i + sessions/2`` read the same documents, so each set recurs: a
policy that sends a set to the replica that read it finds the documents cached there.

Per policy: the prompt tokens served from the prefix cache (and from PIC, which a plain
chat never uses: the routers proxy the OpenAI routes, not spnl's span queries at
``/v1/query/execute``; docs/scale-out.md says what a router must do to route those) over
all prompt tokens, TTFT p50 and p99, and completion tokens
per second over the run. Then ``--tier-policy`` again with one KV tier directory shared
by the replicas (``MISTRALRS_KV_TIER_DIR``): a document first read by one replica is a
tier hit on another (``tier_hit_tokens``). Each run starts fresh replicas.

``--smoke`` is a few seconds' check that every part runs (two replicas, two short
sessions, two tokens per answer); give it a small model (``--model``).
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
from serve import free_port

POLICIES = ("round_robin", "cache_aware", "kv_aware")
MODEL = "m"
READY_S = 900
SYSTEM = "You answer questions using the documents given, and cite them by number."
SMOKE_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_WORDS = [
    "river",
    "stone",
    "ledger",
    "harbour",
    "lantern",
    "orchard",
    "copper",
    "meadow",
    "signal",
    "archive",
    "glacier",
    "quarry",
    "beacon",
    "market",
    "vessel",
    "cipher",
    "thicket",
    "garrison",
    "pasture",
    "furnace",
]


@dataclass(frozen=True)
class Workload:
    sessions: int
    turns: int
    docs_per_session: int
    doc_words: int
    max_tokens: int


@dataclass
class Tally:
    ttfts: list[float] = field(default_factory=list)
    prompt: int = 0
    cached: int = 0  # prefix cache
    pic: int = 0
    tier: int = 0
    completion: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def documents(workload: Workload, seed: int = 7) -> list[list[str]]:
    """Each session's documents: half as many sets as sessions, each read by two."""
    rng = random.Random(seed)
    sets = max(1, workload.sessions // 2)
    pool = [
        [
            f"Document {s}.{d}: " + " ".join(rng.choices(_WORDS, k=workload.doc_words))
            for d in range(workload.docs_per_session)
        ]
        for s in range(sets)
    ]
    return [pool[i % sets] for i in range(workload.sessions)]


def rag_messages(docs: list[str], question: str) -> list[dict]:
    """A RAG query as spnl's ``openai/`` provider flattens it."""
    return [
        {"role": "system", "content": SYSTEM},
        *[{"role": "user", "content": doc} for doc in docs],
        {"role": "user", "content": question},
    ]


# ---- the fleet --------------------------------------------------------------------------


@dataclass
class Fleet:
    urls: list[str]
    events: list[str]  # each replica's KV events endpoint, as a subscriber connects
    router: str
    block_size: int


def _wait(url: str, process: subprocess.Popen, log: Path, path: str = "/health") -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: exited {process.returncode}:\n{_tail(log)}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not ready in {READY_S} s:\n{_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def _router_binary(given: str | None) -> str:
    found = given or shutil.which("vllm-router")
    beside = Path(sys.executable).parent / "vllm-router"
    found = found or (str(beside) if beside.exists() else None)
    if found is None:
        raise SystemExit("vllm-router not found: pip install vllm-router, or give --router")
    return found


@contextmanager
def fleet(
    model: Path, args: argparse.Namespace, policy: str, tier: Path | None, logs: Path
) -> Iterator[Fleet]:
    processes: list[subprocess.Popen] = []
    try:
        urls, events = [], []
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        env["MISTRALRS_NUM_THREADS"] = str(args.threads)
        if tier is not None:
            env["MISTRALRS_KV_TIER_DIR"] = str(tier)
        for i in range(args.replicas):
            port, events_port = free_port(), free_port()
            argv = [sys.executable, "-m", "spnl_backend.cli", "serve", "--model", str(model)]
            argv += ["--port", str(port), "--served-model-name", MODEL]
            argv += ["--kv-events", f"tcp://*:{events_port}"]
            if args.chat_template:
                argv += ["--chat-template", args.chat_template]
            log = logs / f"{policy}-replica{i}.log"
            with log.open("w") as sink:
                processes.append(
                    subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT)
                )
            urls.append(f"http://127.0.0.1:{port}")
            events.append(f"tcp://127.0.0.1:{events_port}")
        for i, (url, process) in enumerate(zip(urls, processes, strict=True)):
            _wait(url, process, logs / f"{policy}-replica{i}.log")
        info = httpx.get(urls[0] + "/get_server_info", timeout=10).json()
        block_size = int(info["page_size"])
        port = free_port()
        argv = [_router_binary(args.router), "--worker-urls", *urls, "--policy", policy]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        if policy == "kv_aware":
            for url, endpoint in zip(urls, events, strict=True):
                argv += ["--kv-event-source", f"{url}={endpoint}"]
            argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", str(model)]
        log = logs / f"{policy}-router.log"
        with log.open("w") as sink:
            processes.append(subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT))
        router = f"http://127.0.0.1:{port}"
        _wait(router, processes[-1], log)
        yield Fleet(urls, events, router, block_size)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


# ---- the workload -----------------------------------------------------------------------


def ask(url: str, messages: list[dict], max_tokens: int, tally: Tally) -> None:
    """One streamed chat completion; its TTFT and usage added to ``tally``."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    started, ttft, usage = time.perf_counter(), None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as reply:
        if reply.status_code != 200:
            reply.read()
            raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:300]}")
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c["delta"].get("content") for c in chunk["choices"]):
                ttft = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    if usage is None:
        raise RuntimeError("the stream carried no usage")
    details = usage.get("prompt_tokens_details") or {}
    with tally.lock:
        tally.ttfts.append(ttft if ttft is not None else time.perf_counter() - started)
        tally.prompt += usage["prompt_tokens"]
        tally.cached += details.get("cached_tokens", 0)
        tally.pic += details.get("pic_hit_tokens", 0)
        tally.tier += details.get("tier_hit_tokens", 0)
        tally.completion += usage["completion_tokens"]


def run_sessions(url: str, workload: Workload) -> tuple[Tally, float]:
    tally = Tally()
    sets = documents(workload)

    def session(index: int) -> None:
        for turn in range(workload.turns):
            question = f"Question {index}.{turn}: which document mentions the most rivers?"
            try:
                ask(url, rag_messages(sets[index], question), workload.max_tokens, tally)
            except Exception as exc:  # counted and shown in the table: a run's failures
                with tally.lock:
                    tally.errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=session, args=(i,)) for i in range(workload.sessions)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tally, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def row(label: str, tally: Tally, wall: float) -> list:
    prompt = max(tally.prompt, 1)
    return [
        label,
        f"{tally.cached / prompt:.1%}",
        f"{tally.pic / prompt:.1%}",
        f"{tally.tier / prompt:.1%}",
        f"{statistics.median(tally.ttfts) * 1000:.0f}" if tally.ttfts else "-",
        f"{percentile(tally.ttfts, 0.99) * 1000:.0f}",
        f"{tally.completion / wall:.1f}",
        str(len(tally.ttfts)),
        str(len(tally.errors)),
    ]


HEADER = [
    "policy",
    "prefix hit",
    "PIC hit",
    "tier hit",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "completion tok/s",
    "requests",
    "errors",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model path (default: the default model)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="threads per replica (1)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument(
        "--tier-policy",
        choices=(*POLICIES, "none"),
        default="round_robin",
        help="the policy run again with a shared KV tier directory (none: skip)",
    )
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4, help="questions per session")
    parser.add_argument("--docs", type=int, default=4, help="documents per session")
    parser.add_argument("--doc-words", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--router", help="the vllm-router executable (default: on PATH)")
    parser.add_argument(
        "--chat-template", help="for a model without one: passed to serve (--smoke: a plain one)"
    )
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--smoke", action="store_true", help="a seconds-long check (--model)")
    args = parser.parse_args(argv)
    if args.smoke:
        if args.model is None:
            parser.error("--smoke needs --model: a small model, not the default one")
        args.replicas, args.sessions, args.turns = 2, 2, 2
        args.docs, args.doc_words, args.max_tokens = 2, 20, 2
        args.chat_template = args.chat_template or SMOKE_TEMPLATE
    for name in ("replicas", "threads", "sessions", "turns", "docs", "doc_words", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> list[list]:
    args = parse_args(argv)
    model = args.model or harness.default_gguf()
    workload = Workload(args.sessions, args.turns, args.docs, args.doc_words, args.max_tokens)
    runs = [(policy, False) for policy in args.policies]
    if args.tier_policy != "none":
        runs.append((args.tier_policy, True))
    rows, began = [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spnl-replicas-") as scratch:
        logs = Path(scratch)
        for policy, shared in runs:
            tier = logs / f"tier-{policy}" if shared else None
            label = f"{policy} + shared tier" if shared else policy
            started = time.monotonic()
            with fleet(model, args, policy, tier, logs) as running:
                ready = time.monotonic() - started
                tally, wall = run_sessions(running.router, workload)
            rows.append(row(label, tally, wall))
            # where the run's time goes (starting the fleet, the sessions), for sizing it
            print(
                f"{label}: fleet ready in {ready:.0f} s, sessions {wall:.0f} s, "
                f"{time.monotonic() - began:.0f} s so far",
                file=sys.stderr,
            )
            for error in tally.errors[:3]:
                print(f"{label}: {error}", file=sys.stderr)
    head = (
        f"{args.replicas} replicas of {model.name}, {args.threads} thread(s) each; "
        f"{args.sessions} sessions x {args.turns} turns, {args.docs} documents of "
        f"{args.doc_words} words, {args.max_tokens} tokens per answer"
    )
    harness.publish(f"{head}\n\n{harness.md_table(HEADER, rows)}", args.markdown)
    failed = [r[0] for r in rows if r[-1] != "0"]
    if failed:
        raise SystemExit(f"requests failed under: {', '.join(failed)}")
    return rows


if __name__ == "__main__":
    main()
