"""The scheduler on its own, over a cache that always has room: how a step's tokens are
shared out between decoding sequences and prompts."""

from helpers import PROMPT, engine_internals

from spnl_backend.engine.scheduler import Scheduler
from spnl_backend.engine.sequence import Sequence
from spnl_backend.sampling import SamplingParams


class RoomyCache:
    """A cache manager that admits everything and holds nothing."""

    def admit(self, seq) -> None:
        pass

    def reserve(self, seq, num_tokens: int) -> bool:
        return True

    def chunk(self, seq, count: int) -> int:
        return count

    def release(self, seq) -> None:
        pass


def _sequence(prompt_len: int) -> Sequence:
    return Sequence(list(range(prompt_len)), SamplingParams(temperature=0.0), max_len=10_000)


def _step(scheduler: Scheduler) -> dict[int, int]:
    """Schedule a step and compute it (every scheduled prompt's last token yields one)."""
    batch = scheduler.schedule()
    for item in batch:
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.append(7)
    return {item.seq.seq_id: item.num_new_tokens for item in batch}


def test_a_prompt_takes_the_whole_budget_when_nothing_decodes():
    scheduler = Scheduler(RoomyCache(), 64, 100, prefill_chunk_while_decoding=16)
    long = _sequence(250)
    scheduler.add(long)
    assert [_step(scheduler) for _ in range(3)] == [
        {long.seq_id: 100},
        {long.seq_id: 100},
        {long.seq_id: 50},
    ]


def test_prompts_arriving_among_decodes_share_a_chunk_a_step_and_the_decodes_go_on():
    scheduler = Scheduler(RoomyCache(), 64, 100, prefill_chunk_while_decoding=16)
    decoding = _sequence(5)
    scheduler.add(decoding)
    assert _step(scheduler) == {decoding.seq_id: 5}
    long, short = _sequence(40), _sequence(3)
    scheduler.add(long)
    scheduler.add(short)
    steps = [_step(scheduler) for _ in range(4)]  # prompts share 16 tokens a step
    assert steps[0] == {decoding.seq_id: 1, long.seq_id: 16}
    assert steps[1] == {decoding.seq_id: 1, long.seq_id: 16}
    assert steps[2] == {decoding.seq_id: 1, long.seq_id: 8, short.seq_id: 3}
    assert steps[3] == {decoding.seq_id: 1, long.seq_id: 1, short.seq_id: 1}


def test_chunks_while_decoding_change_no_token(tiny):
    """A prompt prefilled in chunks of 3 beside a decoding request gives the tokens it
    gives alone (batch invariance), and so does the request it joined."""
    backend = tiny.backend("gemma3")
    alone_ids = backend.generate(PROMPT, max_tokens=12, temperature=0).token_ids
    alone_text = backend.generate("Hi", max_tokens=40, temperature=0).text
    scheduler = engine_internals(backend).scheduler
    scheduler.prefill_chunk_while_decoding = 3
    schedule, steps = scheduler.schedule, []

    def recorded():
        batch = schedule()
        steps.append(sorted(item.num_new_tokens for item in batch))
        return batch

    scheduler.schedule = recorded
    try:
        stream = backend.stream("Hi", max_tokens=40, temperature=0)
        first = next(stream)  # "Hi" decodes from here on
        joined = backend.generate(PROMPT, max_tokens=12, temperature=0)
        text = first + "".join(stream)
    finally:
        del scheduler.schedule
        scheduler.prefill_chunk_while_decoding = 256
    assert joined.token_ids == alone_ids
    assert text == alone_text
    assert [1, 3] in steps  # the prompt went 3 tokens at a time beside the decode
