"""Paged attention kernels on a GPU: decode bandwidth and prefill throughput.

    python bench/kernels.py [--peak-gbs N] [--markdown FILE]

Decode: batch 1/32/128 at context 1k/8k/32k, one query token per sequence; the
Triton kernel reads the paged cache through block tables, against torch's
`scaled_dot_product_attention` on the same keys gathered contiguous (the gather not
timed), and FlashInfer's paged decode where its wheel is installed. Achieved
bandwidth = bytes of K and V read / time, as a fraction of the GPU's peak.
Prefill: 1k and 8k tokens of one sequence, causal, in TFLOP/s.

Shapes are those of an 8B-class model: 32 query heads, 8 KV heads, head dim 128,
bfloat16, block size 32. ``--device cpu`` runs a tiny smoke version (Triton's interpreter).
"""

import argparse
import os
import sys
from pathlib import Path

import harness
import torch
import torch.nn.functional as F

from spnl_backend.kernels.scoring import Scoring

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 32
# Peak memory bandwidth by GPU name (GB/s), for the fraction; --peak-gbs overrides.
PEAK_GBS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0, "L40S": 864.0, "RTX 4090": 1008.0}


def _cuda_seconds(fn) -> float:
    """GPU time of one call: the kernels run asynchronously, so wall time would not see them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000


def _timed(fn, warmup: int = 3, repeats: int = 10) -> float:
    """Median seconds of ``fn`` (CUDA events where there is a GPU)."""
    timer = _cuda_seconds if torch.cuda.is_available() else harness.seconds
    return harness.median_seconds(fn, repeats, warmup, timer)


def _cache(batch: int, context: int, device: str, dtype: torch.dtype):
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    key_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    order = torch.randperm(num_blocks, device=device)
    tables = order.view(batch, blocks_per_seq).to(torch.int32)
    return key_cache, value_cache, tables


def _metadata(tables: torch.Tensor, seq_lens: list[int], query_lens: list[int]):
    """One step's metadata, built once as the engine does for all the layers of a step."""
    from spnl_backend.kernels.metadata import PagedMetadata

    return PagedMetadata(tables, seq_lens, query_lens, BLOCK)


def decode_row(batch: int, context: int, device: str, dtype: torch.dtype, peak: float) -> dict:
    from spnl_backend.kernels.triton_attention import paged_attention_triton

    key_cache, value_cache, tables = _cache(batch, context, device, dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=dtype)
    meta = _metadata(tables, [context] * batch, [1] * batch)
    scale = HEAD_DIM**-0.5
    triton_s = _timed(
        lambda: paged_attention_triton(q, key_cache, value_cache, meta, Scoring(scale))
    )
    k = key_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2)
    v = value_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2)
    sdpa_s = _timed(
        lambda: F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)
    )
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * key_cache.element_size()
    row = {
        "batch": batch,
        "context": context,
        "triton_us": 1e6 * triton_s,
        "sdpa_us": 1e6 * sdpa_s,
        "triton_gbs": kv_bytes / triton_s / 1e9,
    }
    row["fraction"] = row["triton_gbs"] / peak if peak else None
    row["flashinfer_us"] = _flashinfer_decode(q, key_cache, value_cache, tables, context)
    return row


def _flashinfer_decode(q, key_cache, value_cache, tables, context) -> float | None:
    try:
        import flashinfer
    except ImportError:
        return None
    batch, blocks = tables.shape
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    indptr = torch.arange(0, batch * blocks + 1, blocks, dtype=torch.int32, device=q.device)
    last = torch.full((batch,), (context - 1) % BLOCK + 1, dtype=torch.int32, device=q.device)
    wrapper.plan(
        indptr, tables.flatten(), last, HEADS, KV_HEADS, HEAD_DIM, BLOCK, q_data_type=q.dtype
    )
    return 1e6 * _timed(lambda: wrapper.run(q, (key_cache, value_cache)))


def prefill_row(tokens: int, device: str, dtype: torch.dtype) -> dict:
    from spnl_backend.kernels.triton_attention import paged_attention_triton

    key_cache, value_cache, tables = _cache(1, tokens, device, dtype)
    q = torch.randn(tokens, HEADS, HEAD_DIM, device=device, dtype=dtype)
    meta = _metadata(tables, [tokens], [tokens])
    scale = HEAD_DIM**-0.5
    triton_s = _timed(
        lambda: paged_attention_triton(q, key_cache, value_cache, meta, Scoring(scale))
    )
    k = key_cache[tables.long()].flatten(1, 2)[:, :tokens].transpose(1, 2)
    v = value_cache[tables.long()].flatten(1, 2)[:, :tokens].transpose(1, 2)
    sdpa_s = _timed(
        lambda: F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k, v, is_causal=True, scale=scale, enable_gqa=True
        )
    )
    flops = 4 * HEADS * HEAD_DIM * tokens * tokens / 2  # causal: half of QK^T and PV
    return {
        "tokens": tokens,
        "triton_tflops": flops / triton_s / 1e12,
        "sdpa_tflops": flops / sdpa_s / 1e12,
    }


DECODE_HEADER = ["batch", "context", "Triton µs", "GB/s", "of peak", "SDPA (contiguous) µs"]
DECODE_HEADER += ["FlashInfer µs"]


def decode_cells(r: dict) -> list:
    return [
        r["batch"],
        r["context"],
        f"{r['triton_us']:.0f}",
        f"{r['triton_gbs']:.0f}",
        f"{100 * r['fraction']:.0f}%" if r["fraction"] else "?",
        f"{r['sdpa_us']:.0f}",
        f"{r['flashinfer_us']:.0f}" if r["flashinfer_us"] else "not installed",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-gbs", type=float, help="the GPU's peak memory bandwidth")
    parser.add_argument("--markdown", type=Path, help="also write the tables to this file")
    args = parser.parse_args()
    quick = args.device == "cpu"
    if quick:  # Triton has no CPU backend: its interpreter, set before Triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU (or --device cpu for a smoke run)")
    dtype = torch.float32 if quick else torch.bfloat16
    name = "cpu" if quick else torch.cuda.get_device_name()
    peak = args.peak_gbs or next((v for k, v in PEAK_GBS.items() if k in name), None)
    batches, contexts = ((1, 2), (64, 128)) if quick else ((1, 32, 128), (1024, 8192, 32768))
    decode = [decode_row(b, c, args.device, dtype, peak) for b in batches for c in contexts]
    prefill = [prefill_row(t, args.device, dtype) for t in ((64,) if quick else (1024, 8192))]
    text = "\n\n".join(
        [
            f"Device: {name}; peak {peak or '?'} GB/s",
            harness.md_table(DECODE_HEADER, [decode_cells(r) for r in decode]),
            harness.md_table(
                ["prefill tokens", "Triton TFLOP/s", "SDPA TFLOP/s"],
                [
                    [r["tokens"], f"{r['triton_tflops']:.1f}", f"{r['sdpa_tflops']:.1f}"]
                    for r in prefill
                ],
            ),
        ]
    )
    harness.publish(text, args.markdown)


if __name__ == "__main__":
    main()
