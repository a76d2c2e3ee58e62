"""Speed on a machine that is doing other things: ours and llama.cpp side by side, with 0, 1
and 2 other busy processes on the cores, at 1 thread, 2 threads and each engine's default.

    python bench/contention.py [--peers-python PATH] [--gguf PATH ...] [--default-model]
        [--loads 0 1 2] [--threads 1 2 default] [--runs 3] [--markdown FILE]

A competing process is a fixed arithmetic loop (a linear congruential generator in plain
Python, one core's worth of work each), started before the measurement and killed after.
For each model, load and thread setting, a fresh child process per engine loads the model
and measures, greedy: prefill tok/s of a ~512-token prompt (to its first token) and decode
tok/s of 64 tokens after the first (stopped after 60 s: a collapsed engine would take many
minutes); medians of ``--runs``. "default" sets nothing: ours then
sizes its pool itself, llama-cpp-python takes its own default (half the CPU count). A
fixed count is set the way each engine takes it: ``MISTRALRS_NUM_THREADS`` (and
``OMP_NUM_THREADS``) for ours, ``n_threads``/``n_threads_batch`` for llama.cpp.

The table gives each figure with, for ours, its ratio to the best fixed thread count at
that load (the target: never below 0.9x) and to llama.cpp at the same setting.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import decode
import harness
from real_sizes import isa_line, read_text

BUSY = "x = 1\nwhile True:\n    x = (x * 1103515245 + 12345) % 2147483648\n"
PREFILL_TOKENS = 512
DECODE_TOKENS = 64  # greedy, after the first
BUDGET_S = 60.0  # a decode stops here, however few tokens it made
ENGINES = ("ours", "llama.cpp")


def parse_args(argv: list[str] | None = None):
    parser = harness.arguments(__doc__, runs=True)
    harness.add_peers_python(parser, "llama-cpp-python")
    parser.add_argument("--gguf", type=Path, action="append", default=[])
    parser.add_argument("--default-model", action="store_true")
    parser.add_argument("--loads", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--settings", nargs="+", default=["1", "2", "default"])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.default_model and not args.gguf:
        args.default_model = True
    return args


@contextlib.contextmanager
def busy(count: int) -> Iterator[None]:
    """``count`` processes spinning on arithmetic until the block ends."""
    loops = [
        subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.DEVNULL)
        for _ in range(count)
    ]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def child_env(engine: str, setting: str) -> dict:
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MISTRALRS_NUM_THREADS"):
        env.pop(name, None)
    if engine == "ours" and setting != "default":
        env["MISTRALRS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = setting
    return env


def measure_child(engine: str, python: str, gguf: Path, setting: str, runs: int) -> dict:
    command = [python, __file__, "--child", engine, "--gguf", str(gguf)]
    command += ["--settings", setting, "--runs", str(runs)]
    return harness.run_json_child(command, child_env(engine, setting))


def child(args) -> None:
    """One engine's measurement, in this process: prints its JSON."""
    setting = args.settings[0]
    threads = None if setting == "default" else int(setting)
    gguf = args.gguf[0]
    prefill, decode_probe = run_ours(gguf) if args.child == "ours" else run_llama(gguf, threads)
    prefills = [prefill() for _ in range(args.runs)]
    decodes = [decode_probe() for _ in range(args.runs)]
    result = {
        "prefill_tok_s": sorted(prefills)[len(prefills) // 2],
        "decode_tok_s": sorted(decodes)[len(decodes) // 2],
    }
    print(json.dumps(result))


def _within_budget(tokens) -> float:
    """Decode tok/s from an iterator yielding once per token (the first one included),
    stopped at `DECODE_TOKENS` after the first or after `BUDGET_S` seconds (a collapsed
    engine would take many minutes)."""
    first = last = None
    count = 0
    for _ in tokens:
        last = time.perf_counter()
        first = first or last
        count += 1
        if count > DECODE_TOKENS or last - first > BUDGET_S:
            break
    return (count - 1) / (last - first) if count > 1 and last > first else 0.0


def run_ours(gguf: Path):
    """Our probes, the pool as the settings size it (nothing forced from here)."""
    from spnl_backend.request import sampling_params

    backend = harness.load_ours(gguf, prefix_cache_n=0)
    prompt = harness.long_prompt(backend.tokenizer.encode, PREFILL_TOKENS)
    backend.generate(decode.SHORT_PROMPT, max_tokens=4, temperature=0)
    params = sampling_params(max_tokens=DECODE_TOKENS + 1, temperature=0, ignore_eos=True)

    def prefill() -> float:
        usage = backend.generate(prompt, max_tokens=1, temperature=0).usage
        return usage.prompt_tokens / usage.ttft_s

    def decode_probe() -> float:
        return _within_budget(backend.run_steps([harness.STORY_PROMPT], params))

    return prefill, decode_probe


def run_llama(gguf: Path, threads: int | None):
    if threads is None:
        threads = max((os.cpu_count() or 2) // 2, 1)  # llama-cpp-python's own default
    llm = harness.load_llama_cpp(gguf, threads)
    prompt = harness.long_prompt(lambda text: llm.tokenize(text.encode()), PREFILL_TOKENS)
    llm.create_completion(decode.SHORT_PROMPT, max_tokens=4, temperature=0.0)

    def prefill() -> float:
        llm.reset()
        tokens = len(llm.tokenize(prompt.encode()))
        start = time.perf_counter()
        next(iter(llm.create_completion(prompt, max_tokens=1, temperature=0.0, stream=True)))
        return tokens / (time.perf_counter() - start)

    def decode_probe() -> float:
        llm.reset()
        stream = llm.create_completion(
            harness.STORY_PROMPT, max_tokens=DECODE_TOKENS + 1, temperature=0.0, stream=True
        )
        return _within_budget(stream)

    return prefill, decode_probe


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    models = [harness.default_gguf()] if args.default_model else []
    models += args.gguf
    rows = []
    for gguf in models:
        for load in args.loads:
            with busy(load):
                for setting in args.settings:
                    for engine in args.engines:
                        python = sys.executable if engine == "ours" else args.peers_python
                        result = measure_child(engine, python, gguf, setting, args.runs)
                        row = {"model": gguf.stem, "load": load, "threads": setting}
                        row |= {"engine": engine} | result
                        print(json.dumps(row), file=sys.stderr)
                        rows.append(row)
    machine = f"{isa_line(read_text('/proc/cpuinfo'))}; {os.cpu_count()} CPUs"
    harness.publish(f"{machine}\n\n{table(rows)}", args.markdown)


def _value(rows: list[dict], key: str, **where) -> float | None:
    for row in rows:
        if all(row.get(k) == v for k, v in where.items()):
            return row.get(key)
    return None


def table(rows: list[dict]) -> str:
    header = ["model", "busy processes", "threads", "ours decode tok/s", "llama.cpp decode",
              "ours / llama.cpp", "ours / our best fixed", "ours prefill tok/s",
              "llama.cpp prefill"]  # fmt: skip
    lines = []
    settings = sorted({r["threads"] for r in rows})
    for model in dict.fromkeys(r["model"] for r in rows):
        for load in sorted({r["load"] for r in rows}):
            fixed = [
                _value(rows, "decode_tok_s", model=model, load=load, threads=s, engine="ours")
                for s in settings
                if s != "default"
            ]
            best = max((v for v in fixed if v), default=None)
            for setting in settings:
                where = {"model": model, "load": load, "threads": setting}
                ours = _value(rows, "decode_tok_s", engine="ours", **where)
                theirs = _value(rows, "decode_tok_s", engine="llama.cpp", **where)
                lines.append([
                    model, load, setting, _fmt(ours), _fmt(theirs),
                    f"{ours / theirs:.2f}x" if ours and theirs else "",
                    f"{ours / best:.2f}x" if ours and best else "",
                    _fmt(_value(rows, "prefill_tok_s", engine="ours", **where)),
                    _fmt(_value(rows, "prefill_tok_s", engine="llama.cpp", **where)),
                ])  # fmt: skip
    return harness.md_table(header, lines)


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:,.1f}"


if __name__ == "__main__":
    main()
