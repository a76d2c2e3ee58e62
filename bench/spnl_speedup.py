"""spnl's own speed-up benchmark (its ``spnl-speedup.sh``), reproduced against our server:
the time to first token of the same queries sent as spnl's ``openai/`` provider sends them
(flattened into plain chat) and as its ``spnl/`` provider sends them (span queries to
``/v1/query/execute``), both to one ``spnl-backend serve``, each run after
``POST /reset_prefix_cache``.

    python bench/spnl_speedup.py [--default-model] [--gguf PATH ...] [--lengths 100 1000]
        [--runs 5] [--n 8] [--threads 2] [--markdown FILE]

The two workloads of ``spnl-speedup.sh``, with made-up text (so no model knows it):

- **rag**: 10 fragments of ``l`` characters retrieved for a question, shuffled. ``spnl/``
  first warms the cache with a ``map`` over the fragments (``max_tokens`` 1, not
  streamed), then sends ``cross[system, plus[fragments], user(question), user]``;
  ``openai/`` sends the same messages as one chat. TTFT is the final query's, as spnl
  reports it (``spnl run --time``'s last TTFT); the ``spnl/`` end-to-end column adds the
  warm-up. One fragment holds the answer (an access code).
- **email2**: ``n`` candidate emails, then a judging generate over all of them. ``spnl/``
  sends ``n`` concurrent generates of ``plus[system, user]`` and then
  ``seq[system, plus[system, user], plus[assistant(email_i)...]]``; ``openai/`` sends one
  chat with ``n`` completions, then the judge's messages as one chat. TTFT is the judge's.
  ``l`` sets the emails' length (``max_tokens`` ``l // 4``).

Every query is greedy. Per workload and ``l``: the TTFT medians and their ratio (spnl
reports 10-20x with its vLLM fork on GPUs), the plus tokens reused, and for rag the span
query computed from nothing too (after a reset, no warm-up: what the exact rule
computes) and the answers: how often the question's code is in each (flattened, span
query cold, span query after the warm-up); how often spnl's reuse rule
(``MISTRALRS_SPAN_QUERY_REUSE=tokens``, the server's default for span queries) leaves the
answer as the query computed from nothing gives it, with spnl's accuracy measure (word
F1 against it); and under the exact rule (a second server, ``=exact``) whether a query
whose documents all come from the pool (the same documents shuffled again) answers as
the same query computed from nothing. The server runs with ``OMP_NUM_THREADS`` = ``--threads`` and a
16,384-token pool; the 1B-sized model is ``bench/synthetic_gguf.py --shape llama-1b``
(random weights: its answers mean nothing, its times do).
"""

import contextlib
import json
import random
import statistics
import string
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import harness
import httpx
from pic import f1
from real_sizes import isa_line, read_text
from serve import free_port, server_command, started, wait_ready_blocking
from spnl_client import execute_openai, execute_spnl

FRAGMENTS = 10
ANSWER_MAX_TOKENS = 24
READY_TIMEOUT_S = 900
SYSTEM = (
    "You answer questions using the relevant documents given, and cite them by number. "
    "If no document says, answer that you do not know."
)
INSTRUCTION = "Answer in one sentence."
WRITER = "You write an introductory email for a job application, short and specific."
REQUEST = (
    "My name is Ilse Marwick. I am a data engineer with eight years of experience and need "
    "an introductory email to apply for a position at Corvane Labs in their research group."
)
JUDGE = (
    "You score candidate introductory emails from 0 to 100; better ones mention specifics "
    "such as names of people and companies. List the top three with their scores."
)
SPNL_PUBLISHED = "10-20x (vLLM fork, GPUs)"
_NOUNS = ["archive", "ledger", "vault", "depot", "harbor", "relay", "foundry", "orchard"]
_NAMES = ["Halvorsen", "Quintero", "Abernathy", "Okonkwo", "Lindqvist", "Tavares", "Brannock"]
_FILLER = (
    "The {noun} at {name} keeps records of shipments, visitors and repairs. Its staff "
    "meet on Tuesdays to review the {noun} logs and plan the next quarter's work. "
)


def parse_args(argv: list[str] | None = None):
    parser = harness.arguments(__doc__)
    parser.add_argument("--default-model", action="store_true")
    parser.add_argument("--gguf", type=Path, action="append", default=[])
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--n", type=int, default=8, help="email2's candidate emails")
    parser.add_argument("--workloads", nargs="+", default=["rag", "email2"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.default_model and not args.gguf:
        args.default_model = True
    return args


# ---- the workloads ----------------------------------------------------------------------


def fragments(
    length: int, rng: random.Random, count: int = FRAGMENTS
) -> tuple[list[str], str, str]:
    """``count`` made-up fragments of ``length`` characters, one holding an access code;
    the question and the code."""
    docs = []
    for number in range(count):
        noun, name = rng.choice(_NOUNS), rng.choice(_NAMES)
        text = f"Relevant Document {number + 1}: " + _FILLER.format(noun=noun, name=name) * 40
        docs.append(text[:length])
    code = "".join(rng.choices(string.digits, k=4))
    holder = rng.randrange(count)
    noun, name = rng.choice(_NOUNS), rng.choice(_NAMES)
    fact = f"Relevant Document {holder + 1}: The access code of the {name} {noun} is {code}. "
    docs[holder] = (fact + docs[holder][len(fact) :])[: max(length, len(fact))]
    question = f"Question: What is the access code of the {name} {noun}?"
    return docs, question, code


def rag_query(model: str, docs: list[str], question: str) -> dict:
    plus = {"plus": [{"user": doc} for doc in docs]}
    body = {"cross": [{"system": SYSTEM}, plus, {"user": question}, {"user": INSTRUCTION}]}
    g = {"model": model, "input": body, "max_tokens": ANSWER_MAX_TOKENS, "temperature": 0}
    return {"repeat": {"n": 1, "g": g}}


def warm_up_query(model: str, docs: list[str]) -> dict:
    meta = {"model": model, "max_tokens": 1, "temperature": 0}
    return {"map": {"metadata": meta, "inputs": docs}}


def email_query(model: str, max_tokens: int, n: int = 1) -> dict:
    body = {"plus": [{"system": WRITER}, {"user": REQUEST}]}
    g = {"model": model, "input": body, "max_tokens": max_tokens, "temperature": 0}
    return {"repeat": {"n": n, "g": g}}


def judge_query(model: str, emails: list[str]) -> dict:
    candidates = {"plus": [{"assistant": email} for email in emails]}
    body = {"seq": [{"system": JUDGE}, {"plus": [{"system": WRITER}, {"user": REQUEST}]}]}
    body["seq"].append(candidates)
    g = {"model": model, "input": body, "max_tokens": ANSWER_MAX_TOKENS, "temperature": 0}
    return {"repeat": {"n": 1, "g": g}}


# ---- one run of each provider -----------------------------------------------------------


def reset(base: str) -> None:
    httpx.post(base + "/reset_prefix_cache", timeout=60).raise_for_status()


def rag_spnl(base: str, model: str, docs: list[str], question: str) -> dict:
    reset(base)
    started_at = time.perf_counter()
    execute_spnl(base, warm_up_query(f"spnl/{model}", docs))
    warmed = time.perf_counter() - started_at
    answer = execute_spnl(base, rag_query(f"spnl/{model}", docs, question))
    details = answer.usage["prompt_tokens_details"]
    return {
        "ttft": answer.ttft_s,
        "end_to_end": warmed + answer.ttft_s,
        "hit": details["pic_hit_tokens"],
        "plus": details["pic_hit_tokens"] + details["pic_miss_tokens"],
        "text": answer.texts[0],
    }


def rag_cold(base: str, model: str, docs: list[str], question: str) -> dict:
    """The span query computed from nothing (no warm-up, nothing cached): what the exact
    rule answers."""
    reset(base)
    answer = execute_spnl(base, rag_query(f"spnl/{model}", docs, question))
    return {"ttft": answer.ttft_s, "text": answer.texts[0]}


def rag_openai(base: str, model: str, docs: list[str], question: str) -> dict:
    reset(base)
    answer = execute_openai(base, rag_query(f"openai/{model}", docs, question))
    return {"ttft": answer.ttft_s, "text": answer.texts[0]}


def email_spnl(base: str, model: str, n: int, max_tokens: int) -> dict:
    reset(base)
    query = email_query(f"spnl/{model}", max_tokens)
    with ThreadPoolExecutor(n) as pool:
        emails = [a.texts[0] for a in pool.map(lambda _: execute_spnl(base, query), range(n))]
    answer = execute_spnl(base, judge_query(f"spnl/{model}", emails))
    details = answer.usage["prompt_tokens_details"]
    hit = details["pic_hit_tokens"]
    return {"ttft": answer.ttft_s, "hit": hit, "plus": hit + details["pic_miss_tokens"]}


def email_openai(base: str, model: str, n: int, max_tokens: int) -> dict:
    reset(base)
    emails = execute_openai(base, email_query(f"openai/{model}", max_tokens, n)).texts
    answer = execute_openai(base, judge_query(f"openai/{model}", emails))
    return {"ttft": answer.ttft_s}


# ---- the server -------------------------------------------------------------------------


@contextlib.contextmanager
def server(model: Path, threads: int, reuse: str, log: Path) -> Iterator[tuple[str, str]]:
    """Our server over ``model`` with span queries under ``reuse``: (base URL, name)."""
    port = free_port()
    argv, env = server_command("ours", model, port, threads, "")
    env |= {"MISTRALRS_SPAN_QUERY_REUSE": reuse, "MISTRALRS_PAGED_ATTN_CONTEXT_LEN": "16384"}
    base = f"http://127.0.0.1:{port}"
    with started(argv, env, log) as process:
        wait_ready_blocking(base, READY_TIMEOUT_S, process, log)
        name = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        yield base, name


# ---- the benchmark ----------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values)


def bench_rag(
    base: str, name: str, length: int, runs: int, rng: random.Random, count: int = FRAGMENTS
) -> dict:
    rows = []
    for _ in range(runs):
        docs, question, code = fragments(length, rng, count)
        rng.shuffle(docs)
        theirs = rag_openai(base, name, docs, question)
        ours = rag_spnl(base, name, docs, question)
        cold = rag_cold(base, name, docs, question)
        rows.append({"openai": theirs, "spnl": ours, "cold": cold, "code": code})
    openai_ttft = median([r["openai"]["ttft"] for r in rows])
    spnl_ttft = median([r["spnl"]["ttft"] for r in rows])
    return {
        "openai_ttft": openai_ttft,
        "spnl_ttft": spnl_ttft,
        "speedup": median([r["openai"]["ttft"] / r["spnl"]["ttft"] for r in rows]),
        "spnl_end_to_end": median([r["spnl"]["end_to_end"] for r in rows]),
        "hit": sum(r["spnl"]["hit"] for r in rows) / max(sum(r["spnl"]["plus"] for r in rows), 1),
        "code_openai": sum(r["code"] in r["openai"]["text"] for r in rows),
        "code_spnl": sum(r["code"] in r["spnl"]["text"] for r in rows),
        "code_cold": sum(r["code"] in r["cold"]["text"] for r in rows),
        "cold_ttft": median([r["cold"]["ttft"] for r in rows]),
        "unchanged": sum(r["spnl"]["text"] == r["cold"]["text"] for r in rows),
        "f1": statistics.mean(f1(r["spnl"]["text"], r["cold"]["text"]) for r in rows),
        "runs": runs,
    }


def bench_email(base: str, name: str, length: int, runs: int, n: int) -> dict:
    max_tokens = max(length // 4, 8)
    pairs = [
        (email_openai(base, name, n, max_tokens), email_spnl(base, name, n, max_tokens))
        for _ in range(runs)
    ]
    return {
        "openai_ttft": median([a["ttft"] for a, _ in pairs]),
        "spnl_ttft": median([b["ttft"] for _, b in pairs]),
        "speedup": median([a["ttft"] / b["ttft"] for a, b in pairs]),
        "hit": sum(b["hit"] for _, b in pairs) / max(sum(b["plus"] for _, b in pairs), 1),
        "runs": runs,
    }


def exact_answers(
    base: str, name: str, length: int, runs: int, rng: random.Random, count: int = FRAGMENTS
) -> dict:
    """Under the exact rule: a query whose documents all hit (seen in another order)
    answers as the same query computed from nothing."""
    same, hits = 0, 0
    for _ in range(runs):
        docs, question, _ = fragments(length, rng, count)
        shuffled = docs[:]
        rng.shuffle(shuffled)
        reset(base)
        cold = execute_spnl(base, rag_query(f"spnl/{name}", shuffled, question)).texts[0]
        reset(base)
        execute_spnl(base, rag_query(f"spnl/{name}", docs, question))
        warm = execute_spnl(base, rag_query(f"spnl/{name}", shuffled, question))
        details = warm.usage["prompt_tokens_details"]
        hits += details["pic_miss_tokens"] == 0
        same += warm.texts[0] == cold
    return {"same": same, "all_hit": hits, "runs": runs}


def run_model(model: Path, label: str, args) -> list[list]:
    rows = []
    log = Path(f"/tmp/spnl-speedup-{label}.log")
    with server(model, args.threads, "tokens", log) as (base, name):
        for workload in args.workloads:
            for length in args.lengths:
                rng = random.Random(args.seed + length)
                if workload == "rag":
                    result = bench_rag(base, name, length, args.runs, rng)
                else:
                    result = bench_email(base, name, length, args.runs, args.n)
                print(json.dumps({"model": label, "workload": workload, "l": length} | result),
                      file=sys.stderr)  # fmt: skip
                rows.append([label, workload, length, result])
    if "rag" in args.workloads:
        with server(model, args.threads, "exact", log) as (base, name):
            for row in rows:
                if row[1] == "rag":
                    rng = random.Random(args.seed + 7 * row[2])
                    row[3]["exact"] = exact_answers(base, name, row[2], args.runs, rng)
                    print(json.dumps(row[3]["exact"]), file=sys.stderr)
    return rows


def table(rows: list[list]) -> str:
    header = [
        "model", "workload", "l", "openai/ TTFT", "spnl/ TTFT", "speedup", "spnl's published",
        "plus tokens reused", "spnl/ warm-up + TTFT", "spnl/ cold TTFT",
        "code right: openai/, spnl/ cold, warm", "spnl's rule: answer unchanged (F1)",
        "exact rule: all hit, answer unchanged",
    ]  # fmt: skip
    lines = []
    for label, workload, length, r in rows:
        rag = workload == "rag"
        exact = r.get("exact")
        lines.append([
            label, workload, length, f"{r['openai_ttft'] * 1000:,.0f} ms",
            f"{r['spnl_ttft'] * 1000:,.0f} ms", f"{r['speedup']:.1f}x", SPNL_PUBLISHED,
            f"{r['hit']:.0%}",
            f"{r['spnl_end_to_end'] * 1000:,.0f} ms" if rag else "",
            f"{r['cold_ttft'] * 1000:,.0f} ms" if rag else "",
            f"{r['code_openai']}, {r['code_cold']}, {r['code_spnl']} of {r['runs']}" if rag else "",
            f"{r['unchanged']}/{r['runs']} ({r['f1']:.0f})" if rag else "",
            f"{exact['all_hit']}/{exact['runs']}, {exact['same']}/{exact['runs']}" if exact else "",
        ])  # fmt: skip
    return harness.md_table(header, lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    models = [(harness.default_gguf(), "default")] if args.default_model else []
    models += [(path, path.stem) for path in args.gguf]
    rows = []
    for path, label in models:
        rows += run_model(path, label, args)
    machine = isa_line(read_text("/proc/cpuinfo"))
    harness.publish(f"{machine}; {args.threads} threads\n\n{table(rows)}", args.markdown)


if __name__ == "__main__":
    main()
