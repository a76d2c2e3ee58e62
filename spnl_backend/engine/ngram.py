"""Speculation without a draft model: n-gram lookup in the sequence's own prompt and output.

Where an answer copies its context (a quoted document, code rewritten with one change,
echoed tool output), the tokens after the latest earlier occurrence of the sequence's last
``n`` tokens are a good guess at its next ones. Each decoding sequence looks up its last
``n`` tokens, ``n`` from the longest size down to the shortest, and proposes what followed
the latest match; the target verifies the proposal in its step exactly as it verifies a
draft model's (`speculative.VerifyingRunner`): greedy keeps the target's argmax tokens,
sampling keeps its distribution (a proposal is a draft whose distribution is all on one
token, so it is accepted with the target's probability of it).

Each sequence's draft length adapts to what it accepts: it keeps an estimate of how often a
proposed token passes and takes the length expected to yield the most tokens per unit of
verification cost (`VERIFY_COST`: a few rows cost little more than one, many rows cost
several steps); where no length beats a plain step it proposes nothing for a few steps
(more after each fruitless try), so text that copies nothing decodes as it would without
speculation but for an occasional one-token try.
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
        suffix of ``tokens`` that occurred before; where that occurrence runs into the
        suffix itself (text repeating with a period shorter than ``k``), the copy goes on
        over the tokens it has proposed, as the repetition would."""
        self.update(tokens)
        for n in self.sizes:
            if len(tokens) <= n:
                continue
            end = self.ends.get(tuple(tokens[-n:]))
            if end is not None:
                proposal = tokens[end : end + k]
                period = len(tokens) - end
                while len(proposal) < k:  # an overlapping copy: the period again
                    proposal.append(proposal[len(proposal) - period])
                return proposal
        return []


# What verifying k proposed tokens costs, in plain decode steps (k + 1 rows in one step),
# measured on the default model's native int8 products at 2 threads (bench/speculation.py's
# note): up to 3 rows share each unpacked weight block, more take the 16-row tiles.
VERIFY_COST = {1: 1.1, 2: 1.35, 4: 2.6, 8: 2.9, 16: 3.8}
# A length is taken only where it is expected to beat a plain step by this factor.
MIN_GAIN = 1.05
# How fast the acceptance estimate forgets, per verification.
DECAY = 0.8


def verify_cost(k: int) -> float:
    """Steps' worth of verifying ``k`` tokens: the cost of the next tabulated length, and
    past the table, growing with the rows."""
    for length, cost in VERIFY_COST.items():
        if k <= length:
            return cost
    return VERIFY_COST[16] * (k + 1) / 17


def expected_tokens(p: float, k: int) -> float:
    """Tokens a step keeps from ``k`` proposed ones each accepted with probability ``p``
    (given the ones before it) plus the target's own: 1 + p + ... + p**k."""
    return sum(p**i for i in range(k + 1))


@dataclass
class DraftLength:
    """A sequence's draft length: the one expected to yield the most tokens per unit of
    verification cost, from its acceptance so far (a decayed count of proposed tokens
    accepted, given the ones before them); at 0 it waits, longer after each fruitless try."""

    accepted: float = 1.0  # the prior: one of two
    tried: float = 2.0
    idle: int = 0  # steps left before it proposes again
    backoff: int = 1  # the wait after its next fall to 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tried

    def best(self, gamma: int) -> int:
        """The length (up to ``gamma``) with the most expected tokens per cost; 0 where
        none beats a plain step."""
        p = self.acceptance
        lengths = sorted({k for k in (*VERIFY_COST, gamma) if k <= gamma})
        scores = {k: expected_tokens(p, k) / verify_cost(k) for k in lengths}
        k = max(scores, key=scores.__getitem__)
        return k if scores[k] >= MIN_GAIN else 0

    def usable(self, gamma: int) -> int:
        """The draft length for this step: 0 while it waits, one token at a wait's end."""
        if self.idle > 0:
            self.idle -= 1
            return 0 if self.idle else 1
        k = self.best(gamma)
        if k == 0:  # none pays now: wait, then try one token
            self.idle = self.backoff
            self.backoff = min(self.backoff * 2, MAX_IDLE_STEPS)
        return k

    def settle(self, proposed: int, accepted: int) -> None:
        """Count a verification: ``accepted`` tokens passed, and one more failed unless
        every proposed one passed."""
        failed = 1 if accepted < proposed else 0
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + accepted + failed
        if accepted:
            self.backoff = 1


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
            state = NgramState(NgramIndex(self.min_n, self.max_n), DraftLength())
            self.states[seq] = state
            self._new_state(seq)
        return state

    def _new_state(self, seq: Sequence) -> None:
        """A sequence is seen for the first time (a subclass may index its prompt)."""

    def _guess(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` tokens to propose: the sequence's own lookup."""
        return self.state(seq).index.lookup(seq.token_ids, k)

    def _proposed(self, seq: Sequence, count: int) -> None:
        """``count`` guessed tokens go to verification (a subclass may count them)."""

    def _propose(self, batch: list[ScheduledSeq]) -> dict[int, Proposal]:
        proposals = {}
        for item in batch:
            seq = item.seq
            if not decodes(item):
                continue
            budget = self.draft_budget(seq, self.max_len)
            if budget <= 0:
                continue
            state = self.state(seq)
            state.index.update(seq.token_ids)  # kept current whether it proposes or not
            k = min(budget, state.length.usable(self.gamma))
            proposal = self._proposal(seq, self._guess(seq, k) if k else [])
            if proposal.tokens and self.cache.reserve(seq, seq.num_tokens + len(proposal.tokens)):
                proposals[seq.seq_id] = proposal
                self._proposed(seq, len(proposal.tokens))
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
        state.length.settle(num_drafts, accepted)
