"""The model's mean K and V over a short reference text, for compression methods that centre.

A centre measured on a few hundred tokens of ordinary prose serves every later request:
it no longer depends on which request came first (paged mode) or on how short a prompt
is (non-paged mode). Measured once per model at load, with the plain cache.
"""

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..loader.model import LoadedModel
from ..log import get_logger
from .kv_cache import ContiguousStep, StepSlice, plain_stores

log = get_logger()

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
MAX_CALIBRATION_TOKENS = 256


@dataclass(frozen=True)
class KVStatistics:
    """The model's K and V over the reference text: ``means`` float32 ``[layers, 2,
    kv_heads, head_dim]`` (position 0, the attention sink the methods keep apart, left
    out; None where the layers' shapes differ), ``absmax`` float32 ``[layers, 2]`` (every
    position)."""

    means: torch.Tensor | None
    absmax: torch.Tensor


def kv_statistics(loaded: LoadedModel, role: str) -> KVStatistics:
    """One forward pass over the reference text with a plain cache, so that what a
    compressed or FP8 cache derives from K and V is fixed at load, whatever requests come
    first."""
    config = loaded.config
    limit = min(MAX_CALIBRATION_TOKENS, config.max_position_embeddings)
    ids = loaded.tokenizer.encode(CALIBRATION_TEXT.read_text())[:limit]
    if len(ids) < 2:
        raise ValueError(f"the calibration text encodes to {len(ids)} token(s); 2 are needed")
    start = time.perf_counter()
    store = plain_stores(config, loaded.dtype, loaded.device)()
    store.reserve(len(ids), used=0)
    step = ContiguousStep([StepSlice(store, 0, len(ids))])
    with torch.inference_mode():
        loaded.model(
            torch.tensor(ids, device=loaded.device),
            torch.arange(len(ids), device=loaded.device),
            step,
        )
    held = [store.layer(place)[:, : len(ids)].float() for place in range(config.num_kv_layers)]
    absmax = torch.stack([layer.abs().amax(dim=(1, 2, 3)) for layer in held])
    tp = loaded.model.tp
    if tp is not None:  # each rank holds some heads: an FP8 scale fits all of a layer's
        absmax = tp.all_max(absmax)
    # Means only where the layers share one shape (what the centring methods take).
    means = torch.stack([layer[:, 1:].mean(1) for layer in held]) if config.uniform_kv else None
    stats = KVStatistics(means, absmax)
    log.info(
        "kv_cache.calibrated",
        model=role,
        tokens=len(ids),
        seconds=round(time.perf_counter() - start, 2),
    )
    return stats
