"""Where one decode token's time goes, in our engine on the CPU.

    python bench/profile_decode.py [--gguf FILE] [--threads 2] [--tokens 32] [--markdown FILE]

Timers around every native call (each quantized product, by its weight shape; attention;
the norms, RoPE, the KV store and embedding lookups), over a greedy generation of
--tokens + 1 tokens less the same prompt's generation of 1 token: what is left is decode
alone, against the engine's own decode time. Each product's rate is its weight bytes
over its time; the read bandwidth (a torch sum over 1 GiB at the same thread count) is
measured after, for comparison. What the timers do not cover is Python and torch's small
operations between the kernels, and sampling. The default model unless --gguf.
"""

import collections
import time
from contextlib import contextmanager
from pathlib import Path

import decode
import harness

OTHER_KERNELS = ("rms_norm", "rope_", "store_kv", "gather_rows")


class Timers:
    """Seconds and calls per label, while installed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.bytes: dict[str, int] = {}

    def timed(self, label: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[label] += time.perf_counter() - start
            self.calls[label] += 1

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        return dict(self.seconds), dict(self.calls)


def product_label(products, k_in: int) -> str:
    from gguf import GGMLQuantizationType

    names = "+".join(sorted({GGMLQuantizationType(q).name for q, _ in products.row_bytes}))
    widths = "+".join(str(n) for n in products.widths)
    return f"product {widths} x {k_in} ({names})"


@contextmanager
def installed(timers: Timers):
    """Wrap the kernels' entry points in ``timers``; restored on exit."""
    from spnl_backend.kernels import cpu

    originals = {name: getattr(cpu.CpuKernels, name) for name in (*OTHER_KERNELS, "paged_decode")}
    products_call = cpu.Products.__call__

    def wrap(name, original):
        label = "attention" if name == "paged_decode" else "norms, RoPE, KV store, lookups"
        return lambda self, *a, **k: timers.timed(label, original, self, *a, **k)

    def products(self, x):
        label = product_label(self, x.shape[1])
        timers.bytes[label] = sum(w.numel() for w in self.weights)
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


def profile(gguf: Path, threads: int, tokens: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    backend = harness.load_ours(gguf, prefix_cache_n=0)
    prompt = harness.STORY_PROMPT  # short: the prefill subtracted is small beside decode
    backend.generate(prompt, max_tokens=4, temperature=0)  # warm-up
    timers = Timers()
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
        "tokens": made,
        "ms_per_token": 1000 * wall / made,
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
        "bandwidth_gb_s": decode.read_bandwidth_gb_s(threads),
        "weight_mb": decode.weight_bytes_per_token(gguf) / 1e6,
    }


def table(result: dict) -> str:
    total = result["ms_per_token"]
    parts = sorted(result["parts"].items(), key=lambda item: -item[1]["ms"])
    rows = []
    for label, part in parts:
        rate = f"{part['gb_s']:.1f} GB/s" if part["gb_s"] else ""
        share = f"{100 * part['ms'] / total:.0f}%"
        rows.append([label, f"{part['calls']:.0f}", f"{part['ms']:.2f}", share, rate])
    timed = sum(part["ms"] for _, part in parts)
    rest = total - timed
    rows.append(["Python, torch ops, sampling", "", f"{rest:.2f}", f"{100 * rest / total:.0f}%"])
    rows.append(["one decode token", "", f"{total:.2f}", "100%"])
    header = ["part", "calls per token", "ms per token", "share", "weights read at"]
    note = (
        f"{result['model']}, {result['threads']} threads, {result['tokens']} greedy decode "
        f"tokens ({1000 / total:.1f} tok/s with the timers in). Read bandwidth: "
        f"{result['bandwidth_gb_s']:.1f} GB/s (a torch sum); {result['weight_mb']:,.0f} MB "
        "of weights per token."
    )
    return f"{harness.md_table(header, rows)}\n\n{note}"


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--gguf", type=Path, help="a GGUF file (default: the default model)")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    gguf = args.gguf or harness.default_gguf()
    result = profile(gguf, args.threads, args.tokens)
    harness.publish(table(result), args.markdown)


if __name__ == "__main__":
    main()
