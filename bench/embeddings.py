"""Embeddings per second: ours and llama.cpp's llama-server, side by side in one run.

    python bench/embeddings.py --llama-server PATH [--gguf GGUF] [--threads 2]
        [--texts 128] [--batches 1 64] [--markdown FILE]

Each server is started as a child on a free 127.0.0.1 port with the same GGUF (default:
Gemma 3 270M Q4_K_M) and thread count: ours as ``spnl-backend serve``, llama.cpp's as
``llama-server --embeddings --pooling last -np 16`` (the last token's state, as ours pools
a model whose GGUF names no pooling). The texts are ``--texts`` sentences of the shipped
English text, 8 to 120 words each, the same for both. At batch B, POST /v1/embeddings is
sent with B texts per request, one request after another, until every text is embedded:
embeddings/s is the texts over the wall time. One untimed request warms each server up.
The vectors of the two servers are compared too (their mean cosine similarity): the same
pooling over the same weights should agree closely.
"""

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import harness
import httpx
from serve import (
    BUILD_LLAMA_SERVER,
    SLOTS,
    ServerError,
    free_port,
    log_tail,
    model_id,
    pair_command,
    started,
    wait_ready,
)

LLAMA_N_CTX = 2048  # per slot: the longest text is far shorter
READY_TIMEOUT_S = 300


def texts(count: int) -> list[str]:
    """``count`` pieces of the shipped text, of 8 to 120 words, cycling through sizes."""
    words = (harness.DATA / "english.txt").read_text().split()
    sizes = [8, 16, 32, 64, 120]
    out, at = [], 0
    for i in range(count):
        size = sizes[i % len(sizes)]
        if at + size > len(words):
            at = 0
        out.append(" ".join(words[at : at + size]))
        at += size
    return out


def command(engine: str, gguf: Path, port: int, threads: int, llama_server: Path | None):
    flags = ("--embeddings", "--pooling", "last")
    return pair_command(engine, gguf, port, threads, llama_server, LLAMA_N_CTX, flags)


async def embed_all(base: str, inputs: list[str], batch: int) -> tuple[float, list[list[float]]]:
    """Every input embedded ``batch`` at a time: the wall time and the vectors."""
    vectors: list[list[float]] = []
    async with httpx.AsyncClient(timeout=600) as client:
        model = await model_id(client, base)
        warm = await client.post(
            f"{base}/v1/embeddings", json={"model": model, "input": inputs[:2]}
        )
        warm.raise_for_status()
        start = time.perf_counter()
        for at in range(0, len(inputs), batch):
            body = {"model": model, "input": inputs[at : at + batch]}
            answer = await client.post(f"{base}/v1/embeddings", json=body)
            answer.raise_for_status()
            data = sorted(answer.json()["data"], key=lambda d: d["index"])
            vectors += [d["embedding"] for d in data]
        return time.perf_counter() - start, vectors


async def drive(base: str, inputs: list[str], batches: list[int], process) -> dict:
    async with httpx.AsyncClient(timeout=10) as client:
        await wait_ready(client, base, READY_TIMEOUT_S, process)
    rates, vectors = {}, []
    for batch in batches:
        wall, vectors = await embed_all(base, inputs, batch)
        rates[batch] = len(inputs) / wall
    return {"rates": rates, "vectors": vectors}


def bench(engine: str, args: argparse.Namespace, gguf: Path, inputs: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        try:
            port = free_port()
            argv, extra = command(engine, gguf, port, args.threads, args.llama_server)
            env = {**os.environ, **extra}
            with started(argv, env, log) as process:
                base = f"http://127.0.0.1:{port}"
                return asyncio.run(drive(base, inputs, args.batches, process))
        except (ServerError, httpx.HTTPError, OSError) as exc:
            return {"error": f"{exc} ({log_tail(log, 1)[:160]})"}


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return dot / norm if norm else 0.0


def report(results: dict[str, dict], batches: list[int], args, count: int) -> str:
    lines = ["| engine | " + " | ".join(f"batch {b}: embeddings/s" for b in batches) + " |"]
    lines.append("|---" * (len(batches) + 1) + "|")
    for name, result in results.items():
        if "error" in result:
            lines.append(f"| {name} | not run: {result['error']} |")
            continue
        cells = [f"{result['rates'][b]:.1f}" for b in batches]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    notes = [
        f"{count} texts of 8-120 words, {args.threads} threads, POST /v1/embeddings; "
        f"llama-server --embeddings --pooling last -np {SLOTS}."
    ]
    ours, peer = results.get("spnl-backend", {}), results.get("llama-server", {})
    if "vectors" in ours and "vectors" in peer:
        agree = [cosine(a, b) for a, b in zip(ours["vectors"], peer["vectors"], strict=True)]
        notes.append(
            f"The two servers' vectors: mean cosine similarity {statistics.mean(agree):.4f}, "
            f"lowest {min(agree):.4f}."
        )
        for b in batches:
            notes.append(f"batch {b}: {ours['rates'][b] / peer['rates'][b]:.2f}x llama-server.")
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, help=BUILD_LLAMA_SERVER)
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    gguf = args.gguf or harness.default_gguf()
    inputs = texts(args.texts)
    results = {
        "spnl-backend": bench("ours", args, gguf, inputs),
        "llama-server": bench("llama-server", args, gguf, inputs),
    }
    harness.publish(report(results, args.batches, args, len(inputs)), args.markdown)


if __name__ == "__main__":
    main()
