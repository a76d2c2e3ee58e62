"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Running sequences go first, oldest first: a decoding one takes one token, one still in
its prompt takes a chunk of the step's token budget (chunked prefill). Then waiting
sequences join, first come first served, while the budget, the sequence limit and the
cache allow. When a running sequence needs cache the cache does not have, the newest
running sequence is preempted: its cache is released and it waits, first in line, to
be recomputed; its generated tokens are kept.
"""

from collections import deque
from typing import Protocol

import torch

from ..models.layers import AttentionBackend
from .sequence import ScheduledSeq, Sequence, SequenceStatus


class CacheManager(Protocol):
    """The KV cache as the scheduler and runner see it (paged or contiguous)."""

    capacity_tokens: int | None
    num_holders: int

    def admit(self, seq: Sequence) -> None: ...
    def reserve(self, seq: Sequence, num_tokens: int) -> bool: ...
    def release(self, seq: Sequence) -> None: ...
    def truncate(self, seq: Sequence) -> None: ...
    def after_step(self, batch: list[ScheduledSeq]) -> None: ...
    def backend(self, batch: list[ScheduledSeq], device: torch.device) -> AttentionBackend: ...


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
            count = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.cache.reserve(seq, seq.num_computed_tokens + count):
                batch.append(ScheduledSeq(seq, count))
                budget -= count
                index += 1
            else:
                self.preempt(self.running[-1])  # the newest; possibly ``seq`` itself
        return budget

    def _schedule_waiting(self, batch: list[ScheduledSeq], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self.cache.admit(seq)
            count = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.cache.reserve(seq, seq.num_computed_tokens + count):
                self.cache.release(seq)  # not now: running sequences are not preempted for it
                seq.num_computed_tokens = 0
                return
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, count))
            budget -= count

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
