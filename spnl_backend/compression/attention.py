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
from ..kernels.cpu import CpuKernels
from ..kernels.ops import native_for
from ..kernels.scoring import Scoring
from .codecs import VectorCodec
from .polar import PolarCodec


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

    def bytes_per_token(self, num_layers: int, num_kv_heads: int) -> int:
        """K and V of every layer and KV head, for one token."""
        return num_layers * num_kv_heads * self.record_bytes

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
    scoring: Scoring,
    *,
    context_len: int,
) -> torch.Tensor:
    """``q [nq, heads, dim]``, the last ``nq`` positions of a sequence whose records are
    ``[context_len + nq, kv_heads, bytes]`` → ``[nq, heads, dim]`` in ``q``'s dtype."""
    first = first_visible(context_len, scoring.window)
    keys, values = key_records[first:], value_records[first:]
    out = attend_scores(
        pair.key.scores(layer, q, keys) * scoring.scale,
        pair.value.decode(layer, values),
        scoring,
        context_len=context_len - first,
    )
    rotation = pair.value.rotation
    return (out if rotation is None else out @ rotation.T).to(q.dtype)


def decode_records(
    native: CpuKernels | None,
    pair: CodecPair,
    layer: int,
    q: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scoring: Scoring,
) -> torch.Tensor | None:
    """One query per sequence, ``q [seqs, heads, dim]``, over records ``[slots, kv_heads,
    bytes]`` (sequence ``s``'s keys at ``slots[s, :lens[s]]``), by the CPU's native kernel
    ``native``; None where it does not apply (the caller then runs `attend_records`)."""
    key, value = pair.key, pair.value
    native = native_for(native, q)
    if native is None:
        return None
    if not (isinstance(key, PolarCodec) and isinstance(value, PolarCodec)) or key.qjl:
        return None
    out = native.coded_decode(
        q @ key.rotation,
        q,
        _anchor_terms(pair, layer, q),
        key_pool,
        value_pool,
        (key.codebook, key.bits, key.outliers),
        (value.codebook, value.bits),
        slots,
        lens,
        scoring,
    )
    centre = value.centers[layer] @ value.rotation
    return (out + _per_query_head(centre, q.shape[1])) @ value.rotation.T


def _per_query_head(vectors: torch.Tensor, heads: int) -> torch.Tensor:
    """``[kv_heads, dim]`` → ``[heads, dim]``: each KV head's vector for its query heads."""
    return vectors.repeat_interleave(heads // vectors.shape[0], dim=0)


def _anchor_terms(
    pair: CodecPair, layer: int, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the native kernel needs of the codecs' centres and anchors (see
    ``spnl_coded_decode``): ``q . key centre``, ``q . key anchor``, and the value anchor
    less the value centre, rotated."""
    key, value = pair.key, pair.value

    def products(vectors: torch.Tensor) -> torch.Tensor:
        return (q * _per_query_head(vectors, q.shape[1])).sum(-1)

    value_anchor = (value.anchors[layer] - value.centers[layer]) @ value.rotation
    return products(key.centers[layer]), products(key.anchors[layer]), value_anchor
