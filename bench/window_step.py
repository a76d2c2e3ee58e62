"""A decode step's CPU time at a 32k context on the default model, the sliding-window layers'
own pool on or off.

    python bench/window_step.py on|off [--context 32768] [--tokens 32]

The prompt's K/V is not computed: admission is told all but the prompt's last token are
(its blocks taken, the windowed pool's holds as it keeps them), so every later step is a
real decode step over the whole context (its keys' values arbitrary). Prints the mean
decode step's process CPU time and wall time, and the part of it spent building the step's
attention metadata (`PagedCacheManager.attention`). N-gram speculation is off.
"""

import argparse
import random
import time

from spnl_backend import BackendSettings, load_backend
from spnl_backend.engine import build, paged
from spnl_backend.engine.engine import Engine


def _timed(owner: type, name: str, into: list[tuple[float, float]]) -> None:
    original = getattr(owner, name)

    def run(*args, **kwargs):
        cpu, wall = time.process_time(), time.perf_counter()
        result = original(*args, **kwargs)
        into.append((time.process_time() - cpu, time.perf_counter() - wall))
        return result

    setattr(owner, name, run)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pool", choices=["on", "off"])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    if args.pool == "off":
        build._window_plan = lambda *a, **k: None
    admit = paged.PagedCacheManager.admit

    def admitted_computed(self, seq):
        admit(self, seq)
        seq.num_computed_tokens = seq.num_tokens - 1

    paged.PagedCacheManager.admit = admitted_computed
    steps: list[tuple[float, float]] = []
    metas: list[tuple[float, float]] = []
    _timed(Engine, "step", steps)
    _timed(paged.PagedCacheManager, "attention", metas)
    settings = BackendSettings(paged_attn_context_len=args.context, speculative_method="none")
    with load_backend(settings=settings) as backend:
        info = backend.cache_info()
        prompt = [random.Random(0).randrange(1000, 200000) for _ in range(args.context - 64)]
        backend.generate(prompt_token_ids=prompt, max_tokens=args.tokens + 1, temperature=0)
    decode = slice(2, None)  # after the one-token "prefill" step

    def mean(pairs: list[tuple[float, float]], which: int) -> float:
        return 1000 * sum(p[which] for p in pairs[decode]) / len(pairs[decode])

    print(
        f"pool {args.pool} (windowed blocks: {info.window_blocks}, blocks: {info.num_blocks} "
        f"of {info.block_size}): decode step CPU {mean(steps, 0):.1f} ms, wall "
        f"{mean(steps, 1):.1f} ms; of it attention metadata CPU {mean(metas, 0):.2f} ms"
    )


if __name__ == "__main__":
    main()
