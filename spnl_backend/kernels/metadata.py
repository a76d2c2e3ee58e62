"""What the paged kernels need to know about one step, built once and shared by all layers."""

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from .pic import PicKeys

T = TypeVar("T")


@dataclass
class PagedMetadata:
    """The sequences of one step over the paged cache.

    ``block_tables [seqs, width]`` (padded with block 0), ``seq_lens`` (tokens in the cache
    after the step), ``query_lens`` (tokens computed now), ``slot_mapping [tokens]`` (-1:
    write nothing). Everything derived from them is computed on first use and reused by
    every layer of the step.
    """

    block_tables: torch.Tensor
    seq_lens: list[int]
    query_lens: list[int]
    block_size: int
    slot_mapping: torch.Tensor | None = None
    # Per sequence, its keys and queries where it is a PIC sequence (`kernels.pic`), else
    # None; None when no sequence of the step is. A PIC sequence's ``seq_lens`` entry is
    # the slots its block table spans, and only its `PicKeys` say which keys it sees.
    pic: "list[PicKeys | None] | None" = None
    _memo: dict = field(default_factory=dict, repr=False)

    def memo(self, key: object, make: Callable[[], T]) -> T:
        """``make()`` computed once per step for ``key`` (kernels keep their own plans here)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    @property
    def device(self) -> torch.device:
        return self.block_tables.device

    def to(self, device: torch.device) -> "PagedMetadata":
        """The same step on ``device`` (its derived values computed there afresh)."""
        return PagedMetadata(
            self.block_tables.to(device),
            self.seq_lens,
            self.query_lens,
            self.block_size,
            None if self.slot_mapping is None else self.slot_mapping.to(device),
            pic=None if self.pic is None else [p if p is None else p.to(device) for p in self.pic],
        )

    def pic_of(self, index: int) -> "PicKeys | None":
        return None if self.pic is None else self.pic[index]

    @cached_property
    def is_decode(self) -> bool:
        return max(self.query_lens) == 1

    @cached_property
    def query_starts(self) -> torch.Tensor:
        """``[seqs + 1]`` int32 offsets of each sequence's queries in the packed batch."""
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        return torch.tensor(starts, dtype=torch.int32, device=self.device)

    @cached_property
    def written_slots(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(token mask, their slots)`` of the tokens that are written; no mask when every
        token is."""
        keep = self.slot_mapping >= 0
        if bool(keep.all()):
            return None, self.slot_mapping
        return keep, self.slot_mapping[keep]

    @cached_property
    def decode_slots(self) -> torch.Tensor:
        """``[seqs, longest]`` cache slots of every key of every sequence (padding: slot of
        block 0, masked out)."""
        longest = max(self.seq_lens)
        blocks = -(-longest // self.block_size)
        offsets = torch.arange(self.block_size, device=self.device)
        slots = self.block_tables[:, :blocks, None] * self.block_size + offsets
        return slots.flatten(1)[:, :longest]

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """``[seqs, 1, 1, longest]``: which keys each sequence's one query sees."""
        return self.memo(("decode_mask", window), lambda: self._decode_mask(window))

    def decode_keys(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(slots, mask)`` of the keys the decode queries see. A lone sequence reads just
        its window, so no mask is needed (torch's fused attention takes over)."""
        if len(self.seq_lens) > 1:
            return self.decode_slots, self.decode_mask(window)
        first = max(self.seq_lens[0] - window, 0) if window else 0
        return self.decode_slots[:, first:], None

    def _decode_mask(self, window: int | None) -> torch.Tensor:
        lengths = torch.tensor(self.seq_lens, device=self.device).unsqueeze(-1)
        positions = torch.arange(max(self.seq_lens), device=self.device)
        visible = positions < lengths
        if window is not None:
            visible &= positions > lengths - 1 - window
        return visible[:, None, None, :]
