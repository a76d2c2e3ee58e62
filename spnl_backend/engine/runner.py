"""Runs one scheduled step through the model: inputs, attention backend, logits, sampling."""

from typing import Protocol

import torch

from ..models.transformer import CausalLM
from .cache import CacheManager
from .sampler import sample
from .sequence import ScheduledSeq

# Each sampling sequence's new tokens, or the error that ends it alone.
Sampled = dict[int, "list[int] | Exception"]


class Runner(Protocol):
    """What the engine steps: a model over a cache, giving each sequence its new tokens."""

    model: CausalLM
    cache: CacheManager

    def run(self, batch: list[ScheduledSeq]) -> Sampled: ...


class ModelRunner:
    def __init__(self, model: CausalLM, cache: CacheManager, device: torch.device) -> None:
        self.model, self.cache, self.device = model, cache, device

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> Sampled:
        """Computes the step; returns the sampled token of each sequence whose tokens are now
        all computed (a prefill chunk in the middle of a prompt samples nothing), or the
        error of a sequence whose sampling failed."""
        backend = self.cache.backend(batch, self.device)
        input_ids, positions = step_inputs(batch, self.device, self.cache)
        hidden = self.model(input_ids, positions, backend)
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
        logits = self.model.compute_logits(hidden[rows])
        tokens = sample(logits, [s.params for s in sampling], [s.generator for s in sampling])
        return {
            seq.seq_id: token if isinstance(token, Exception) else [token]
            for seq, token in zip(sampling, tokens, strict=True)
        }


def step_inputs(
    batch: list[ScheduledSeq], device: torch.device, cache: CacheManager | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and positions of every scheduled token, packed sequence after sequence
    (a PIC sequence's from its cache, which knows which of its tokens come next)."""
    feeds: list[tuple[int | list[int], list[int]]] = []
    for item in batch:
        start, count = item.seq.num_computed_tokens, item.num_new_tokens
        if getattr(item.seq, "pic", None) is not None and cache is not None:
            indices, places = cache.pic_feed(item.seq, count)  # type: ignore[attr-defined]
            tokens = item.seq.token_ids
            feeds.append((places, [tokens[i] for i in indices]))
        else:
            feeds.append((start, item.seq.token_ids[start : start + count]))
    return pack_inputs(feeds, device)


def pack_inputs(
    feeds: list[tuple[int | list[int], list[int]]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first position or every position, tokens)`` of each sequence → packed token ids
    and positions."""
    ids: list[int] = []
    positions: list[int] = []
    for start, tokens in feeds:
        ids += tokens
        positions += range(start, start + len(tokens)) if isinstance(start, int) else start
    return torch.tensor(ids, device=device), torch.tensor(positions, device=device)
