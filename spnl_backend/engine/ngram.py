"""Speculation without a draft model: n-gram lookup in the sequence's own prompt and output.

Where an answer copies its context (a quoted document, code rewritten with one change,
echoed tool output), the tokens after the latest earlier occurrence of the sequence's last
``n`` tokens are a good guess at its next ones. Each decoding sequence looks up its last
``n`` tokens, ``n`` from the longest size down to the shortest, and proposes what followed
the latest match; the target verifies the proposal in its step exactly as it verifies a
draft model's (`speculative.VerifyingRunner`): greedy keeps the target's argmax tokens,
sampling keeps its distribution (a proposal is a draft whose distribution is all on one
token, so it is accepted with the target's probability of it).

Each sequence's draft length adapts to what it accepts: doubled when all of a proposal
passed, cut to one past what passed otherwise, halved when none did, and at 0 the sequence
proposes nothing for a few steps (more after each fruitless try), so text that copies
nothing decodes as it would without speculation but for an occasional one-token try.
"""

import weakref
from dataclasses import dataclass

import torch

from ..log import get_logger
from ..models.transformer import CausalLM
from .cache import CacheManager
from .sequence import ScheduledSeq, Sequence
from .speculative import Proposal, VerifyingRunner, decodes
from .token_bitmask import Constraint, constraint_row

log = get_logger()

# A sequence whose proposals keep failing waits this many steps at most between tries.
MAX_IDLE_STEPS = 64
# The draft length a sequence starts at (it grows with what it accepts).
FIRST_DRAFT_LENGTH = 4


class NgramIndex:
    """Where each n-gram of a sequence's tokens last ended, for the sizes ``min_n`` to
    ``max_n``; grown as the sequence's tokens grow (they are only ever appended)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)  # the longest match first
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in ``ends``

    def update(self, tokens: list[int]) -> None:
        """Index the n-grams ending before the last token (each has a token after it)."""
        for end in range(max(self.indexed, 1), len(tokens)):
            for n in self.sizes:
                if end >= n:
                    self.ends[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        suffix of ``tokens`` that occurred before."""
        self.update(tokens)
        for n in self.sizes:
            if len(tokens) <= n:
                continue
            end = self.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + k]
        return []


@dataclass
class DraftLength:
    """A sequence's adaptive draft length, and its wait after fruitless tries."""

    limit: int
    idle: int = 0  # steps left before it proposes again
    backoff: int = 1  # the wait after its next fall to 0

    def usable(self) -> int:
        """The draft length for this step (0 while it waits)."""
        if self.idle > 0:
            self.idle -= 1
            return 0
        return max(self.limit, 1)  # back from a wait: a one-token try

    def settle(self, proposed: int, accepted: int, gamma: int) -> None:
        if accepted == proposed:
            self.limit = min(gamma, max(self.limit, 1) * 2)
            self.backoff = 1
        elif accepted:
            self.limit = accepted + 1
            self.backoff = 1
        else:
            self.limit = min(self.limit, proposed) // 2
            if self.limit == 0:
                self.idle = self.backoff
                self.backoff = min(self.backoff * 2, MAX_IDLE_STEPS)


@dataclass
class NgramState:
    index: NgramIndex
    length: DraftLength


class NgramRunner(VerifyingRunner):
    """The target's step with n-gram proposals for the sequences that decode."""

    def __init__(
        self,
        model: CausalLM,
        cache: CacheManager,
        device: torch.device,
        gamma: int,
        ngram_sizes: tuple[int, int],
        vocab_size: int,
        max_len: int,
    ) -> None:
        super().__init__(model, gamma, device, vocab_size)
        self.cache, self.min_n, self.max_n, self.max_len = cache, *ngram_sizes, max_len
        # Per sequence, gone with it (a finished or aborted sequence is not told here).
        self.states: weakref.WeakKeyDictionary[Sequence, NgramState] = weakref.WeakKeyDictionary()

    def state(self, seq: Sequence) -> NgramState:
        state = self.states.get(seq)
        if state is None:
            start = min(FIRST_DRAFT_LENGTH, self.gamma)
            state = NgramState(NgramIndex(self.min_n, self.max_n), DraftLength(start))
            self.states[seq] = state
        return state

    def _propose(self, batch: list[ScheduledSeq]) -> dict[int, Proposal]:
        proposals = {}
        for item in batch:
            seq = item.seq
            if not decodes(item) or seq.pic is not None:  # a PIC sequence's blocks: not in order
                continue
            budget = self.draft_budget(seq, self.max_len)
            if budget <= 0:
                continue
            state = self.state(seq)
            tokens = seq.token_ids
            state.index.update(tokens)  # kept current whether it proposes or not
            k = min(budget, state.length.usable())
            guess = state.index.lookup(tokens, k) if k else []
            proposal = self._proposal(seq, guess)
            if proposal.tokens and self.cache.reserve(seq, seq.num_tokens + len(proposal.tokens)):
                proposals[seq.seq_id] = proposal
        return proposals

    def _proposal(self, seq: Sequence, guess: list[int]) -> Proposal:
        """``guess`` as drafts: cut where the sequence's constraint refuses a token (with
        its mask at each position and after the last), and for a sampling sequence each
        with a distribution that is all on it."""
        if not guess:
            return Proposal()
        proposal = Proposal()
        if seq.constraint is not None and seq.constraint.active:
            guess = self._allowed(seq.constraint.fork(), guess, proposal)
        proposal.tokens = guess
        if guess and not seq.params.greedy:
            certain = torch.zeros(len(guess), self.vocab_size)
            certain[torch.arange(len(guess)), torch.tensor(guess)] = 1.0
            proposal.probs = list(certain)
        return proposal

    def _allowed(self, fork: Constraint, guess: list[int], proposal: Proposal) -> list[int]:
        """The longest prefix of ``guess`` the constraint allows; ``proposal.masks``: its
        row before each kept token and after the last."""
        kept: list[int] = []
        for token in guess:
            mask = constraint_row(fork, self.vocab_size)
            proposal.masks.append(mask)
            if not (int(mask[token // 32]) >> (token % 32)) & 1:
                break
            kept.append(token)
            if fork.active:
                fork.accept(token)
        else:
            proposal.masks.append(constraint_row(fork, self.vocab_size))
        if not kept:
            proposal.masks = []
        return kept

    def _settle(self, seq: Sequence, num_drafts: int, accepted: int, tokens: list[int]) -> None:
        state = self.state(seq)
        state.length.settle(num_drafts, accepted, self.gamma)
