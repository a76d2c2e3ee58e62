"""The CompressedKVCache contract between the engine and KV-cache compression methods.

A method implements `CompressedKVCache` for the cache of one sequence (all its layers)
and registers a factory for it (`spnl_backend.compressors`); every model then runs on it
without changes. Shapes are token-major, as everywhere in the engine:

- ``k``, ``v``: ``[tokens, kv_heads, head_dim]``; ``q``: ``[tokens, heads, head_dim]``;
- ``DequantResult.k``/``.v``: ``[seq_len, kv_heads, head_dim]``, every token stored so
  far for the layer, the new ones included, in the model's domain (not rotated);
- ``DequantResult.logit_bias``: ``[heads, tokens, seq_len]`` or None, a correction of
  the raw products: scores are ``softmax_scale * (q.k + logit_bias)``, then softcap and
  causal mask (``prefill`` is not told the scale, so the bias is given unscaled);
- ``Fused.output``: ``[tokens, heads, head_dim]``, attention already computed.

Calls for different layers may come from different threads at once: implementations
lock per layer.
"""

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from ..kernels.cpu import CpuKernels
from ..kernels.scoring import Scoring


@dataclass(frozen=True)
class KVGeometry:
    """What a compressed cache is made for: the model's KV shape, dtype and device, and,
    for a method that asks for them (`Compressor.calibrated`), ``kv_means``: the model's
    mean key and value per layer and KV head over a short reference text, float32
    ``[num_layers, 2, num_kv_heads, head_dim]`` (None where nobody measured them), and
    ``kv_absmax``, the largest K and V magnitude of each layer on that text; and
    ``native``, the compiled CPU kernels the engine runs on, if any (the built-in methods
    decode through them)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    kv_means: torch.Tensor | None = field(default=None, compare=False)
    kv_absmax: torch.Tensor | None = field(default=None, compare=False)  # [layers, 2]
    native: CpuKernels | None = field(default=None, compare=False)


@dataclass(frozen=True)
class AttendConfig:
    """How a decode step attends. The seed's contract has the first two; Gemma's sliding
    layers and softcapped models need the last two, which a method that computes
    attention itself (`Fused`) must honour. The engine makes it from the layer's
    `Scoring` (`of`) and the built-in methods attend by ``scoring``; a model whose
    attention has sinks is refused a compressed cache, so none is ever lost here."""

    softmax_scale: float
    n_kv_groups: int
    sliding_window: int | None = None
    softcap: float | None = None

    @classmethod
    def of(cls, scoring: Scoring, n_kv_groups: int) -> "AttendConfig":
        if scoring.sinks is not None:
            raise ValueError("a compressed cache does not attend with sinks")
        if scoring.chunk is not None:
            raise ValueError("a compressed cache does not attend in chunks")
        return cls(scoring.scale, n_kv_groups, scoring.window, scoring.softcap)

    @property
    def scoring(self) -> Scoring:
        return Scoring(self.softmax_scale, self.sliding_window, self.softcap)


@dataclass(frozen=True)
class DequantResult:
    k: torch.Tensor
    v: torch.Tensor
    logit_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class Fused:
    """The method computed attention itself."""

    output: torch.Tensor


@dataclass(frozen=True)
class Dequantized:
    """The caller runs attention over the dequantized cache."""

    result: DequantResult


DecodeOutput = Fused | Dequantized


@runtime_checkable
class CompressedKVCache(Protocol):
    def prefill(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor
    ) -> DequantResult:
        """Store several tokens; return the layer's whole cache, dequantized."""
        ...

    def decode(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, config: AttendConfig
    ) -> DecodeOutput:
        """Store one token; compute attention for it or hand back the dequantized cache."""
        ...

    def seq_len(self, layer: int) -> int:
        """Tokens stored for ``layer``."""
        ...

    def reset(self) -> None:
        """Forget every layer's tokens."""
        ...

    def memory_usage(self) -> int:
        """Bytes held persistently (the compressed form, with its spare capacity)."""
        ...


@runtime_checkable
class ResizableKVCache(Protocol):
    """Optional: what prefix reuse and speculative rollback need from a method's cache.
    Without it, prefix caching is off for the method and a draft model is refused."""

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens of every layer."""
        ...

    def copy_prefix(self, source: "ResizableKVCache", length: int) -> None:
        """Replace this (empty) cache's contents with the first ``length`` tokens of
        ``source``, a cache of the same method."""
        ...
