"""Attention of a PIC sequence's queries in the paged pool (`pic.layout` for the rule).

The step gives each PIC sequence's keys in prompt order: their pool slots, block ids and
positions, and the prompt-order index of each of its queries (`PicKeys`). From them the
CPU set builds each query's list of visible key slots, what its decode kernel reads
(`PicKeys.rows`), and the torch twin its mask (`pic_attention_ref`); no kernel reads a
sequence's keys in pool order, so padding and blocks mapped in from other sequences are
never seen.
"""

from dataclasses import dataclass, field

import torch

from ..pic.layout import visible
from .attention_ref import raw_scores, softmax_sum
from .scoring import Scoring


@dataclass
class PicKeys:
    """One PIC sequence in a step: its keys ``0 .. K - 1`` in prompt order (``K``: one past
    the last query) and its queries, in the step's order."""

    key_slots: torch.Tensor  # [K] int64 pool slots
    key_blocks: torch.Tensor  # [K] int64 block ids (0: cross)
    key_positions: torch.Tensor  # [K] int64
    q_index: torch.Tensor  # [queries] int64 prompt-order indices
    # Tokens before the first plus one: they attend as in a plain prompt, whose blocks they
    # share through the prefix cache, so their key lists are a plain prompt's (same chunks).
    plain_until: int = 0
    # [queries] the block id each query attends as (None: its own key's). A recomputed
    # element token attends as cross (0), over every key before it, while its key stays
    # its element's.
    q_blocks: torch.Tensor | None = None
    _rows: dict = field(default_factory=dict, repr=False)

    def to(self, device: torch.device) -> "PicKeys":
        if self.key_slots.device == device:
            return self
        return PicKeys(
            self.key_slots.to(device),
            self.key_blocks.to(device),
            self.key_positions.to(device),
            self.q_index.to(device),
            self.plain_until,
            None if self.q_blocks is None else self.q_blocks.to(device),
        )

    def query_blocks(self) -> torch.Tensor:
        """``[queries]``: the block id each query attends as."""
        return self.key_blocks[self.q_index] if self.q_blocks is None else self.q_blocks

    def visible(self, window: int | None, first: int = 0) -> torch.Tensor:
        """``[queries, K]``: which keys each query (from the ``first``) sees."""
        q = self.q_index[first:]
        return visible(
            q,
            self.query_blocks()[first:],
            self.key_positions[q],
            self.key_blocks,
            self.key_positions,
            window,
        )

    def rows(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each query's key slots in prompt order ``[queries, width]`` (padded with slot 0),
        their counts and each query's first key ``[queries]``: a query before the first
        plus token lists its keys as a plain prompt's decode would (from the start, the
        window as a first key); any other lists just its visible keys (first key 0)."""
        if window not in self._rows:
            self._rows[window] = self._make_rows(window)
        return self._rows[window]

    def _make_rows(self, window: int | None):
        plain = int((self.q_index < self.plain_until).sum())
        rows, lens = key_rows(self.visible(window, plain), self.key_slots)
        firsts = torch.zeros(self.q_index.numel(), dtype=torch.int64)
        if plain:
            lead = self.q_index[:plain] + 1  # queries come in prompt order
            width = max(rows.shape[1], int(lead.max()))
            head = self.key_slots[:width].expand(plain, width)
            head = torch.where(torch.arange(width) < lead[:, None], head, 0)
            rows = torch.cat([head, torch.nn.functional.pad(rows, (0, width - rows.shape[1]))])
            lens = torch.cat([lead, lens])
            firsts[:plain] = first_keys(lead, window)
        return rows, lens, firsts


def first_keys(lens: torch.Tensor, window: int | None) -> torch.Tensor:
    """Each list's first key under a sliding ``window`` (the last ``window`` of ``lens``
    keys; all without one): what the decode kernel takes from its window itself."""
    return (lens - window).clamp(min=0) if window else torch.zeros_like(lens)


def key_rows(seen: torch.Tensor, key_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``seen [queries, K]`` compacted: each row's seen keys' slots, in key order."""
    lens = seen.sum(1)
    width = max(int(lens.max()), 1) if lens.numel() else 1
    rows = torch.zeros((seen.shape[0], width), dtype=torch.int64)
    query, key = seen.nonzero(as_tuple=True)
    column = (seen.cumsum(1) - 1)[query, key]
    rows[query, column] = key_slots[key]
    return rows, lens.to(torch.int64)


def pic_attention_ref(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pic: PicKeys,
    scoring: Scoring,
) -> torch.Tensor:
    """The torch twin for one PIC sequence: ``q [queries, heads, d]`` over its ``keys`` and
    ``values [K, kv_heads, d]`` (prompt order, read from the pool) under its mask."""
    scores = scoring.capped(raw_scores(q, keys) * scoring.scale)
    visible = pic.visible(scoring.window)
    return softmax_sum(scores, values, visible, scoring.sinks).to(q.dtype)
