"""CacheBlend's pick of the tokens a reused group recomputes
(``MISTRALRS_PIC_RECOMPUTE_SELECT=deviation``).

A group's keys in the pool were computed without the group's other elements (and, for a
hit under spnl's rule, without what now comes before it). Layer 0's keys depend only on a
token and its position, so the first keys that differ from a full-attention pass are
layer 1's. When a group's recomputation is due, its pooled layer-0 keys are read again and
every token of the group attends over them as a cross token would; layer 1's K/V of that
pass are compared with the pooled ones, and the tokens that deviate most (squared
distance of K and V together, earlier first on a tie) are recomputed, as many as the
fraction's first tokens would have been. CacheBlend narrows its set further layer by
layer; here the set is picked once and recomputed through every layer, which keeps the
recomputation the engine already runs (`engine.pic_blocks`).

The probe runs per op, on the step's attention kernels over the pool as it is (a step
whose slots are all -1: nothing is written), a fixed number of the group's tokens at a
time: its pick depends on nothing but the sequence. It costs one layer of the group's
prefill, run per op (measured: 0.1-1 s, 11-17% of the plain prompt's prefill, for groups
of 1,100-5,500 tokens on 2 cores: `bench/pic_accuracy.py`).
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..kernels.paged_ref import read_kv
from ..kernels.pic import PicKeys
from ..log import get_logger
from ..models.step_attention import StepAttention
from ..models.transformer import CausalLM

log = get_logger()

CHECK_LAYER = 1  # the first layer whose keys depend on what a token attends to
PROBE_ROWS = 512  # group tokens per probe pass: bounds its activations


class PooledLayers(Protocol):
    """The pool's tensors as the probe reads them: each layer's (K, V) and scales."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    k_scale: list[float]
    v_scale: list[float]


@dataclass(frozen=True)
class RecomputeProbe:
    """One group of a PIC sequence whose recomputation begins this step: its tokens and
    positions, the keys its tokens attend over as cross tokens (``keys``: every key before
    the group's end as the recomputation reads them, the group's as first computed), a
    step over them that stores nothing (``attention``, for some of the queries), how many
    tokens to pick, and where the pick goes."""

    seq_id: int
    token_ids: torch.Tensor  # [G] the group's tokens
    positions: torch.Tensor  # [G]
    keys: PicKeys  # queries: the group's tokens (prompt order), each attending as cross
    attention: Callable[[PicKeys, torch.device], StepAttention]
    pool: PooledLayers
    count: int
    choose: Callable[[list[int]], None]  # takes prompt-order indices

    @property
    def first(self) -> int:
        return int(self.keys.q_index[0])


def pooled_kv(
    pool: PooledLayers, layer: int, slots: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's K and V at ``slots`` of ``layer``, in ``dtype``."""
    key_cache, value_cache = pool.layers[layer]
    slots = slots.to(key_cache.device)
    return read_kv(key_cache, value_cache, slots, dtype, pool.k_scale[layer], pool.v_scale[layer])


def deviation(
    fresh: tuple[torch.Tensor, torch.Tensor], pooled: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """``[T]``: each token's squared distance between two versions of its K and V."""
    (k, v), (k0, v0) = fresh, pooled
    return _squared(k, k0) + _squared(v, v0)


def _squared(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a.float() - b.float()) ** 2).flatten(1).sum(1)


def most_deviating(deviations: torch.Tensor, count: int) -> list[int]:
    """The rows of the ``count`` largest deviations (earlier rows first on a tie; NaN
    counts as largest), in row order."""
    values = deviations.tolist()
    ranked = sorted(range(len(values)), key=lambda i: _rank_key(values[i], i))
    return sorted(ranked[:count])


def _rank_key(value: float, row: int) -> tuple[float, int]:
    return (float("-inf") if value != value else -value, row)


def group_deviations(model: CausalLM, probe: RecomputeProbe, device: torch.device) -> torch.Tensor:
    """Every group token's deviation at the check layer, `PROBE_ROWS` tokens at a time."""
    layer = min(CHECK_LAYER, model.config.num_layers - 1)
    parts = []
    keys = probe.keys
    for start in range(0, keys.q_index.numel(), PROBE_ROWS):
        rows = slice(start, start + PROBE_ROWS)
        part = replace(keys, q_index=keys.q_index[rows], q_blocks=keys.q_blocks[rows], _rows={})
        ids, positions = probe.token_ids[rows].to(device), probe.positions[rows].to(device)
        fresh = model.model.layer_kv(ids, positions, probe.attention(part, device), layer)
        slots = part.key_slots[part.q_index]
        parts.append(deviation(fresh, pooled_kv(probe.pool, layer, slots, fresh[0].dtype)).cpu())
    return torch.cat(parts)


def choose_recomputed(model: CausalLM, probes: list[RecomputeProbe], device: torch.device) -> None:
    """Each probe's group recomputes its most deviating tokens."""
    for probe in probes:
        rows = most_deviating(group_deviations(model, probe, device), probe.count)
        probe.choose([probe.first + row for row in rows])
        log.debug(
            "pic.recompute_chosen",
            seq_id=probe.seq_id,
            tokens=probe.count,
            of_tokens=probe.keys.q_index.numel(),
        )
