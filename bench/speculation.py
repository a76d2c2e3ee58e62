"""Draft-free speculation on the default model: n-gram lookup against no speculation.

    python bench/speculation.py [--methods none ngram suffix] [--workloads copy code-edit story]
                                [--threads 2] [--runs 2] [--tokens 256] [--markdown FILE]

One child process loads the default GGUF (Gemma 3 270M Q4_K_M) once per method, with
MISTRALRS_SPECULATIVE_METHOD set to it (and --ngram-min/--ngram-max/--gamma for ngram and
suffix) and prefix caching off, warms each up, then runs every workload --runs times, greedy, one
client at a time, the methods' runs interleaved (so that the machine's load, which may
change, falls on each alike). A workload is a chat request streamed (`Backend.stream`),
timed from its first text piece to its last: decode tok/s is the completion's tokens after
the first over that time (the median of the runs); CPU ms/token, the process's CPU time
over the same span per token (less sensitive to other processes' load than the wall clock,
though the kernels' threads count while they wait for each other). Workloads:

- copy: repeat a 250-word passage of bench/data/english.txt word for word;
- code-edit: rewrite a 60-line Python function with one name changed;
- story: a story continuation (free text, little to copy).

suffix's store is the backend's, so from a workload's second run on it holds that
workload's earlier outputs (as a server's would for a repeated request): its first run
shows what the prompt's documents alone give.

The table gives, per workload and method, decode tok/s, the speedup over no speculation,
the tokens proposed and accepted, and whether the greedy text equals no speculation's.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import harness

METHODS = ["none", "ngram", "suffix"]
WORKLOADS = ["copy", "code-edit", "story"]


def passage(words: int = 250) -> str:
    text = (harness.DATA / "english.txt").read_text()
    body = text.split("\n\n", 1)[1]
    return " ".join(body.split()[:words])


def function_source() -> str:
    """A 60-line function to rewrite (the same every run)."""
    lines = ["def summarize_orders(orders, tax_rate, discounts):"]
    lines.append('    """Totals per customer, with tax and discounts applied."""')
    lines.append("    totals = {}")
    for i in range(14):
        lines += [
            f"    for order in orders[{i}::14]:",
            "        customer = order['customer']",
            f"        amount = order['amount'] * (1 + tax_rate) - discounts.get(customer, {i})",
            "        totals[customer] = totals.get(customer, 0) + amount",
        ]
    lines.append("    return totals")
    return "\n".join(lines)


def messages(workload: str) -> list[dict]:
    if workload == "copy":
        prompt = f"Repeat the following text exactly, word for word:\n\n{passage()}"
    elif workload == "code-edit":
        prompt = (
            "Rewrite this Python function with the variable `totals` renamed to "
            f"`per_customer`. Output only the code.\n\n```python\n{function_source()}\n```"
        )
    elif workload == "story":
        prompt = f"Continue this story: {harness.STORY_PROMPT}"
    else:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    return [{"role": "user", "content": prompt}]


# ---- the child: one method in its own process ------------------------------------------


def load(method: str, args):
    import torch

    torch.set_num_threads(args.threads)
    settings = {"speculative_method": method}
    if method in ("ngram", "suffix"):
        settings |= {
            "speculative_gamma": args.gamma,
            "speculative_ngram_min": args.ngram_min,
            "speculative_ngram_max": args.ngram_max,
        }
    return harness.load_ours(harness.default_gguf(), device="cpu", prefix_cache_n=0, **settings)


def streamed(backend, ids: list[int], tokens: int) -> dict:
    """One streamed request: seconds from its first piece to its last, and its counts."""
    stream = backend.stream(prompt_token_ids=ids, max_tokens=tokens, temperature=0)
    first = last = None
    cpu_first = cpu_last = 0.0
    for _ in stream:
        last, cpu_last = time.perf_counter(), time.process_time()
        if first is None:
            first, cpu_first = last, cpu_last
    seq = stream.seq
    return {
        "seconds": (last - first) if first else 0.0,
        "cpu_seconds": cpu_last - cpu_first,
        "tokens": list(seq.output_token_ids),
        "draft": seq.num_draft_tokens,
        "accepted": seq.num_accepted_tokens,
    }


def measure(args) -> dict:
    """Every method's backend in this one process, their runs interleaved (none, ngram,
    none, ...), so that a change in the machine's load falls on each alike."""
    backends = {method: load(method, args) for method in args.methods}
    for backend in backends.values():
        backend.generate(harness.STORY_PROMPT, max_tokens=8, temperature=0)  # warm-up
    results: dict[str, dict] = {method: {} for method in args.methods}
    for workload in args.workloads:
        ids = next(iter(backends.values())).chat_prompt_ids(messages(workload))
        runs: dict[str, list] = {method: [] for method in args.methods}
        for _ in range(args.runs):
            for method, backend in backends.items():
                runs[method].append(streamed(backend, ids, args.tokens))
        for method, done in runs.items():
            rates = [(len(r["tokens"]) - 1) / r["seconds"] for r in done if r["seconds"] > 0]
            results[method][workload] = {
                "prompt_tokens": len(ids),
                "tokens": done[0]["tokens"],
                "decode_tok_s": statistics.median(rates) if rates else 0.0,
                "cpu_ms_per_token": statistics.median(
                    1000 * r["cpu_seconds"] / (len(r["tokens"]) - 1)
                    for r in done
                    if len(r["tokens"]) > 1
                ),
                "draft": sum(r["draft"] for r in done),
                "accepted": sum(r["accepted"] for r in done),
                "same_each_run": all(r["tokens"] == done[0]["tokens"] for r in done),
            }
    return results


# ---- the parent ----------------------------------------------------------------------------


def uptime() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def report(results: dict[str, dict], args, loads: list[str]) -> str:
    header = ["workload", "method", "prompt tokens", "completion tokens", "decode tok/s"]
    header += ["vs none", "CPU ms/token", "proposed", "accepted", "same text as none"]
    rows = []
    for workload in args.workloads:
        base = results.get("none", {}).get(workload)
        for method in args.methods:
            found = results[method]
            if "error" in found:
                rows.append([workload, method, f"not run: {found['error']}"])
                continue
            r = found[workload]
            speedup = r["decode_tok_s"] / base["decode_tok_s"] if base else None
            same = "" if base is None else ("yes" if r["tokens"] == base["tokens"] else "no")
            rows.append(
                [
                    workload,
                    method,
                    r["prompt_tokens"],
                    len(r["tokens"]),
                    f"{r['decode_tok_s']:.1f}",
                    "" if speedup is None else f"{speedup:.2f}×",
                    f"{r['cpu_ms_per_token']:.1f}",
                    r["draft"],
                    f"{r['accepted']} ({100 * r['accepted'] / r['draft']:.0f}%)"
                    if r["draft"]
                    else "0",
                    same,
                ]
            )
    ngram = f"gamma {args.gamma}, n-grams {args.ngram_max} down to {args.ngram_min}"
    notes = (
        f"\n{args.threads} threads, greedy, one client, streamed, timed from the first "
        f"piece; median of {args.runs} runs of at most {args.tokens} tokens; ngram and "
        f"suffix: {ngram} (suffix's store keeps earlier runs' outputs). "
        f"Load average (1, 5, 15 min) before and after: {loads[0]}, {loads[1]}."
    )
    return harness.md_table(header, rows) + notes


def parse_args():
    parser = harness.arguments(__doc__, runs=True)
    parser.set_defaults(runs=2)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    parser.add_argument("--tokens", type=int, default=256, help="max tokens per request")
    parser.add_argument("--gamma", type=int, default=16, help="most proposed tokens per step")
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args()


def child_options(args) -> list[str]:
    options = ["--threads", args.threads, "--runs", args.runs, "--tokens", args.tokens]
    options += ["--gamma", args.gamma, "--ngram-min", args.ngram_min]
    options += ["--ngram-max", args.ngram_max, "--workloads", *args.workloads]
    options += ["--methods", *args.methods]
    return [str(option) for option in options]


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    loads = [uptime()]
    command = [sys.executable, __file__, "--child", "1", *child_options(args)]
    found = harness.run_json_child(command)
    results = {method: found.get(method, found) for method in args.methods}
    loads.append(uptime())
    harness.publish(report(results, args, loads), args.markdown)


if __name__ == "__main__":
    main()
