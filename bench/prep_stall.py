"""Does one request's preparation stall the server? `/health`'s latency, polled every 20 ms
while the server reads large GBNF grammars (converted to Lark and compiled before the
request is queued) and a chat of 299 messages (templated and tokenized).

    python bench/prep_stall.py [--rules 8000 30000] [--concurrent N] [--gguf GGUF]
                               [--markdown FILE]

The server (`spnl-backend serve`, the default model unless ``--gguf``) runs as a child
on 127.0.0.1. For each request: its status and seconds, and `/health`'s median and
largest latency while it was in flight; with ``--concurrent N``, N such requests at once
(each grammar its own, so none is a cache hit), timed together. Target (issue 44):
`/health` within 100 ms.
"""

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import harness
import httpx
from serve import model_id, serving_ours, wait_ready

POLL_S = 0.02


def chain(rules: int) -> str:
    """A GBNF grammar of ``rules`` rules, each using the next."""
    body = "".join(f'r{i} ::= "x{i}" r{i + 1} | "y"\n' for i in range(rules))
    return f'root ::= r0\n{body}r{rules} ::= "end"\n'


def copies(body: dict, count: int) -> list[dict]:
    """``count`` copies of a request, each grammar made its own."""
    if "guided_grammar" not in body:
        return [body] * count
    grammar = body["guided_grammar"]
    return [{**body, "guided_grammar": grammar.replace('"end"', f'"end{i}"')} for i in range(count)]


def requests(rules: list[int]) -> list[tuple[str, str, dict]]:
    """(label, path, body) of each request measured."""
    asked = [
        (
            f"GBNF grammar, {n:,} rules ({len(chain(n)) // 1000:,} KB)",
            "/v1/completions",
            {"prompt": "x", "max_tokens": 2, "guided_grammar": chain(n)},
        )
        for n in rules
    ]
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(299)
    ]
    asked.append(
        ("chat of 299 messages", "/v1/chat/completions", {"messages": turns, "max_tokens": 2})
    )
    return asked


async def measured(client: httpx.AsyncClient, base: str, path: str, bodies: list[dict]) -> dict:
    """The requests' worst status and seconds together, and /health's latencies meanwhile."""
    start = time.perf_counter()
    posts = [client.post(base + path, json=body, timeout=600) for body in bodies]
    task = asyncio.ensure_future(asyncio.gather(*posts))
    latencies = []
    while not task.done():
        probe = time.perf_counter()
        reply = await client.get(base + "/health", timeout=600)
        reply.raise_for_status()
        latencies.append(time.perf_counter() - probe)
        await asyncio.sleep(POLL_S)
    replies = await task
    return {
        "status": max(reply.status_code for reply in replies),
        "s": time.perf_counter() - start,
        "median_ms": 1000 * statistics.median(latencies),
        "max_ms": 1000 * max(latencies),
        "probes": len(latencies),
    }


READY_TIMEOUT_S = 300


async def run(base: str, rules: list[int], concurrent: int, process) -> list[tuple[str, dict]]:
    limits = httpx.Limits(max_connections=concurrent + 2)
    async with httpx.AsyncClient(limits=limits) as client:
        await wait_ready(client, base, READY_TIMEOUT_S, process)
        model = await model_id(client, base)
        return [
            (
                label if concurrent == 1 else f"{concurrent} x {label}",
                await measured(client, base, path, copies({"model": model, **body}, concurrent)),
            )
            for label, path, body in requests(rules)
        ]


def report(results: list[tuple[str, dict]]) -> str:
    rows = [
        "| request | status | seconds | /health median | /health max | probes |",
        "|---|---|---|---|---|---|",
    ]
    rows += [
        f"| {label} | {r['status']} | {r['s']:.2f} | {r['median_ms']:.1f} ms "
        f"| {r['max_ms']:.1f} ms | {r['probes']} |"
        for label, r in results
    ]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", type=int, nargs="+", default=[8000, 30000])
    parser.add_argument("--concurrent", type=int, default=1, help="requests at once")
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    with serving_ours(args.gguf or harness.default_gguf(), args.threads) as (base, process):
        results = asyncio.run(run(base, args.rules, args.concurrent, process))
    harness.publish(report(results), args.markdown)


if __name__ == "__main__":
    main()
