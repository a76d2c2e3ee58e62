"""Where one decode token's time goes, in our engine on the CPU (or, with --prefill N,
where the time of an N-token prompt's prefill goes).

    python bench/profile_decode.py [--gguf FILE] [--threads 2] [--tokens 32] [--prefill N]
                                   [--context N] [--cpu-time] [--markdown FILE]

Timers around every native call (each quantized product, by its weight shape; attention;
the MLP's activation; the norms, RoPE, the KV store and embedding lookups), over a greedy
generation of --tokens + 1 tokens less the same prompt's generation of 1 token: what is
left is decode alone, against the engine's own decode time. Each product's rate is its
weight bytes over its time; the read bandwidth at the same thread count (bench/read_bound.py) is
measured after, for comparison. What the timers do not cover is Python and torch's small
operations between the kernels, and sampling. With --prefill, the parts are those of one
generation of a single token from an N-token prompt (the shipped English text, repeated
past its length), against its wall time. --context N profiles decode after an N-token
prompt instead of a short one (prefix caching holds it, so each run recomputes only its
last token). --cpu-time (with --threads 1) times the parts by CPU time instead of the
wall's. At 1 thread each product's rate in decode stands beside its rate "back to back": a
step's products called in its order with nothing between them (the micro-benchmark's
rate on the same weights, each read from memory), and "plain read": bench/read_bound.c's
loop over the same bytes in the same order (the bound for a matrix of that size). The
default model unless --gguf.
"""

import collections
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import decode
import harness
import read_bound

BLOCK_SIZE = 32  # the default paged KV block; a --context pool is whole blocks
OTHER_KERNELS = ("rms_norm", "add_rms_norm", "qk_norm_rope_", "store_kv", "gather_rows")
LABELS = {"paged_decode": "attention", "gated_act": "activation (act(gate) * up)"}


class Timers:
    """Seconds and calls per label, while installed; ``clock``: the wall's
    (time.perf_counter) or the calling thread's CPU time (time.thread_time: at 1 thread
    the kernels run on the engine's thread, and a shared machine's other processes then
    leave the figures alone)."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.bytes: dict[str, int] = {}
        self.macs: dict[str, int] = collections.defaultdict(int)
        self.order: dict[int, tuple[str, object]] = {}  # each product, first call first

    def timed(self, label: str, fn, *args, **kwargs):
        start = self.clock()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[label] += self.clock() - start
            self.calls[label] += 1

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        return dict(self.seconds), dict(self.calls)


def product_label(products, k_in: int) -> str:
    from spnl_backend.kernels.cpu.checks import qtype_name

    names = "+".join(sorted({qtype_name(q) for q, _ in products.row_bytes}))
    widths = "+".join(str(n) for n in products.widths)
    return f"product {widths} x {k_in} ({names})"


@contextmanager
def installed(timers: Timers):
    """Wrap the kernels' entry points in ``timers``; restored on exit."""
    from spnl_backend.kernels import cpu

    originals = {name: getattr(cpu.CpuKernels, name) for name in (*OTHER_KERNELS, *LABELS)}
    products_call = cpu.Products.__call__

    def wrap(name, original):
        label = LABELS.get(name, "norms, RoPE, KV store, lookups")
        return lambda self, *a, **k: timers.timed(label, original, self, *a, **k)

    def products(self, x):
        label = product_label(self, x.shape[1])
        timers.bytes[label] = sum(w.numel() for w in self.weights)
        timers.macs[label] += x.shape[0] * x.shape[1] * sum(self.widths)
        timers.order.setdefault(id(self), (label, self))  # for back_to_back
        return timers.timed(label, products_call, self, x)

    try:
        for name, original in originals.items():
            setattr(cpu.CpuKernels, name, wrap(name, original))
        cpu.Products.__call__ = products
        yield
    finally:
        for name, original in originals.items():
            setattr(cpu.CpuKernels, name, original)
        cpu.Products.__call__ = products_call


def per_op_path(backend) -> None:
    """Leave the native layer blocks off: they call the kernels from C, out of the timers'
    reach, while the per-op path (their twin, the same bits) calls each from Python."""
    backend.model.model.use_layer_blocks = False


def whole_blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE) * BLOCK_SIZE


def decode_backend(
    gguf: Path, tokens: int, context: int | None, threads: int
) -> tuple[object, str]:
    """The backend and its prompt: a short one with prefix caching off; or ``context``
    tokens of the shipped text, with a pool that holds them and prefix caching on, the
    prompt cached by a first run so that every later run recomputes only its last token
    and the runs subtracted from each other differ by decode alone."""
    if context is None:
        # short: the prefill subtracted is small beside decode
        return harness.load_ours(gguf, prefix_cache_n=0, num_threads=threads), harness.STORY_PROMPT
    room = whole_blocks(context + tokens + BLOCK_SIZE)
    backend = harness.load_ours(
        gguf, prefix_cache_n=1, paged_attn_context_len=room, num_threads=threads
    )
    prompt = harness.context_prompt(backend.tokenizer.encode, context)
    backend.generate(prompt, max_tokens=1, temperature=0)  # the prefill, cached
    return backend, prompt


def back_to_back(timers: Timers, rounds: int = 5) -> dict[str, tuple[float, float]]:
    """Each product label's GB/s as a micro-benchmark finds it: every product of a decode
    step called in the step's order on one random row, nothing between them, each timed
    by the calling thread's CPU time (a step's weights outgrow the last-level cache, so
    each is read from memory), and the same bytes read in the same order by the plain
    loop of bench/read_bound.c; the medians over layers and ``rounds``."""
    import torch

    library = read_bound.build_reader()
    inputs = {}
    calls = []  # (label, product, its plain read)
    for label, product in timers.order.values():
        inputs.setdefault(product.k_in, torch.randn(1, product.k_in))
        spans = [(w.data_ptr(), w.numel()) for w in product.weights]
        calls.append((label, product, read_bound.reader(library, spans, 1, 0)))
    products, reads = collections.defaultdict(list), collections.defaultdict(list)
    for _ in range(rounds):  # two passes: a read right after the product would hit L3
        for label, product, _ in calls:
            start = time.thread_time()
            product(inputs[product.k_in])
            products[label].append(time.thread_time() - start)
        for label, _, read in calls:
            start = time.thread_time()
            read()
            reads[label].append(time.thread_time() - start)
    return {
        label: (
            timers.bytes[label] / statistics.median(products[label]) / 1e9,
            timers.bytes[label] / statistics.median(reads[label]) / 1e9,
        )
        for label in products
    }


def profile(
    gguf: Path, threads: int, tokens: int, context: int | None = None, cpu: bool = False
) -> dict:
    import torch

    torch.set_num_threads(threads)
    backend, prompt = decode_backend(gguf, tokens, context, threads)
    backend.generate(prompt, max_tokens=4, temperature=0)  # warm-up
    shipped = backend.generate(prompt, max_tokens=tokens + 1, temperature=0).usage
    per_op_path(backend)
    timers = Timers(time.thread_time if cpu else time.perf_counter)
    with installed(timers):
        backend.generate(prompt, max_tokens=1, temperature=0)
        prefill, prefill_calls = timers.snapshot()
        result = backend.generate(prompt, max_tokens=tokens + 1, temperature=0)
    made = result.usage.completion_tokens - 1
    if made < 1:
        raise SystemExit("the generation stopped at EOS before a decode token")
    seconds = {k: v - 2 * prefill.get(k, 0.0) for k, v in timers.seconds.items()}
    calls = {k: v - 2 * prefill_calls.get(k, 0) for k, v in timers.calls.items()}
    # The timers hold both runs, and the second's first token is the first run again; the
    # engine times decode itself, from the first token to the last.
    wall = made / result.usage.decode_tok_s
    return {
        "model": gguf.name,
        "threads": threads,
        "context": result.usage.prompt_tokens,
        "tokens": made,
        "ms_per_token": 1000 * wall / made,
        "blocks_ms_per_token": 1000 / shipped.decode_tok_s,
        "parts": {
            label: {
                "ms": 1000 * s / made,
                "calls": calls[label] / made,
                "gb_s": timers.bytes[label] / (s / calls[label]) / 1e9
                if label in timers.bytes and calls[label] > 0 and s > 0
                else None,
            }
            for label, s in seconds.items()
        },
        "clock": "CPU" if cpu else "wall",
        "back_to_back": back_to_back(timers) if threads == 1 else {},
        "bandwidth": read_bound.read_bandwidth(threads),
        "weight_mb": decode.weight_bytes_per_token(gguf) / 1e6,
    }


def batch_prompts(count: int) -> list[str]:
    """``count`` different prompts of about a dozen words: runs of the shipped text."""
    words = (harness.DATA / "english.txt").read_text().split()
    return [" ".join(words[12 * i : 12 * i + 12]) for i in range(count)]


def timed_generate(backend, prompts: list[str], max_tokens: int, clock) -> tuple[float, int]:
    """Seconds of one batch's generation by ``clock``, and its steps (its longest
    completion)."""
    start = clock()
    results = backend.generate(prompts, max_tokens=max_tokens, temperature=0)
    return clock() - start, max(r.usage.completion_tokens for r in results)


def profile_batch(gguf: Path, threads: int, tokens: int, batch: int, cpu: bool) -> dict:
    """profile's parts for decode steps of ``batch`` sequences at once: a batch generating
    --tokens + 1 tokens less the same batch generating 1, per step (each step one token of
    every sequence). The step's time is the same difference, untimed and timed: wall time,
    or with ``cpu`` the process's CPU time (every thread's; the parts: the engine thread's,
    so at 1 thread only)."""
    import torch

    if cpu and threads != 1:
        raise SystemExit("--cpu-time: the parts are the engine thread's CPU time; run --threads 1")
    clock = time.process_time if cpu else time.perf_counter
    torch.set_num_threads(threads)
    # the native kernels' pool at the same count (it follows the CPUs, not torch)
    context = 32 * -(-batch * (64 + tokens) // 32)
    backend = harness.load_ours(
        gguf, prefix_cache_n=0, paged_attn_context_len=context, num_threads=threads
    )
    prompts = batch_prompts(batch)
    timed_generate(backend, prompts, 4, clock)  # warm-up
    first, _ = timed_generate(backend, prompts, 1, clock)
    whole, steps = timed_generate(backend, prompts, tokens + 1, clock)
    shipped_ms = 1000 * (whole - first) / (steps - 1)
    per_op_path(backend)
    timers = Timers(time.thread_time if cpu else time.perf_counter)
    with installed(timers):
        first, _ = timed_generate(backend, prompts, 1, clock)
        prefill, prefill_calls = timers.snapshot()
        prefill_macs = dict(timers.macs)
        whole, steps = timed_generate(backend, prompts, tokens + 1, clock)
    made = steps - 1
    if made < 1:
        raise SystemExit("every sequence stopped at EOS before a decode token")
    seconds = {k: v - 2 * prefill.get(k, 0.0) for k, v in timers.seconds.items()}
    calls = {k: v - 2 * prefill_calls.get(k, 0) for k, v in timers.calls.items()}
    return {
        "model": gguf.name,
        "threads": threads,
        "batch": batch,
        "clock": "CPU" if cpu else "wall",
        "tokens": made,
        "ms_per_token": 1000 * (whole - first) / made,
        "blocks_ms_per_token": shipped_ms,
        "parts": {
            label: {
                "ms": 1000 * s / made,
                "calls": calls[label] / made,
                "gmac_s": (timers.macs[label] - 2 * prefill_macs.get(label, 0)) / s / 1e9
                if label in timers.macs and s > 0
                else None,
            }
            for label, s in seconds.items()
        },
    }


def batch_table(result: dict) -> str:
    total = result["ms_per_token"]
    rows = part_rows(
        result, total, lambda p: f"{p['gmac_s']:.1f}" if p["gmac_s"] else "", 2, "one decode step"
    )
    header = ["part", "calls per step", "ms per step", "share", "GMAC/s"]
    note = (
        f"{result['model']}, {result['threads']} threads, {result['batch']} sequences, "
        f"{result['clock']} time, {result['tokens']} greedy decode steps "
        f"({result['batch'] * 1000 / total:.1f} tok/s with the timers in), on the per-op path "
        "the timers see" + _blocks_note(result.get("blocks_ms_per_token"), "a step")
    )
    return f"{harness.md_table(header, rows)}\n\n{note}"


def profile_prefill(gguf: Path, threads: int, prompt_tokens: int, cpu: bool = False) -> dict:
    """The parts of one prefill by the wall's clock, or with ``cpu`` (1 thread) the
    process's CPU time for the whole and the engine thread's for the parts: a shared
    machine's other processes then leave the figures alone."""
    import torch

    if cpu and threads != 1:
        raise SystemExit("--cpu-time: the parts are the engine thread's CPU time; run --threads 1")
    clock = time.process_time if cpu else time.perf_counter
    torch.set_num_threads(threads)
    room = whole_blocks(prompt_tokens + BLOCK_SIZE)
    backend = harness.load_ours(
        gguf, prefix_cache_n=0, paged_attn_context_len=room, num_threads=threads
    )
    prompt = harness.context_prompt(backend.tokenizer.encode, prompt_tokens)
    backend.generate(prompt, max_tokens=1, temperature=0)  # warm-up
    start = clock()
    backend.generate(prompt, max_tokens=1, temperature=0)
    shipped = clock() - start
    per_op_path(backend)
    timers = Timers(time.thread_time if cpu else time.perf_counter)
    with installed(timers):
        start = clock()
        result = backend.generate(prompt, max_tokens=1, temperature=0)
        wall = clock() - start
    return {
        "model": gguf.name,
        "threads": threads,
        "clock": "CPU" if cpu else "wall",
        "prompt_tokens": result.usage.prompt_tokens,
        "ms": 1000 * wall,
        "blocks_ms": 1000 * shipped,
        "parts": {
            label: {
                "ms": 1000 * s,
                "calls": timers.calls[label],
                "gmac_s": timers.macs[label] / s / 1e9 if label in timers.macs and s > 0 else None,
            }
            for label, s in timers.seconds.items()
        },
    }


def part_rows(result: dict, total: float, rate, digits: int, whole: str) -> list[list[str]]:
    """A row per timed part, largest first (``rate(part)``: its last cell), then the untimed
    rest and the whole; ``total`` ms is the whole."""
    parts = sorted(result["parts"].items(), key=lambda item: -item[1]["ms"])
    rows = []
    for label, part in parts:
        share = f"{100 * part['ms'] / total:.0f}%"
        rows.append([label, f"{part['calls']:.0f}", f"{part['ms']:.{digits}f}", share, rate(part)])
    rest = total - sum(part["ms"] for _, part in parts)
    rows.append(
        ["Python, torch ops, sampling", "", f"{rest:.{digits}f}", f"{100 * rest / total:.0f}%"]
    )
    rows.append([whole, "", f"{total:.{digits}f}", "100%"])
    return rows


def prefill_table(result: dict) -> str:
    total = result["ms"]
    rows = part_rows(
        result, total, lambda p: f"{p['gmac_s']:.1f}" if p["gmac_s"] else "", 1, "the whole prefill"
    )
    header = ["part", "calls", "ms", "share", "GMAC/s"]
    tok_s = result["prompt_tokens"] / (total / 1000)
    note = (
        f"{result['model']}, {result['threads']} threads, {result.get('clock', 'wall')} time, "
        f"a {result['prompt_tokens']}-token prompt to its first token ({tok_s:.1f} tok/s with "
        "the timers in), on the per-op "
        "path the timers see" + _blocks_note(result.get("blocks_ms"), "the prefill")
    )
    return f"{harness.md_table(header, rows)}\n\n{note}"


def table(result: dict) -> str:
    total = result["ms_per_token"]
    apart = result.get("back_to_back", {})
    rows = part_rows(
        result, total, lambda p: f"{p['gb_s']:.1f} GB/s" if p["gb_s"] else "", 2, "one decode token"
    )
    for row in rows:  # the same products back to back, where measured
        rates = apart.get(row[0])
        row += [f"{rates[0]:.1f} GB/s", f"{rates[1]:.1f} GB/s"] if rates else []
    header = [
        "part",
        "calls per token",
        "ms per token",
        "share",
        "weights read at",
        "back to back",
        "plain read, back to back",
    ]
    note = (
        f"{result['model']}, {result['threads']} threads, {result.get('clock', 'wall')} time, "
        f"{result['tokens']} greedy decode "
        f"tokens{_after(result.get('context'))} ({1000 / total:.1f} tok/s with the timers "
        "in), on the per-op path the timers see"
        + _blocks_note(result.get("blocks_ms_per_token"), "a token")
        + f" Read bandwidth: {result['bandwidth']['gb_s']:.1f} GB/s "
        f"({result['bandwidth']['method']}); {result['weight_mb']:,.0f} MB of weights per token."
    )
    return f"{harness.md_table(header, rows)}\n\n{note}"


def _after(context: int | None) -> str:
    return f" after a {context}-token prompt" if context else ""


def _blocks_note(ms: float | None, what: str) -> str:
    if ms is None:
        return "."
    return (
        f"; as shipped, with the native layer blocks (the same bits, the layers' Python "
        f"left out), {what} took {ms:.2f} ms."
    )


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--gguf", type=Path, help="a GGUF file (default: the default model)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prefill", type=int, metavar="N", help="profile an N-token prefill")
    parser.add_argument(
        "--batch", type=int, metavar="B", help="profile decode steps of B sequences"
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="with --batch or --prefill: CPU time (needs --threads 1)",
    )
    parser.add_argument(
        "--context", type=int, metavar="N", help="decode after an N-token prompt (cached)"
    )
    args = parser.parse_args()
    if args.context is not None and args.context < 1:
        parser.error(f"--context: a prompt of at least 1 token, not {args.context}")
    gguf = args.gguf or harness.default_gguf()
    if args.batch is not None:
        if args.batch < 1:
            parser.error(f"--batch: at least 1 sequence, not {args.batch}")
        harness.publish(
            batch_table(profile_batch(gguf, args.threads, args.tokens, args.batch, args.cpu_time)),
            args.markdown,
        )
        return
    if args.prefill is not None:
        if args.prefill < 1:
            parser.error(f"--prefill: a prompt of at least 1 token, not {args.prefill}")
        result = profile_prefill(gguf, args.threads, args.prefill, args.cpu_time)
        harness.publish(prefill_table(result), args.markdown)
        return
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time: the parts are the engine thread's CPU time; run --threads 1")
    result = profile(gguf, args.threads, args.tokens, args.context, args.cpu_time)
    harness.publish(table(result), args.markdown)


if __name__ == "__main__":
    main()
