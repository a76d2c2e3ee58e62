"""Does one request's preparation stall the server? `/health`'s latency, polled every 20 ms
while the server reads large GBNF grammars (converted to Lark and compiled before the
request is queued) and a chat of 299 messages (templated and tokenized).

    python bench/prep_stall.py [--rules 8000 30000] [--gguf GGUF] [--markdown FILE]

The server (`spnl-backend serve`, the default model unless ``--gguf``) runs as a child
on 127.0.0.1. For each request: its status and seconds, and `/health`'s median and
largest latency while it was in flight. Target (issue 44): `/health` within 100 ms.
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


async def measured(client: httpx.AsyncClient, base: str, path: str, body: dict) -> dict:
    """The request's status and seconds, and /health's latencies meanwhile."""
    start = time.perf_counter()
    task = asyncio.create_task(client.post(base + path, json=body, timeout=600))
    latencies = []
    while not task.done():
        probe = time.perf_counter()
        reply = await client.get(base + "/health", timeout=600)
        reply.raise_for_status()
        latencies.append(time.perf_counter() - probe)
        await asyncio.sleep(POLL_S)
    reply = await task
    return {
        "status": reply.status_code,
        "s": time.perf_counter() - start,
        "median_ms": 1000 * statistics.median(latencies),
        "max_ms": 1000 * max(latencies),
        "probes": len(latencies),
    }


READY_TIMEOUT_S = 300


async def run(base: str, rules: list[int], process) -> list[tuple[str, dict]]:
    async with httpx.AsyncClient() as client:
        await wait_ready(client, base, READY_TIMEOUT_S, process)
        model = await model_id(client, base)
        return [
            (label, await measured(client, base, path, {"model": model, **body}))
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
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    with serving_ours(args.gguf or harness.default_gguf(), args.threads) as (base, process):
        results = asyncio.run(run(base, args.rules, process))
    harness.publish(report(results), args.markdown)


if __name__ == "__main__":
    main()
