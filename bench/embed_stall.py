"""Does an embedding batch stall generation? A stream's gaps between tokens, and a short
request's seconds, while one `POST /v1/embeddings` of 512 texts (some 64 tokens each) runs.

    python bench/embed_stall.py [--texts 512] [--words 58] [--gguf GGUF] [--markdown FILE]

The server (`spnl-backend serve`, the default model unless ``--gguf``) runs as a child
on 127.0.0.1. Measured one after another: a stream alone (its median and largest gap), a
16-token request alone, the batch alone; then the stream again, the batch sent once the
stream has given a few tokens and the 16-token request a second after the batch: the
stream's largest gap while the batch was in flight, its tokens meanwhile, both
requests' seconds and `/health`'s largest latency (polled every 50 ms). Issue 53: a
13.9 s gap and 36 s for the 16-token request before the engine loop took embeddings a
chunk at a time.
"""

import argparse
import asyncio
import itertools
import statistics
import time
from pathlib import Path

import harness
import httpx
from serve import model_id, serving_ours, wait_ready

READY_TIMEOUT_S = 300
PROMPT = "Once upon a time"
WARM_TOKENS = 8  # the stream's tokens before the batch is sent
SHORT_DELAY_S = 1.0  # from the batch to the 16-token request
HEALTH_POLL_S = 0.05
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven bright stars watch quietly "
    "from far above the sleeping town"
)


def texts(count: int, words: int) -> list[str]:
    """``count`` distinct texts of ``words`` words (numbered, the words rotated)."""
    vocabulary = WORDS.split()
    return [
        f"{i}: " + " ".join(vocabulary[(i + j) % len(vocabulary)] for j in range(words))
        for i in range(count)
    ]


def gaps_during(arrivals: list[float], start: float, end: float) -> list[float]:
    """The gaps between consecutive ``arrivals`` that overlap ``[start, end]``."""
    return [b - a for a, b in itertools.pairwise(arrivals) if b > start and a < end]


async def stream(
    client: httpx.AsyncClient,
    base: str,
    model: str,
    tokens: int,
    stop: asyncio.Event | None = None,
    warm: asyncio.Event | None = None,
) -> list[float]:
    """The arrival times of a greedy stream's chunks, up to ``tokens`` or the first after
    ``stop`` is set; ``warm`` is set after `WARM_TOKENS` of them."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    arrivals: list[float] = []
    async with client.stream("POST", base + "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
                if warm is not None and len(arrivals) == WARM_TOKENS:
                    warm.set()
                if stop is not None and stop.is_set():
                    break
    return arrivals


async def timed(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    reply = await client.post(url, json=body)
    reply.raise_for_status()
    return time.perf_counter() - start, reply.json()


async def together(client: httpx.AsyncClient, base: str, model: str, batch: dict) -> dict:
    """The stream, the batch once it has begun and the short request a second later."""
    stop, warm = asyncio.Event(), asyncio.Event()
    streaming = asyncio.create_task(stream(client, base, model, 4000, stop, warm))
    warming = asyncio.create_task(warm.wait())
    await asyncio.wait({streaming, warming}, return_when=asyncio.FIRST_COMPLETED)
    if streaming.done():
        streaming.result()  # its error, if any
        raise RuntimeError("the stream ended before the batch was sent")
    start = time.perf_counter()
    embedding = asyncio.create_task(timed(client, base + "/v1/embeddings", batch))
    probing = asyncio.create_task(health_latencies(client, base, embedding))
    await asyncio.sleep(SHORT_DELAY_S)
    short_s, _ = await timed(client, base + "/v1/completions", _short(model))
    batch_s, _ = await embedding
    stop.set()
    arrivals = await streaming
    gaps = gaps_during(arrivals, start, start + batch_s)
    return {
        "max_gap_s": max(gaps),
        "tokens": len(gaps),
        "short_s": short_s,
        "batch_s": batch_s,
        "max_health_s": max(await probing),
    }


async def health_latencies(
    client: httpx.AsyncClient, base: str, until: asyncio.Task
) -> list[float]:
    """`/health`'s latencies, polled every `HEALTH_POLL_S` until ``until`` is done (its
    answer rendered and sent)."""
    latencies = []
    while not until.done():
        probe = time.perf_counter()
        (await client.get(base + "/health")).raise_for_status()
        latencies.append(time.perf_counter() - probe)
        await asyncio.sleep(HEALTH_POLL_S)
    return latencies


def _short(model: str) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    return body | {"ignore_eos": True}


async def run(base: str, count: int, words: int, process) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        await wait_ready(client, base, READY_TIMEOUT_S, process)
        model = await model_id(client, base)
        batch = {"model": model, "input": texts(count, words)}
        await timed(client, base + "/v1/embeddings", {"model": model, "input": texts(4, words)})
        arrivals = await stream(client, base, model, 64)
        gaps = gaps_during(arrivals, arrivals[0], arrivals[-1])
        short_s, _ = await timed(client, base + "/v1/completions", _short(model))
        batch_s, answer = await timed(client, base + "/v1/embeddings", batch)
        return {
            "texts": count,
            "tokens_per_text": answer["usage"]["prompt_tokens"] / count,
            "alone": {
                "median_gap_s": statistics.median(gaps),
                "max_gap_s": max(gaps),
                "short_s": short_s,
                "batch_s": batch_s,
            },
            "together": await together(client, base, model, batch),
        }


def report(result: dict) -> str:
    alone, both = result["alone"], result["together"]
    ms = lambda s: f"{1000 * s:.0f} ms"  # noqa: E731
    rows = [
        ["the stream's median gap, alone", ms(alone["median_gap_s"])],
        ["the stream's largest gap, alone", ms(alone["max_gap_s"])],
        ["the stream's largest gap, with the batch", ms(both["max_gap_s"])],
        ["the stream's tokens while the batch ran", str(both["tokens"])],
        ["16-token request, alone", f"{alone['short_s']:.2f} s"],
        ["16-token request, with the batch and the stream", f"{both['short_s']:.2f} s"],
        ["the batch, alone", f"{alone['batch_s']:.2f} s"],
        ["the batch, with the stream", f"{both['batch_s']:.2f} s"],
        ["/health's largest latency, with the batch", ms(both["max_health_s"])],
    ]
    head = (
        f"{result['texts']} texts of {result['tokens_per_text']:.0f} tokens "
        "in one POST /v1/embeddings"
    )
    return head + "\n\n" + harness.md_table(["measure", "value"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--words", type=int, default=58)
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    with serving_ours(args.gguf or harness.default_gguf(), args.threads) as (base, process):
        result = asyncio.run(run(base, args.texts, args.words, process))
    harness.publish(report(result), args.markdown)


if __name__ == "__main__":
    main()
