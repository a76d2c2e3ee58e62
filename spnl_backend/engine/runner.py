"""Runs one scheduled step through the model: inputs, caches, logits, sampling."""

import torch

from ..models.transformer import CausalLM
from .kv_cache import ContiguousStep, SequenceKV, StepSlice
from .sampler import sample
from .scheduler import ScheduledSeq
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        config = model.config
        self._kv_shape = (config.num_layers, config.num_kv_heads, config.head_dim)
        self.caches: dict[int, SequenceKV] = {}

    def release(self, seq: Sequence) -> None:
        self.caches.pop(seq.seq_id, None)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> dict[int, int]:
        """Computes the step; returns the sampled token of each sequence that finished
        its prompt (chunked prefills in the middle of a prompt sample nothing)."""
        input_ids, positions, slices = self._prepare(batch)
        hidden = self.model(input_ids, positions, ContiguousStep(slices))
        last_rows, sampling = [], []
        row = -1
        for item in batch:
            row += item.num_new_tokens
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.seq.num_computed_tokens == item.seq.num_tokens:
                last_rows.append(row)
                sampling.append(item.seq)
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[last_rows])
        tokens = sample(logits, [s.params for s in sampling], [s.generator for s in sampling])
        return {seq.seq_id: token for seq, token in zip(sampling, tokens, strict=True)}

    def _prepare(
        self, batch: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, list[StepSlice]]:
        ids: list[int] = []
        positions: list[int] = []
        slices = []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            kv = self.caches.get(seq.seq_id) or self._new_cache(seq)
            kv.reserve(end, used=start)
            slices.append(StepSlice(kv, start, item.num_new_tokens))
        return (
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            slices,
        )

    def _new_cache(self, seq: Sequence) -> SequenceKV:
        layers, heads, dim = self._kv_shape
        kv = SequenceKV(layers, heads, dim, self.dtype, self.device)
        self.caches[seq.seq_id] = kv
        return kv
