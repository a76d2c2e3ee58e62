"""The KV tier: time to first token computed, from the pool, from the tier in the page
cache, and from the tier after its files left the page cache.

    python bench/kv_tier.py [--gguf GGUF ...] [--shapes 1k 4k rag] [--threads 2]
        [--markdown FILE]

Per model (default: the default model; ``--gguf`` repeated for more) and prompt shape
(``1k`` and ``4k``: the shipped text's first 1,000 or 4,000 tokens; ``rag``: spnl's rag
shape, a system text, 10 documents of 100 words as PIC plus elements and a question), each
step in a process of its own, on an empty tier directory:

1. a server process: one untimed warm-up request of other text, then the prompt (cold:
   computed; its blocks go to the tier), then the prompt again (a pool hit); closing the
   backend waits for the tier's writer;
2. a restart: a new process on the same directory, the warm-up, then the prompt (a
   tier hit, the entries in the page cache);
3. the entries' pages dropped (``os.sync`` then ``posix_fadvise(DONTNEED)`` on each file,
   which needs no privileges; whether the kernel let every page go cannot be checked
   from here), then another restart (a tier hit read from the disk).

TTFT is `usage.ttft_s` (the request's arrival to its first token), greedy, 8 tokens. Also
the tier's bytes per token on disk. Targets (issue 39): a tier hit at most 20% of the cold
TTFT at 1k tokens on a 1B-sized model, and the first request after a restart within 1.5x
of a warm pool hit.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import harness

SHAPES = ("1k", "4k", "rag")
RAG_DOCS, RAG_WORDS = 10, 100
WARM_UP = "Here is a short poem about the sea, and about the ships that sail on it."


def request(backend, shape: str) -> dict:
    """The shape's prompt, as `Backend.generate` keywords."""
    encode = backend.tokenizer.encode
    if shape in ("1k", "4k"):
        return {"prompt": harness.long_prompt(encode, 1000 if shape == "1k" else 4000)}
    words = (harness.DATA / "english.txt").read_text().split()
    plain = backend.tokenizer.encode_plain
    docs = [" ".join(words[i * RAG_WORDS : (i + 1) * RAG_WORDS]) for i in range(RAG_DOCS)]
    system = "Answer the question from these documents."
    return {
        "blocks": [
            ("cross", encode("") + plain(system)),
            *[("plus", plain(doc)) for doc in docs],
            ("cross", plain("Question: what is the text about?")),
        ]
    }


def phase(gguf: str, tier: str, shape: str, repeat: bool) -> dict:
    """One process's requests: the warm-up, the prompt and (``repeat``) the prompt again."""
    backend = harness.load_ours(gguf, kv_tier_dir=tier)
    backend.generate(WARM_UP, max_tokens=2, temperature=0)
    asked = request(backend, shape)
    first = backend.generate(**asked, max_tokens=8, temperature=0).usage
    found = {"ttft": first.ttft_s, "tier_tokens": first.tier_hit_tokens}
    found["prompt_tokens"] = first.prompt_tokens
    if repeat:
        again = backend.generate(**asked, max_tokens=8, temperature=0).usage
        found["pool_ttft"] = again.ttft_s
    backend.close()  # waits for the tier's writer
    return found


def drop_page_cache(tier: Path) -> None:
    os.sync()
    for path in tier.rglob("*.kv"):
        with path.open("rb") as file:
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def child(gguf: Path, tier: Path, shape: str, threads: int, repeat: bool) -> dict:
    command = [sys.executable, __file__, "--phase", str(gguf), str(tier), shape]
    env = {**os.environ, "MISTRALRS_NUM_THREADS": str(threads)}
    return harness.run_json_child(command + (["--repeat"] if repeat else []), env)


def bench(gguf: Path, shape: str, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="kv-tier-") as directory:
        tier = Path(directory)
        first = child(gguf, tier, shape, threads, repeat=True)
        if "error" in first:
            return first
        cached = child(gguf, tier, shape, threads, repeat=False)
        drop_page_cache(tier)
        disk = child(gguf, tier, shape, threads, repeat=False)
        entries = list(tier.rglob("*.kv"))
        stored = sum(p.stat().st_size for p in entries)
        per_token = stored / max(cached.get("tier_tokens", 0), 1)
        return {"first": first, "cached": cached, "disk": disk, "bytes_per_token": per_token}


def row(name: str, shape: str, r: dict) -> list[str]:
    failed = (
        [r] if "error" in r else [p for p in r.values() if isinstance(p, dict) and "error" in p]
    )
    if failed:
        return [name, shape, f"not run: {failed[0]['error']}", *[""] * (len(HEADER) - 3)]
    cold, pool = r["first"]["ttft"], r["first"]["pool_ttft"]
    cached, disk = r["cached"]["ttft"], r["disk"]["ttft"]
    cells = [name, shape, str(r["first"]["prompt_tokens"])]
    cells += [f"{1000 * t:,.0f} ms" for t in (cold, pool, cached, disk)]
    cells += [f"{cached / cold:.0%}", f"{cached / pool:.2f}x"]
    cells += [f"{r['cached']['tier_tokens']:,}", f"{r['bytes_per_token']:,.0f}"]
    return cells


HEADER = [
    "model",
    "prompt",
    "tokens",
    "cold",
    "pool hit",
    "tier hit (page cache)",
    "tier hit (dropped)",
    "tier / cold",
    "tier / pool",
    "tier tokens",
    "bytes/token on disk",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, action="append")
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--phase", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--repeat", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(*args.phase, repeat=args.repeat)))
        return
    models = args.gguf or [harness.default_gguf()]
    rows = [
        row(gguf.name, shape, bench(gguf, shape, args.threads))
        for gguf in models
        for shape in args.shapes
    ]
    notes = (
        f"TTFT, greedy, {args.threads} threads; each column a process of its own on one "
        "tier directory (cold and pool hit in the first, then a restart with the entries "
        "in the page cache, then one after dropping their pages)."
    )
    harness.publish(harness.md_table(HEADER, rows) + "\n\n" + notes, args.markdown)


if __name__ == "__main__":
    main()
