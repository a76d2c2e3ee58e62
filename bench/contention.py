"""Speed on a machine that is doing other things: ours and llama.cpp side by side, with 0, 1
and 2 other busy processes on the cores, at 1 thread, 2 threads and each engine's default.

    python bench/contention.py [--peers-python PATH] [--gguf PATH ...] [--default-model]
        [--loads 0 1 2] [--settings 1 2 default] [--rounds 3] [--runs 1] [--before CHECKOUT]
        [--markdown FILE]

A competing process is a fixed arithmetic loop (a linear congruential generator in plain
Python, one core's worth of work each), started before the measurements at its load and
killed after. For each model and load, every engine at every thread setting is measured by
a child process of its own (one engine, one setting: two models in one process would
change what is measured), and the children run round after round (``--rounds``), every
engine and setting in each round, so that the load's ups and downs fall on all of them
alike; a child measures ``--runs`` times and each figure is the median over the rounds of
its child's median, greedy: prefill tok/s of a ~512-token prompt (to its first token) and decode
tok/s of 64 tokens after the first (stopped after 60 s: a collapsed engine would take many
minutes). "default" sets nothing: ours then sizes its pool itself (``auto``), llama-cpp-
python takes its own default (half the CPU count). A fixed count is set as each engine
takes it: ``MISTRALRS_NUM_THREADS`` for ours, ``n_threads``/``n_threads_batch`` for
llama.cpp. ``--before CHECKOUT`` adds the spnl_backend of another checkout (the code before
a change) as an engine of its own, its thread count set through torch's
(``torch.set_num_threads``, what it took then).

The table gives, for each figure of ours, its ratio to the best fixed thread count at that
load (the target: never below 0.9x) and to llama.cpp at the same setting and at its best.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import decode
import harness
from real_sizes import isa_line, read_text

BUSY = "x = 1\nwhile True:\n    x = (x * 1103515245 + 12345) % 2147483648\n"
PREFILL_TOKENS = 512
DECODE_TOKENS = 64  # greedy, after the first
BUDGET_S = 60.0  # a decode stops here, however few tokens it made
ENGINES = ("ours", "before", "llama.cpp")

Probe = tuple[Callable[[], float], Callable[[], float]]  # prefill tok/s, decode tok/s


def parse_args(argv: list[str] | None = None):
    parser = harness.arguments(__doc__, runs=True)
    harness.add_peers_python(parser, "llama-cpp-python")
    parser.set_defaults(runs=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gguf", type=Path, action="append", default=[])
    parser.add_argument("--default-model", action="store_true")
    parser.add_argument("--loads", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--settings", nargs="+", default=["1", "2", "default"])
    parser.add_argument("--engines", nargs="+", default=["ours", "llama.cpp"], choices=ENGINES)
    parser.add_argument("--before", type=Path, help="a checkout whose spnl_backend to add")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.default_model and not args.gguf:
        args.default_model = True
    if args.before and "before" not in args.engines:
        args.engines.insert(1, "before")
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


def measure_child(engine: str, args, gguf: Path, setting: str) -> dict:
    python = args.peers_python if engine == "llama.cpp" else sys.executable
    command = [python, __file__, "--child", engine, "--gguf", str(gguf)]
    command += ["--runs", str(args.runs), "--settings", setting]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
    if engine == "before":
        env["PYTHONPATH"] = str(args.before)
    return harness.run_json_child(command, env)


def child(args) -> None:
    """One engine at one setting, measured ``--runs`` times: prints the medians' JSON."""
    make = {"ours": ours_probes, "before": before_probes, "llama.cpp": llama_probes}
    prefill, decode_probe = make[args.child](args.gguf[0], args.settings[0])
    runs = [(prefill(), decode_probe()) for _ in range(args.runs)]
    print(json.dumps({
        "prefill_tok_s": statistics.median(p for p, _ in runs),
        "decode_tok_s": statistics.median(d for _, d in runs),
    }))  # fmt: skip


def _within_budget(tokens) -> float:
    """Decode tok/s from an iterator yielding once per token (the first one included),
    stopped at `DECODE_TOKENS` after the first or after `BUDGET_S` seconds."""
    first = last = None
    count = 0
    for _ in tokens:
        last = time.perf_counter()
        first = first or last
        count += 1
        if count > DECODE_TOKENS or last - first > BUDGET_S:
            break
    return (count - 1) / (last - first) if count > 1 and last > first else 0.0


def ours_probes(gguf: Path, setting: str, before_each: Callable[[], None] | None = None) -> Probe:
    """Our probes; ``before_each`` runs before each of them (the checkout before: it sets
    torch's thread count, which that code computed on), else the setting is ours."""
    from spnl_backend.request import sampling_params

    fixed = setting != "default" and before_each is None
    ready = before_each or (lambda: None)
    ready()  # before the load: the engine thread takes torch's count when it starts
    backend = harness.load_ours(
        gguf, prefix_cache_n=0, **({"num_threads": setting} if fixed else {})
    )
    prompt = harness.long_prompt(backend.tokenizer.encode, PREFILL_TOKENS)
    backend.generate(decode.SHORT_PROMPT, max_tokens=4, temperature=0)
    params = sampling_params(max_tokens=DECODE_TOKENS + 1, temperature=0, ignore_eos=True)

    def prefill() -> float:
        ready()
        usage = backend.generate(prompt, max_tokens=1, temperature=0).usage
        return usage.prompt_tokens / usage.ttft_s

    def decode_probe() -> float:
        ready()
        return _within_budget(backend.run_steps([harness.STORY_PROMPT], params))

    return prefill, decode_probe


def before_probes(gguf: Path, setting: str) -> Probe:
    """The checkout before: its compute threads were torch's, set before each probe."""
    import torch

    count = torch.get_num_threads() if setting == "default" else int(setting)
    return ours_probes(gguf, setting, lambda: torch.set_num_threads(count))


def llama_probes(gguf: Path, setting: str) -> Probe:
    threads = max((os.cpu_count() or 2) // 2, 1) if setting == "default" else int(setting)
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
                rows += measure_load(args, gguf, load)
    machine = f"{isa_line(read_text('/proc/cpuinfo'))}; {os.cpu_count()} CPUs"
    harness.publish(f"{machine}\n\n{table(rows, args.settings)}", args.markdown)


def measure_load(args, gguf: Path, load: int) -> list[dict]:
    """Every engine at every setting, round after round; the medians over the rounds."""
    found: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for engine in args.engines:
            for setting in args.settings:
                result = measure_child(engine, args, gguf, setting)
                where = {"model": gguf.stem, "load": load, "threads": setting, "engine": engine}
                print(json.dumps(where | result), file=sys.stderr)
                found.setdefault((engine, setting), []).append(result)
    rows = []
    for (engine, setting), results in found.items():
        row = {"model": gguf.stem, "load": load, "threads": setting, "engine": engine}
        for key in ("prefill_tok_s", "decode_tok_s"):
            values = [r[key] for r in results if key in r]
            row[key] = statistics.median(values) if values else None
        rows.append(row)
    return rows


def _value(rows: list[dict], key: str, **where) -> float | None:
    for row in rows:
        if all(row.get(k) == v for k, v in where.items()):
            return row.get(key)
    return None


def table(rows: list[dict], settings: list[str]) -> str:
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    header = ["model", "busy processes", "threads"]
    header += [f"{e} decode tok/s" for e in engines]
    header += ["ours / best fixed", "ours / llama.cpp", "ours / llama.cpp's best"]
    header += [f"{e} prefill tok/s" for e in engines]
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for load in sorted({r["load"] for r in rows}):
            where = {"model": model, "load": load}
            decodes = {
                (e, s): _value(rows, "decode_tok_s", engine=e, threads=s, **where)
                for e in engines
                for s in settings
            }
            best = max((v for (e, s), v in decodes.items() if e == "ours" and s != "default" and v),
                       default=None)  # fmt: skip
            theirs_best = max((v for (e, _), v in decodes.items() if e == "llama.cpp" and v),
                              default=None)  # fmt: skip
            for setting in settings:
                ours, theirs = decodes.get(("ours", setting)), decodes.get(("llama.cpp", setting))
                line = [model, load, setting] + [_fmt(decodes[(e, setting)]) for e in engines]
                line += [_ratio(ours, best), _ratio(ours, theirs), _ratio(ours, theirs_best)]
                line += [
                    _fmt(_value(rows, "prefill_tok_s", engine=e, threads=setting, **where))
                    for e in engines
                ]
                lines.append(line)
    return harness.md_table(header, lines)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else ""


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:,.1f}"


if __name__ == "__main__":
    main()
