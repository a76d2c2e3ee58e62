"""Attention over compressed records, in the codecs' own domain.

Rotating the query once costs ``dim^2`` per query; rotating every cached key back would
cost that per key. So scores are taken against the rotated keys, the values are summed
rotated, and only the output is rotated back. This is the torch reference of the
compressed caches; the paged pool and the per-sequence protocol cache both call it.
"""

from dataclasses import dataclass

import torch

from ..kernels.attention_ref import attention_ref
from .codecs import VectorCodec


@dataclass(frozen=True)
class CodecPair:
    """A compression method's codecs for keys and for values (they may differ)."""

    key: VectorCodec
    value: VectorCodec

    @property
    def record_bytes(self) -> int:
        """Bytes of one token's K and V for one KV head."""
        return self.key.record_bytes + self.value.record_bytes

    def fork(self) -> "CodecPair":
        return CodecPair(self.key.fork(), self.value.fork())


def to_domain(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    return x.float() if rotation is None else x.float() @ rotation


def from_domain(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    return x if rotation is None else x @ rotation.T


def first_visible(context_len: int, window: int | None) -> int:
    """The oldest key that the first query (position ``context_len``) still sees."""
    return max(context_len - window + 1, 0) if window else 0


def logit_bias(
    pair: CodecPair, q: torch.Tensor, key_records: torch.Tensor, scale: float
) -> torch.Tensor | None:
    """The key codec's score correction for queries ``q`` (model domain), if it has one."""
    if not getattr(pair.key, "has_logit_bias", False):
        return None
    return pair.key.logit_bias(to_domain(q, pair.key.rotation), key_records, scale)


def dequantize(
    pair: CodecPair, layer: int, key_records: torch.Tensor, value_records: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Records → float32 K and V in the model's domain."""
    k = from_domain(pair.key.decode(layer, key_records), pair.key.rotation)
    v = from_domain(pair.value.decode(layer, value_records), pair.value.rotation)
    return k, v


def attend_records(
    pair: CodecPair,
    layer: int,
    q: torch.Tensor,
    key_records: torch.Tensor,
    value_records: torch.Tensor,
    *,
    scale: float,
    context_len: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``q [nq, heads, dim]``, the last ``nq`` positions of a sequence whose records are
    ``[context_len + nq, kv_heads, bytes]`` → ``[nq, heads, dim]`` in ``q``'s dtype."""
    first = first_visible(context_len, sliding_window)
    keys, values = key_records[first:], value_records[first:]
    out = attention_ref(
        to_domain(q, pair.key.rotation),
        pair.key.decode(layer, keys),
        pair.value.decode(layer, values),
        scale=scale,
        context_len=context_len - first,
        sliding_window=sliding_window,
        softcap=softcap,
        logit_bias=logit_bias(pair, q, keys, scale),
    )
    return from_domain(out, pair.value.rotation).to(q.dtype)
