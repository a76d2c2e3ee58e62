"""Suffix speculation: n-gram proposals from the sequence's own tokens, and where those have
no match, from a store that every request shares.

The store holds copies of token ids (not references to pool blocks), bounded by a token
budget, the oldest entry dropped first:

- **documents**: what prompts bring, added when a sequence first decodes: a PIC prompt's
  plus elements one by one (a span query's fragments, which its answer and later answers
  quote), a plain prompt whole (a shared system prompt or document);
- **outputs**: finished requests' generated tokens (an answer the next request repeats).

An entry already held is refreshed (moved to the newest) rather than held twice, so the
documents a workload keeps sending stay while those it stopped sending age out. Its index
maps each n-gram (sizes ``min_n`` to ``max_n``) to the latest entry and place where it
ended; an entry's n-grams leave the index with it. The proposals go through the same
verification as the n-gram method's (`engine.ngram`), so output stays the target's alone.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import torch

from ..log import get_logger
from ..models.transformer import CausalLM
from .cache import CacheManager
from .ngram import NgramRunner
from .sequence import Sequence

log = get_logger()

Source = Literal["document", "output"]


@dataclass(frozen=True)
class SuffixStats:
    """The shared store now, and the tokens it proposed and had accepted since the engine
    was built (the sequences' own lookups are not counted here)."""

    entries: int
    tokens: int
    budget_tokens: int
    dropped_entries: int
    proposed_from_documents: int
    accepted_from_documents: int
    proposed_from_outputs: int
    accepted_from_outputs: int


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    source: Source


class TokenStore:
    """Token id copies of documents and outputs within ``budget_tokens``, indexed by their
    n-grams; the oldest entry dropped when a new one would pass the budget."""

    def __init__(self, min_n: int, max_n: int, budget_tokens: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)  # the longest match first
        self.min_n, self.budget = min_n, budget_tokens
        self.entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.ends: dict[tuple[int, ...], tuple[tuple[int, ...], int]] = {}
        self.num_tokens = 0
        self.dropped = 0
        self.proposed: dict[Source, int] = {"document": 0, "output": 0}
        self.accepted: dict[Source, int] = {"document": 0, "output": 0}

    def add(self, tokens: list[int], source: Source) -> None:
        """Hold ``tokens`` (at most the budget's first tokens) as the newest entry."""
        key = tuple(tokens[: self.budget])
        if len(key) <= self.min_n:  # no n-gram with a token after it
            return
        if key in self.entries:
            key = self.entries[key].tokens  # the held tuple: the index refers to it by identity
            self.entries.move_to_end(key)
        else:
            self.entries[key] = _Entry(key, source)
            self.num_tokens += len(key)
            while self.num_tokens > self.budget:
                self._drop(next(iter(self.entries)))
        self._index(key)

    def lookup(self, tokens: list[int], k: int) -> tuple[list[int], Source | None]:
        """Up to ``k`` tokens that followed the latest held occurrence of the longest
        suffix of ``tokens`` that the store holds, and where they came from."""
        for n in self.sizes:
            if len(tokens) < n:
                continue
            hit = self.ends.get(tuple(tokens[-n:]))
            if hit is not None:
                key, end = hit
                return list(key[end : end + k]), self.entries[key].source
        return [], None

    def _index(self, key: tuple[int, ...]) -> None:
        for end in range(self.min_n, len(key)):
            for n in self.sizes:
                if end >= n:
                    self.ends[key[end - n : end]] = (key, end)

    def _drop(self, key: tuple[int, ...]) -> None:
        """Forget the oldest entry and the n-grams whose latest place was in it."""
        del self.entries[key]
        self.num_tokens -= len(key)
        self.dropped += 1
        for end in range(self.min_n, len(key)):
            for n in self.sizes:
                gram = key[end - n : end]
                if end >= n and self.ends.get(gram, (None,))[0] is key:
                    del self.ends[gram]

    def stats(self) -> SuffixStats:
        return SuffixStats(
            len(self.entries),
            self.num_tokens,
            self.budget,
            self.dropped,
            self.proposed["document"],
            self.accepted["document"],
            self.proposed["output"],
            self.accepted["output"],
        )


class SuffixRunner(NgramRunner):
    """N-gram proposals from the sequence's own tokens, else from the shared store."""

    def __init__(
        self,
        model: CausalLM,
        cache: CacheManager,
        device: torch.device,
        gamma: int,
        ngram_sizes: tuple[int, int],
        vocab_size: int,
        max_len: int,
        budget_tokens: int,
    ) -> None:
        super().__init__(model, cache, device, gamma, ngram_sizes, vocab_size, max_len)
        self.store = TokenStore(*ngram_sizes, budget_tokens)
        self.sources: dict[int, Source] = {}  # the source of a sequence's pending proposal

    def _new_state(self, seq: Sequence) -> None:
        """A sequence decodes for the first time: its prompt's documents join the store."""
        prompt = seq.prompt_token_ids
        layout = seq.pic
        if layout is None:
            self.store.add(prompt, "document")
            return
        for span in layout.spans:
            if span.kind == "plus":
                self.store.add(prompt[span.start : span.end], "document")

    def _guess(self, seq: Sequence, k: int) -> list[int]:
        own = super()._guess(seq, k)
        self.sources.pop(seq.seq_id, None)
        if own:
            return own
        guess, source = self.store.lookup(seq.token_ids, k)
        if guess and source is not None:
            self.sources[seq.seq_id] = source
        return guess

    def _proposed(self, seq: Sequence, count: int) -> None:
        source = self.sources.get(seq.seq_id)
        if source is not None:
            self.store.proposed[source] += count

    def _settle(self, seq: Sequence, num_drafts: int, accepted: int, tokens: list[int]) -> None:
        super()._settle(seq, num_drafts, accepted, tokens)
        source = self.sources.pop(seq.seq_id, None)
        if source is not None:
            self.store.accepted[source] += accepted

    def finished(self, seq: Sequence) -> None:
        """A request finished: its output joins the store."""
        self.sources.pop(seq.seq_id, None)
        if seq.finish_reason in ("stop", "length"):
            self.store.add(seq.output_token_ids, "output")
