"""A PIC prompt's spans, and what follows from them: which keys each token sees, and the
positions its rotary embedding takes.

Every token belongs to the cross side (block id 0) or to one plus element (block ids 1,
2, ... in prompt order). A query sees a key at or before it (in prompt order) when either
is cross or both are of the same element: so an element sees the cross tokens before its
group and itself, a cross token everything before it. Generated tokens are cross.

Positions, two schemes (`POSITION_SCHEMES`):

- ``after_prefix`` (the block-attention paper's): a group's elements all start right after
  the cross tokens before it; the cross tokens after a group continue after its longest
  element. ``[c c c | p p | q q q q | c c]`` (one group of two) → ``0 1 2 | 3 4 | 3 4 5 6 |
  7 8``.
- ``local`` (spnl's own engine): each element counts from 0; cross tokens count the cross
  tokens only. The same prompt → ``0 1 2 | 0 1 | 0 1 2 3 | 3 4``.
- ``sequential`` (the plain prompt's, as CacheBlend and EPIC place reused chunks): every
  token at its index. The same prompt → ``0 1 2 | 3 4 | 5 6 7 8 | 9 10``.

Under the first two an element's positions depend only on what came before its group
and on itself, never on its order in the group, so its K (stored rotated) can be reused
as is; under ``sequential`` they depend on the elements before it too, so its key takes
in its first position (`engine.pic_blocks`), and spnl's rule moves a hit's keys.

**Recomputation** (``recompute``, a fraction): an element computed (or reused) under
this mask never attended to the elements before it in its group, nor (under spnl's
reuse rule) to what came before the group; the first tokens of an element then draw
attention as a sequence's first tokens do. The first ``ceil(recompute × length)`` tokens
of each element are computed once more, attending as cross tokens (to every key before
them), after the group and before anything that follows it; what follows reads those
keys instead (`engine.pic_blocks`). A group that ends the prompt is left as it is:
nothing of the prompt comes after it. With ``recompute_select="deviation"`` as many
tokens are recomputed, chosen from the whole group when its recomputation begins: those
whose keys a full-attention pass would change most (`engine.pic_probe`).
"""

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

from ..settings.pic import RECOMPUTE_SELECTIONS, REUSE_RULES

Kind = Literal["cross", "plus"]
POSITION_SCHEMES = ("after_prefix", "local", "sequential")
CROSS = 0  # the block id of every cross token


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, end)`` of a prompt, all cross or all one plus element."""

    kind: Kind
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PicLayout:
    """The spans of a prompt (in order, none empty, adjacent cross spans merged), each
    prompt token's block id and position under ``scheme``, and the rule its elements are
    reused by (`REUSE_RULES`)."""

    spans: tuple[Span, ...]
    scheme: str
    block_ids: tuple[int, ...]
    positions: tuple[int, ...]
    next_position: int  # of the first token after the prompt (then one more per token)
    reuse: str = "exact"
    recompute: float = 0.0  # the fraction of each element's first tokens computed again
    # Which tokens those are (`RECOMPUTE_SELECTIONS`): the first ones, or a probe's pick of
    # the same number from the whole group (`engine.pic_probe`).
    recompute_select: str = "first"

    @classmethod
    def build(
        cls,
        pieces: list[tuple[Kind, int]],
        scheme: str = "after_prefix",
        reuse: str = "exact",
        recompute: float = 0.0,
        recompute_select: str = "first",
    ) -> "PicLayout":
        """The layout of a prompt made of ``(kind, length)`` pieces, in order (lengths >=
        1; adjacent cross pieces merge, adjacent plus pieces are elements of one group)."""
        if scheme not in POSITION_SCHEMES:
            raise ValueError(f"position scheme {scheme!r}: expected one of {POSITION_SCHEMES}")
        if reuse not in REUSE_RULES:
            raise ValueError(f"reuse rule {reuse!r}: expected one of {REUSE_RULES}")
        if not 0.0 <= recompute <= 1.0:
            raise ValueError(f"recompute {recompute!r}: expected a fraction from 0 to 1")
        if recompute_select not in RECOMPUTE_SELECTIONS:
            raise ValueError(
                f"recompute selection {recompute_select!r}: expected one of {RECOMPUTE_SELECTIONS}"
            )
        spans: list[Span] = []
        start = 0
        for kind, length in pieces:
            if length < 1:
                raise ValueError(f"an empty {kind} span")
            if kind == "cross" and spans and spans[-1].kind == "cross":
                spans[-1] = Span("cross", spans[-1].start, start + length)
            else:
                spans.append(Span(kind, start, start + length))
            start += length
        numbered = _number(spans, scheme)
        return cls(tuple(spans), scheme, *numbered, reuse, recompute, recompute_select)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.block_ids)

    @property
    def num_plus_tokens(self) -> int:
        return sum(span.length for span in self.spans if span.kind == "plus")

    @property
    def first_plus(self) -> int:
        """The index of the first plus token (the tokens before it form a plain prompt)."""
        return next(span.start for span in self.spans if span.kind == "plus")

    def padded_slots(self, block_size: int) -> int:
        """The slots the prompt takes with each span starting a new block, and each
        group's recomputed tokens a run of blocks of their own."""
        runs = [span.length for span in self.spans] + [len(r) for _, r in self.recomputed]
        return sum(-(-length // block_size) * block_size for length in runs)

    @cached_property
    def recomputed(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """Each group's recomputed tokens, as ``(end, indices)``: the index of the first
        token after the group, and in prompt order the first ``ceil(recompute × length)``
        tokens of each of its elements. None for a group that ends the prompt."""
        if not self.recompute:
            return ()
        groups: list[tuple[int, tuple[int, ...]]] = []
        indices: list[int] = []
        for number, span in enumerate(self.spans):
            if span.kind != "plus":
                continue
            count = min(span.length, math.ceil(self.recompute * span.length))
            indices += range(span.start, span.start + count)
            after = self.spans[number + 1] if number + 1 < len(self.spans) else None
            if after is None or after.kind == "cross":
                if after is not None:
                    groups.append((span.end, tuple(indices)))
                indices = []
        return tuple(groups)

    def group_start(self, end: int) -> int:
        """The first token of the group whose last element ends at ``end``."""
        number = next(n for n, span in enumerate(self.spans) if span.end == end)
        while number and self.spans[number - 1].kind == "plus":
            number -= 1
        return self.spans[number].start

    def position(self, index: int) -> int:
        """The position of token ``index`` (a generated one past the prompt too)."""
        if index < self.num_prompt_tokens:
            return self.positions[index]
        return self.next_position + index - self.num_prompt_tokens

    def key_tensors(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block ids, positions)`` int64 ``[num_tokens]`` of the first ``num_tokens``
        tokens (generated ones included: cross, positions counting on); read-only (views
        of tensors the layout keeps)."""
        prompt = self.num_prompt_tokens
        blocks, positions = self._prompt_tensors
        if num_tokens <= prompt:
            return blocks[:num_tokens], positions[:num_tokens]
        extra = num_tokens - prompt
        tail = torch.arange(self.next_position, self.next_position + extra)
        return (
            torch.cat([blocks, torch.zeros(extra, dtype=torch.int64)]),
            torch.cat([positions, tail]),
        )

    @cached_property
    def _prompt_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(self.block_ids), torch.tensor(self.positions)


def _number(spans: list[Span], scheme: str) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    block_ids: list[int] = []
    positions: list[int] = []
    counter = 0  # the next cross position
    element = 0
    index = 0
    while index < len(spans):
        span = spans[index]
        if span.kind == "cross":
            block_ids += [CROSS] * span.length
            positions += range(counter, counter + span.length)
            counter += span.length
            index += 1
            continue
        start = counter if scheme != "local" else 0
        longest = 0
        while index < len(spans) and spans[index].kind == "plus":
            element += 1
            length = spans[index].length
            block_ids += [element] * length
            positions += range(start, start + length)
            longest = max(longest, length)
            if scheme == "sequential":
                start += length
            index += 1
        if scheme == "after_prefix":
            counter += longest
        elif scheme == "sequential":
            counter = start
    return tuple(block_ids), tuple(positions), counter


@dataclass(frozen=True)
class PicPrompt:
    """A prompt's token ids with its PIC layout (marker and sentinel tokens removed)."""

    token_ids: list[int]
    layout: PicLayout

    def __post_init__(self) -> None:
        if len(self.token_ids) != self.layout.num_prompt_tokens:
            raise ValueError("a PIC prompt's layout does not cover its tokens")


def visible(
    q_index: torch.Tensor,
    q_block: torch.Tensor,
    q_pos: torch.Tensor,
    k_block: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """``[queries, keys]``: which of the keys ``0 .. len(k_block) - 1`` (prompt order) each
    query at ``q_index`` sees: at or before it, cross on either side or the same element,
    and with a sliding window ``w``, less than ``w`` positions behind it."""
    k_index = torch.arange(k_block.shape[0])
    seen = k_index <= q_index[:, None]
    seen &= (q_block[:, None] == CROSS) | (k_block == CROSS) | (k_block == q_block[:, None])
    if window is not None:
        seen &= q_pos[:, None] - k_pos < window
    return seen
