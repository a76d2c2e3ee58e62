"""The CPU's decode attention alone: one query's time by context length and KV storage.

    python bench/cpu_attention.py [--threads 2] [--contexts 1024 4096 16384]
        [--heads 4] [--kv-heads 1] [--head-dim 256] [--markdown FILE]

One sequence's decode query (--heads query heads over --kv-heads KV heads of --head-dim
dims: by default the default model's layer) attends to C cached keys through the native
paged kernel, with the pool in float32 and in float16 (MISTRALRS_PAGED_CACHE_TYPE=f32 and
the CPU's auto): median of 50 calls after 5, and the K/V bytes read per second.
"""

import harness
import torch

from spnl_backend.kernels.scoring import Scoring

BLOCK = 32


def one_call(native, dtype: torch.dtype, context: int, heads: int, kv_heads: int, dim: int):
    blocks = -(-context // BLOCK)
    shape = (blocks, BLOCK, kv_heads, dim)
    keys, values = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    q = torch.randn(1, heads, dim)
    slots, lens = torch.arange(blocks * BLOCK)[None], torch.tensor([context])
    scale = dim**-0.5
    return lambda: native.paged_decode(q, keys, values, slots, lens, Scoring(scale))


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    args = parser.parse_args()
    if (
        min(args.contexts) < 1
        or args.heads % args.kv_heads
        or min(args.kv_heads, args.head_dim) < 1
    ):
        parser.error("contexts and sizes must be at least 1, heads a multiple of --kv-heads")
    native = harness.native_kernels(args.threads)
    rows = []
    for context in args.contexts:
        cells = [f"{context:,}"]
        times = []
        for dtype in (torch.float32, torch.float16):
            call = one_call(native, dtype, context, args.heads, args.kv_heads, args.head_dim)
            seconds = harness.median_seconds(call, repeats=50, warmup=5)
            read = 2 * context * args.kv_heads * args.head_dim * dtype.itemsize
            cells.append(f"{seconds * 1e6:,.0f} µs ({read / seconds / 1e9:.1f} GB/s)")
            times.append(seconds)
        rows.append([*cells, f"{times[0] / times[1]:.2f}x"])
    header = ["context", "float32 pool", "float16 pool", "float16 speed-up"]
    note = (
        f"{args.threads} threads; one decode query, {args.heads} heads over {args.kv_heads} "
        f"KV head(s) of {args.head_dim} dims; median of 50 calls."
    )
    harness.publish(f"{harness.md_table(header, rows)}\n\n{note}", args.markdown)


if __name__ == "__main__":
    main()
