"""A mixture-of-experts model at a real size, side by side with llama.cpp, in one run.

    python bench/moe.py [--peers-python PATH] [--threads 2] [--runs 3] [--markdown FILE]

Writes (once, cached beside the other synthetic files) an OLMoE-1B-7B-sized GGUF with
`synthetic_gguf.py` (shape ``olmoe-7b``: 64 experts of 1,024 rows, 8 per token, 16 layers,
llama-quantize's Q4_K_M mix, random but valid blocks: the speed is real, the text is not),
in llama.cpp's ``qwen3moe`` architecture, which both engines run. Each engine then runs in
a fresh process (`decode.measure`: TTFT, prefill and decode tok/s, peak RSS, load time).

The bound on decode is memory bandwidth over the bytes one token reads: every tensor
outside the experts, and of each layer's stacked experts the share of the experts a token
uses (8 of 64). Random routers spread the tokens over the experts as trained ones roughly do.
"""

import json
import sys
from pathlib import Path

import decode
import harness
import read_bound
import synthetic_gguf

SHAPE = "olmoe-7b"
ENGINES = ("spnl-backend", "llama.cpp")


def model_file(fmt: str = "q4_k_m") -> Path:
    path = harness.bench_cache("bench-gguf") / f"{SHAPE}-{fmt}.gguf"
    if not path.exists():
        print(f"writing {path} (about 20 s) ...", file=sys.stderr)
        synthetic_gguf.write(path, SHAPE, fmt)
    return path


def active_bytes_per_token(gguf: Path, shape_name: str = SHAPE) -> int:
    """Bytes of weights one decode step reads: the experts' tensors by the share of
    experts a token uses, the rest whole (the embedding: one row)."""
    from gguf import GGUFReader

    shape = synthetic_gguf.SHAPES[shape_name]
    total = 0
    for tensor in GGUFReader(gguf).tensors:
        if "_exps." in tensor.name:
            total += int(tensor.n_bytes) * shape.experts_used // shape.experts
        elif tensor.name == "token_embd.weight" and not shape.tied:
            total += int(tensor.n_bytes) // shape.vocab
        else:
            total += int(tensor.n_bytes)
    return total


def table(results: list[dict], bound: dict, threads: int) -> str:
    rows = [decode.table_row(r, bound) for r in results]
    rows.append(["bandwidth bound", f"{bound['tok_s']:.0f}", "100%"])
    return (
        f"{harness.md_table(decode.HEADER, rows)}\n\n"
        f"{threads} threads, greedy, {harness.DECODE_TOKENS} decode tokens, median of runs; "
        f"OLMoE-1B-7B's sizes as qwen3moe, Q4_K_M. Bound: {bound['mb_per_token']:.0f} MB "
        f"read per token (8 of 64 experts) over {bound['gb_s']:.1f} GB/s measured read "
        f"bandwidth ({bound['method']})."
    )


def main() -> None:
    parser = harness.arguments(__doc__, runs=True)
    harness.add_peers_python(parser, "llama-cpp-python")
    args = parser.parse_args()
    gguf = model_file()
    results = []
    for engine in ENGINES:
        python = args.peers_python if engine == "llama.cpp" else sys.executable
        results.append(decode.run_child(engine, python, gguf, args.threads, args.runs))
        print(json.dumps(results[-1]), file=sys.stderr)
    bandwidth = read_bound.read_bandwidth(args.threads)
    bound = decode.bandwidth_bound(bandwidth, active_bytes_per_token(gguf))
    harness.publish(table(results, bound, args.threads), args.markdown)


if __name__ == "__main__":
    main()
