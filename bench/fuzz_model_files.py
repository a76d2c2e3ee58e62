"""Fuzz the loader with mutated model files: every case must load (and generate) or raise
an SpnlError; anything else, a crash included, is a failure.

    python -m bench.fuzz_model_files [--cases 400] [--seed 0] [--show 5] [--keep DIR]
                                     [--list-loaded]

Tiny random models (tests/tiny_models.py) are written as GGUF (Llama Q8_0, Gemma 3 F32,
Phi-3 Q4_0) and as safetensors directories (Llama, Phi-3, Gemma 3), and a LoRA adapter
of the tiny Llama as a PEFT directory and as a GGUF adapter; each case mutates one of
them (tests/model_file_mutations.py: truncation, retyped or extreme metadata, moved,
retyped or reshaped tensors, byte flips, non-finite weights, broken config.json,
safetensors headers and shard indexes; an adapter's config fields and tensor names too)
and a worker process loads it (an adapter: on the Llama base while it runs), so that a
segfault is counted, not fatal. Prints the count table by mutation kind (a
``generate_error`` loaded, then generate raised an SpnlError: counted apart, not a
failure) and the first few tracebacks of anything else.

Run it from the repository root: ``-m`` puts the root on sys.path, where the test helpers
are ``tests.…`` (a namespace package: tests/ has no ``__init__.py``).
"""

import argparse
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from gguf import GGMLQuantizationType as Q

from bench.harness import md_table
from tests.model_file_mutations import (
    LoadWorker,
    Outcome,
    parse_gguf,
    random_adapter_case,
    random_gguf_case,
    random_text_case,
    read_dir,
    write_dir,
)
from tests.tiny_models import build_hf_model, write_adapter, write_gguf, write_gguf_adapter

GGUF_BASES = (("llama", Q.Q8_0), ("gemma3", Q.F32), ("phi3", Q.Q4_0))
TEXT_BASES = ("llama", "phi3", "gemma3")
COLUMNS = ("loaded", "refused", "generate_error", "other", "crash", "timeout")


def build_bases(root: Path) -> tuple[dict, dict, tuple]:
    """The model files to mutate, and the Llama base with its adapter's files (PEFT and
    GGUF) to mutate."""
    ggufs, texts = {}, {}
    for arch in sorted({*TEXT_BASES, *(a for a, _ in GGUF_BASES)}):
        tiny = build_hf_model(arch, root / arch / "hf")
        texts[arch] = read_dir(tiny.path)
        for gguf_arch, qtype in GGUF_BASES:
            if gguf_arch == arch:
                path = write_gguf(tiny, root / arch / f"{arch}-{qtype.name}.gguf", qtype)
                ggufs[f"{arch}-{qtype.name}"] = parse_gguf(path.read_bytes())
        if arch == "llama":
            pairs = write_adapter(root / "adapter", tiny.hf, seed=1)
            gguf = write_gguf_adapter(root / "adapter.gguf", arch, pairs, alpha=8.0)
            adapter = (tiny.path, read_dir(root / "adapter"), parse_gguf(gguf.read_bytes()))
    return ggufs, texts, adapter


Result = tuple[str, str, Outcome]  # mutation kind, the case's label, what loading did


def run_cases(cases: int, seed: int, root: Path, worker: LoadWorker) -> list[Result]:
    ggufs, texts, (base_path, peft, gguf_adapter) = build_bases(root / "bases")
    rng = random.Random(seed)
    results = []
    for number in range(cases):
        if number % 5 == 4:  # a LoRA adapter, on the Llama base
            path = root / "cases" / f"{number:05d}"
            if rng.random() < 0.5:
                label, files = random_adapter_case(peft, rng)
                write_dir(files, path)
                kind = f"peft adapter {label.split(':')[0]}"
            else:
                label, raw = random_gguf_case(gguf_adapter, rng)
                path = path.with_suffix(".gguf")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(raw)
                kind = f"gguf adapter {label.split(':')[0]}"
            results.append((kind, f"[adapter] {label}", worker.run(path, base=base_path)))
            continue
        if number % 2 == 0:
            base = rng.choice(sorted(ggufs))
            label, raw = random_gguf_case(ggufs[base], rng)
            path = root / "cases" / f"{number:05d}.gguf"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(raw)
            kind, label = f"gguf {label.split(':')[0]}", f"[{base}] {label}"
        else:
            base = rng.choice(TEXT_BASES)
            label, files = random_text_case(texts[base], rng)
            path = write_dir(files, root / "cases" / f"{number:05d}")
            kind, label = f"text {label.split(':')[0]}", f"[{base}] {label}"
        results.append((kind, label, worker.run(path)))
    return results


def table(results: list[Result]) -> str:
    counts: dict[str, Counter] = defaultdict(Counter)
    for kind, _, outcome in results:
        counts[kind][outcome.kind] += 1
        counts["all"][outcome.kind] += 1
    kinds = [*sorted(k for k in counts if k != "all"), "all"]
    rows = [
        [kind, sum(counts[kind].values())] + [counts[kind][c] for c in COLUMNS] for kind in kinds
    ]
    return md_table(["mutation", "cases", *COLUMNS], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=5, help="tracebacks of failures to print")
    parser.add_argument("--keep", type=Path, help="write the cases here (default: a temp dir)")
    parser.add_argument("--list-loaded", action="store_true", help="list the cases that loaded")
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch, LoadWorker() as worker:
        root = args.keep or Path(scratch)
        results = run_cases(args.cases, args.seed, root, worker)
    print(table(results))
    failures = [(label, outcome) for _, label, outcome in results if not outcome.ok]
    elapsed = time.perf_counter() - start
    print(f"\n{len(results)} cases in {elapsed:.0f} s; failures: {len(failures)}")
    late = [f"{label}: {o.message}" for _, label, o in results if o.kind == "generate_error"]
    if late:
        print("\nloaded, then generate raised an SpnlError:\n" + "\n".join(late))
    if args.list_loaded:
        loaded = [label for _, label, outcome in results if outcome.kind == "loaded"]
        print("\nloaded:\n" + "\n".join(loaded))
    for label, outcome in failures[: args.show]:
        print(f"\n{label}\n{outcome.describe()}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
