"""The CPU's paged attention kernel, two versions of its sources side by side in one process.

    python bench/attention_ab.py [--old REV] [--repeats 15] [--threads 1] [--markdown FILE]

Builds the C kernels twice, from git revision --old (default main) and from this checkout,
checks that both give the same bits on every case, and then times one call of each case
with the two libraries alternating (CPU time of this process with one thread, wall time
with more; median of --repeats): on a shared machine the two see the same load, and the
ratio is what to read. The cases are the default model's attention layer (4 query heads
over 1 KV head of 256 dims, a float16 pool): a decode after 16k and 32k keys, three
decodes after 16k keys over three pools (the model's three global layers: more than the
last-level cache holds), and a prefill chunk of 64 queries after 16k keys, without and
with a 512-key window.
"""

import dataclasses
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import harness
import torch

from spnl_backend.kernels.scoring import Scoring

BLOCK = 32
HEADS, DIM = 4, 256


def build_pair(old: str) -> tuple[object, object]:
    """The kernels built from revision ``old`` and from this checkout, same compiler and flags."""
    from spnl_backend.kernels.cpu import build

    compiler = build.find_c_compiler()
    if compiler is None:
        raise SystemExit("no C compiler found")
    flags = build._targets(compiler, False)[0][0]
    folder = Path(tempfile.mkdtemp(prefix="attention_ab_"))
    old_sources = folder / "old"
    old_sources.mkdir()
    root = Path(build.__file__).parents[3]
    for path in (*build.SOURCES, *build.HEADERS):
        relative = path.relative_to(root).as_posix()
        shown = subprocess.run(
            ["git", "show", f"{old}:{relative}"], capture_output=True, check=True, cwd=root
        )
        (old_sources / path.name).write_bytes(shown.stdout)

    def compile_from(sources: Path, name: str):
        target = folder / name
        files = [str(sources / path.name) for path in build.SOURCES]
        subprocess.run(
            [compiler, *flags, *files, "-o", str(target), "-lm", "-pthread"],
            check=True,
            capture_output=True,
        )
        return build._load(target)

    return compile_from(old_sources, "old.so"), compile_from(build.HERE, "new.so")


def attention_case(context: int, queries: int, window: int | None = None) -> Callable:
    """``queries`` consecutive queries ending at ``context`` keys, over one float16 pool."""
    generator = torch.Generator().manual_seed(context + queries)
    shape = (-(-context // BLOCK), BLOCK, 1, DIM)
    keys = torch.randn(shape, generator=generator).half()
    values = torch.randn(shape, generator=generator).half()
    q = torch.randn(queries, HEADS, DIM, generator=generator)
    slots = torch.arange(context)[None].expand(queries, -1)
    lens = torch.arange(context - queries + 1, context + 1)
    scoring = Scoring(DIM**-0.5, window=window)
    return lambda native: native.paged_decode(q, keys, values, slots, lens, scoring)


def layers_case(context: int, count: int) -> Callable:
    calls = [attention_case(context + i, 1) for i in range(count)]
    return lambda native: torch.cat([call(native) for call in calls])


CASES = {
    "decode after 16k keys": lambda: attention_case(16384, 1),
    "decode after 32k keys": lambda: attention_case(32768, 1),
    "3 decodes after 16k keys, 3 pools": lambda: layers_case(16384, 3),
    "prefill: 64 queries after 16k keys": lambda: attention_case(16384, 64),
    "prefill: 64 queries after 16k keys, window 512": lambda: attention_case(16384, 64, 512),
}


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--old", default="main", help="git revision of the old sources")
    parser.add_argument("--repeats", type=int, default=15)
    parser.set_defaults(threads=1)
    args = parser.parse_args()
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1")
    old, new = (dataclasses.replace(k, threads=args.threads) for k in build_pair(args.old))
    # One thread: this process's CPU time. More: wall time, since each library's idle
    # workers spin a while after its calls (pool.c), CPU time that would land on the other's.
    clock = time.process_time if args.threads == 1 else time.perf_counter
    rows = []
    for name, make in CASES.items():
        call = make()
        if not torch.equal(call(old), call(new)):
            raise SystemExit(f"{name}: the two versions give different bits")
        times: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(args.repeats):
            for label, native in (("old", old), ("new", new)):
                start = clock()
                call(native)
                times[label].append(clock() - start)
        median = {label: sorted(t)[len(t) // 2] for label, t in times.items()}
        rows.append(
            [
                name,
                f"{median['old'] * 1e3:.2f} ms",
                f"{median['new'] * 1e3:.2f} ms",
                f"{median['old'] / median['new']:.2f}x",
            ]
        )
    header = ["case", f"old ({args.old})", "new (this checkout)", "old / new"]
    kind = "CPU time" if args.threads == 1 else "wall time"
    note = (
        f"{args.threads} thread(s); {kind} per call, median of {args.repeats}, the two "
        "libraries alternating; the same bits checked on every case."
    )
    harness.publish(f"{harness.md_table(header, rows)}\n\n{note}", args.markdown)


if __name__ == "__main__":
    main()
