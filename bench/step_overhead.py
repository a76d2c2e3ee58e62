"""Where a shipped decode step's time goes outside the native layer blocks, by CPU time.

    python bench/step_overhead.py [--gguf FILE] [--threads 1] [--tokens 64] [--runs 5]
                                  [--markdown FILE]

The step runs as shipped (native layer blocks on); timers read the engine thread's CPU
time (time.thread_time) around each part of it: scheduling, the step's attention metadata
and inputs, the embedding and rotary tables, the blocks' Python and their native calls
(products, attention, norms: one row, in C), the head, sampling, accepting the token
(detokenizing, stop checks) and delivering it. Other processes on a shared machine then
leave the figures alone; at 1 thread the kernels run on the engine thread, so the parts
add up to the step (at more threads the native row is the engine thread's share alone).
The parts are a greedy generation of --tokens + 1 tokens less that of 1 token, per decode
token. Then, untimed, --runs times the same difference by the process's CPU time and the
wall's: the shipped decode per token (median and range), the figure to compare across
checkouts (run it with PYTHONPATH set to each, alternately). The default model unless --gguf.
"""

import statistics
import time
from pathlib import Path

import harness
from profile_decode import Timers

NATIVE = "layer blocks' native calls (products, attention, norms)"


def load(gguf: Path, threads: int):
    import torch

    torch.set_num_threads(threads)
    backend = harness.load_ours(gguf, prefix_cache_n=0, num_threads=threads)
    backend.generate(harness.STORY_PROMPT, max_tokens=4, temperature=0)  # warm-up
    return backend


def wrap(timers: Timers, owner, name: str, label: str) -> None:
    """Time ``owner.name`` under ``label`` (an instance's attribute, or a module's)."""
    original = getattr(owner, name)
    setattr(owner, name, lambda *a, **k: timers.timed(label, original, *a, **k))


def install(backend, timers: Timers) -> None:
    """Timers around the parts of the engine's step, on this backend's objects alone."""
    from spnl_backend.engine import runner as runner_module

    loop = backend._loop
    engine = loop.engine
    runner = engine.runner
    model = runner.model
    wrap(timers, engine, "step", "whole step")
    wrap(timers, engine.scheduler, "schedule", "schedule")
    wrap(timers, runner.cache, "attention", "attention metadata (block tables, slots)")
    wrap(timers, runner_module, "step_inputs", "token ids and positions")
    wrap(timers, model.model, "_inputs", "embedding, rotary tables, first norm")
    wrap(timers, model.model, "_native_step", "the blocks' keys and pools")
    wrap(timers, model, "compute_logits", "head (the LM head's product, float logits)")
    wrap(timers, runner_module, "pick_next", "sampling (penalties, masks, argmax)")
    wrap(timers, engine, "_accept_safely", "accept (detokenize, stop checks)")
    wrap(timers, engine.cache, "after_step", "after step (register full blocks)")
    wrap(timers, loop, "_deliver", "deliver to the caller's channel")
    blocks = model.model._blocks
    if blocks is None:
        raise SystemExit("the model does not run on the native layer blocks")
    stack = blocks.stack
    wrap(timers, stack, "run", "layer blocks (all)")
    stack.native = TimedBlocks(stack.native, timers)


class TimedBlocks:
    """The blocks' kernels (a frozen object) with their block calls timed."""

    def __init__(self, native, timers: Timers) -> None:
        self._native = native
        for name in ("attention_block", "mlp_block", "moe_block", "layers"):
            original = getattr(native, name, None)
            if original is None:  # a checkout from before the one call for every layer
                continue
            setattr(self, name, lambda *a, _f=original, **k: timers.timed(NATIVE, _f, *a, **k))

    def __getattr__(self, name: str):
        return getattr(self._native, name)


def timed_parts(backend, tokens: int) -> tuple[dict[str, float], int]:
    """ms per decode token of each timed part: the run of ``tokens`` + 1 less that of 1."""
    timers = Timers(time.thread_time)
    install(backend, timers)
    backend.generate(harness.STORY_PROMPT, max_tokens=1, temperature=0)
    first = dict(timers.seconds)
    result = backend.generate(harness.STORY_PROMPT, max_tokens=tokens + 1, temperature=0)
    made = result.usage.completion_tokens - 1
    if made < 1:
        raise SystemExit("the generation stopped at EOS before a decode token")
    parts = {k: 1000 * (v - 2 * first.get(k, 0.0)) / made for k, v in timers.seconds.items()}
    return parts, made


def shipped(backend, tokens: int, runs: int) -> dict[str, list[float]]:
    """ms per decode token, untimed, ``runs`` times: process CPU time and wall time."""
    cpu, wall = [], []
    for _ in range(runs):
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        backend.generate(harness.STORY_PROMPT, max_tokens=1, temperature=0)
        mid_cpu, mid_wall = time.process_time(), time.perf_counter()
        result = backend.generate(harness.STORY_PROMPT, max_tokens=tokens + 1, temperature=0)
        end_cpu, end_wall = time.process_time(), time.perf_counter()
        made = result.usage.completion_tokens - 1
        cpu.append(1000 * ((end_cpu - mid_cpu) - (mid_cpu - start_cpu)) / made)
        wall.append(1000 * ((end_wall - mid_wall) - (mid_wall - start_wall)) / made)
    return {"cpu": cpu, "wall": wall}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def parts_table(parts: dict[str, float]) -> str:
    whole = parts.pop("whole step")
    blocks = parts.pop("layer blocks (all)")
    parts["layer blocks' Python (checks, buffers, arguments)"] = blocks - parts.get(NATIVE, 0.0)
    rest = whole - sum(parts.values())
    rows = [
        [label, f"{ms:.3f}", f"{100 * ms / whole:.1f}%"]
        for label, ms in sorted(parts.items(), key=lambda item: -item[1])
    ]
    rows.append(["the rest of the step (runner, engine glue)", f"{rest:.3f}", ""])
    rows.append(["one decode step", f"{whole:.3f}", "100%"])
    return harness.md_table(["part", "ms per token", "share"], rows)


def main() -> None:
    parser = harness.arguments(__doc__, runs=True)
    parser.add_argument("--gguf", type=Path, help="a GGUF file (default: the default model)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--no-parts", action="store_true", help="only the shipped figures")
    args = parser.parse_args()
    gguf = args.gguf or harness.default_gguf()
    backend = load(gguf, args.threads)
    figures = shipped(backend, args.tokens, args.runs)
    import spnl_backend

    text = (
        f"{gguf.name}, {args.threads} threads, spnl_backend from "
        f"{Path(spnl_backend.__file__).parent}, shipped decode over {args.tokens} tokens, "
        f"{args.runs} runs: CPU {spread(figures['cpu'])} ms/token, "
        f"wall {spread(figures['wall'])} ms/token"
    )
    if not args.no_parts:
        parts, made = timed_parts(backend, args.tokens)
        text = (
            f"{parts_table(parts)}\n\n{gguf.name}, {args.threads} threads, engine thread's "
            f"CPU time over {made} greedy decode tokens.\n\n{text}"
        )
    harness.publish(text, args.markdown)


if __name__ == "__main__":
    main()
