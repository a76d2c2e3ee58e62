"""Does a request's greedy output depend on what shares its steps?

    python bench/batch_invariance.py [--tokens 32] [--settings batch_invariant=false ...]

Generates 16 prompts one at a time (the reference), then as one list, then from 16
threads at once, then as one list under a KV budget small enough to force preemption,
and prints how many of the 16 outputs equal their serial run in each case.
"""

import argparse
import threading

from spnl_backend import BackendSettings, load_backend

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "The three primary colors are",
    "def fibonacci(n):",
    "Give me a haiku about rain.",
    "The quick brown fox",
    "In 1969, astronauts",
    "Water boils at",
    "The best way to learn a language is",
    "import numpy as np\n",
    "My favourite recipe for bread is",
    "The theory of relativity states that",
    "Dear Sir or Madam,",
    "Photosynthesis is the process by which",
    "A list of prime numbers: 2, 3, 5,",
    "The meaning of life is",
]


def _settings(pairs: list[str], **extra: object) -> BackendSettings:
    fields = dict(pair.split("=", 1) for pair in pairs)
    return BackendSettings(**fields, **extra)


def _greedy(backend, prompts, tokens):
    return [r.token_ids for r in backend.generate(prompts, max_tokens=tokens, temperature=0)]


def _threads(backend, tokens):
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = backend.generate(PROMPTS[i], max_tokens=tokens, temperature=0).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[i] for i in range(len(PROMPTS))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--settings", nargs="*", default=[], help="field=value, as in code")
    args = parser.parse_args()
    backend = load_backend(settings=_settings(args.settings))
    print(
        f"platform: {backend.platform.device_name}, kernels {backend.platform.kernels}, "
        f"cpu_matmul {backend.platform.cpu_matmul}, cpu_gemm {backend.platform.cpu_gemm}, "
        f"batch_invariant {backend.platform.batch_invariant}"
    )
    serial = [_greedy(backend, [p], args.tokens)[0] for p in PROMPTS]
    cases = {
        "one list": _greedy(backend, PROMPTS, args.tokens),
        "16 threads": _threads(backend, args.tokens),
    }
    tight = load_backend(settings=_settings(args.settings, paged_attn_context_len=256))
    cases["one list, preempting budget"] = _greedy(tight, PROMPTS, args.tokens)
    print(f"preemptions under the tight budget: {tight.stats().preemptions}")
    for name, outputs in cases.items():
        same = sum(a == b for a, b in zip(outputs, serial, strict=True))
        print(f"{name}: {same}/16 equal to their serial run")


if __name__ == "__main__":
    main()
