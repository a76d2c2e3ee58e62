"""Runs one scheduled step through the model: inputs, attention backend, logits, sampling."""

from dataclasses import dataclass
from typing import Protocol

import torch

from ..models.step_attention import StepAttention
from ..models.transformer import CausalLM
from .cache import CacheManager, Feed
from .logits import RowHistory, adjust, fill_masks
from .pic_probe import choose_recomputed
from .sampler import TokenLogprobs, row_error, sample, token_logprobs
from .sequence import ScheduledSeq, Sequence


@dataclass(frozen=True)
class Picked:
    """A sequence's new tokens in one step, and their log-probabilities where asked for."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] | None = None


# Each sampling sequence's new tokens, or the error that ends it alone.
Sampled = dict[int, "Picked | Exception"]


class Runner(Protocol):
    """What the engine steps: a model over a cache, giving each sequence its new tokens."""

    model: CausalLM
    cache: CacheManager
    device: torch.device

    def run(self, batch: list[ScheduledSeq]) -> Sampled: ...


class ModelRunner:
    def __init__(self, model: CausalLM, cache: CacheManager, device: torch.device) -> None:
        self.model, self.cache, self.device = model, cache, device

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> Sampled:
        """Computes the step; returns the sampled token of each sequence whose tokens are now
        all computed (a prefill chunk in the middle of a prompt samples nothing), or the
        error of a sequence whose sampling failed."""
        choose_recomputed(self.model, self.cache.probes(batch), self.device)
        attention = self.cache.attention(batch, self.device)
        input_ids, positions = step_inputs(batch, self.device, self.cache)
        hidden = forward_with_adapters(self.model, batch, input_ids, positions, attention)
        rows, sampling = [], []
        row = -1
        for item in batch:
            row += item.num_new_tokens
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.seq.num_computed_tokens == item.seq.num_tokens:
                rows.append(row)
                sampling.append(item.seq)
        if not sampling:
            return {}
        return pick_next(self.model.compute_logits(sampled_rows(hidden, rows)), sampling)


def sampled_rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``hidden``'s ``rows``: a view where they are a run of consecutive rows (a decode
    step's every row), which skips the copy of an indexed gather."""
    first = rows[0]
    if rows[-1] - first == len(rows) - 1:  # increasing, so consecutive
        return hidden[first : first + len(rows)]
    return hidden[rows]


def forward_with_adapters(
    model: CausalLM,
    batch: list[ScheduledSeq],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attention: StepAttention,
) -> torch.Tensor:
    """The model's pass over a step, each sequence's rows through its LoRA adapters (if
    the model has adapters: `models.lora`); the rows are forgotten after it, so no other pass
    (a probe, an embedding) ever takes them."""
    adapters = model.adapters
    if adapters is None:
        return model(input_ids, positions, attention)
    rows = [(getattr(item.seq, "lora", ()), item.num_new_tokens) for item in batch]
    adapters.step.groups = adapters.rows_of(rows, input_ids.device)
    try:
        return model(input_ids, positions, attention)
    finally:
        adapters.step.groups = []


def pick_next(logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
    """Each sequence's next token from its row of ``logits``, after its penalties,
    biases and constraint (`logits.adjust`), with its log-probabilities if asked for."""
    bitmask, errors = fill_masks([seq.constraint for seq in seqs], logits.shape[-1])
    histories = [RowHistory(s.params, s.prompt_token_ids, s.output_token_ids) for s in seqs]
    logits = adjust(logits, histories, bitmask)
    tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
    picked: Sampled = {}
    for row, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
        if row in errors or isinstance(token, Exception):
            picked[seq.seq_id] = row_error(errors.get(row) or token)  # type: ignore[arg-type]
        else:
            picked[seq.seq_id] = Picked([token], logprobs_of(seq, logits[row : row + 1], [token]))
    return picked


def logprobs_of(
    seq: Sequence, logits: torch.Tensor, tokens: list[int]
) -> list[TokenLogprobs] | None:
    """``tokens``' log-probabilities under the rows of ``logits`` where ``seq`` asks for them."""
    if not seq.params.logprobs:
        return None
    return token_logprobs(logits, tokens, seq.params.top_logprobs)


def step_inputs(
    batch: list[ScheduledSeq], device: torch.device, cache: CacheManager
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and positions of every scheduled token, packed sequence after sequence,
    in the order the cache computes each sequence's tokens (`CacheManager.feed`)."""
    return pack_inputs([cache.feed(item.seq, item.num_new_tokens) for item in batch], device)


def pack_inputs(feeds: list[Feed], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's `Feed` → packed token ids and positions."""
    ids: list[int] = []
    positions: list[int] = []
    for start, tokens in feeds:
        ids += tokens
        positions += range(start, start + len(tokens)) if isinstance(start, int) else start
    return torch.tensor(ids, device=device), torch.tensor(positions, device=device)
