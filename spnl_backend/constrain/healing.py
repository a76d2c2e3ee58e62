"""Token healing: the prompt's last token is backed off, and the completion's first token
is constrained to start with its text, so that a prompt cut inside a word or after a
space continues as the model would have tokenized the whole text.

Where "The capital of France is " ends in a lone space token, the model without healing
continues after that space as after a word boundary it has rarely seen; with healing it
chooses among the tokens that start with the space (" Paris", ...).
"""

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..engine.token_bitmask import pack
from ..errors import EngineError


class TokenPrefixIndex:
    """Every ordinary token's bytes, sorted, so that the tokens starting with some bytes
    are one contiguous run (special tokens never qualify)."""

    def __init__(self, token_bytes: list[bytes], special: set[int], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.token_bytes = token_bytes
        ordinary = [i for i, b in enumerate(token_bytes) if b and i not in special]
        ordinary.sort(key=token_bytes.__getitem__)
        self._order = ordinary
        self._sorted = [token_bytes[i] for i in ordinary]

    @functools.lru_cache(maxsize=256)  # noqa: B019  # one index per backend, kept for its life
    def first_tokens(self, token_id: int) -> tuple[torch.Tensor, frozenset[int]]:
        """The packed bitmask row and the ids of the tokens that start with the bytes of
        ``token_id`` (a prompt's last token, backed off)."""
        allowed = self.starting_with(self.token_bytes[token_id])
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[allowed] = True
        return pack(mask), frozenset(allowed)

    def starting_with(self, prefix: bytes) -> list[int]:
        """The ids of the tokens whose bytes start with ``prefix``."""
        start = bisect.bisect_left(self._sorted, prefix)
        after = _successor(prefix)  # the first bytes past every one that starts with it
        end = len(self._sorted) if after is None else bisect.bisect_left(self._sorted, after)
        return self._order[start:end]


_CONTEXT_TOKENS = 8


def _successor(prefix: bytes) -> bytes | None:
    """The least bytes greater than every bytes starting with ``prefix`` (None: there are
    none, a prefix of 0xff bytes alone)."""
    stem = prefix.rstrip(b"\xff")
    return stem[:-1] + bytes([stem[-1] + 1]) if stem else None


@dataclass
class HealingConstraint:
    """The first token's constraint (the engine's `Constraint`); inactive after it."""

    allowed: torch.Tensor  # the packed bitmask row of the tokens that may come first
    allowed_ids: frozenset[int]
    accepted: int = 0

    @property
    def active(self) -> bool:
        return self.accepted == 0

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.allowed

    def accept(self, token_id: int) -> None:
        if self.accepted == 0 and token_id not in self.allowed_ids:
            raise EngineError(
                f"token healing refused token {token_id}: it does not start with the "
                "prompt's backed-off text"
            )
        self.accepted += 1

    def fork(self) -> "HealingConstraint":
        return HealingConstraint(self.allowed, self.allowed_ids, self.accepted)


@dataclass(frozen=True)
class Healed:
    """A prompt with its last token backed off: the ids kept, the text removed, and the
    first token's allowed ids."""

    kept_ids: list[int]
    text: str
    allowed: torch.Tensor
    allowed_ids: frozenset[int]

    def constraint(self) -> HealingConstraint:
        return HealingConstraint(self.allowed, self.allowed_ids)


def back_off(
    ids: list[int], index: TokenPrefixIndex, decode: Callable[[list[int]], str]
) -> Healed | None:
    """``ids`` healed, or None where there is nothing to heal: a prompt of one token, or
    one ending in a special token or in bytes that are not whole characters."""
    if len(ids) < 2:
        return None
    last = ids[-1]
    removed = index.token_bytes[last] if last < len(index.token_bytes) else b""
    kept = ids[:-1]
    tail = ids[-_CONTEXT_TOKENS:]  # enough before it for the decoder to keep its spaces
    text = decode(tail)[len(decode(tail[:-1])) :]
    if not removed or text.encode("utf-8") != removed:
        return None
    allowed, allowed_ids = index.first_tokens(last)
    if last not in allowed_ids:  # a special token: not among the ordinary ones
        return None
    return Healed(kept, text, allowed, allowed_ids)
