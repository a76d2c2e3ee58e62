"""How many cycles this core spends on each vector instruction the one-row kernels use.

    python bench/vector_rates.py [--trips 20000000] [--repeats 5] [--markdown FILE]

bench/vector_rates.c, compiled for this machine, runs 8 independent copies of one
instruction (or of a pair) per loop trip; the first probe, a chain of dependent adds (one a
cycle on every x86 core of the last decade), gives the clock. Each row: cycles per
instruction, the best of --repeats (one thread, wall time: run it on a quiet machine).
The probes the CPU cannot run (AVX-512, VNNI) are left out at compile time.

Where the kernels' time goes depends on these: a core that runs 512-bit operations as two
256-bit halves (a Zen 4) issues about one 512-bit shuffle, shift or multiply a cycle, and
a 512-bit load that crosses two cache lines costs more than one that does not.
"""

import ctypes
from pathlib import Path

import harness

SOURCE = Path(__file__).resolve().parent / "vector_rates.c"
PER_TRIP = 8  # instructions a loop trip


def build() -> ctypes.CDLL:
    """bench/vector_rates.c for this machine, by the compiler the library's kernels use."""
    library = harness.compile_shared(SOURCE, ["-O2", "-march=native"])
    if library is None:
        raise SystemExit("no C compiler found")
    if library.spnl_rate_count() == 0:
        raise SystemExit("bench/vector_rates.c probes x86-64 cores only")
    library.spnl_rate_name.restype = ctypes.c_char_p
    library.spnl_rate_run.restype = ctypes.c_double
    library.spnl_rate_run.argtypes = [ctypes.c_int, ctypes.c_long]
    return library


def rates(library: ctypes.CDLL, trips: int, repeats: int) -> tuple[float, list[tuple]]:
    """The clock (Hz) and, per probe, its name and cycles per instruction."""
    count = library.spnl_rate_count()
    best = [min(library.spnl_rate_run(i, trips) for _ in range(repeats)) for i in range(count)]
    hz = trips * PER_TRIP / best[0]
    rows = [
        (library.spnl_rate_name(i).decode(), best[i] * hz / (trips * PER_TRIP))
        for i in range(1, count)
    ]
    return hz, rows


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--trips", type=int, default=20_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.trips < 1 or args.repeats < 1:
        parser.error("--trips and --repeats: at least 1")
    hz, rows = rates(build(), args.trips, args.repeats)
    table = harness.md_table(
        ["instruction", "cycles each"], [[name, f"{c:.2f}"] for name, c in rows]
    )
    note = f"Clock {hz / 1e9:.2f} GHz (the add chain); one thread, best of {args.repeats}."
    harness.publish(f"{table}\n\n{note}", args.markdown)


if __name__ == "__main__":
    main()
