"""Position-independent caching: spnl's `bench pic` protocol on our paged pool.

For each document size (words per document), fresh synthetic documents: one request whose
documents the pool has never seen (no-cache), then ``--reuse`` requests with the same
documents shuffled (reuse), each a PIC prompt (a cross instruction, the documents as plus
blocks, a cross question) generating one token, so its time to first token is what reuse
saves. Reported per size: TTFT p50 no-cache and reuse, their ratio beside spnl's published
figure, the hit rate (plus tokens reused / plus tokens), and the bound of what reuse can
give: the TTFT of a prompt made of the request's cross tokens alone (computed whole, on a
backend without prefix caching), and reuse / that bound (target <= 1.2x); and the TTFT
of the same tokens as a plain prompt whose prefix cache holds all but its last block
(what the question costs with the documents' keys cached, in order).

With ``--accuracy`` (meaningful on a trained model: the default one) each size also
answers a question whose answer is in one document (a vault code), 32 greedy tokens, in
four ways: the plain causal prompt (documents in order, and shuffled) and the PIC prompt
(in order, shuffled) under each position scheme; and the token F1 of each PIC answer
against the plain answer (spnl's accuracy measure), and decode tok/s PIC against plain;
and what relaxed reuse approximates (the documents reused after another instruction).

    python bench/pic.py --default-model --accuracy
    python bench/pic.py --gguf ~/.cache/spnl_backend/bench-gguf/llama-1b-q4_k_m.gguf
"""

import random
import re
import statistics
import sys
from pathlib import Path

import harness

SIZES = (10, 50, 200, 500, 1000, 2000)
# spnl's README_PIC (llama3.1:8b on Metal, 4 documents): speedup no-cache / reuse TTFT.
SPNL_SPEEDUP = {10: 2.35, 50: 5.59, 200: 17.62, 500: 35.48, 1000: 66.89, 2000: 120.24}
SYSTEM = "You are a helpful assistant. Answer based on the provided documents."
SUMMARY = "Summarize the key topics from all the documents."
CODE_QUESTION = "What is the code of the vault? Answer with only the number."
CODE_ANSWER = "The code of the vault is"  # the answer's start, so that it is a copy
LOREM = (
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt "
    "ut labore et dolore magna aliqua enim ad minim veniam quis nostrud exercitation ullamco "
    "laboris nisi aliquip ex ea commodo consequat duis aute irure in reprehenderit voluptate "
    "velit esse cillum fugiat nulla pariatur excepteur sint occaecat cupidatat non proident "
    "sunt culpa qui officia deserunt mollit anim id est laborum"
)
LIPSUM = LOREM.split()


def parse_args(argv: list[str] | None = None):
    parser = harness.arguments(__doc__)
    parser.add_argument("--gguf", type=Path, action="append", default=[])
    parser.add_argument("--default-model", action="store_true")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--reuse", type=int, default=5)
    parser.add_argument("--accuracy", action="store_true")
    parser.add_argument("--context", type=int, default=16384, help="the paged pool, in tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.default_model:
        args.gguf.append(harness.default_gguf())
    if not args.gguf:
        parser.error("give --default-model or --gguf FILE")
    return args


def documents(words: int, count: int, rng: random.Random, code: int | None = None) -> list[str]:
    """spnl's synthetic documents: a topic line and lorem ipsum; one carries the code."""
    docs = []
    for i in range(count):
        body = " ".join(rng.choice(LIPSUM) for _ in range(words))
        fact = f" The code of the vault is {code}." if code is not None and i == 1 else ""
        docs.append(f"Document {i}: The topic of this document is item-{i}.{fact} {body}\n\n")
    return docs


def turns(backend) -> tuple[str, str]:
    """The instruction's and the question's wrapping in the model's chat turns (Gemma's
    and Llama 3's markers where the vocabulary has them, else plain text)."""
    vocab = backend.tokenizer.hf.get_vocab()
    if "<start_of_turn>" in vocab:
        return "<start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n"
    if "<|start_header_id|>" in vocab:
        head = "<|start_header_id|>{}<|end_header_id|>\n\n"
        return head.format("user"), "<|eot_id|>" + head.format("assistant")
    return "User: ", "\nAssistant:"


def blocks(
    backend, docs: list[str], question: str, answer: str = "", system: str = SYSTEM
) -> list[tuple[str, list[int]]]:
    encode = backend.tokenizer.encode_plain
    start, end = turns(backend)
    return [
        ("cross", backend.tokenizer.encode("") + encode(start + system + "\n\n")),
        *[("plus", encode(doc)) for doc in docs],
        ("cross", encode(question + end + answer)),
    ]


def flat(pieces) -> list[int]:
    return [token for _, ids in pieces for token in ids]


def pic(backend, pieces, tokens: int = 1):
    return backend.generate(blocks=pieces, max_tokens=tokens, temperature=0)


def plain(backend, ids: list[int], tokens: int = 1):
    return backend.generate(prompt_token_ids=ids, max_tokens=tokens, temperature=0)


def timing(backend, uncached, words: int, args, rng: random.Random) -> dict:
    docs = documents(words, args.docs, rng)
    pieces = blocks(backend, docs, SUMMARY)
    cold = pic(backend, pieces)
    reuse, hits, plus = [], 0, 0
    for _ in range(args.reuse):
        shuffled = docs[:]
        rng.shuffle(shuffled)
        result = pic(backend, blocks(backend, shuffled, SUMMARY))
        reuse.append(result.usage.ttft_s)
        hits += result.usage.pic_hit_tokens
        plus += result.usage.pic_hit_tokens + result.usage.pic_miss_tokens
    cross = flat([piece for piece in pieces if piece[0] == "cross"])
    bound = statistics.median(plain(uncached, cross).usage.ttft_s for _ in range(5))
    whole = flat(pieces)  # the same tokens as a plain prompt: after one run, a prefix hit
    plain(backend, whole)
    prefix_hit = statistics.median(plain(backend, whole).usage.ttft_s for _ in range(3))
    # Decode over the same context, the documents reused either way.
    flat_decode = plain(backend, whole, 33).usage.decode_tok_s
    pic_decode = pic(backend, blocks(backend, docs[::-1], SUMMARY), 33).usage.decode_tok_s
    return {
        "words": words,
        "prompt_tokens": len(flat(pieces)),
        "cold_ms": cold.usage.ttft_s * 1000,
        "reuse_ms": statistics.median(reuse) * 1000,
        "hit_rate": hits / plus if plus else 0.0,
        "bound_ms": bound * 1000,
        "prefix_hit_ms": prefix_hit * 1000,
        "flat_decode": flat_decode,
        "pic_decode": pic_decode,
    }


def f1(candidate: str, reference: str) -> float:
    """spnl's token F1: lower case, split on non-alphanumerics, bag-of-words overlap."""
    a = [w for w in re.split(r"[^0-9a-z]+", candidate.lower()) if w]
    b = [w for w in re.split(r"[^0-9a-z]+", reference.lower()) if w]
    if not a and not b:
        return 100.0
    common = sum(min(a.count(w), b.count(w)) for w in set(a))
    if not common:
        return 0.0
    precision, recall = common / len(a), common / len(b)
    return 200 * precision * recall / (precision + recall)


def accuracy(backends: dict, words: int, args, rng: random.Random) -> dict:
    code = rng.randrange(1000, 10000)
    docs = documents(words, args.docs, rng, code)
    shuffled = docs[::-1]
    first = next(iter(backends.values()))
    flat_answer = plain(first, flat(blocks(first, docs, CODE_QUESTION, CODE_ANSWER)), 32)
    flat_shuffled = plain(first, flat(blocks(first, shuffled, CODE_QUESTION, CODE_ANSWER)), 32)
    row = {
        "flat": str(code) in flat_answer.text,
        "flat shuffled": str(code) in flat_shuffled.text,
        "flat decode": flat_answer.usage.decode_tok_s,
    }
    for scheme, backend in backends.items():
        ordered = pic(backend, blocks(backend, docs, CODE_QUESTION, CODE_ANSWER), 32)
        moved = pic(backend, blocks(backend, shuffled, CODE_QUESTION, CODE_ANSWER), 32)
        row[scheme] = str(code) in ordered.text
        row[f"{scheme} shuffled"] = str(code) in moved.text
        row[f"{scheme} f1"] = f1(ordered.text, flat_answer.text)
        row[f"{scheme} decode"] = ordered.usage.decode_tok_s
    return row


OTHER_SYSTEM = "You are a careful assistant. Use only the documents given below."


def relaxed(path: Path, words: int, args, rng: random.Random) -> dict:
    """What relaxed reuse approximates: the documents computed after one instruction and
    reused after another (spnl's engine reuses them so), against an exact recompute of
    the second request; with spnl's local positions, where relaxed keys hit."""
    code = rng.randrange(1000, 10000)
    docs = documents(words, args.docs, rng, code)
    found = {}
    for reuse in ("relaxed", "exact"):
        backend = harness.load_ours(
            path, pic_reuse=reuse, pic_positions="local", paged_attn_context_len=args.context
        )
        pic(backend, blocks(backend, docs, CODE_QUESTION, CODE_ANSWER))  # cached after one
        second = blocks(backend, docs, CODE_QUESTION, CODE_ANSWER, OTHER_SYSTEM)
        found[reuse] = pic(backend, second, 32)
        backend.close()
    hit, exact = found["relaxed"], found["exact"]
    same = 0
    for a, b in zip(hit.token_ids, exact.token_ids, strict=False):
        if a != b:
            break
        same += 1
    return {
        "words": words,
        "hit_tokens": hit.usage.pic_hit_tokens,
        "same_tokens": same,
        "f1": f1(hit.text, exact.text),
        "right": (str(code) in hit.text, str(code) in exact.text),
    }


def relaxed_table(name: str, rows: list[dict]) -> str:
    header = [
        "words per doc",
        "plus tokens reused",
        "greedy tokens equal to exact (of 32)",
        "F1 against exact",
        "vault code relaxed / exact",
    ]
    lines = [
        [
            row["words"],
            row["hit_tokens"],
            row["same_tokens"],
            f"{row['f1']:.0f}",
            " / ".join("right" if ok else "wrong" for ok in row["right"]),
        ]
        for row in rows
    ]
    title = f"**{name}: relaxed reuse after another instruction (local positions)**"
    return title + "\n\n" + harness.md_table(header, lines)


def fits(backend, words: int, args) -> bool:
    rng = random.Random(0)
    tokens = len(flat(blocks(backend, documents(words, args.docs, rng, 1234), CODE_QUESTION)))
    return tokens + 64 + args.docs * 32 < args.context


def run_model(path: Path, args) -> tuple[list[dict], list[dict], list[dict]]:
    schemes = ("after_prefix", "local") if args.accuracy else ("after_prefix",)
    backends = {
        scheme: harness.load_ours(path, pic_positions=scheme, paged_attn_context_len=args.context)
        for scheme in schemes
    }
    backend = backends["after_prefix"]
    # The bound's prompts computed whole every time: no prefix cache.
    uncached = harness.load_ours(path, prefix_cache_n=0, paged_attn_context_len=4096)
    sizes = [words for words in args.sizes if fits(backend, words, args)]
    skipped = sorted(set(args.sizes) - set(sizes))
    if skipped:
        print(f"{path.name}: sizes {skipped} do not fit {args.context} tokens", file=sys.stderr)
    rng = random.Random(args.seed)
    pic(backend, blocks(backend, documents(20, args.docs, rng), SUMMARY))  # warm up
    for _ in range(2):
        plain(uncached, flat(blocks(uncached, [], SUMMARY)))
    times = [timing(backend, uncached, words, args, rng) for words in sizes]
    uncached.close()
    answers = []
    if args.accuracy:
        answers = [accuracy(backends, words, args, rng) | {"words": words} for words in sizes]
    for each in backends.values():
        each.close()
    approximations = [relaxed(path, words, args, rng) for words in sizes if args.accuracy]
    return times, answers, approximations


def timing_table(name: str, rows: list[dict]) -> str:
    header = [
        "words per doc",
        "prompt tokens",
        "TTFT no-cache",
        "TTFT reuse",
        "speedup",
        "spnl's speedup",
        "hit rate",
        "cross tokens alone",
        "reuse / cross alone",
        "flat prompt, prefix-cache hit",
        "decode tok/s flat / PIC",
    ]
    lines = [
        [
            row["words"],
            f"{row['prompt_tokens']:,}",
            f"{row['cold_ms']:,.0f} ms",
            f"{row['reuse_ms']:,.1f} ms",
            f"{row['cold_ms'] / row['reuse_ms']:.1f}x",
            f"{SPNL_SPEEDUP[row['words']]:.1f}x" if row["words"] in SPNL_SPEEDUP else "",
            f"{row['hit_rate']:.0%}",
            f"{row['bound_ms']:,.1f} ms",
            f"{row['reuse_ms'] / row['bound_ms']:.2f}x",
            f"{row['prefix_hit_ms']:,.1f} ms",
            f"{row['flat_decode']:.1f} / {row['pic_decode']:.1f}",
        ]
        for row in rows
    ]
    return f"**{name}**\n\n" + harness.md_table(header, lines)


def accuracy_table(name: str, rows: list[dict]) -> str:
    header = ["words per doc", "flat", "flat shuffled"]
    schemes = ("after_prefix", "local")
    header += [f"PIC {s}{extra}" for s in schemes for extra in ("", " shuffled", " F1")]
    header += ["decode tok/s flat / PIC"]

    def mark(ok: bool) -> str:
        return "right" if ok else "wrong"

    lines = []
    for row in rows:
        cells = [row["words"], mark(row["flat"]), mark(row["flat shuffled"])]
        for s in schemes:
            cells += [mark(row[s]), mark(row[f"{s} shuffled"]), f"{row[f'{s} f1']:.0f}"]
        cells.append(f"{row['flat decode']:.1f} / {row['after_prefix decode']:.1f}")
        lines.append(cells)
    return f"**{name}: the vault code, 32 greedy tokens**\n\n" + harness.md_table(header, lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    parts = [
        f"{args.docs} documents, {args.reuse} reuse requests per size, {args.threads} threads, "
        "TTFT p50 (one token generated)"
    ]
    for path in args.gguf:
        times, answers, approximations = run_model(path, args)
        parts.append(timing_table(path.name, times))
        if answers:
            parts.append(accuracy_table(path.name, answers))
            parts.append(relaxed_table(path.name, approximations))
    harness.publish("\n\n".join(parts), args.markdown)


if __name__ == "__main__":
    main()
