"""Where a one-row product from memory loses to the plain read: the same buffer three ways.

    PYTHONPATH=. python bench/read_gap.py [--repeats 15] [--old REV] [--distances BYTES ...]
                                          [--formats Q5_0 Q4_K Q6_K] [--shape ROWS COLS]
                                          [--variant NAME=-DMACRO=V[,-DMACRO=V]] [--markdown FILE]

One thread, this process's CPU time, the ways alternating on the same copies of each 1B
decode matrix (bench/products_ab.py's --shapes 1b gate + up, an 8192-row slice of
llama-1b's Q6_K output head and a 32768-row slice of gemma3-1b's Q8_0 one; --formats
picks some: the copies on huge pages as the loader holds weights, together twice the
last-level cache, so each call reads from memory):
  (a) bench/read_bound.c over the matrix's bytes (and its loop copied into read_gap.c),
  (b) bench/read_gap.c: the product's own loads in its order with its prefetches, no
      arithmetic (and without prefetches; and prefetching into L2 only),
  (c) the product through the library built from --old (default main) and from this
      checkout (spnl_qmatmul, one activation row), less its fixed
      cost (the same call on a 16-row matrix), and through each --variant: the library
      built again with extra compiler flags (its prefetch distances are macros); and the
      same product on a slice of the matrix that stays in L2 (the kernel's own rate).
(b) ~ (a) with (c) below: the kernel's arithmetic keeps its loads from running ahead.
(b) below (a): the access pattern (its order, its prefetches, the pages) costs the rest.
Also prints how much of each copy sits on huge pages (/proc/self/smaps AnonHugePages).
"""

import ctypes
import dataclasses
import functools
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import harness
import torch
from attention_ab import build_pair
from gguf import GGMLQuantizationType as Q
from products_ab import LAST_LEVEL, random_weight
from read_bound import build_reader

HERE = Path(__file__).resolve().parent
CASES = [
    (Q.Q5_0, 13824, 1152, 22, 32),  # gemma3-1b gate + up
    (Q.Q4_K, 16384, 2048, 144, 256),  # llama-1b gate + up
    (Q.Q6_K, 8192, 2048, 210, 256),  # a slice of llama-1b's output head
    (Q.Q8_0, 32768, 1152, 34, 32),  # a slice of gemma3-1b's output head
]
FIXED_ROWS = 16  # a product's fixed cost: the call on this many rows
IN_L2 = 800 << 10  # bytes of a matrix that stays in the core's 1-2 MiB L2
SMALL_CALLS = 200  # calls per timing of the small matrices


def build_gap() -> ctypes.CDLL:
    """bench/read_gap.c for this machine."""
    library = harness.compile_shared(HERE / "read_gap.c", ["-O3", "-march=native"])
    if library is None:
        raise SystemExit("no C compiler found")
    library.spnl_gap_plain.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    for name in ("spnl_gap_q5_0", "spnl_gap_q4_k", "spnl_gap_q6_k", "spnl_gap_q8_0"):
        getattr(library, name).argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_int]
    for name in (
        "spnl_gap_plain",
        "spnl_gap_q5_0",
        "spnl_gap_q4_k",
        "spnl_gap_q6_k",
        "spnl_gap_q8_0",
    ):
        getattr(library, name).restype = ctypes.c_uint64
    return library


def build_library(extra: list[str], name: str):
    """The kernels of this checkout built with the library's own flags plus ``extra``."""
    from spnl_backend.kernels.cpu import build

    compiler = build.find_c_compiler()
    flags = build._targets(compiler, False)[0][0]
    target = Path(tempfile.mkdtemp(prefix="read_gap_lib_")) / f"{name}.so"
    files = [str(path) for path in build.SOURCES]
    subprocess.run(
        [compiler, *flags, *extra, *files, "-o", str(target), "-lm", "-pthread"],
        check=True,
        capture_output=True,
    )
    return build._load(target)


def huge_share(tensors: list[torch.Tensor]) -> float:
    """The share of the bytes of the mappings holding ``tensors`` that are on huge pages
    (/proc/self/smaps: AnonHugePages over the mapping's size; adjacent mappings merge)."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in tensors]
    huge = size = 0
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = any(lo < end and hi > start for start, end in spans)
            size += hi - lo if inside else 0
        elif inside and head == "AnonHugePages:":
            huge += int(line.split()[1]) * 1024
    return huge / size if size else 0.0


def median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


def one_case(case: tuple, gap, reader, libraries: dict, repeats: int, distances: list[int]):
    """The table of one matrix: each way's time per call (median, less the fixed cost for
    the products) and GB/s, the ways alternating."""
    from spnl_backend.memory import host_tensor

    qtype, n_out, k_in, block_bytes, block = case
    weight = random_weight(qtype, n_out, k_in)
    copies = [weight]
    while len(copies) * weight.numel() < 2 * LAST_LEVEL:
        copies.append(host_tensor(tuple(weight.shape), torch.uint8).copy_(weight))
    row_bytes = k_in // block * block_bytes
    in_l2 = weight[: IN_L2 // row_bytes].clone()  # stays in L2 between calls
    x = torch.randn(1, k_in)
    y = torch.empty(1, n_out)
    order = {
        Q.Q5_0: gap.spnl_gap_q5_0,
        Q.Q4_K: gap.spnl_gap_q4_k,
        Q.Q6_K: gap.spnl_gap_q6_k,
        Q.Q8_0: gap.spnl_gap_q8_0,
    }[qtype]
    ahead = 8192  # the kernels' own distance (Q5_0/Q8_0_PREFETCH_BYTES, ROW1_PREFETCH)

    def product(lib, w: torch.Tensor) -> Callable[[], int]:
        rows = w.shape[0]
        args = lib.products([(qtype.value, w, rows)]).args
        return lambda: lib.library.spnl_qmatmul(
            ctypes.byref(args), x.data_ptr(), 1, k_in, y.data_ptr(), rows, 1, 0
        )

    def each_copy(read: Callable[[torch.Tensor], int]) -> list[Callable[[], int]]:
        return [functools.partial(read, w) for w in copies]

    spans, sizes, checksum = (ctypes.c_void_p * 1)(), (ctypes.c_int64 * 1)(), ctypes.c_uint64()

    def bound(w: torch.Tensor) -> int:  # read_bound.c as bench/read_bound.py calls it
        spans[0], sizes[0] = w.data_ptr(), w.numel()
        return reader.spnl_bench_read(spans, sizes, 1, 1, 0, ctypes.byref(checksum))

    def loads(w: torch.Tensor, distance: int, l2: int) -> int:
        return order(w.data_ptr(), n_out, row_bytes, distance, l2)

    calls = {
        "(a) read_bound.c": each_copy(bound),
        "(a) its loop, in read_gap.c": each_copy(
            lambda w: gap.spnl_gap_plain(w.data_ptr(), w.numel(), 4096)
        ),
        f"(b) the product's loads ({ahead // 1024} KiB prefetch)": each_copy(
            lambda w: loads(w, ahead, 0)
        ),
        "(b) no prefetch": each_copy(lambda w: loads(w, 0, 0)),
        "(b) prefetch to L2 (prefetcht1)": each_copy(lambda w: loads(w, ahead, 1)),
    }
    for d in distances:
        calls[f"(b) prefetch {d // 1024} KiB"] = each_copy(lambda w, d=d: loads(w, d, 0))
    for name, lib in libraries.items():
        calls[f"(c) {name}"] = [product(lib, w) for w in copies]
    fixed = {name: product(lib, weight[:FIXED_ROWS].clone()) for name, lib in libraries.items()}
    cached = {name: product(lib, in_l2) for name, lib in libraries.items()}
    times: dict[str, list[float]] = {label: [] for label in calls}
    fixed_times: dict[str, list[float]] = {name: [] for name in libraries}
    cached_times: dict[str, list[float]] = {name: [] for name in libraries}
    for _ in range(repeats):
        for label, ring in calls.items():
            start = time.process_time()
            for call in ring:
                call()
            times[label].append((time.process_time() - start) / len(ring))
        for name in libraries:
            for kept, one in ((fixed_times, fixed[name]), (cached_times, cached[name])):
                start = time.process_time()
                for _ in range(SMALL_CALLS):
                    one()
                kept[name].append((time.process_time() - start) / SMALL_CALLS)

    def row(label: str, seconds: list[float], less: float, nbytes: int) -> list[str]:
        cost = median(seconds) - less
        low, high = (sorted(seconds)[len(seconds) * q // 4] - less for q in (3, 1))
        return [
            label,
            f"{cost * 1e6:.1f} us",
            f"{nbytes / cost / 1e9:.1f}",
            f"{nbytes / low / 1e9:.1f}-{nbytes / high / 1e9:.1f}",
        ]

    rows = []
    for label, seconds in times.items():
        name = label[4:] if label.startswith("(c)") else None
        rows.append(row(label, seconds, median(fixed_times[name]) if name else 0.0, weight.numel()))
    for name, seconds in cached_times.items():
        less = median(fixed_times[name])
        rows.append(row(f"(c) {name}, weights in L2", seconds, less, in_l2.numel()))
    title = (
        f"{qtype.name} {n_out} x {k_in} ({weight.numel() / 2**20:.1f} MiB, {len(copies)} copies,"
        f" their mappings {huge_share(copies):.0%} on huge pages; a product's fixed cost "
        + ", ".join(f"{n} {median(t) * 1e6:.1f} us" for n, t in fixed_times.items())
        + f", the in-L2 rows {in_l2.numel() / 2**10:.0f} KiB)"
    )
    return title, rows


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--old", default="main", help="git revision of the old sources")
    parser.add_argument(
        "--variant", action="append", default=[], help="NAME=FLAG[,FLAG]: a library build"
    )
    parser.add_argument(
        "--distances", type=int, nargs="*", default=[], help="more prefetch distances for (b)"
    )
    parser.add_argument(
        "--formats", nargs="*", default=None, help="only these CASES (Q5_0, Q4_K, Q6_K, Q8_0)"
    )
    parser.add_argument(
        "--shape",
        type=int,
        nargs=2,
        metavar=("ROWS", "COLS"),
        help="the cases' matrix instead (128256 2048: llama-1b's head)",
    )
    args = parser.parse_args()
    cases = [c for c in CASES if args.formats is None or c[0].name in args.formats]
    if args.shape:
        rows, cols = args.shape
        if rows < FIXED_ROWS or cols < 1 or any(cols % c[4] for c in cases):
            parser.error(f"--shape: at least {FIXED_ROWS} rows, columns whole blocks")
        cases = [(q, rows, cols, *rest) for q, _, _, *rest in cases]
    if not cases:
        raise SystemExit(f"--formats: none of {args.formats} is one of the cases' formats")
    torch.set_num_threads(1)
    old, new = build_pair(args.old)
    libraries = {f"old ({args.old})": old, "this checkout": new}
    for spec in args.variant:
        name, _, flags = spec.partition("=")
        libraries[name] = build_library(flags.split(","), name)
    libraries = {n: dataclasses.replace(k, threads=1) for n, k in libraries.items()}
    gap, reader = build_gap(), build_reader()
    out = []
    for case in cases:
        title, rows = one_case(case, gap, reader, libraries, args.repeats, args.distances)
        table = harness.md_table(["way", "per call", "GB/s", "GB/s, quartiles"], rows)
        out.append(f"{title}\n\n{table}")
    load = Path("/proc/loadavg").read_text().split()[:3]
    note = (
        f"One thread; CPU time per call, median of {args.repeats}, all ways alternating on "
        f"the same copies. Load average at the end: {' '.join(load)}."
    )
    harness.publish("\n\n".join(out) + "\n\n" + note, args.markdown)


if __name__ == "__main__":
    main()
