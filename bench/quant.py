"""Quantization on the default model: ISQ types side by side, and K-quant accuracy.

    python bench/quant.py [--peers-python PATH] [--threads 2] [--runs 3] [--markdown FILE]

1. ISQ: a text model made from the default GGUF (dequantized once by transformers into a
   safetensors directory, cached) is loaded with MISTRALRS_ISQ none, Q8_0, Q6K, Q4K and
   Q4_0, each in a fresh process: load time, resident weight memory, peak RSS, decode
   tok/s (128 greedy tokens, median of runs) and perplexity on the shipped English text
   (its first 1,024 tokens). The GGUF as stored (Q4_K_M, Q8_0 embedding) is the last row.
2. Round trips: relative RMS error of quantize-then-dequantize on standard normal weights
   (256 x 4096), ours against llama.cpp's reference quantizers (``quantize_row_*_ref`` in
   the libggml that llama-cpp-python ships, run by --peers-python) dequantized by gguf-py.
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
from harness import DECODE_TOKENS, STORY_PROMPT

ISQ_TYPES = ["none", "Q8_0", "Q6K", "Q4K", "Q4_0"]
ROUND_TRIP_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q8_0"]
PERPLEXITY_TOKENS = 1024


# ---- 1. ISQ on the text model -------------------------------------------------------------


def measure_isq(model: str, isq: str, threads: int, runs: int) -> dict:
    """One process, one model: load, speed, memory, perplexity."""
    import statistics

    import torch

    torch.set_num_threads(threads)
    start = time.perf_counter()
    backend = harness.load_ours(model, prefix_cache_n=0, isq=None if isq == "none" else isq)
    load_s = time.perf_counter() - start
    backend.generate(STORY_PROMPT, max_tokens=4, temperature=0)  # warm-up
    rates = [
        backend.generate(
            STORY_PROMPT, max_tokens=DECODE_TOKENS + 1, temperature=0
        ).usage.decode_tok_s
        for _ in range(runs)
    ]
    rss_mb = harness.peak_rss_mb()  # before scoring, whose [1024, vocab] logits would dominate
    ids = harness.text_ids(backend.tokenizer.encode, PERPLEXITY_TOKENS)
    return {
        "isq": isq,
        "load_s": load_s,
        "weights_mb": _resident_weight_bytes(backend.model) / 1e6,
        "peak_rss_mb": rss_mb,
        "decode_tok_s": statistics.median(rates),
        "perplexity": harness.our_perplexity(backend, ids),
        "tokens": len(ids),
    }


def _resident_weight_bytes(model) -> int:
    from spnl_backend.quant.linear import QuantEmbedding, QuantLinear

    quantized = sum(
        m.weight_q.nbytes for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding)
    )
    return quantized + sum(p.numel() * p.element_size() for p in model.parameters())


def run_isq_child(model: str, isq: str, threads: int, runs: int) -> dict:
    command = [sys.executable, __file__, "--child-isq", isq, "--model", model]
    command += ["--threads", threads, "--runs", runs]
    return {"isq": isq} | harness.run_json_child(command)


def isq_row(r: dict) -> list[str]:
    if "error" in r:
        return [r["isq"], f"not run: {r['error']}"]
    return [
        r["isq"],
        f"{r['weights_mb']:,.0f} MB",
        f"{r['peak_rss_mb']:,.0f} MB",
        f"{r['load_s']:.1f} s",
        f"{r['decode_tok_s']:.1f}",
        f"{r['perplexity']:.3f}",
    ]


def isq_table(results: list[dict], threads: int) -> str:
    header = ["model", "weights resident", "peak RSS", "load", "decode tok/s", "perplexity"]
    tokens = next((r["tokens"] for r in results if "tokens" in r), PERPLEXITY_TOKENS)
    return (
        f"{harness.md_table(header, [isq_row(r) for r in results])}\n\n"
        f"{threads} threads; decode: {DECODE_TOKENS} greedy tokens, median of runs; "
        f"perplexity over the first {tokens} tokens of bench/data/english.txt."
    )


# ---- 2. K-quant round trips against llama.cpp ---------------------------------------------


def standard_normal_weights():
    import numpy as np

    return np.random.default_rng(1).standard_normal((256, 4096)).astype(np.float32)


def llama_cpp_quantize(out_dir: Path) -> None:
    """Runs under --peers-python: llama.cpp's reference quantizers, bytes saved per type."""
    import ctypes

    import llama_cpp
    import numpy as np

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    library = ctypes.CDLL(str(next(lib_dir.glob("libggml-base.*"))))
    weights = standard_normal_weights()
    row_bytes = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
    row_bytes |= {"Q4_0": 18 * 8, "Q8_0": 34 * 8}  # per 256 values
    for name in ROUND_TRIP_TYPES:
        quantize_row = getattr(library, f"quantize_row_{name.lower().replace('_k', '_K')}_ref")
        out = np.zeros((weights.shape[0], weights.shape[1] // 256 * row_bytes[name]), np.uint8)
        for r in range(weights.shape[0]):
            quantize_row(
                weights[r].ctypes.data_as(ctypes.c_void_p),
                out[r].ctypes.data_as(ctypes.c_void_p),
                ctypes.c_int64(weights.shape[1]),
            )
        np.save(out_dir / f"{name}.npy", out)


def round_trip_rows(peers_python: str) -> list[dict]:
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    from spnl_backend.quant.ggml import dequantize
    from spnl_backend.quant.quantize import quantize

    weights = standard_normal_weights()
    power = float((weights**2).mean())

    def error(values) -> float:
        return math.sqrt(float(((values - weights) ** 2).mean()) / power)

    with tempfile.TemporaryDirectory() as tmp:
        command = [peers_python, __file__, "--child-llama-quantize", tmp]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        have_llama = done.returncode == 0
        if not have_llama:
            print(f"llama.cpp quantizers not run: {done.stderr.strip()[-300:]}", file=sys.stderr)
        rows = []
        for name in ROUND_TRIP_TYPES:
            qtype = GGMLQuantizationType[name]
            packed = quantize(torch.from_numpy(weights), qtype)
            ours = dequantize(packed.reshape(-1), qtype, weights.shape).numpy()
            row = {"type": name, "ours": error(ours)}
            if have_llama:
                theirs = np.load(Path(tmp) / f"{name}.npy")
                row["llama.cpp"] = error(quants.dequantize(theirs, qtype))
                row["same_bytes"] = float((packed.numpy() == theirs).mean())
            rows.append(row)
    return rows


def round_trip_row(r: dict) -> list[str]:
    if "llama.cpp" not in r:
        return [r["type"], f"{r['ours']:.5f}", "not run"]
    return [
        r["type"],
        f"{r['ours']:.5f}",
        f"{r['llama.cpp']:.5f}",
        f"{r['ours'] / r['llama.cpp']:.4f}",
        f"{100 * r['same_bytes']:.1f}%",
    ]


def round_trip_table(rows: list[dict]) -> str:
    header = ["type", "ours", "llama.cpp", "ours / llama.cpp", "identical bytes"]
    return (
        f"{harness.md_table(header, [round_trip_row(r) for r in rows])}\n\n"
        "Relative RMS error of quantize-then-dequantize, standard normal 256 x 4096; "
        "llama.cpp's bytes dequantized by gguf-py."
    )


def main() -> None:
    parser = harness.arguments(__doc__, runs=True)
    parser.add_argument("--types", nargs="+", default=ISQ_TYPES, choices=ISQ_TYPES)
    harness.add_peers_python(parser, "llama-cpp-python")
    parser.add_argument("--child-isq", help=argparse.SUPPRESS)
    parser.add_argument("--child-llama-quantize", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_isq:
        print(json.dumps(measure_isq(args.model, args.child_isq, args.threads, args.runs)))
        return
    if args.child_llama_quantize:
        llama_cpp_quantize(args.child_llama_quantize)
        return
    gguf = harness.default_gguf()
    text = harness.text_model_dir(gguf)
    results = []
    for isq in args.types:
        results.append(run_isq_child(str(text), isq, args.threads, args.runs))
        print(json.dumps(results[-1]), file=sys.stderr)
    stored = run_isq_child(str(gguf), "none", args.threads, args.runs)
    results.append(stored | {"isq": "GGUF Q4_K_M as stored"})
    print(json.dumps(results[-1]), file=sys.stderr)
    rows = round_trip_rows(args.peers_python)
    output = isq_table(results, args.threads) + "\n\n" + round_trip_table(rows)
    harness.publish(output, args.markdown)


if __name__ == "__main__":
    main()
