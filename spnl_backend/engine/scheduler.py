"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Running sequences go first, oldest first: a decoding one takes one token, one still in
its prompt takes a chunk of the step's token budget (chunked prefill); while sequences
decode, the prompts of a step take at most ``prefill_chunk_while_decoding`` tokens in all,
so that long prompts arriving do not hold up the decodes' next tokens for the whole of
their prefill. Then waiting sequences join, first come first served, while the budget,
the sequence limit and the cache allow (its blocks, and for a model with state layers a
free state slot: the cache refuses to reserve for a sequence without one). When a
running sequence needs cache the cache does not have, the newest running sequence is
preempted: its cache is released and it waits, first in line, to be recomputed; its
generated tokens are kept. A paused sequence (its reader is behind) is skipped, and is
the first to give up its cache when another needs room. Another completion of a prompt
waits until its leader has computed the prompt, whose blocks it then shares.
"""

from collections import deque
from dataclasses import dataclass

from .cache import CacheManager
from .sequence import ScheduledSeq, Sequence, SequenceStatus


@dataclass
class StepBudget:
    """What is left of a step: tokens, and of them, prompt tokens."""

    tokens: int
    prefill: int

    def count(self, remaining: int) -> int:
        """The tokens a sequence with ``remaining`` uncomputed ones takes now: a decode its
        one, a prompt a chunk (0: none left for prompts)."""
        return 1 if remaining == 1 else min(remaining, self.tokens, self.prefill)

    def take(self, count: int, remaining: int) -> None:
        self.tokens -= count
        if remaining > 1:  # a prompt's chunk
            self.prefill -= count


class Scheduler:
    def __init__(
        self,
        cache: CacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_chunk_while_decoding: int | None = None,
    ) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_while_decoding = prefill_chunk_while_decoding or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        batch: list[ScheduledSeq] = []
        decoding = any(
            not s.paused and s.num_tokens - s.num_computed_tokens == 1 for s in self.running
        )
        tokens = self.max_num_batched_tokens
        budget = StepBudget(tokens, self.prefill_chunk_while_decoding if decoding else tokens)
        self._schedule_running(batch, budget)
        self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: list[ScheduledSeq], budget: StepBudget) -> None:
        index = 0
        while index < len(self.running) and budget.tokens > 0:
            seq = self.running[index]
            remaining = seq.num_tokens - seq.num_computed_tokens
            count = self.cache.chunk(seq, budget.count(remaining))
            if seq.paused or count == 0:
                index += 1
                continue
            if self.cache.reserve(seq, seq.num_computed_tokens + count):
                batch.append(ScheduledSeq(seq, count))
                budget.take(count, remaining)
                index += 1
            else:
                victim = self._victim()  # possibly ``seq`` itself
                if self.running.index(victim) < index:
                    index -= 1  # a paused one before ``seq``: the rest move down
                self.preempt(victim)

    def _schedule_waiting(self, batch: list[ScheduledSeq], budget: StepBudget) -> None:
        while budget.tokens > 0 and budget.prefill > 0 and len(self.running) < self.max_num_seqs:
            seq = next((s for s in self.waiting if not (s.paused or s.waits_for_leader)), None)
            if seq is None:
                return
            self.cache.admit(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            count = self.cache.chunk(seq, budget.count(remaining))
            if not self.cache.reserve(seq, seq.num_computed_tokens + count):
                self.cache.release(seq)
                seq.num_computed_tokens = 0
                paused = self._newest_paused()
                if paused is None:  # running sequences are not preempted for it
                    return
                self.preempt(paused)  # a paused one gives up its cache
                continue
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, count))
            budget.take(count, remaining)

    def _victim(self) -> Sequence:
        """Whom to preempt for room: the newest paused sequence, else the newest one."""
        return self._newest_paused() or self.running[-1]

    def _newest_paused(self) -> Sequence | None:
        return next((s for s in reversed(self.running) if s.paused), None)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and release its cache."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.release(seq)
