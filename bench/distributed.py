"""Tensor parallelism on the CPU: 2 ranks of 1 thread against 1 process of 2 threads.

    python bench/distributed.py [--runs 3] [--shapes llama-1b] [--markdown FILE]

Informational: on one machine the ranks share its memory bandwidth, so splitting a model
over processes only adds work (each step's all-reduces, two per layer, and the messages by
which rank 0 has the others run the step). This shows that cost. Each configuration runs in
a fresh process with bench/decode.py's probes (TTFT, prefill and decode tok/s) on the
default model and on bench/synthetic_gguf.py's files (real shapes, random blocks); the
split run also times rank 0's collectives (waiting for the others included) per decoded
token. Peak RSS is rank 0's process alone.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import decode
import harness
import real_sizes

CONFIGS = {"1 process x 2 threads": (1, 2), "2 ranks x 1 thread": (2, 2)}


def run_split(gguf: Path, world: int, threads: int, runs: int) -> dict:
    """The probes with ``world`` local ranks (each the machine's cores over ``world``),
    and the milliseconds rank 0 spends in collectives per decoded token."""
    if world > 1:
        os.environ["MISTRALRS_MN_LOCAL_WORLD_SIZE"] = str(world)
    spent = _time_collectives()
    per_token: list[float] = []

    def ours(gguf: Path, threads: int) -> decode.Probes:
        ttft, prefill, decoded = decode.run_ours(gguf, threads)

        def timed_decode() -> tuple[float, int]:
            spent.clear()
            tok_s, tokens = decoded()
            per_token.append(1000 * sum(spent.values()) / tokens)
            return tok_s, tokens

        return ttft, prefill, timed_decode

    result = decode.measure("spnl-backend", gguf, threads, runs, run=ours)
    result["collective_ms_per_token"] = statistics.median(per_token) if world > 1 else None
    return result


def _time_collectives() -> dict[str, float]:
    """Seconds in each of the group's collectives, from now on (rank 0's)."""
    from spnl_backend.distributed import group

    spent: dict[str, float] = {}
    for name in ("all_reduce_", "all_gather", "broadcast_"):
        original = getattr(group.Group, name)

        def timed(self, *args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - start

        setattr(group.Group, name, timed)
    return spent


HEADER = [
    "model",
    "configuration",
    "decode tok/s",
    "collectives per token",
    "TTFT",
    "prefill tok/s",
    "rank 0 peak RSS",
    "load",
]


def row(model: str, config: str, r: dict) -> list[str]:
    if "error" in r:
        return [model, config, f"not run: {r['error']}"]
    collective = r.get("collective_ms_per_token")
    return [
        model,
        config,
        f"{r['decode_tok_s']:.1f}",
        "-" if collective is None else f"{collective:.2f} ms",
        f"{r['ttft_ms']:.0f} ms",
        f"{r['prefill_tok_s']:.0f} ({r['prefill_tokens']} tokens)",
        f"{r['peak_rss_mb']:,.0f} MB",
        f"{r['load_s']:.1f} s",
    ]


def main() -> None:
    parser = harness.arguments(__doc__, runs=True)
    parser.add_argument("--shapes", nargs="*", default=["llama-1b"])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--gguf", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        world, threads = map(int, args.child)
        print(json.dumps(run_split(args.gguf, world, threads, args.runs)))
        return
    models = [("Gemma 3 270M Q4_K_M (default)", harness.default_gguf())]
    for shape in args.shapes:
        path = real_sizes.synthetic_file(harness.bench_cache("bench-gguf"), shape, "q4_k_m")
        models.append((f"{shape} Q4_K_M (synthetic)", path))
    rows = []
    for label, gguf in models:
        for config, (world, threads) in CONFIGS.items():
            command = [sys.executable, __file__, "--child", world, threads, "--gguf", gguf]
            result = harness.run_json_child([*command, "--runs", args.runs])
            print(json.dumps({"model": label, "config": config, **result}), file=sys.stderr)
            rows.append(row(label, config, result))
    harness.publish(
        f"{harness.md_table(HEADER, rows)}\n\n"
        f"greedy, {harness.DECODE_TOKENS} decode tokens, median of {args.runs} runs; "
        "collectives: rank 0's time in all-reduces, gathers and step messages per decoded "
        "token (waiting for the other rank included).",
        args.markdown,
    )


if __name__ == "__main__":
    main()
