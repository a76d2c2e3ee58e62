"""Non-paged mode: each sequence owns one growing KV store for all its layers.

The store is a plain buffer (`SequenceKV`) or a compressed cache behind the protocol
(`engine.compressed.ProtocolKV`). Finished sequences' stores are kept by a
sequence-level prefix cache (up to ``MISTRALRS_PREFIX_CACHE_N`` of them, least recently
used out first); a new request copies the K/V of the longest common prefix it shares
with one of them.
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..kernels.attention_ref import attention_ref
from ..kernels.cpu import CpuKernels
from ..kernels.paged_ref import to_cache
from ..kernels.sets import attend_contiguous, contiguous_kernels
from ..kernels.thresholds import native_attention_queries
from ..log import get_logger
from ..memory import grown
from ..models.config import ModelConfig
from ..models.step_attention import AttentionSpec, WithoutLayerBlocks
from .cache import Feed, in_order
from .sequence import CachedTokens, ScheduledSeq

log = get_logger()


class SequenceStore(Protocol):
    """One sequence's K/V for every layer, as the contiguous cache manager uses it."""

    def reserve(self, num_tokens: int, used: int) -> None: ...
    def copy_prefix(self, source: "SequenceStore", length: int) -> None: ...
    def truncate(self, length: int) -> None: ...
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        context_len: int,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        """Store this step's K/V after ``context_len`` cached tokens and attend over all."""
        ...


class SequenceKV:
    """K and V of one sequence: ``[layers, 2, capacity, kv_heads, head_dim]`` per KV group
    (the layers of one shape, in ``shapes``: each KV layer's ``(kv_heads, head_dim)``), of
    ``dtype`` (the cache's, which may be narrower than the queries').

    With the compiled CPU kernels (``native``) a float32 or float16 store attends through
    the native decode kernel, query by query, as the paged cache does: the same fast path,
    and a query's result independent of how many come with it. ``longest``: queries per step up
    to which it does (None: all, batch invariance); longer ones take `attention_ref`."""

    def __init__(
        self,
        shapes: tuple[tuple[int, int], ...],
        dtype: torch.dtype,
        device: torch.device,
        native: CpuKernels | None = None,
        longest: int | None = None,
        planes: tuple[int, ...] | None = None,
    ) -> None:
        """``planes``: each layer's tensors per token (`ModelConfig.kv_planes`: 1 for a
        latent layer, whose keys are its values too); None: K and V everywhere."""
        planes = planes or (2,) * len(shapes)
        by_shape: dict[tuple[tuple[int, int], int], list[int]] = {}
        for place, shape in enumerate(shapes):
            by_shape.setdefault((shape, planes[place]), []).append(place)
        self.groups = [
            torch.empty((len(places), count, 0, *shape), dtype=dtype, device=device)
            for (shape, count), places in by_shape.items()
        ]
        # Each KV layer's (group, index in it).
        self.where = [(0, 0)] * len(shapes)
        for group, places in enumerate(by_shape.values()):
            for index, place in enumerate(places):
                self.where[place] = (group, index)
        self.native, self.longest = contiguous_kernels(native, dtype, device), longest

    @property
    def capacity(self) -> int:
        return self.groups[0].shape[2]

    def layer(self, place: int) -> torch.Tensor:
        """KV layer ``place``'s ``[2, capacity, kv_heads, head_dim]`` (a latent layer's
        ``[1, ...]``)."""
        group, index = self.where[place]
        return self.groups[group][index]

    def reserve(self, num_tokens: int, used: int) -> None:
        """Make room for ``num_tokens``, keeping the first ``used`` tokens."""
        self.groups = [grown(group, num_tokens, used, dim=2) for group in self.groups]

    def copy_prefix(self, source: "SequenceKV", length: int) -> None:
        self.reserve(length, used=0)
        for group, held in zip(self.groups, source.groups, strict=True):
            group[:, :, :length] = held[:, :, :length]

    def truncate(self, length: int) -> None:
        """Nothing to return: K/V past the computed tokens are overwritten later."""

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        context_len: int,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        total = context_len + q.shape[0]
        layer = self.layer(spec.layer)
        if spec.latent:  # one plane of keys, the values their first dims
            layer[0, context_len:total] = to_cache(k, layer.dtype)
            keys = layer[0, :total].to(q.dtype)
            return attention_ref(
                q, keys, keys[..., : spec.latent], spec.scoring, context_len=context_len
            )
        if not spec.shared_kv:  # a shared layer's K and V were stored by their own layer
            layer[0, context_len:total] = to_cache(k, layer.dtype)
            layer[1, context_len:total] = to_cache(v, layer.dtype)
        return attend_contiguous(
            self.native,
            self.longest,
            q,
            layer[0],
            layer[1],
            spec.scoring,
            context_len=context_len,
        )


@dataclass(frozen=True)
class StepSlice:
    """One sequence's share of a step: its cache, tokens already cached, tokens now."""

    kv: SequenceStore
    context_len: int
    query_len: int


class ContiguousStep(WithoutLayerBlocks):
    """The attention backend for one forward step over contiguous caches."""

    def __init__(self, slices: list[StepSlice]) -> None:
        self.slices = slices

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        width = spec.latent or q.shape[-1]  # a latent layer's output: its values' width
        out = q.new_empty(*q.shape[:-1], width)
        start = 0
        for s in self.slices:
            end = start + s.query_len
            rows = slice(start, end)
            k_rows = None if k is None else k[rows]
            v_rows = None if v is None else v[rows]
            out[rows] = s.kv.attend(q[rows], k_rows, v_rows, s.context_len, spec)
            start = end
        return out


class SequencePrefixCache:
    """Finished sequences' caches, keyed by the tokens they hold (and the hash root of the
    LoRA adapter that computed them: never shared with another), least recently used out."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, tuple[int, list[int], SequenceStore]] = OrderedDict()

    def insert(self, seq_id: int, token_ids: list[int], kv: SequenceStore, root: int = 0) -> None:
        if self.capacity == 0 or not token_ids:
            return
        self.entries[seq_id] = (root, token_ids, kv)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def clear(self) -> int:
        """Forget every entry; how many there were."""
        count = len(self.entries)
        self.entries.clear()
        return count

    def longest_prefix(
        self, token_ids: list[int], root: int = 0
    ) -> tuple[SequenceStore | None, int]:
        """The entry of ``root`` sharing the longest prefix with ``token_ids``, and that
        length."""
        best_key, best_len = None, 0
        for key, (own_root, tokens, _) in self.entries.items():
            if own_root != root:
                continue
            length = _common_prefix(tokens, token_ids)
            if length > best_len:
                best_key, best_len = key, length
        if best_key is None:
            return None, 0
        self.entries.move_to_end(best_key)
        return self.entries[best_key][2], best_len


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] holds, a[:high] == b[:high] does not
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


def plain_stores(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    native: CpuKernels | None = None,
    batch_invariant: bool = True,
) -> Callable[[], SequenceKV]:
    """A factory of uncompressed per-sequence buffers of ``dtype`` (the cache's) for
    ``config``'s model."""
    shapes, longest = config.kv_shapes, native_attention_queries(batch_invariant)
    planes = config.kv_planes
    return lambda: SequenceKV(shapes, dtype, device, native, longest, planes)


class ContiguousCacheManager:
    """Per-sequence stores, and the sequence-level prefix cache over finished ones."""

    capacity_tokens = None  # grows with the sequences; no fixed budget

    def __init__(self, new_store: Callable[[], SequenceStore], prefix_cache_n: int) -> None:
        self.new_store = new_store
        self.caches: dict[int, SequenceStore] = {}
        self.prefix_cache = SequencePrefixCache(prefix_cache_n)

    @property
    def num_holders(self) -> int:
        """Sequences that hold cache now."""
        return len(self.caches)

    def pool_usage(self) -> None:
        """No block pool: each sequence's cache grows on its own."""

    def arriving(self, seq: CachedTokens) -> None:
        """A request was added: nothing to read ahead (no KV tier here)."""

    def admit(self, seq: CachedTokens) -> None:
        kv = self.new_store()
        self.caches[seq.seq_id] = kv
        source, length = self.prefix_cache.longest_prefix(seq.token_ids, seq.hash_root)
        length = min(length, seq.num_tokens - 1)  # the last token is always computed
        if source is not None and length > 0:
            kv.copy_prefix(source, length)
        seq.num_computed_tokens = max(length, 0)
        if not seq.output_token_ids:
            seq.num_cached_tokens = seq.num_computed_tokens
            event = "prefix_cache.hit" if length > 0 else "prefix_cache.miss"
            log.debug(event, seq_id=seq.seq_id, cached_tokens=seq.num_cached_tokens)

    def reserve(self, seq: CachedTokens, num_tokens: int) -> bool:
        self.caches[seq.seq_id].reserve(num_tokens, used=seq.num_computed_tokens)
        return True

    def release(self, seq: CachedTokens) -> None:
        kv = self.caches.pop(seq.seq_id, None)
        if kv is not None:
            tokens = seq.token_ids[: seq.num_computed_tokens]
            self.prefix_cache.insert(seq.seq_id, tokens, kv, seq.hash_root)

    def reset_prefix_cache(self) -> int:
        """Forget the finished sequences' caches (running ones keep theirs)."""
        return self.prefix_cache.clear()

    def truncate(self, seq: CachedTokens) -> None:
        kv = self.caches.get(seq.seq_id)
        if kv is not None:
            kv.truncate(seq.num_computed_tokens)

    def after_step(self, batch: list[ScheduledSeq]) -> None:
        """Nothing to register: reuse is found by comparing tokens."""

    def chunk(self, seq: CachedTokens, count: int) -> int:
        return count

    def probes(self, batch: list[ScheduledSeq]) -> list:
        return []  # no PIC prompts: nothing recomputed

    def feed(self, seq: CachedTokens, count: int) -> Feed:
        return in_order(seq, count)

    def attention(self, batch: list[ScheduledSeq], device: torch.device) -> ContiguousStep:
        return ContiguousStep(
            [
                StepSlice(
                    self.caches[item.seq.seq_id], item.seq.num_computed_tokens, item.num_new_tokens
                )
                for item in batch
            ]
        )
