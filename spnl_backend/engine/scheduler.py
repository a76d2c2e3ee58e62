"""Which sequences run in the next step, and how many of their tokens.

Prefill first (long prompts in chunks of at most ``max_num_batched_tokens``),
then one decode step for every running sequence.
"""

from collections import deque
from dataclasses import dataclass

from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        return self._schedule_prefill() or [ScheduledSeq(seq, 1) for seq in self.running]

    def _schedule_prefill(self) -> list[ScheduledSeq]:
        batch: list[ScheduledSeq] = []
        budget = self.max_num_batched_tokens
        for seq in self.waiting:
            if budget == 0 or len(self.running) + len(batch) >= self.max_num_seqs:
                break
            chunk = min(seq.num_tokens - seq.num_computed_tokens, budget)
            batch.append(ScheduledSeq(seq, chunk))
            budget -= chunk
        return batch

    def postprocess(self, batch: list[ScheduledSeq]) -> None:
        """Move sequences whose prompt is now cached to running; drop finished ones."""
        for item in batch:
            seq = item.seq
            if seq.status is SequenceStatus.WAITING and seq.num_computed_tokens >= len(
                seq.prompt_token_ids
            ):
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            if seq.is_finished:
                if seq in self.waiting:
                    self.waiting.remove(seq)
                if seq in self.running:
                    self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
