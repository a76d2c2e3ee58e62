"""Decode on this checkout's host weight layout against another revision's, in one process.

    PYTHONPATH=. python bench/layout_ab.py [--gguf FILE] [--old REV] [--rounds 8]
                                           [--old-first] [--threads 1] [--markdown FILE]

The model is loaded twice, once with each revision's `memory.host_tensor` (--old:
default main; this checkout's: everything else), and the two backends generate in turn,
round by round (a shared machine's load then falls on both alike): each round is one
greedy generation of 33 tokens less one of 1, per token, by the process's CPU time. Two
copies of the weights are resident at once. Also prints each layout's bytes on huge pages
(/proc/self/smaps AnonHugePages, before the second load and after it). The default model
unless --gguf.
"""

import importlib.util
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import harness

TOKENS = 32
HERE = Path(__file__).resolve().parent


def host_tensor_of(rev: str):
    """``memory.host_tensor`` as revision ``rev`` wrote it."""
    source = subprocess.run(
        ["git", "-C", str(HERE), "show", f"{rev}:spnl_backend/memory.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    folder = Path(tempfile.mkdtemp(prefix="layout_ab_"))
    (folder / "memory.py").write_text(source)
    spec = importlib.util.spec_from_file_location("spnl_backend.old_memory", folder / "memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its relative imports resolve in spnl_backend
    return module.host_tensor


def load_with(host_tensor, gguf: Path, threads: int):
    """The backend for ``gguf`` with its weights placed by ``host_tensor``."""
    import spnl_backend.loader.gguf_file as gguf_file
    import spnl_backend.loader.weights as weights
    import spnl_backend.models.arch.family as family

    for module in (gguf_file, weights, family):  # where the loader calls it by name
        module.host_tensor = host_tensor
    return harness.load_ours(gguf, prefix_cache_n=0, num_threads=threads)


def huge_page_mb() -> int:
    with open("/proc/self/smaps") as smaps:
        kb = sum(int(line.split()[1]) for line in smaps if line.startswith("AnonHugePages:"))
    return kb // 1024


def per_token_ms(backend) -> float:
    """One round: ms of CPU time per decode token."""
    start = time.process_time()
    backend.generate(harness.STORY_PROMPT, max_tokens=1, temperature=0)
    one = time.process_time() - start
    start = time.process_time()
    result = backend.generate(harness.STORY_PROMPT, max_tokens=TOKENS + 1, temperature=0)
    many = time.process_time() - start
    made = result.usage.completion_tokens - 1
    if made < 1:
        raise SystemExit("the generation stopped at EOS before a decode token")
    return 1000 * (many - one) / made


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--gguf", type=Path, help="a GGUF file (default: the default model)")
    parser.add_argument("--old", default="main", help="the revision to compare against")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--old-first", action="store_true", help="load and run --old first")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, not {args.rounds}")
    import torch

    from spnl_backend import memory

    torch.set_num_threads(args.threads)
    gguf = args.gguf or harness.default_gguf()
    makers = {args.old: host_tensor_of(args.old), "this checkout": memory.host_tensor}
    names = list(makers) if args.old_first else list(reversed(makers))
    backends, huge = {}, {}
    for name in names:
        before = huge_page_mb()
        backends[name] = load_with(makers[name], gguf, args.threads)
        huge[name] = huge_page_mb() - before
        per_token_ms(backends[name])  # warm-up
    times = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            times[name].append(per_token_ms(backends[name]))
    ratios = [o / n for o, n in zip(times[args.old], times["this checkout"], strict=True)]
    rows = [
        [
            name,
            f"{statistics.median(times[name]):.2f}",
            f"{min(times[name]):.2f}-{max(times[name]):.2f}",
            f"{huge[name]:,}",
        ]
        for name in names
    ]
    note = (
        f"{gguf.name}, {args.threads} thread(s), {args.rounds} alternated rounds of "
        f"{TOKENS} decode tokens, CPU time. {args.old} / this checkout per round: "
        f"{min(ratios):.3f}-{max(ratios):.3f}, median {statistics.median(ratios):.3f}."
    )
    header = ["layout", "ms per token (median)", "range", "MB on huge pages"]
    harness.publish(f"{harness.md_table(header, rows)}\n\n{note}", args.markdown)


if __name__ == "__main__":
    main()
