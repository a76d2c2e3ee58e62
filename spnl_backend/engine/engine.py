"""The engine: requests in, one scheduled model step at a time, finished sequences out."""

from dataclasses import dataclass

from .detokenizer import Decoder, IncrementalDetokenizer
from .runner import Runner
from .scheduler import Scheduler
from .sequence import SamplingParams, Sequence


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int  # tokens per sequence: the model's context, or the whole KV cache
    eos_token_ids: frozenset[int]
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


@dataclass(frozen=True)
class StepOutput:
    """What one step did for one sequence: its new token and the text it added."""

    seq: Sequence
    token_id: int
    text_delta: str


class Engine:
    def __init__(self, runner: Runner, decoder: Decoder, config: EngineConfig) -> None:
        self.config = config
        self.decoder = decoder
        self.runner = runner
        self.cache = runner.cache
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens)
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}

    def add(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        seq = Sequence(prompt_ids, params, max_len=self.config.max_model_len)
        self.detokenizers[seq.seq_id] = IncrementalDetokenizer(
            self.decoder, prompt_ids, params.stop
        )
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        sampled = self.runner.run(batch)
        outputs, finished = [], []
        for item in batch:
            for token_id in sampled.get(item.seq.seq_id, ()):
                outputs.append(self._accept(item.seq, token_id))
                if item.seq.is_finished:
                    finished.append(item.seq)
                    break  # accepted drafts after a stop are dropped
        self.cache.after_step(batch)  # register full blocks now that their tokens are known
        for seq in finished:
            self._release(seq)
        return outputs

    def abort(self, seq: Sequence) -> None:
        self._release(seq)

    def _accept(self, seq: Sequence, token_id: int) -> StepOutput:
        seq.append(token_id)
        detok = self.detokenizers[seq.seq_id]
        delta = detok.add(token_id)
        reason = self._finish_reason(seq, token_id, detok.stopped)
        if reason:
            delta += detok.flush()
            seq.text = detok.text
            seq.finish(reason)
        return StepOutput(seq, token_id, delta)

    def _finish_reason(self, seq: Sequence, token_id: int, stopped: bool) -> str | None:
        if stopped or token_id in self.config.eos_token_ids:
            return "stop"
        max_tokens = seq.params.max_tokens
        if (max_tokens and len(seq.output_token_ids) >= max_tokens) or (
            seq.num_tokens >= seq.max_len
        ):
            return "length"
        return None

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.detokenizers.pop(seq.seq_id, None)
