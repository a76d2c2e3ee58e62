"""Where a decode token goes between the weights' pure reading and Backend.generate.

    python bench/decode_gap.py --gguf FILE [--thread-counts 1 2] [--tokens 32] [--rounds 5]
                               [--markdown FILE]

One process; for each thread count the model is loaded once and six measures of one
token are alternated round by round (a shared machine's load then falls on all alike),
the median of the rounds:

- generate: Backend.generate of --tokens + 1 greedy tokens less that of 1, per token
  (everything: scheduler, sampler, detokenizer);
- stream: the same through Backend.stream, from the first piece to the last;
- engine: the engine's own decode time (usage.decode_tok_s, what bench/decode.py reports);
- products: every quantized product of a decode step (each layer's q/k/v, o, gate/up and
  down, and the output layer) on one random row, called from a loop straight through
  ctypes, nothing between them;
- read (whole): the same weight bytes read by a plain AVX-512 loop (bench/read_bound.c),
  each thread one contiguous slice: the machine's read bound;
- read (each): the same loop, every matrix split among the threads with a spinning
  barrier after it (how a spinning pool fares).

Then each product set's share of the products, and the cost of one job on the kernels'
pool. Wall time and the process's CPU time (every thread's) are both kept: on a shared
machine the 1-thread CPU times are the steady figures. --threads is not used.
"""

import collections
import ctypes
import gc
import statistics
import time
from pathlib import Path

import harness
import read_bound


def build_reader() -> ctypes.CDLL:
    """bench/read_bound.c compiled for this machine (bench/read_bound.py)."""
    library = read_bound.build_reader()
    if library is None:
        raise SystemExit("no C compiler: the read bound needs one")
    return library


def step_products(before: set[int]) -> list:
    """Every prepared product set alive (the layer blocks' and the output layer's) but
    those of ids in ``before`` (another backend's)."""
    from spnl_backend.kernels import cpu

    found = (o for o in gc.get_objects() if isinstance(o, cpu.Products))
    return [o for o in found if id(o) not in before]


def width(products) -> int:
    """The products' input width, from their first weight's row bytes."""
    from gguf import GGML_QUANT_SIZES

    from spnl_backend.kernels.cpu.checks import block_type

    qtype, row_bytes = products.row_bytes[0]
    block, block_bytes = GGML_QUANT_SIZES[block_type(qtype)]
    return row_bytes // block_bytes * block


def set_label(products) -> str:
    from spnl_backend.kernels.cpu.checks import qtype_name

    names = "+".join(sorted({qtype_name(q) for q, _ in products.row_bytes}))
    return f"{'+'.join(str(n) for n in products.widths)} x {width(products)} ({names})"


def products_loop(products: list, seconds: dict[str, float] | None = None):
    """A callable running each product once on a random row, through ctypes alone (with
    ``seconds``: each set's time added to its label's: the calling thread's CPU time at 1
    thread, where the kernels run on it, else wall time)."""
    import torch

    calls = []
    for p in products:
        x = torch.randn(1, width(p))
        out = torch.empty(1, p.total)
        calls.append((p, x, out))
    library = products[0].kernels.library
    threads, exact = products[0].kernels.threads, products[0].kernels.exact

    def run() -> None:
        for p, x, out in calls:
            library.spnl_qmatmul(
                p.args, x.data_ptr(), 1, x.shape[1], out.data_ptr(), p.total, threads, exact
            )

    clock = time.thread_time if threads == 1 else time.perf_counter

    def timed() -> None:
        for p, x, out in calls:
            start = clock()
            library.spnl_qmatmul(
                p.args, x.data_ptr(), 1, x.shape[1], out.data_ptr(), p.total, threads, exact
            )
            seconds[set_label(p)] += clock() - start

    return run if seconds is None else timed


def pool_round_trip_us(library, threads: int, rounds: int = 20000) -> float:
    """Microseconds of one parallel job of ``threads`` tiny tasks on the kernels' pool:
    the wake, the claims and the wait that every product dispatch pays."""
    counts = (ctypes.c_int64 * threads)()
    start = time.perf_counter()
    library.spnl_pool_check(threads, threads, rounds, ctypes.addressof(counts))
    return 1e6 * (time.perf_counter() - start) / rounds


def reader(library, products: list, threads: int, mode: int):
    spans = [(w.data_ptr(), w.numel()) for p in products for w in p.weights]
    return read_bound.reader(library, spans, threads, mode)


def clocked(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(gguf: Path, threads: int, tokens: int, rounds: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    before = {id(o) for o in step_products(set())}
    backend = harness.load_ours(gguf, prefix_cache_n=0, num_threads=threads)
    prompt = harness.STORY_PROMPT
    backend.generate(prompt, max_tokens=4, temperature=0)  # warm-up, prepares every product
    products = step_products(before)
    weight_bytes = sum(w.numel() for p in products for w in p.weights)
    library = build_reader()
    loop = products_loop(products)
    read_whole = reader(library, products, threads, 0)
    read_each = reader(library, products, threads, 1)
    engine_ms: list[float] = []

    def generate(n: int):
        result = backend.generate(prompt, max_tokens=n, temperature=0)
        if result.usage.completion_tokens != n:
            raise SystemExit(f"the generation stopped at {result.usage.completion_tokens} of {n}")
        if n > 1:
            engine_ms.append(1000 / result.usage.decode_tok_s)
        return result

    def stream(n: int) -> tuple[float, float]:
        """Wall and CPU seconds from the first piece to the last (the prefill left out)."""
        stamps = [
            (time.perf_counter(), time.process_time())
            for _ in backend.stream(prompt, max_tokens=n, temperature=0)
        ]
        return stamps[-1][0] - stamps[0][0], stamps[-1][1] - stamps[0][1]

    per_round: dict[str, list[tuple[float, float]]] = {
        k: [] for k in ("generate", "stream", "products", "read (whole)", "read (each)")
    }
    for _ in range(rounds):
        one = clocked(lambda: generate(1))
        full = clocked(lambda: generate(tokens + 1))
        per_round["generate"].append(
            (1000 * (full[0] - one[0]) / tokens, 1000 * (full[1] - one[1]) / tokens)
        )
        wall, cpu = stream(tokens + 1)
        per_round["stream"].append((1000 * wall / tokens, 1000 * cpu / tokens))
        for label, fn in (
            ("products", loop),
            ("read (whole)", read_whole),
            ("read (each)", read_each),
        ):
            times = [clocked(fn) for _ in range(3)]
            best = min(times)
            per_round[label].append((1000 * best[0], 1000 * best[1]))
    by_set: dict[str, float] = collections.defaultdict(float)
    timed_loop = products_loop(products, by_set)
    for _ in range(rounds):
        timed_loop()
    set_bytes: dict[str, int] = collections.defaultdict(int)
    set_count: dict[str, int] = collections.defaultdict(int)
    for p in products:
        set_bytes[set_label(p)] += sum(w.numel() for w in p.weights)
        set_count[set_label(p)] += 1
    library = products[0].kernels.library
    backend.close()  # the next thread count loads its own
    return {
        "model": gguf.name,
        "pool_us": pool_round_trip_us(library, threads) if threads > 1 else 0.0,
        "sets": {
            k: (1000 * v / rounds, set_count[k], set_bytes[k] / (v / rounds) / 1e9)
            for k, v in by_set.items()
        },
        "threads": threads,
        "tokens": tokens,
        "rounds": rounds,
        "weight_mb": weight_bytes / 1e6,
        "products": len(products),
        "engine_ms": statistics.median(engine_ms),
        "parts": {
            k: (statistics.median(v[0] for v in vs), statistics.median(v[1] for v in vs))
            for k, vs in per_round.items()
        },
    }


def table(results: list[dict]) -> str:
    header = ["measure", *(f"{r['threads']} thr: ms wall / CPU ms, GB/s" for r in results)]
    labels = ["generate", "stream", "engine", "products", "read (each)", "read (whole)"]
    rows = []
    for label in labels:
        cells = [label]
        for r in results:
            if label == "engine":
                wall, cpu = r["engine_ms"], None
            else:
                wall, cpu = r["parts"][label]
            gbs = r["weight_mb"] / wall
            cells.append(
                f"{wall:.1f}" + (f" / {cpu:.1f}" if cpu is not None else "") + f", {gbs:.1f}"
            )
        rows.append(cells)
    set_rows = []
    for name in sorted(results[0]["sets"], key=lambda k: -results[0]["sets"][k][0]):
        cells = [f"{name}, {results[0]['sets'][name][1]} per token"]
        for r in results:
            ms, _, gbs = r["sets"][name]
            cells.append(f"{ms:.1f}, {gbs:.1f}")
        set_rows.append(cells)
    pool = ", ".join(
        f"{r['pool_us']:.1f} us at {r['threads']}" for r in results if r["threads"] > 1
    )
    r0 = results[0]
    note = (
        f"{r0['model']}: {r0['weight_mb']:,.0f} MB of weights in {r0['products']} product sets "
        f"per token; {r0['tokens']} greedy tokens, median of {r0['rounds']} alternated rounds. "
        f"One pool job (wake, claim, wait) of the kernels' pool: {pool or 'n/a'}."
    )
    sets = harness.md_table(
        [
            "product set",
            *(
                f"{r['threads']} thr: {'CPU' if r['threads'] == 1 else 'wall'} ms, GB/s"
                for r in results
            ),
        ],
        set_rows,
    )
    return f"{harness.md_table(header, rows)}\n\n{note}\n\n{sets}"


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    results = [measure(args.gguf, t, args.tokens, args.rounds) for t in args.thread_counts]
    harness.publish(table(results), args.markdown)


if __name__ == "__main__":
    main()
