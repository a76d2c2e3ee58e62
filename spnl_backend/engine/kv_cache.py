"""Contiguous KV caches: each sequence owns one growing buffer for all its layers.

This is the non-paged mode. A step's `ContiguousStep` is the `AttentionBackend`
the model calls: it writes each sequence's new K/V after its cached ones and
attends over them with the torch reference attention.
"""

from dataclasses import dataclass

import torch

from ..kernels.attention_ref import attention_ref
from ..models.layers import AttentionSpec

_GROWTH_QUANTUM = 256  # tokens; capacity grows to a multiple of this, at least doubling


class SequenceKV:
    """K and V of one sequence: ``[layers, 2, capacity, kv_heads, head_dim]``."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shape = (num_layers, 2, 0, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.data = torch.empty(self.shape, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.data.shape[2]

    def reserve(self, num_tokens: int, used: int) -> None:
        """Make room for ``num_tokens``, keeping the first ``used`` tokens."""
        if num_tokens <= self.capacity:
            return
        target = max(2 * self.capacity, -(-num_tokens // _GROWTH_QUANTUM) * _GROWTH_QUANTUM)
        layers, _, _, heads, dim = self.shape
        grown = torch.empty((layers, 2, target, heads, dim), dtype=self.dtype, device=self.device)
        grown[:, :, :used] = self.data[:, :, :used]
        self.data = grown

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(frozen=True)
class StepSlice:
    """One sequence's share of a step: its cache, tokens already cached, tokens now."""

    kv: SequenceKV
    context_len: int
    query_len: int


class ContiguousStep:
    """The attention backend for one forward step over contiguous caches."""

    def __init__(self, slices: list[StepSlice]) -> None:
        self.slices = slices

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for s in self.slices:
            end = start + s.query_len
            total = s.context_len + s.query_len
            layer = s.kv.data[spec.layer]
            layer[0, s.context_len : total] = k[start:end]
            layer[1, s.context_len : total] = v[start:end]
            out[start:end] = attention_ref(
                q[start:end],
                layer[0, :total],
                layer[1, :total],
                scale=spec.scale,
                context_len=s.context_len,
                sliding_window=spec.sliding_window,
                softcap=spec.softcap,
            )
            start = end
        return out
