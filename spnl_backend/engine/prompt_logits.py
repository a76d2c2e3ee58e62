"""Logits at every position of a token sequence, through an engine's own KV cache.

What perplexity measurements and the exactness tests need: the model's full
distribution at each position, computed the way generation computes it. No request
reaches it; the benchmarks (`bench/harness.py`) and tests (`tests/helpers.py`) call it.
"""

import torch

from ..sampling import SamplingParams
from .engine import Engine
from .sequence import ScheduledSeq, Sequence


def prompt_logits(engine: Engine, ids: list[int], device: torch.device) -> torch.Tensor:
    """float32 logits ``[len(ids), vocab]`` (positions a prefix cache served are omitted:
    the result has ``len(ids) - cached`` rows)."""
    seq = Sequence(ids, SamplingParams(temperature=0.0), max_len=engine.config.max_model_len)
    engine.cache.admit(seq)
    start = seq.num_computed_tokens
    try:
        if not engine.cache.reserve(seq, len(ids)):
            raise RuntimeError(f"{len(ids)} tokens do not fit the KV cache now")
        step = engine.cache.attention([ScheduledSeq(seq, len(ids) - start)], device)
        model = engine.runner.model
        with torch.inference_mode():
            hidden = model(
                torch.tensor(ids[start:], device=device),
                torch.arange(start, len(ids), device=device),
                step,
            )
            return model.compute_logits(hidden)
    finally:
        engine.cache.release(seq)
