"""Moving a pool block's keys to other positions.

Under spnl's reuse rule (``tokens``) a plus element is keyed by its tokens alone, so the
pool may hold it computed where it stood at other positions (a map warm-up computes a
document after the BOS; the query that reuses it puts it after a system prompt). Keys
are stored rotated, and a rotation by ``p`` followed by one by ``d`` is a rotation by
``p + d``, so the element's keys are rotated on by the difference into a block of the
request's own (the pooled block stays as it is): what spnl's engine gets by rotating
every key as it reads it. Values do not depend on positions.
"""

from collections.abc import Callable

import torch

from ..models.config import ModelConfig, RopeConfig
from ..models.rope import inv_freq_and_scale

Angles = list[tuple[torch.Tensor, torch.Tensor]]  # each layer's (cos, sin) of one shift
# Copies pool blocks (sources to targets), their keys turned by the angles.
MoveBlocks = Callable[[list[int], list[int], Angles], None]


class KeyShift:
    """A pool's block mover with each layer's inverse frequencies."""

    def __init__(self, config: ModelConfig, move_blocks: MoveBlocks) -> None:
        self._move_blocks = move_blocks
        max_position = config.max_position_embeddings
        main = _inv_freq(config.rope, max_position)
        local = _inv_freq(config.rope_local, max_position) if config.rope_local else main
        # A layer that does not rotate turns by nothing (cos 1, sin 0: its keys unchanged).
        tables = {"global": main, "local": local, None: torch.zeros_like(main)}
        self.inv_freqs = [  # by the pool's layers: those that keep K and V
            tables[spec.mixer.rope] for spec in config.layers if spec.kv_layer is not None
        ]
        ropes = [config.rope, config.rope_local]
        # LongRoPE changes its frequencies past its original context: no shift across it.
        limits = [r.original_max_position for r in ropes if r is not None and r.kind == "longrope"]
        self.limit = min(limits, default=None)

    def possible(self, old: int, new: int, length: int) -> bool:
        """Whether ``length`` keys from position ``old`` can move to ``new``."""
        if old < 0 or new < 0:
            return False
        return self.limit is None or max(old, new) + length <= self.limit

    def move(self, sources: list[int], targets: list[int], delta: int) -> None:
        """Blocks ``targets`` set to blocks ``sources``, their keys ``delta`` positions on."""
        self._move_blocks(sources, targets, self.angles(delta))

    def angles(self, delta: int) -> Angles:
        """Each layer's ``(cos, sin)`` of a shift by ``delta`` positions (float32)."""
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for inv_freq in self.inv_freqs:
            if id(inv_freq) not in cache:
                turned = inv_freq.double() * delta  # exact enough for any context length
                cache[id(inv_freq)] = (turned.cos().float(), turned.sin().float())
        return [cache[id(inv_freq)] for inv_freq in self.inv_freqs]


def _inv_freq(rope: RopeConfig, max_position: int) -> torch.Tensor:
    return inv_freq_and_scale(rope, max_position)[0]
