"""One-row products of the Q4_K_M formats, two versions of the kernels side by side in one process.

    PYTHONPATH=. python bench/products_ab.py [--old REV] [--repeats 15] [--gguf FILE ...]
                                             [--markdown FILE]

(PYTHONPATH=.: "this checkout" is the spnl_backend that Python imports, and a script's
own folder, not the working directory, is first on its path.)

Builds the C kernels from git revision --old (default main) and from this checkout (as
bench/attention_ab.py does), checks that both give the same bits on every case, then
times one activation row against a Q4_K and a Q6_K matrix, the two libraries alternating,
in this process's CPU time on one thread (median of --repeats). Two sizes per format:
weights that stay in the core's L2 cache between calls (a kernel bound by its
instructions shows there) and weights 3-4x the last-level cache (read from memory each
call, as a decode's are), on huge pages as the loader holds them. GB/s is weight
bytes over the time of one call; the L2 calls are short, so the call's fixed cost (the
activations' rounding, Python) is measured on a matrix of 16 rows and shown apart.
Compare with bench/read_bound.c, what one core can read. With --gguf, one more row per
file: every quantized product of one decode token of that model (each product set once on
a random row, as bench/decode_gap.py's `products`), the sets prepared once and run through
either library. With --shapes 1b, the products of the 1B files' decode instead of CASES
(gemma3-1b's gate+up, qkv, down and o_proj, llama-1b's), each read from memory: the calls
go round copies of the matrix that together pass the last-level cache twice over. With
--shapes q6_k, so the Q6_K matrices of llama-1b and gemma3-4b (output heads, ffn_down);
with --shapes q8_0, the Q8_0 output heads (tied embeddings) of Gemma 3 270M and 1B.
"""

import dataclasses
import time
from pathlib import Path

import harness
import torch
from attention_ab import build_pair
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

# (format, output rows, input width, calls per timing): in L2, then 3-4x the L3
# (a matrix barely past it is still read partly from it).
CASES = [
    (Q.Q4_K, 512, 2048, 40),
    (Q.Q4_K, 16384, 14336, 1),
    (Q.Q6_K, 192, 4096, 40),
    (Q.Q6_K, 8192, 14336, 1),
    (Q.Q4_K, 16, 2048, 40),  # the fixed cost of a call
]
# The 1B files' decode products (format, output rows, input width, calls per timing).
SHAPES_1B = [
    (Q.Q5_0, 13824, 1152, 8),  # gemma3-1b gate + up
    (Q.Q5_0, 1536, 1152, 40),  # gemma3-1b q + k + v
    (Q.Q4_K, 1152, 6912, 8),  # gemma3-1b down
    (Q.Q6_K, 1152, 6912, 8),  # gemma3-1b down, the layers that keep Q6_K
    (Q.Q4_K, 1152, 1024, 40),  # gemma3-1b o_proj
    (Q.Q4_K, 16384, 2048, 4),  # llama-1b gate + up
    (Q.Q4_K, 2048, 2048, 20),  # llama-1b o_proj
    (Q.Q4_K, 2048, 8192, 8),  # llama-1b down
]
# The Q6_K matrices of the 1B and 4B Q4_K_M files' decode (the heads one very tall matrix).
SHAPES_Q6_K = [
    (Q.Q6_K, 128256, 2048, 1),  # llama-1b output head
    (Q.Q6_K, 2048, 8192, 8),  # llama-1b ffn_down
    (Q.Q6_K, 262144, 2560, 1),  # gemma3-4b output head
    (Q.Q6_K, 2560, 10240, 4),  # gemma3-4b ffn_down
]
# The Q8_0 output heads of the Gemma files (their tied embeddings).
SHAPES_Q8_0 = [
    (Q.Q8_0, 262144, 640, 1),  # gemma3-270m output head
    (Q.Q8_0, 262144, 1152, 1),  # gemma3-1b output head
]
LAST_LEVEL = 32 << 20  # bytes of L3 that copies must pass twice over to be read from memory
HEADS = {
    Q.Q4_K: (slice(0, 16), 144),
    Q.Q6_K: (slice(192, 210), 210),
    Q.Q5_0: (slice(0, 2), 22),
    Q.Q8_0: (slice(0, 2), 34),
}


def random_weight(qtype: Q, n_out: int, k_in: int) -> torch.Tensor:
    """Random blocks with finite float16 scales (quantizing a matrix this large is slow)."""
    from spnl_backend.quant.linear import QuantizedWeight

    one = QuantizedWeight.from_float(torch.randn(16, k_in), qtype).data
    rows = one.repeat((n_out + 15) // 16, 1)[:n_out].contiguous()
    # Scramble the values (not the block scales: where they sit differs by format).
    gen = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=gen)
    head, block = HEADS[qtype]
    keep = torch.zeros(block, dtype=torch.bool)
    keep[head] = True
    keep = keep.repeat(k_in // GGML_QUANT_SIZES[qtype][0])
    from spnl_backend.memory import host_tensor

    return host_tensor(tuple(rows.shape), torch.uint8).copy_(torch.where(keep, rows, noise))


def alternate(calls: dict, repeats: int, per_timing: int = 1) -> dict[str, float]:
    """The median CPU time of each labelled call, the calls alternating."""
    times: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(repeats):
        for label, call in calls.items():
            start = time.process_time()
            for _ in range(per_timing):
                call()
            times[label].append((time.process_time() - start) / per_timing)
    return {label: sorted(t)[len(t) // 2] for label, t in times.items()}


def token_row(gguf: Path, old, new, repeats: int) -> list[str]:
    """A decode token's products of the model in ``gguf``, through each library."""
    import ctypes

    from decode_gap import step_products, width

    torch.set_num_threads(1)
    before = {id(o) for o in step_products(set())}
    backend = harness.load_ours(gguf, prefix_cache_n=0, num_threads=1)
    backend.generate(harness.STORY_PROMPT, max_tokens=2, temperature=0)  # prepares them
    products = step_products(before)
    sets = [(p, torch.randn(1, width(p)), torch.empty(1, p.total)) for p in products]
    weight_bytes = sum(w.numel() for p in products for w in p.weights)

    def token(native):
        def run() -> None:
            for p, x, y in sets:
                status = native.library.spnl_qmatmul(
                    ctypes.byref(p.args), x.data_ptr(), 1, x.shape[1], y.data_ptr(), p.total, 1, 0
                )
                if status:
                    raise SystemExit(f"{gguf.name}: a product failed ({status})")

        return run

    outputs = {}
    for label, native in (("old", old), ("new", new)):
        token(native)()
        outputs[label] = [y.clone() for _, _, y in sets]
    if not all(torch.equal(a, b) for a, b in zip(outputs["old"], outputs["new"], strict=True)):
        raise SystemExit(f"{gguf.name}: the two versions give different bits")
    median = alternate({"old": token(old), "new": token(new)}, repeats)
    gb = weight_bytes / 1e9
    return [
        f"{gguf.name}: a token's {len(sets)} product sets ({weight_bytes / 2**20:.0f} MiB)",
        f"{median['old'] * 1e3:.1f} ms ({gb / median['old']:.1f} GB/s)",
        f"{median['new'] * 1e3:.1f} ms ({gb / median['new']:.1f} GB/s)",
        f"{median['old'] / median['new']:.2f}x",
    ]


def shape_row(
    qtype: Q, n_out: int, k_in: int, calls: int, old, new, repeats: int, from_memory: bool
) -> list[str]:
    """One row against an n_out x k_in matrix through each library, the bits checked."""
    from spnl_backend.memory import host_tensor

    weight = random_weight(qtype, n_out, k_in)
    copies = [weight]
    if from_memory:  # each call a copy of its own, the copies past the last-level cache
        while len(copies) * weight.numel() < 2 * LAST_LEVEL or len(copies) < calls:
            copies.append(host_tensor(tuple(weight.shape), torch.uint8).copy_(weight))
    x = torch.randn(1, k_in)
    prepared = {
        label: [n.products([(qtype.value, w, n_out)]) for w in copies]
        for label, n in (("old", old), ("new", new))
    }
    if not torch.equal(prepared["old"][0](x), prepared["new"][0](x)):
        raise SystemExit(f"{qtype.name} {n_out} x {k_in}: the two versions give different bits")

    def turns(calls_of: list):
        at = iter(range(1 << 62))
        return lambda: calls_of[next(at) % len(calls_of)](x)

    median = alternate({label: turns(c) for label, c in prepared.items()}, repeats, calls)
    gb = weight.numel() / 1e9
    return [
        f"{qtype.name} {n_out} x {k_in} ({weight.numel() / 2**20:.1f} MiB)",
        f"{median['old'] * 1e6:.0f} us ({gb / median['old']:.1f} GB/s)",
        f"{median['new'] * 1e6:.0f} us ({gb / median['new']:.1f} GB/s)",
        f"{median['old'] / median['new']:.2f}x",
    ]


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--old", default="main", help="git revision of the old sources")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--gguf", type=Path, nargs="*", default=[], help="Q4_K_M files")
    parser.add_argument(
        "--shapes",
        choices=("q4_k_m", "1b", "q6_k", "q8_0"),
        default="q4_k_m",
        help="q4_k_m: CASES (in L2 and from memory); 1b: SHAPES_1B, q6_k: SHAPES_Q6_K (the"
        " 1B and 4B files' Q6_K heads and ffn_down), q8_0: SHAPES_Q8_0 (the Gemma 270M and 1B"
        " Q8_0 heads), from memory",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    old, new = (dataclasses.replace(k, threads=1) for k in build_pair(args.old))
    one_b = args.shapes != "q4_k_m"  # from memory
    cases = {"q4_k_m": CASES, "1b": SHAPES_1B, "q6_k": SHAPES_Q6_K, "q8_0": SHAPES_Q8_0}[
        args.shapes
    ]
    rows = [shape_row(*case, old, new, args.repeats, one_b) for case in cases]
    rows += [token_row(gguf, old, new, args.repeats) for gguf in args.gguf]
    header = ["one row against", f"old ({args.old})", "new (this checkout)", "old / new"]
    note = (
        f"One thread; CPU time per call, median of {args.repeats}, the two libraries "
        "alternating; the same bits checked on every case. "
        + ("Each matrix read from memory." if one_b else "The 16-row case is the fixed cost.")
    )
    harness.publish(f"{harness.md_table(header, rows)}\n\n{note}", args.markdown)


if __name__ == "__main__":
    main()
