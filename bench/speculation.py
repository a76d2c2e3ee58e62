"""Draft-free speculation: ours (none, ngram, suffix) and llama-server (none, ngram-mod,
ngram-cache) side by side, on the same GGUF, prompts and threads, in one run.

    python bench/speculation.py --llama-server PATH [--gguf GGUF | --shape llama-1b]
        [--engines ours:none ours:ngram ours:suffix llama:none llama:ngram-mod llama:ngram-cache]
        [--workloads rag judge summary code-edit story] [--clients 1 16]
        [--tokens 256] [--runs 2] [--threads 2] [--quick] [--markdown FILE]

Each engine is a server started in turn on a free 127.0.0.1 port (one at a time, so none
takes another's cores), warmed up, driven, and stopped:

- ours: ``spnl-backend serve --model GGUF`` with ``OMP_NUM_THREADS`` = --threads and
  ``MISTRALRS_SPECULATIVE_METHOD`` = none, ngram or suffix (--gamma, --ngram-min/max);
- llama: ``llama-server -m GGUF -np 16 -c 16*SLOT_CTX -t T -tb T``, with no speculation,
  ``--spec-type ngram-mod`` or ``--spec-type ngram-cache`` (llama.cpp's own defaults for
  each: ngram-mod looks up 24 tokens and drafts 48 to 64).

Every prompt is a chat turn tokenized once, before the engines run, by our server's
``/tokenize`` (the GGUF's chat template), and sent as those token ids to POST
/v1/completions, streamed, greedy (``temperature: 0``), ``max_tokens`` = --tokens: both
engines read the same tokens. Workloads (``i`` varies each request's text, so that no two
concurrent requests are the same):

- rag: spnl's rag answer at l = 1000 (bench/spnl_speedup.py's made-up fragments: 10 of 1,000
  characters, one holding an access code), flattened into one chat as spnl's ``openai/``
  provider sends it;
- judge: email2's judge over 8 candidate emails (made up here, each with its own names),
  asked to list the top three with their scores and quote their openings;
- summary: summarise a 2,000-token document (bench/data/english.txt);
- code-edit: rewrite a 100-line Python function with one name changed;
- story: a story continuation (free text: little to copy).

At each client count C, C clients send --runs requests each (variants 0, 1, ...), each
its next as soon as its last is done. Per engine, workload and C:

- decode tok/s: per stream, its completion tokens after the first over the time from its
  first text chunk to its last (the median over the streams); at C > 1, also the
  aggregate (all completion tokens over the level's wall time);
- acceptance: proposed tokens the target kept, of those proposed (ours: the usage's
  ``completion_tokens_details``; llama-server: its ``timings``' ``draft_n`` and
  ``draft_n_accepted``);
- ms/step and its cost over none's: the streams' decode time per verification step (a
  step yields its accepted proposals and one token of its own, so steps = tokens after the
  first - accepted), against the same engine's with no speculation (where a step is a
  token). It says what verifying the proposed tokens (proposed/step) costs, whatever their
  acceptance. At more than one client a stream's steps also carry the other requests'
  prefill chunks, so few steps make a noisy figure.

A 1B-sized model (--shape llama-1b: bench/synthetic_gguf.py's file, the real shape with
random weights and Gemma 3's vocabulary) cannot show how much real answers copy: its
greedy text is whatever random weights repeat, so its acceptance and speedups say nothing
about these workloads. What it does show is the verification cost at that size (ms/step
and proposed/step, and the speedup free text gets or loses where proposals fail); read
its acceptance as a property of random weights only.

Sizing, estimated from the default model's rates on a 2-core machine (idle: prefill about
550 tok/s ours, 840 llama-server; decode 60 and 80), with prefill the larger part: the
full run (6 engines, 5 workloads, 1 and 16 clients, --runs 2, 256 tokens, the documents at
full size at 16 clients too) takes about an hour; --quick (--runs 1, 128 tokens, and at
more than one client shorter documents: rag l = 400, a 700-token summary, a 40-line
function, 4 candidate emails) about 15 minutes. Each engine's time is printed under the
table. The 1B-sized model is about 4x slower to prefill and decode; for its verification
cost, ``--shape llama-1b --quick --clients 1 --workloads code-edit story`` takes about 6
minutes. The machine's load average before and after is printed: a run under load
measures the load, and llama-server's spinning threads suffer most from it.

Our server is the installed ``spnl-backend`` console script of this interpreter's
environment; it imports the ``spnl_backend`` that this environment finds (set PYTHONPATH
to a checkout to measure that checkout).
"""

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import harness
import httpx
from serve import ServerError, free_port, ours_executable, started, wait_ready_blocking
from spnl_speedup import INSTRUCTION, JUDGE, REQUEST, SYSTEM, WRITER, fragments

ENGINES = [
    "ours:none",
    "ours:ngram",
    "ours:suffix",
    "llama:none",
    "llama:ngram-mod",
    "llama:ngram-cache",
]
WORKLOADS = ["rag", "judge", "summary", "code-edit", "story"]
SLOTS = 16  # llama-server's -np: one slot per client at the most
READY_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Sizes:
    """The workloads' document sizes: the issue's at full size, smaller for --quick's
    16-client levels."""

    rag_chars: int = 1000
    summary_words: int = 1750  # about 2,000 Gemma 3 tokens
    function_blocks: int = 24  # 4 lines each: a 100-line function with its head and tail
    candidates: int = 8  # email2's n


SMALL = Sizes(rag_chars=400, summary_words=600, function_blocks=9, candidates=4)

# ---- the workloads ------------------------------------------------------------------------


def document(words: int, i: int) -> str:
    """``words`` words of the shipped English text, starting further in for each ``i``."""
    body = (harness.DATA / "english.txt").read_text().split()
    start = (i * 97) % max(1, len(body) - words)
    return " ".join(body[start : start + words])


def function_source(blocks: int, i: int) -> str:
    name = ["summarize_orders", "total_invoices", "tally_refunds", "sum_shipments"][i % 4]
    lines = [f"def {name}(orders, tax_rate, discounts):"]
    lines.append('    """Totals per customer, with tax and discounts applied."""')
    lines.append("    totals = {}")
    for b in range(blocks):
        lines += [
            f"    for order in orders[{b}::{blocks}]:",
            "        customer = order['customer']",
            f"        amount = order['amount'] * (1 + tax_rate) - discounts.get(customer, {b + i})",
            "        totals[customer] = totals.get(customer, 0) + amount",
        ]
    lines.append("    return totals")
    return "\n".join(lines)


def emails(i: int, count: int) -> list[str]:
    """Candidate introductory emails, each with its own names and details."""
    rng = random.Random(i)
    people = ["Ilse Marwick", "Dana Okafor", "Priya Raman", "Tomas Lind", "Mei Chen", "Ravi Das"]
    teams = ["research group", "data platform team", "analytics group", "search team"]
    out = []
    for c in range(count):
        person, team = rng.choice(people), rng.choice(teams)
        out.append(
            f"Dear {person},\n\nI am writing to apply for the data engineer position in the "
            f"{team} at Corvane Labs. Over eight years I have built pipelines that move "
            f"{rng.randint(2, 90)} terabytes a day, and I led the migration of {c + 3} "
            f"services to a streaming design. I would welcome the chance to talk.\n\n"
            f"Best regards,\nIlse Marwick"
        )
    return out


def messages(workload: str, i: int, sizes: Sizes) -> list[dict]:
    if workload == "rag":
        docs, question, _ = fragments(sizes.rag_chars, random.Random(i))
        system = [{"role": "system", "content": SYSTEM}]
        users = [{"role": "user", "content": text} for text in [*docs, question, INSTRUCTION]]
        return system + users
    if workload == "judge":
        candidates = enumerate(emails(i, sizes.candidates))
        shown = "\n\n".join(f"Candidate {c + 1}:\n{e}" for c, e in candidates)
        ask = "List the top three with their scores, quoting each one's first sentence."
        return [
            {"role": "system", "content": JUDGE},
            {"role": "user", "content": f"{WRITER}\n\n{REQUEST}\n\n{shown}\n\n{ask}"},
        ]
    if workload == "summary":
        text = document(sizes.summary_words, i)
        return [{"role": "user", "content": f"Summarise this document in detail:\n\n{text}"}]
    if workload == "code-edit":
        ask = "Rewrite this Python function with `totals` renamed to `per_customer`."
        source = function_source(sizes.function_blocks, i)
        return [{"role": "user", "content": f"{ask} Output only the code.\n\n{source}"}]
    if workload == "story":
        opening = harness.STORY_PROMPT.replace("lived", ["lived", "worked", "sailed"][i % 3])
        return [{"role": "user", "content": f"Continue this story ({i}): {opening}"}]
    raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")


# ---- the servers --------------------------------------------------------------------------


def server_argv(engine: str, gguf: Path, port: int, args) -> tuple[list[str], dict]:
    """The engine's server command and its environment's additions."""
    kind, method = engine.split(":")
    if kind == "ours":
        argv = [ours_executable(), "serve", "--host", "127.0.0.1", "--port", port]
        env = {
            "OMP_NUM_THREADS": str(args.threads),
            "MISTRALRS_PAGED_ATTN_CONTEXT_LEN": str(SLOTS * args.slot_ctx),
            "MISTRALRS_SPECULATIVE_METHOD": method,
        }
        if method != "none":
            env |= {
                "MISTRALRS_SPECULATIVE_GAMMA": str(args.gamma),
                "MISTRALRS_SPECULATIVE_NGRAM_MIN": str(args.ngram_min),
                "MISTRALRS_SPECULATIVE_NGRAM_MAX": str(args.ngram_max),
            }
        return [str(a) for a in [*argv, "--model", gguf]], env
    if args.llama_server is None or not args.llama_server.is_file():
        raise ServerError("--llama-server PATH is needed (see ../shared/PEERS.md to build it)")
    argv = [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", port]
    argv += ["-np", SLOTS, "-c", SLOTS * args.slot_ctx, "-t", args.threads, "-tb", args.threads]
    if method != "none":
        argv += ["--spec-type", method]
    return [str(a) for a in argv], {}


@contextlib.contextmanager
def running(engine: str, gguf: Path, args):
    """The engine's server, ready: its base URL and model name."""
    port = free_port()
    argv, extra = server_argv(engine, gguf, port, args)
    env = {**os.environ, **extra}
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log"
        with started(argv, env, log) as process:
            try:
                wait_ready_blocking(base, READY_TIMEOUT_S, process, log)
            except ServerError as error:
                raise ServerError(f"{engine}: {error}") from None
            yield base, httpx.get(base + "/v1/models").json()["data"][0]["id"]


def tokenized(base: str, model: str, chats: dict) -> dict:
    """Every chat's prompt token ids, by our server's /tokenize."""
    out = {}
    for key, chat in chats.items():
        answer = httpx.post(base + "/tokenize", json={"model": model, "messages": chat})
        answer.raise_for_status()
        out[key] = answer.json()["tokens"]
    return out


# ---- one request and one level ------------------------------------------------------------


@dataclass
class Outcome:
    tokens: int = 0
    first: float | None = None
    last: float | None = None
    proposed: int = 0
    accepted: int = 0
    text: str = ""
    finish: str | None = None


def stream(base: str, model: str, ids: list[int], tokens: int) -> Outcome:
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    outcome = Outcome()
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as r:
        if r.status_code != 200:
            raise ServerError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            read_chunk(outcome, json.loads(line[6:]), time.perf_counter())
    return outcome


def read_chunk(outcome: Outcome, chunk: dict, now: float) -> None:
    for choice in chunk.get("choices") or []:
        if choice.get("text"):
            outcome.first = outcome.first or now
            outcome.last = now
            outcome.text += choice["text"]
        outcome.finish = choice.get("finish_reason") or outcome.finish
    usage = chunk.get("usage")
    if usage:
        outcome.tokens = usage.get("completion_tokens", outcome.tokens)
        details = usage.get("completion_tokens_details") or {}
        if "accepted_prediction_tokens" in details:  # ours
            outcome.accepted = details["accepted_prediction_tokens"]
            outcome.proposed = outcome.accepted + details["rejected_prediction_tokens"]
    timings = chunk.get("timings")
    if timings and "draft_n" in timings:  # llama-server, when it drafted
        outcome.proposed, outcome.accepted = timings["draft_n"], timings["draft_n_accepted"]


def level(base: str, model: str, prompts: list[list[int]], clients: int, tokens: int) -> dict:
    """``prompts`` sent by ``clients`` concurrent clients: the level's figures."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(lambda ids: stream(base, model, ids, tokens), prompts))
    wall = time.perf_counter() - start
    timed = [o for o in done if o.first is not None and o.last > o.first and o.tokens > 1]
    decode_s = sum(o.last - o.first for o in timed)
    generated = sum(o.tokens - 1 for o in timed)
    accepted = sum(o.accepted for o in timed)
    return {
        "tok_s": statistics.median((o.tokens - 1) / (o.last - o.first) for o in timed)
        if timed
        else 0.0,
        "aggregate_tok_s": sum(o.tokens for o in done) / wall,
        "tokens": sum(o.tokens for o in done),
        "proposed": sum(o.proposed for o in done),
        "accepted": sum(o.accepted for o in done),
        "ms_per_step": 1000 * decode_s / max(1, generated - accepted),
        "steps": max(1, generated - accepted),
        "texts": [o.text for o in done],
        "wall_s": wall,
    }


def bench_engine(engine: str, gguf: Path, ids: dict, args) -> dict:
    """Every workload at every client count, on one server."""
    results: dict = {"wall_s": time.perf_counter()}
    with running(engine, gguf, args) as (base, model):
        stream(base, model, ids[("story", 1, 99)], 8)  # warm-up
        for workload in args.workloads:
            for clients in args.clients:
                count = clients * args.runs
                prompts = [ids[(workload, clients, i)] for i in range(count)]
                found = level(base, model, prompts, clients, args.tokens)
                results[f"{workload}/{clients}"] = found
                print(engine, workload, clients, round(found["tok_s"], 1), file=sys.stderr)
    results["wall_s"] = time.perf_counter() - results["wall_s"]
    return results


# ---- the table ----------------------------------------------------------------------------


def rows(results: dict, args) -> list[list]:
    out = []
    for workload in args.workloads:
        for clients in args.clients:
            key = f"{workload}/{clients}"
            for engine in args.engines:
                found = results.get(engine, {})
                if "error" in found:
                    out.append([workload, clients, engine, f"not run: {found['error']}"])
                    continue
                r = found[key]
                base = results.get(engine.split(":")[0] + ":none", {}).get(key)
                out.append(row(workload, clients, engine, r, base))
    return out


def row(workload: str, clients: int, engine: str, r: dict, base: dict | None) -> list:
    """One table row: ``r`` beside ``base``, the same engine's figures without speculation."""
    speed = f"{r['tok_s']:.1f}"
    if clients > 1:
        speed += f" ({r['aggregate_tok_s']:.1f} all)"
    vs = cost = same = ""
    if base and base["tok_s"]:
        vs = f"{r['tok_s'] / base['tok_s']:.2f}×"
        cost = f"{r['ms_per_step']:.1f} ({r['ms_per_step'] / base['ms_per_step']:.2f}×)"
        same = "yes" if r["texts"] == base["texts"] else "no"
    proposed = r["proposed"]
    accepted = f"{r['accepted']} ({100 * r['accepted'] / proposed:.0f}%)" if proposed else "0"
    per_step = f"{proposed / r['steps']:.1f}"
    return [
        workload,
        clients,
        engine,
        r["tokens"],
        speed,
        vs,
        proposed,
        accepted,
        per_step,
        cost,
        same,
    ]


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def report(results: dict, args, loads: list[str], gguf: Path) -> str:
    header = ["workload", "clients", "engine", "tokens", "decode tok/s", "vs own none"]
    header += ["proposed", "accepted", "proposed/step", "ms/step (× none's)"]
    header += ["same text as own none"]
    timed = {engine: found["wall_s"] for engine, found in results.items() if "wall_s" in found}
    walls = ", ".join(f"{engine} {wall:.0f} s" for engine, wall in timed.items())
    notes = (
        f"\n{gguf.name}, {args.threads} threads, greedy, streamed over /v1/completions, "
        f"timed from each stream's first text chunk; {args.runs} request(s) per client of at "
        f"most {args.tokens} tokens; ours: gamma {args.gamma}, n-grams {args.ngram_max} down "
        f"to {args.ngram_min}; llama-server: -np {SLOTS}, its defaults per --spec-type. "
        f"Load average (1, 5, 15 min) before and after: {loads[0]}, {loads[1]}. "
        f"Each engine's time (its load included): {walls}."
    )
    return harness.md_table(header, rows(results, args)) + notes


# ---- the command line ---------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    parser = harness.arguments(__doc__, runs=True)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n", 1)[1]  # what it measures, the 1B model, sizing
    parser.set_defaults(runs=2)
    parser.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary")
    parser.add_argument("--gguf", type=Path, help="the model (default: the default model)")
    parser.add_argument(
        "--shape",
        help="a bench/synthetic_gguf.py shape instead (llama-1b: random weights, so only its "
        "verification cost means anything; see below)",
    )
    parser.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=256, help="max tokens per request")
    parser.add_argument("--slot-ctx", type=int, default=4096, help="tokens per client")
    parser.add_argument("--gamma", type=int, default=16, help="ours: most proposed per step")
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="--runs 1, --tokens 128, shorter documents at more than one client (~15 min)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.tokens = 1, min(args.tokens, 128)
    if max(args.clients) > SLOTS:
        parser.error(f"--clients: at most {SLOTS} (llama-server's slots)")
    return args


def model_path(args) -> Path:
    if args.gguf:
        return args.gguf
    if args.shape:
        import llama_bench

        return llama_bench.synthetic_file(harness.bench_cache("synthetic"), args.shape)
    return harness.default_gguf()


def chats(args) -> dict:
    """Every request's chat, by (workload, clients, variant), and the warm-up's."""
    out = {("story", 1, 99): messages("story", 99, Sizes())}
    for workload in args.workloads:
        for clients in args.clients:
            sizes = SMALL if args.quick and clients > 1 else Sizes()
            for i in range(clients * args.runs):
                out[(workload, clients, i)] = messages(workload, i, sizes)
    return out


def main() -> None:
    args = parse_args()
    gguf = model_path(args)
    loads = [load_average()]
    with running("ours:none", gguf, args) as (base, model):
        ids = tokenized(base, model, chats(args))
    longest = max(len(v) for v in ids.values()) + args.tokens
    if longest > args.slot_ctx:
        sys.exit(f"a prompt and its tokens take {longest} > --slot-ctx {args.slot_ctx}")
    results = {}
    for engine in args.engines:
        try:
            results[engine] = bench_engine(engine, gguf, ids, args)
        except (ServerError, httpx.HTTPError) as failure:
            results[engine] = {"error": str(failure).splitlines()[-1][:200]}
    loads.append(load_average())
    harness.publish(report(results, args, loads, gguf), args.markdown)


if __name__ == "__main__":
    main()
