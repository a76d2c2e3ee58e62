"""How a layer's attention turns its query-key products into softmax weights: one value,
carried whole from the layer's description (`models.step_attention.AttentionSpec`) into
every attention kernel (the torch twins, the CPU's C structs, Triton's), so that a new
per-layer setting is a field here, not an argument added along the way."""

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Scoring:
    """``scale`` multiplies ``q.k``; ``softcap`` (Gemma 2's) bounds the scaled score to
        ``cap * tanh(s / cap)``; a query sees the last ``window`` positions, itself included
        (None: all before it); with ``chunk`` (Llama 4's chunked attention) positions fall in
    chunks of that many tokens, ``p // chunk``, and a query sees only the keys of its own
    chunk (itself included; not a sliding window: the first query of a chunk sees itself
    alone); ``sinks [heads]`` (gpt-oss's, float32) are a logit per query
        head in each softmax's denominator alone: a column whose value is zero.

        The sinks are a layer's weight, so a description made from the config has None until
        the model's weights are in (`with_sinks`)."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    chunk: int | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def plain(self) -> bool:
        """No softcap and no sinks: scaled products into a softmax (what fused attention
        computes)."""
        return self.softcap is None and self.sinks is None

    def capped(self, scores: torch.Tensor) -> torch.Tensor:
        """Scaled ``scores`` softcapped where the layer caps them."""
        if self.softcap is None:
            return scores
        return torch.tanh(scores / self.softcap) * self.softcap

    def with_sinks(self, sinks: torch.Tensor | None) -> "Scoring":
        """The same scoring with the layer's sink logits (float32, contiguous)."""
        if sinks is None:
            return self
        return dataclasses.replace(self, sinks=sinks.float().contiguous())

    def first_visible(self, position: torch.Tensor | int) -> torch.Tensor | int:
        """The first key position a query at ``position`` sees (a tensor of positions, or
        one): the window's start or the chunk's, whichever is later (0 with neither)."""
        first = position * 0
        if self.window is not None:
            first = _later(first, position - self.window + 1)
        if self.chunk is not None:
            first = _later(first, position // self.chunk * self.chunk)
        return first


def _later(a: torch.Tensor | int, b: torch.Tensor | int) -> torch.Tensor | int:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    return max(a, b)
