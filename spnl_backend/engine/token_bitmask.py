"""Constrained decoding as the engine sees it (the requests' constraints are
`constrain`'s): a matcher per sequence that says which tokens may come next, as a packed
bitmask row, and follows the tokens accepted.

A bitmask row holds one bit per token id, 32 to an int32 (bit ``i % 32`` of word
``i // 32``), set where the token is allowed; rows are filled on the CPU and applied to
the logits of the whole batch at once, on their device.
"""

from typing import Protocol

import torch


class Constraint(Protocol):
    """A sequence's matcher (`constrain.grammar`, `constrain.healing`)."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]``."""

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id``; an error of its request's where it was not allowed."""

    def fork(self) -> "Constraint":
        """An independent copy in the same state: speculative drafts advance a fork, so
        the sequence's own matcher only ever sees the tokens the target kept."""

    @property
    def active(self) -> bool:
        """False once it no longer constrains anything (its mask would allow every token)."""


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-forbidden bitmask of ``rows`` rows (filled in place by the constraints)."""
    return torch.zeros(rows, bitmask_width(vocab_size), dtype=torch.int32)


_BITS = torch.arange(32, dtype=torch.int32)


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``bitmask [rows, words]`` → bool ``[rows, vocab_size]``; ids past the mask's words
    are forbidden (a logits width padded beyond the tokenizer's vocabulary)."""
    bits = _BITS.to(bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - width))


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool ``[vocab]`` → one bitmask row (int32 ``[words]``)."""
    words = bitmask_width(allowed.shape[-1])
    bits = torch.nn.functional.pad(allowed.to(torch.int64), (0, words * 32 - allowed.shape[-1]))
    packed = (bits.view(words, 32) << _BITS.to(torch.int64)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set each row's forbidden logits to -inf, in place (``bitmask`` on any device)."""
    allowed = unpack(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    logits.masked_fill_(~allowed, float("-inf"))


def constraint_row(constraint: Constraint, vocab_size: int) -> torch.Tensor:
    """``constraint``'s bitmask row for its current state (every token, once inactive)."""
    bitmask = new_bitmask(1, vocab_size)
    if constraint.active:
        constraint.fill(bitmask, 0)
    else:
        bitmask[0] = -1
    return bitmask[0]
