"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Running sequences go first, oldest first: a decoding one takes one token, one still in
its prompt takes a chunk of the step's token budget (chunked prefill). Then waiting
sequences join, first come first served, while the budget, the sequence limit and the
cache allow. When a running sequence needs cache the cache does not have, the newest
running sequence is preempted: its cache is released and it waits, first in line, to
be recomputed; its generated tokens are kept. A paused sequence (its reader is behind)
is skipped, and is the first to give up its cache when another needs room. Another
completion of a prompt waits until its leader has computed the prompt, whose blocks it
then shares.
"""

from collections import deque

from .cache import CacheManager
from .sequence import ScheduledSeq, Sequence, SequenceStatus


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        batch: list[ScheduledSeq] = []
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: list[ScheduledSeq], budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.paused:
                index += 1
                continue
            count = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.cache.reserve(seq, seq.num_computed_tokens + count):
                batch.append(ScheduledSeq(seq, count))
                budget -= count
                index += 1
            else:
                victim = self._victim()  # possibly ``seq`` itself
                if self.running.index(victim) < index:
                    index -= 1  # a paused one before ``seq``: the rest move down
                self.preempt(victim)
        return budget

    def _schedule_waiting(self, batch: list[ScheduledSeq], budget: int) -> None:
        while budget > 0 and len(self.running) < self.max_num_seqs:
            seq = next((s for s in self.waiting if not (s.paused or s.waits_for_leader)), None)
            if seq is None:
                return
            self.cache.admit(seq)
            count = min(seq.num_tokens - seq.num_computed_tokens, budget)
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
            budget -= count

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
