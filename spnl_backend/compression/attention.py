"""Attention over compressed records, in the codecs' own domain.

Rotating the query once costs ``dim^2`` per query; rotating every cached key back would
cost that per key. So the key codec scores queries against its records itself (rotated
codes, plus whatever it keeps outside the rotation), the values are summed in their
codec's domain, and only the output is rotated back. This is the torch reference of the
compressed caches; the paged pool and the per-sequence protocol cache both call it.
"""

from dataclasses import dataclass

import torch

from ..kernels.attention_ref import attend_scores
from .codecs import VectorCodec


@dataclass(frozen=True)
class CodecPair:
    """A compression method's codecs for keys and for values (they may differ)."""

    key: VectorCodec
    value: VectorCodec

    def __post_init__(self) -> None:
        if getattr(self.value, "outliers", 0):
            raise ValueError("value codecs keep no outliers: values are summed by `decode`")

    @property
    def record_bytes(self) -> int:
        """Bytes of one token's K and V for one KV head."""
        return self.key.record_bytes + self.value.record_bytes

    def fork(self) -> "CodecPair":
        return CodecPair(self.key.fork(), self.value.fork())


def first_visible(context_len: int, window: int | None) -> int:
    """The oldest key that the first query (position ``context_len``) still sees."""
    return max(context_len - window + 1, 0) if window else 0


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
    out = attend_scores(
        pair.key.scores(layer, q, keys) * scale,
        pair.value.decode(layer, values),
        context_len=context_len - first,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    rotation = pair.value.rotation
    return (out if rotation is None else out @ rotation.T).to(q.dtype)
