"""Many LoRA adapters on one base: 16 concurrent requests over 4 adapters, against the same
16 on the base alone and against llama.cpp's llama-server with the same adapters.

    python bench/lora.py --llama-server PATH [--threads 2] [--max-tokens 96] [--runs 2]
        [--markdown FILE]
    python bench/lora.py --smoke [--llama-server PATH]     (a tiny model, seconds: checks the bench)

The base is a synthetic GGUF of Llama-3.2-1B's shape (Q4_K_M, random valid blocks:
`synthetic_gguf.py`, written once and cached; ``--smoke`` uses its ``tiny`` shape). The
adapters are 4 random GGUF LoRA files, rank 16 (alpha 16: scale 1) on every attention and
MLP projection of every layer, in the layout llama.cpp's ``convert_lora_to_gguf.py``
writes: ``general.type = adapter``, ``adapter.type = lora``, ``adapter.lora.alpha``, and
each projection's ``blk.N.<tensor>.weight.lora_a [r, in]`` and ``.lora_b [out, r]`` in F32.

Each server is started once, as a child on a free 127.0.0.1 port with the same thread
count and the 4 adapters: ours as ``spnl-backend serve --model GGUF --lora a0=FILE ...``
(OMP_NUM_THREADS, a KV budget of llama-server's context), llama-server as ``llama-server
-m GGUF --lora FILE (x4) --lora-init-without-apply -np 16 -c 16*512 -t T -tb T`` (each
adapter loaded at scale 0, applied per request). A phase sends 16 requests at once to POST
/v1/completions, each with its own prompt ("Request i: ..."), ``temperature: 0``,
``max_tokens`` and ``ignore_eos`` (every request gives that many tokens); in the adapters'
phase request i carries ``"lora": [{"id": i % 4, "scale": 1.0}]`` (llama-server's
per-request field, which ours reads too), on the base none. Throughput: the 16 requests'
completion tokens over the phase's wall time (the first request sent to the last answer),
the best of ``--runs``, the two phases alternating. One untimed request on the base and on
each adapter warms each server up first. The table also counts the requests whose text
the adapter changed from the base's (a check that each server applied it).

The full run (1B-sized, 96 tokens, 2 runs, 2 threads) is sized to take about 5-8 minutes
on 2 idle cores (estimated from the per-step costs, not measured), most of it the two
servers' phases; the synthetic GGUF is written on the first run only. Each phase's rate is
printed to stderr as it ends.
"""

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import harness
import httpx
import numpy as np
from serve import (
    BUILD_LLAMA_SERVER,
    ServerError,
    free_port,
    log_tail,
    ours_executable,
    started,
    wait_ready,
)

REQUESTS, ADAPTERS, RANK = 16, 4, 16
SLOT_CTX = 512  # llama-server's context per slot (-c is 16 of them): prompt and output fit
READY_TIMEOUT_S = 600
TOPICS = ("the sea", "a mountain village", "the history of clocks", "a letter to a friend")
LABELS = {"ours": "spnl-backend", "llama-server": f"llama-server -np {REQUESTS}"}


# ---- the adapters -------------------------------------------------------------------------


def projections(dims) -> dict[str, tuple[int, int]]:
    """Every attention and MLP projection of a layer, by llama.cpp's tensor name: (in, out)."""
    q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    return {
        "attn_q": (dims.hidden, q),
        "attn_k": (dims.hidden, kv),
        "attn_v": (dims.hidden, kv),
        "attn_output": (q, dims.hidden),
        "ffn_gate": (dims.hidden, dims.ffn),
        "ffn_up": (dims.hidden, dims.ffn),
        "ffn_down": (dims.ffn, dims.hidden),
    }


def adapter_tensors(dims, rank: int, seed: int):
    """``(name, array)`` of a random adapter: lora_a ``[r, in]`` of about unit products,
    lora_b ``[out, r]`` small, so each projection moves by a tenth or so of its output."""
    rng = np.random.default_rng(seed)
    for layer in range(dims.layers):
        for tensor, (inputs, outputs) in projections(dims).items():
            stem = f"blk.{layer}.{tensor}.weight"
            a = rng.standard_normal((rank, inputs), dtype=np.float32) / np.sqrt(inputs)
            b = rng.standard_normal((outputs, rank), dtype=np.float32) * 0.05
            yield f"{stem}.lora_a", a.astype(np.float32)
            yield f"{stem}.lora_b", b


def write_adapter(path: Path, dims, rank: int, seed: int) -> Path:
    """A random GGUF LoRA adapter for a base of ``dims`` (a `synthetic_gguf.Shape`), in the
    keys and tensors llama.cpp's converter writes."""
    import gguf

    writer = gguf.GGUFWriter(path, dims.arch)
    writer.add_name(f"random LoRA {seed}")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))  # scale alpha / r = 1
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, array in adapter_tensors(dims, rank, seed):
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def base_model(shape_name: str):
    """The synthetic base GGUF (written once, cached) and its `synthetic_gguf.Shape`."""
    import synthetic_gguf

    shape = synthetic_gguf.SHAPES[shape_name]
    path = harness.bench_cache("bench-gguf") / f"{shape_name}-q4_k_m.gguf"
    if not path.exists():
        print(f"writing {path} ...", file=sys.stderr)
        partial = path.with_suffix(".part")
        synthetic_gguf.write(partial, shape_name, "q4_k_m")
        partial.rename(path)
    return path, shape


# ---- the requests -------------------------------------------------------------------------


def request_body(index: int, model: str, max_tokens: int, adapters: int) -> dict:
    """Request ``index``'s body: its own prompt; with ``adapters``, adapter ``index % adapters``
    at scale 1 (llama-server's per-request field), else the base."""
    body = {
        "model": model,
        "prompt": f"Request {index}: write a few sentences about {TOPICS[index % len(TOPICS)]}.",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if adapters:
        body["lora"] = [{"id": index % adapters, "scale": 1.0}]
    return body


async def complete(client: httpx.AsyncClient, base: str, body: dict) -> tuple[str, int]:
    """One completion's text and completion tokens (an HTTP error raises)."""
    answer = await client.post(f"{base}/v1/completions", json=body)
    if answer.status_code != 200:
        raise ServerError(f"POST /v1/completions answered {answer.status_code}: {answer.text}")
    data = answer.json()
    return data["choices"][0]["text"], int(data["usage"]["completion_tokens"])


async def phase(client: httpx.AsyncClient, base: str, bodies: list[dict]) -> dict:
    """The bodies sent at once: wall time, tokens and each request's text."""
    start = time.perf_counter()
    done = await asyncio.gather(*(complete(client, base, body) for body in bodies))
    wall = time.perf_counter() - start
    tokens = sum(count for _, count in done)
    return {"wall": wall, "tokens": tokens, "tok_s": tokens / wall, "texts": [t for t, _ in done]}


async def base_model_id(client: httpx.AsyncClient, base: str) -> str:
    """The served base model's id (ours lists its adapters beside it, with a parent)."""
    answer = await client.get(f"{base}/v1/models")
    answer.raise_for_status()
    return next(m["id"] for m in answer.json()["data"] if not m.get("parent"))


async def drive(base: str, args: argparse.Namespace, process) -> dict:
    limits = httpx.Limits(max_connections=REQUESTS + 4)
    async with httpx.AsyncClient(timeout=10) as client:
        await wait_ready(client, base, READY_TIMEOUT_S, process)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
        model = await base_model_id(client, base)
        await complete(client, base, request_body(0, model, 4, 0))  # warm: the base,
        for index in range(ADAPTERS):  # then each adapter
            await complete(client, base, request_body(index, model, 4, ADAPTERS))
        runs: dict[str, list[dict]] = {"base": [], "lora": []}
        for _ in range(args.runs):
            for kind, adapters in (("base", 0), ("lora", ADAPTERS)):
                bodies = [
                    request_body(i, model, args.max_tokens, adapters) for i in range(REQUESTS)
                ]
                done = await phase(client, base, bodies)
                print(f"{base}: {kind}: {done['tok_s']:.1f} tok/s", file=sys.stderr)
                runs[kind].append(done)
    best = {kind: max(found, key=lambda r: r["tok_s"]) for kind, found in runs.items()}
    changed = sum(a != b for a, b in zip(best["base"]["texts"], best["lora"]["texts"], strict=True))
    return {**best, "changed": changed}


# ---- the servers --------------------------------------------------------------------------


def command(
    engine: str, gguf: Path, adapters: list[Path], port: int, threads: int, llama_server
) -> tuple[list[str], dict]:
    """The server's argv and its environment's additions."""
    if engine == "ours":
        argv = [ours_executable(), "serve", "--host", "127.0.0.1", "--port", port, "--model", gguf]
        for i, path in enumerate(adapters):
            argv += ["--lora", f"a{i}={path}"]
        budget = str(REQUESTS * SLOT_CTX)
        env = {"OMP_NUM_THREADS": str(threads), "MISTRALRS_PAGED_ATTN_CONTEXT_LEN": budget}
        if harness.SPECULATION_VAR not in os.environ:  # llama-server here speculates neither
            env[harness.SPECULATION_VAR] = "none"
        return [str(a) for a in argv], env
    if llama_server is None or not Path(llama_server).is_file():
        raise ServerError(f"--llama-server PATH is needed; build it: {BUILD_LLAMA_SERVER}")
    argv = [llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", port]
    for path in adapters:
        argv += ["--lora", path]
    argv += ["--lora-init-without-apply", "-np", REQUESTS, "-c", REQUESTS * SLOT_CTX]
    argv += ["-t", threads, "-tb", threads]
    return [str(a) for a in argv], {}


def bench(engine: str, args: argparse.Namespace, gguf: Path, adapters: list[Path]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        try:
            port = free_port()
            argv, extra = command(engine, gguf, adapters, port, args.threads, args.llama_server)
            with started(argv, {**os.environ, **extra}, log) as process:
                return asyncio.run(drive(f"http://127.0.0.1:{port}", args, process))
        except (ServerError, httpx.HTTPError, OSError) as exc:
            print(f"{engine}: {exc}\n{log_tail(log, 20)}", file=sys.stderr)
            last = (log_tail(log, 1) or "no output").replace("|", "\\|")[:160]
            return {"error": f"{exc} ({last})"}


# ---- the table ----------------------------------------------------------------------------

HEADER = ["engine", "requests", "adapters", "tokens", "wall", "output tok/s", "vs its base"]


def report(results: dict[str, dict], args: argparse.Namespace, model: str) -> str:
    rows = []
    for name, result in results.items():
        if "error" in result:
            rows.append([name, REQUESTS, "–", "–", "–", f"not run: {result['error']}", "–"])
            continue
        base, lora = result["base"], result["lora"]
        for label, run in (("none (the base)", base), (f"{ADAPTERS} (rank {RANK})", lora)):
            ratio = f"{run['tok_s'] / base['tok_s']:.2f}x"
            wall = f"{run['wall']:.1f} s"
            rows.append([name, REQUESTS, label, run["tokens"], wall, f"{run['tok_s']:.1f}", ratio])
    notes = [
        f"{model}, {args.threads} threads, {REQUESTS} requests sent at once to POST "
        f"/v1/completions, {args.max_tokens} tokens each (ignore_eos, greedy), best of "
        f"{args.runs}; with adapters, request i takes adapter i % {ADAPTERS} "
        '(`"lora": [{"id": i % 4, "scale": 1.0}]`).'
    ]
    for name, result in results.items():
        if "changed" in result:
            changed = f"{result['changed']}/{REQUESTS}"
            notes.append(f"{name}: the adapter changed the text of {changed} requests.")
    ours, peer = results.get(LABELS["ours"], {}), results.get(LABELS["llama-server"], {})
    if "lora" in ours:
        ratio = ours["lora"]["tok_s"] / ours["base"]["tok_s"]
        notes.append(f"Ours with adapters: {ratio:.2f}x its base (target: at least 0.80x).")
    if "lora" in ours and "lora" in peer:
        ratio = ours["lora"]["tok_s"] / peer["lora"]["tok_s"]
        notes.append(f"Ours with adapters: {ratio:.2f}x llama-server's with the same adapters.")
    return harness.md_table(HEADER, rows) + "\n\n" + "\n".join(notes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.arguments(__doc__, runs=True)
    parser.set_defaults(runs=2)
    parser.add_argument("--llama-server", type=Path, help=BUILD_LLAMA_SERVER)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 8 tokens, 1 run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.max_tokens, args.runs = 8, 1
    if args.max_tokens < 1 or args.runs < 1:
        parser.error("--max-tokens and --runs must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    began = time.perf_counter()
    shape = "tiny" if args.smoke else "llama-1b"
    gguf, dims = base_model(shape)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            write_adapter(Path(tmp) / f"lora-{i}.gguf", dims, RANK, seed=i) for i in range(ADAPTERS)
        ]
        results = {label: bench(engine, args, gguf, adapters) for engine, label in LABELS.items()}
    model = f"synthetic {shape} Q4_K_M"
    harness.publish(report(results, args, model), args.markdown)
    print(f"\n(the whole run took {time.perf_counter() - began:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
