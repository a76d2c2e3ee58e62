"""Many short PIC documents at several block sizes: the slots their padding takes, and
whether smaller blocks cost time.

    python bench/pic_block_sizes.py [--docs 100] [--words 15] [--sizes 32 16 8]
        [--gguf GGUF] [--markdown FILE]

Every span of a PIC prompt starts a new block, so a document of a few tokens pays a
block. Per block size, in a process of its own (the default model unless ``--gguf``, a
KV budget of 8,192 tokens): one untimed request of other text, then a PIC prompt of a
system text, ``--docs`` documents of ``--words`` words of the shipped text each as plus
elements, and a question, cold (computed) and again (a hit); 32 greedy tokens each.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import harness


def measure(gguf: str, block: int, docs: int, words: int) -> dict:
    backend = harness.load_ours(gguf, paged_attn_block_size=block, paged_attn_context_len=8192)
    text = (harness.DATA / "english.txt").read_text().split()
    encode, plain = backend.tokenizer.encode, backend.tokenizer.encode_plain
    pieces = [("cross", encode("") + plain("Answer from the documents."))]
    pieces += [("plus", plain(" ".join(text[i * words : (i + 1) * words]))) for i in range(docs)]
    pieces += [("cross", plain("Question: what is it about?"))]
    backend.generate("Here is a short poem about the sea.", max_tokens=2, temperature=0)
    cold = backend.generate(blocks=pieces, max_tokens=32, temperature=0).usage
    hit = backend.generate(blocks=pieces, max_tokens=32, temperature=0).usage
    tokens = sum(len(ids) for _, ids in pieces)
    slots = sum(-(-len(ids) // block) * block for _, ids in pieces)
    backend.close()
    return {
        "block": block,
        "tokens": tokens,
        "slots": slots,
        "cold_ms": cold.ttft_s * 1e3,
        "hit_ms": hit.ttft_s * 1e3,
        "decode": cold.decode_tok_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--words", type=int, default=15)
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 16, 8])
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    gguf = str(args.gguf or harness.default_gguf())
    if args.one:
        print(json.dumps(measure(gguf, args.one, args.docs, args.words)))
        return
    rows = []
    for size in args.sizes:
        command = [sys.executable, __file__, "--one", size, "--docs", args.docs]
        command += ["--words", args.words, "--gguf", gguf]
        r = harness.run_json_child(command, dict(os.environ))
        if "error" in r:
            rows.append([size, f"not run: {r['error']}", "", "", "", ""])
            continue
        rows.append(
            [
                size,
                f"{r['tokens']:,}",
                f"{r['slots']:,} ({r['slots'] / r['tokens']:.2f}x)",
                f"{r['cold_ms']:,.0f} ms",
                f"{r['hit_ms']:,.0f} ms",
                f"{r['decode']:.1f}",
            ]
        )
    header = ["block size", "tokens", "slots", "cold TTFT", "hit TTFT", "decode tok/s"]
    note = f"{args.docs} documents of {args.words} words as plus elements; 32 greedy tokens."
    harness.publish(harness.md_table(header, rows) + "\n\n" + note, args.markdown)


if __name__ == "__main__":
    main()
