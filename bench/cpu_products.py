"""The CPU's quantized products alone: throughput by weight format and row count.

    python bench/cpu_products.py [--threads 2] [--rows 1 16 512] [--part products|lora|both]
                                 [--markdown FILE]

For each format the default model and the Q4_K_M files use, a random weight matrix of a
real shape is multiplied by 1, 16 and 512 activation rows through the native int8
products (what every row count runs with batch invariance on), in GMAC/s and, for one
row, the weight bytes read per second; then one row again with the same weights held on
small pages (torch's allocator) instead of the huge pages the loader gives them
(`memory.host_tensor`); torch's float32 and bfloat16 GEMMs on the same weights
dequantized are the last columns, at the largest row count. Median of 5 calls after one
warm-up (of 15 for the one-row page comparison, which alternates the two).

The LoRA table: the segmented adapter product (`KernelChoice.lora_add`) of a rank-16
adapter on a 2048 x 2048 projection, the rows spread over 4 adapters, through the C
kernel (``lora.c``) and through its torch twin, in milliseconds per call, beside the Q4_K
base product of the same rows (the share the adapters add to a projection).
"""

import harness
import torch
from gguf import GGMLQuantizationType as Q

# (format, output rows, input width, in tiles): a 1B-like MLP's up and down projections
# (each also as the loader lays Q4_K and Q6_K out where the kernels have their tiles,
# `quant.tiles`), the default model's Q5_0 and Q8_0 shapes, and its output layer.
CASES = [
    (Q.Q4_K, 4096, 2048, False),
    (Q.Q4_K, 4096, 2048, True),
    (Q.Q6_K, 2048, 4096, False),
    (Q.Q6_K, 2048, 4096, True),
    (Q.Q5_0, 2048, 640, False),
    (Q.Q8_0, 2048, 640, False),
    (Q.Q8_0, 262144, 640, False),
]


def median_call(fn) -> float:
    return harness.median_seconds(fn, repeats=5, warmup=1)


def measure(native, qtype: Q, n_out: int, k_in: int, tiled: bool, rows: list[int]) -> list:
    from spnl_backend.memory import host_tensor
    from spnl_backend.quant.linear import QuantizedWeight

    weight = QuantizedWeight.from_float(torch.randn(n_out, k_in), qtype)
    if tiled and not native.tiles_native(qtype):
        return [f"{qtype.name} tiles {n_out} x {k_in}", *["no tile kernel here"] * (len(rows) + 3)]
    if tiled:
        weight = weight.as_tiles(native)
    huge = host_tensor(tuple(weight.data.shape), torch.uint8).copy_(weight.data)
    small = torch.empty_like(weight.data).copy_(weight.data)
    fmt = weight.native_format
    products = native.products([(fmt, huge, n_out)])
    cells = [f"{qtype.name}{' tiles' if tiled else ''} {n_out} x {k_in}"]
    for m in rows:
        x = torch.randn(m, k_in)
        seconds = median_call(lambda x=x: products(x))
        gmac = m * n_out * k_in / seconds / 1e9
        read = f" ({weight.data.numel() / seconds / 1e9:.1f} GB/s)" if m == 1 else ""
        cells.append(f"{gmac:.1f}{read}")
    cells.append(page_comparison(native, fmt, k_in, n_out, huge, small))
    x = torch.randn(max(rows), k_in)
    dense = weight.dequantize()
    for dtype in (torch.float32, torch.bfloat16):
        w, a = dense.to(dtype), x.to(dtype)
        seconds = median_call(lambda w=w, a=a: a @ w.T)
        cells.append(f"{max(rows) * n_out * k_in / seconds / 1e9:.1f}")
    return cells


def page_comparison(native, fmt: int, k_in: int, n_out: int, huge, small) -> str:
    """One row's time with the weights (format number ``fmt``) on huge pages and on small
    ones, calls alternated."""
    calls = {
        "huge": native.products([(fmt, huge, n_out)]),
        "small": native.products([(fmt, small, n_out)]),
    }
    x = torch.randn(1, k_in)
    times: dict[str, list[float]] = {"huge": [], "small": []}
    for _ in range(16):
        for name, call in calls.items():
            times[name].append(harness.seconds(lambda call=call: call(x)))
    huge_s, small_s = (sorted(times[n][1:])[7] for n in ("huge", "small"))
    return f"{small_s * 1e3:.2f} / {huge_s * 1e3:.2f} ms ({small_s / huge_s:.2f}x)"


LORA_RANK, LORA_WIDTH, LORA_ADAPTERS = 16, 2048, 4


def lora_measure(native, rows: int) -> list:
    """One row count's cells of the LoRA table."""
    from spnl_backend.kernels.cpu.lora import lora_add_native
    from spnl_backend.kernels.lora_ref import LoraPair, LoraSegment, lora_add_ref
    from spnl_backend.quant.linear import QuantizedWeight

    k_in = n_out = LORA_WIDTH
    x, out = torch.randn(rows, k_in), torch.randn(rows, n_out)
    segments = [
        LoraSegment(
            torch.arange(rows)[i::LORA_ADAPTERS],
            LoraPair(torch.randn(LORA_RANK, k_in), torch.randn(n_out, LORA_RANK), 1.0),
            1.0,
        )
        for i in range(min(rows, LORA_ADAPTERS))
    ]
    weight = QuantizedWeight.from_float(torch.randn(n_out, k_in), Q.Q4_K)
    products = native.products([(Q.Q4_K.value, weight.data, n_out)])
    ms = [
        median_call(call) * 1e3
        for call in (
            lambda: lora_add_native(native, x, out, segments),
            lambda: lora_add_ref(x, out, segments),
            lambda: products(x),
        )
    ]
    return [rows, *(f"{t:.3f}" for t in ms), f"{ms[0] / ms[2]:.1%}"]


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 512])
    parser.add_argument("--part", choices=["products", "lora", "both"], default="both")
    args = parser.parse_args()
    if min(args.rows) < 1:
        parser.error(f"--rows: every row count must be at least 1, not {min(args.rows)}")
    native = harness.native_kernels(args.threads)
    tables = []
    if args.part != "lora":
        header = ["weights", *(f"{m} rows: GMAC/s" for m in args.rows)]
        header += ["1 row, small / huge pages"]
        header += [f"torch float32 GEMM, {max(args.rows)} rows", "torch bfloat16 GEMM"]
        rows = [measure(native, *case, args.rows) for case in CASES]
        tables.append(harness.md_table(header, rows))
    if args.part != "products":
        header = ["rows", "LoRA, C kernel: ms", "LoRA, torch twin: ms", "Q4_K base: ms"]
        header += ["LoRA / base"]
        tables.append(harness.md_table(header, [lora_measure(native, m) for m in args.rows]))
    note = f"{args.threads} threads; int8 products as batch invariance runs them."
    harness.publish("\n\n".join([*tables, note]), args.markdown)


if __name__ == "__main__":
    main()
