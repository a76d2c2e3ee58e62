"""A long session against our server: a fixed mix of normal and hostile requests, the
server's resident memory, descriptors, threads and pool sampled as it goes.

    python bench/soak.py [--requests 10000] [--clients 8] [--gguf GGUF] [--every 100]
        [--markdown FILE]

The server (`spnl-backend serve`, the default model unless ``--gguf``) runs as a child on
127.0.0.1. Request ``i`` is kind ``i mod 10`` of the mix: four short completions (two
streamed), a chat held to a small JSON schema (a new one each time: the compiled-grammar
cache is exercised past its size), a stream whose client leaves after its first chunk, a
completion with four long stop strings and 256 logit biases, spnl's span query with three
plus documents, a body that is not JSON, and a chat with a schema nested past the
grammar engine's limit. Every ``--every`` requests: the server's RSS (VmRSS), open file
descriptors and threads (from /proc), and the pool's blocks in use (`/metrics`).

Targets (issue 42): RSS within +10% of its value after the first 1,000 requests (after
the first tenth, for shorter runs), descriptors and threads flat, the pool empty at the
end, no 5xx, and a healthy greedy request giving the same tokens before and after.
"""

import argparse
import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path

import harness
import httpx
from serve import serving_ours, wait_ready

HEALTHY = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
KINDS = (
    "completion",
    "completion",
    "stream",
    "stream",
    "json_schema",
    "cut_stream",
    "stops_and_bias",
    "span_query",
    "not_json",
    "deep_schema",
)


def body(kind: str, i: int, model: str) -> tuple[str, dict | bytes]:
    """Request ``i`` of ``kind``: its path and JSON body (or raw bytes)."""
    prompt = f"Request {i}: once upon a time"
    if kind in ("completion", "stream", "cut_stream"):
        streamed = kind != "completion"
        return "/v1/completions", {
            "model": model,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "stream": streamed,
        }
    if kind == "json_schema":
        schema = {
            "type": "object",
            "properties": {f"field_{i}": {"type": "integer", "maximum": i}},
            "required": [f"field_{i}"],
        }
        messages = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", {
            "model": model,
            "messages": messages,
            "max_tokens": 12,
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
        }
    if kind == "stops_and_bias":
        stops = [f"stop {j} " + "x" * 44 for j in range(4)]
        bias = {str(token): -1.0 for token in range(1000, 1256)}
        return "/v1/completions", {
            "model": model,
            "prompt": prompt,
            "max_tokens": 8,
            "stop": stops,
            "logit_bias": bias,
        }
    if kind == "span_query":
        docs = {
            "plus": [{"user": f"Document {j} of set {i % 50}: a short text."} for j in range(3)]
        }
        cross = [{"system": "Answer from the documents."}, docs, {"user": "What do they say?"}]
        g = {"model": model, "input": {"cross": cross}, "max_tokens": 8, "temperature": 0}
        query = {"repeat": {"n": 1, "g": g}}
        return "/v1/query/execute?stream=false", json.dumps(query).encode()
    if kind == "not_json":
        return "/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": '
    deep = '{"type": "array", "items": ' * 300 + '{"type": "string"}' + "}" * 300
    raw = (
        f'{{"model": "{model}", "max_tokens": 4, "messages": [{{"role": "user", '
        f'"content": "x"}}], "response_format": {{"type": "json_schema", "json_schema": '
        f'{{"schema": {deep}}}}}}}'
    )
    return "/v1/chat/completions", raw.encode()


async def send(client: httpx.AsyncClient, base: str, kind: str, i: int, model: str) -> int:
    path, payload = body(kind, i, model)
    url = base + path
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    try:
        async with client.stream("POST", url, content=content, headers=headers) as answer:
            if kind == "cut_stream":
                async for _ in answer.aiter_lines():
                    break  # the client leaves after its first chunk
                return answer.status_code
            await answer.aread()
            return answer.status_code
    except httpx.HTTPError:
        return 0


def sample(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    found = {
        key: int(re.search(rf"^{key}:\s+(\d+)", status, re.M).group(1))
        for key in ("VmRSS", "Threads")
    }
    return {
        "rss_mb": found["VmRSS"] / 1024,
        "threads": found["Threads"],
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


async def pool_in_use(client: httpx.AsyncClient, base: str) -> int | None:
    text = (await client.get(base + "/metrics")).text
    found = re.search(r"^spnl_kv_blocks_used(?:\{[^}]*\})? (\S+)", text, re.M)
    return None if found is None else int(float(found.group(1)))


async def healthy(client: httpx.AsyncClient, base: str, model: str) -> str:
    answer = await client.post(base + "/v1/completions", json={"model": model, **HEALTHY})
    return answer.json()["choices"][0]["text"]


async def soak(base: str, pid: int, args: argparse.Namespace, process) -> dict:
    async with httpx.AsyncClient(timeout=10) as client:
        await wait_ready(client, base, 300, process)
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=fresh) as client:
        model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
        before = await healthy(client, base, model)
        gate, statuses, samples = asyncio.Semaphore(args.clients), [], []
        start = time.perf_counter()

        async def one(i: int) -> None:
            async with gate:
                statuses.append(
                    (
                        KINDS[i % len(KINDS)],
                        await send(client, base, KINDS[i % len(KINDS)], i, model),
                    )
                )

        for first in range(0, args.requests, args.every):
            count = min(args.every, args.requests - first)
            await asyncio.gather(*(one(i) for i in range(first, first + count)))
            found = sample(pid) | {"requests": first + count, "s": time.perf_counter() - start}
            found["pool"] = await pool_in_use(client, base)
            samples.append(found)
            print(json.dumps(found), file=sys.stderr)
        await asyncio.sleep(1)
        end_pool = await pool_in_use(client, base)
        after = await healthy(client, base, model)
    return {"samples": samples, "statuses": statuses, "same": before == after, "pool": end_pool}


def report(result: dict, args: argparse.Namespace) -> str:
    samples = result["samples"]
    base_at = min(1000, max(args.requests // 10, args.every))
    baseline = next(s for s in samples if s["requests"] >= base_at)
    last = samples[-1]
    show = [s for s in samples if s["requests"] % max(args.requests // 10, args.every) == 0]
    rows = [
        [
            f"{s['requests']:,}",
            f"{s['s']:.0f} s",
            f"{s['rss_mb']:,.0f} MB",
            s["fds"],
            s["threads"],
            s["pool"],
        ]
        for s in show
    ]
    table = harness.md_table(
        ["requests", "time", "RSS", "descriptors", "threads", "pool blocks in use"], rows
    )
    counts: dict[str, int] = {}
    for _, status in result["statuses"]:
        counts[str(status)] = counts.get(str(status), 0) + 1
    growth = last["rss_mb"] / baseline["rss_mb"] - 1
    notes = [
        f"{args.requests:,} requests, {args.clients} clients, the mix of bench/soak.py.",
        f"HTTP statuses: {dict(sorted(counts.items()))} (0: no response).",
        f"RSS after {baseline['requests']:,} requests {baseline['rss_mb']:,.0f} MB, at the end "
        f"{last['rss_mb']:,.0f} MB ({growth:+.1%}; target at most +10%).",
        f"Descriptors {baseline['fds']} -> {last['fds']}, threads {baseline['threads']} -> "
        f"{last['threads']}; pool blocks in use at the end: {result['pool']}.",
        f"A healthy greedy request gives the same text before and after: {result['same']}.",
    ]
    return table + "\n\n" + "\n".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    with serving_ours(args.gguf or harness.default_gguf(), args.threads) as (base, process):
        result = asyncio.run(soak(base, process.pid, args, process))
    harness.publish(report(result, args), args.markdown)


if __name__ == "__main__":
    main()
