"""Paged mode: the block-pool KV cache, its per-sequence block tables, and the step backend.

The cache is one tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` per KV
group: the layers of one shape (on one device, under layer mapping), a single group where
every layer has one shape (Gemma 4's sliding and global layers differ); each layer's K
and V are ``[num_blocks, block_size, kv_heads, head_dim]`` views of its group's. A latent
group (DeepSeek's multi-head latent attention) holds one plane, ``[layers, 1, num_blocks,
block_size, 1, latent_width]``: each token's normed latent and its rotated key, read by
every head (the values are the latent part of those keys).
New tokens are written through a slot mapping and attention reads every key through
the block tables, via the kernels the platform picked. The sliding-window layers may
keep their own, smaller group (`engine.window_pool`): a step's tables and slot mapping
for them are the sequences' own, each block mapped to its slot there.
"""

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from ..errors import EngineError
from ..kernels import AttentionKernels
from ..kernels.metadata import PagedMetadata
from ..kernels.paged_ref import (
    copy_block_rotated,
    fp8_scale,
    paged_latent_attention_ref,
    store_latent_ref,
)
from ..kernels.pic import PicKeys
from ..kernels.sets import NativeKeys, native_keys, windowed_native_keys
from ..log import get_logger
from ..memory import host_tensor, kv_bytes_per_token
from ..models.config import ModelConfig
from ..models.step_attention import AttentionSpec, StepAttention
from ..pic.layout import CROSS, PicLayout
from .block_manager import UNTAKEN, BlockManager, BlockTable
from .cache import Feed, PoolUsage, in_order
from .kv_shift import Angles, KeyShift
from .pic_blocks import Entry, PicProgress, PlannedBlock
from .pic_probe import RecomputeProbe
from .sequence import CachedTokens, ScheduledSeq
from .window_pool import WindowSlots

if TYPE_CHECKING:
    from .pool_tier import PoolTier

log = get_logger()


class PagedKVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        cache_dtype: torch.dtype,
        device: torch.device,
        kv_absmax: torch.Tensor | None = None,
        layer_spans: list[tuple[torch.device, int]] | None = None,
        window_blocks: int | None = None,
    ) -> None:
        """``kv_absmax [layers, 2]``: each layer's largest K and V magnitude on the reference
        text, from which an FP8 pool's scales are set (needed for float8).
        ``layer_spans``: layer mapping's devices, each with its consecutive layers (a pool
        tensor each), else all layers on ``device``. ``window_blocks``: the sliding-window
        layers' own pool, of that many blocks (`engine.window_pool`); None: every layer
        holds ``num_blocks``."""
        spans = layer_spans or [(device, config.num_kv_layers)]
        self.parts: list[torch.Tensor] = []
        slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        planes = config.kv_planes
        windowed = kv_windows(config) if window_blocks is not None else None
        self.windowed = [w is not None for w in windowed] if windowed else None
        for at, places in _kv_groups(config.kv_shapes, planes, spans, self.windowed):
            heads, dim = config.kv_shapes[places[0]]
            count = planes[places[0]]  # a latent layer's keys are its values too: one plane
            blocks = window_blocks if self.windowed and self.windowed[places[0]] else num_blocks
            shape = (len(places), count, blocks, block_size, heads, dim)
            part = _pool_tensor(shape, cache_dtype, at)
            self.parts.append(part)
            slots.update(
                (place, (part[i, 0], part[i, count - 1])) for i, place in enumerate(places)
            )
        self.layers = [slots[place] for place in range(config.num_kv_layers)]
        self.data = self.parts[0] if len(self.parts) == 1 else None  # the whole pool
        self.bytes_per_token = kv_bytes_per_token(config, cache_dtype)
        self.nbytes = sum(part.numel() * part.element_size() for part in self.parts)
        # Each block's slot in the windowed pool, -1 for none (`window_pool.WindowSlots`).
        self.window_slot_of: list[int] | None = None
        self.is_fp8 = cache_dtype == torch.float8_e4m3fn
        self.k_scale = [1.0] * config.num_kv_layers
        self.v_scale = [1.0] * config.num_kv_layers
        if self.is_fp8:
            if kv_absmax is None:
                raise ValueError("an FP8 pool needs the model's K/V magnitudes (kv_absmax)")
            self.k_scale = [fp8_scale(m) for m in kv_absmax[:, 0]]
            self.v_scale = [fp8_scale(m) for m in kv_absmax[:, 1]]
            log.debug("kv_cache.fp8_scales", k_scale=self.k_scale, v_scale=self.v_scale)

    def step(
        self,
        kernels: AttentionKernels,
        meta: PagedMetadata,
        window_meta: PagedMetadata | None = None,
    ) -> "PagedStep":
        """The step's backend; ``window_meta``: the step in the windowed pool's blocks
        (for the layers with a window, where the pool has a windowed group)."""
        return PagedStep(self, kernels, meta, window_meta)

    def tier_layout(self) -> dict[str, object]:
        """What a block's bytes are (`block_bytes`), for the KV tier's fingerprint."""
        shapes = [(list(part[:, :, 0].shape), str(part.dtype)) for part in self.parts]
        return {"tensors": shapes, "k_scale": self.k_scale, "v_scale": self.v_scale}

    def block_bytes(self, block_id: int) -> torch.Tensor:
        """A copy of block ``block_id``'s K and V, every layer's, as uint8 on the host."""
        parts = [part[:, :, block_id].reshape(-1).view(torch.uint8) for part in self.parts]
        return torch.cat([p.cpu() for p in parts]) if len(parts) > 1 else parts[0].cpu().clone()

    def load_block(self, block_id: int, data: torch.Tensor) -> None:
        """Block ``block_id`` set from `block_bytes`'s bytes."""
        at = 0
        for part in self.parts:
            target = part[:, :, block_id]
            size = target.numel() * target.element_size()
            source = data[at : at + size].view(target.dtype).reshape(target.shape)
            target.copy_(source.to(target.device))
            at += size

    def move_blocks(self, sources: list[int], targets: list[int], angles: Angles) -> None:
        """Blocks ``targets`` of every layer set to blocks ``sources``, their keys turned by
        each layer's ``angles`` (`engine.kv_shift`)."""
        slot_of = self.window_slot_of
        for layer, (keys, values) in enumerate(self.layers):
            cos, sin = angles[layer]
            pair = (sources, targets)
            if self.windowed is not None and self.windowed[layer]:
                assert slot_of is not None
                pair = ([slot_of[b] for b in sources], [slot_of[b] for b in targets])
                if min(*pair[0], *pair[1]) < 0:
                    raise EngineError("keys moved from or to a block without a windowed slot")
            src, dst = (torch.tensor(ids, device=keys.device) for ids in pair)
            copy_block_rotated(keys, values, src, dst, cos, sin, self.k_scale[layer])


def kv_windows(config: ModelConfig) -> list[int | None]:
    """Each KV pool layer's sliding window (None: it attends to the whole context)."""
    windows: dict[int, int | None] = {}
    for spec in config.layers:
        if spec.kv_store is not None and spec.attention is not None:
            windows[spec.kv_store] = spec.attention.spec.scoring.window
    return [windows.get(place) for place in range(config.num_kv_layers)]


def _kv_groups(
    shapes: tuple[tuple[int, int], ...],
    planes: tuple[int, ...],
    spans: list[tuple[torch.device, int]],
    windowed: list[bool] | None = None,
) -> list[tuple[torch.device, list[int]]]:
    """The pool's tensors: for each device's consecutive KV layers, its layers of each
    shape and kind (K and V, or a latent; windowed or not, with a windowed pool), in the
    order they first appear."""
    groups: list[tuple[torch.device, list[int]]] = []
    start = 0
    for device, count in spans:
        by_shape: dict[tuple[tuple[int, int], int, bool], list[int]] = {}
        for place in range(start, start + count):
            key = (shapes[place], planes[place], bool(windowed and windowed[place]))
            by_shape.setdefault(key, []).append(place)
        groups += [(device, places) for places in by_shape.values()]
        start += count
    return groups


def _pool_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host_tensor(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class PagedStep:
    """The attention backend of one step: store through the slot mapping, attend paged."""

    def __init__(
        self,
        cache: PagedKVCache,
        kernels: AttentionKernels,
        meta: PagedMetadata,
        window_meta: PagedMetadata | None = None,
    ) -> None:
        if (window_meta is None) != (cache.windowed is None):
            raise EngineError("a step over a windowed pool needs its windowed blocks, and only it")
        self.cache, self.kernels, self.meta = cache, kernels, meta
        self.window_meta = window_meta
        # the step's metadata on each device it reaches, the windowed pool's apart
        self._metas = {(meta.device, False): meta}
        if window_meta is not None:
            self._metas[(window_meta.device, True)] = window_meta

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        layer, cache = spec.layer, self.cache
        key_cache, value_cache = cache.layers[layer]
        windowed = cache.windowed is not None and cache.windowed[layer]
        if spec.latent:  # one plane of keys, the values their first dims
            assert k is not None
            meta = self._meta_on(key_cache.device, windowed)
            store_latent_ref(k, key_cache, meta)
            return paged_latent_attention_ref(q, key_cache, meta, spec.scoring, spec.latent)
        k_scale, v_scale = cache.k_scale[layer], cache.v_scale[layer]
        meta = self._meta_on(key_cache.device, windowed)
        if not spec.shared_kv:  # a shared layer's K and V were stored by their own layer
            self.kernels.store_kv(k, v, key_cache, value_cache, meta, k_scale, v_scale)
        return self.kernels.paged_attention(
            q,
            key_cache,
            value_cache,
            meta,
            spec.scoring,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def _meta_on(self, device: torch.device, windowed: bool = False) -> PagedMetadata:
        """The step's metadata on ``device`` (a layer-mapping device other than the
        first), moved once per step; ``windowed``: in the windowed pool's blocks."""
        if (device, windowed) not in self._metas:
            source = self.window_meta if windowed else self.meta
            assert source is not None
            self._metas[(device, windowed)] = source.to(device)
        return self._metas[(device, windowed)]

    def native_keys(
        self, windows: tuple[int, ...]
    ) -> tuple[NativeKeys, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """The step's keys and each layer's (key, value) pool for the native layer blocks,
        where the CPU set runs this step's store and attention natively (else None);
        ``windows``: the model's sliding windows."""
        cache = self.cache
        if cache.is_fp8:
            return None
        if cache.windowed is None:
            keys = native_keys(self.kernels, self.meta, cache.layers[0][0], windows)
            return None if keys is None else (keys, cache.layers)
        # One layer of each pool: the keys are slots and lengths, the same for every shape
        # in it (Gemma 4's groups; its layers run per op anyway: `models.native_blocks`).
        window_layer = cache.windowed.index(True)
        full_layer = cache.windowed.index(False)
        assert self.window_meta is not None
        assert len(set(windows)) == 1
        keys = windowed_native_keys(
            self.kernels,
            self.meta,
            cache.layers[full_layer][0],
            self.window_meta,
            cache.layers[window_layer][0],
            windows[0],
        )
        return None if keys is None else (keys, cache.layers)


class PagedKVStorage(Protocol):
    """The pool's tensors (plain `PagedKVCache` or a compressed one), its step backend,
    and a block's bytes read and written whole (the KV tier's)."""

    bytes_per_token: int

    def step(self, kernels: AttentionKernels, meta: PagedMetadata) -> StepAttention: ...

    def block_bytes(self, block_id: int) -> torch.Tensor: ...

    def tier_layout(self) -> dict[str, object]: ...

    def load_block(self, block_id: int, data: torch.Tensor) -> None: ...


class PagedCacheManager:
    """Block tables of the running sequences over one block pool."""

    def __init__(
        self,
        cache: PagedKVStorage,
        blocks: BlockManager,
        kernels: AttentionKernels,
        shift: KeyShift | None = None,
        window: WindowSlots | None = None,
    ) -> None:
        """``shift``: moves a block's keys to other positions, where the pool can (a PIC
        hit under spnl's reuse rule computed elsewhere is a miss without it). ``window``:
        the slots of the sliding-window layers' own pool, where the pool has one (no PIC
        prompts then: `Engine.pic_refusal`)."""
        self.cache, self.blocks, self.kernels = cache, blocks, kernels
        self.block_size = blocks.block_size
        self.shift = shift
        self.window = window
        if window is not None:
            blocks.on_take = window.forget
            window.registered = lambda block_id: blocks.blocks[block_id].hash is not None
            if isinstance(cache, PagedKVCache):
                cache.window_slot_of = window.slot_of  # where moved keys lie (`move_blocks`)
        self.tier: PoolTier | None = None  # the KV tier under the pool, where it is on
        self.tables: dict[int, BlockTable] = {}
        self.pic: dict[int, PicProgress] = {}  # the PIC sequences holding cache

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.block_size

    @property
    def num_holders(self) -> int:
        """Sequences that hold cache now."""
        return len(self.tables)

    def pool_usage(self) -> PoolUsage:
        blocks = self.blocks
        cached = len(blocks.cached_ids)
        usage = PoolUsage(blocks.num_blocks, blocks.num_blocks - blocks.num_available, cached)
        window = self.window
        if window is None:
            return usage
        held = window.num_slots - window.available
        cached = len(window.kept)
        return dataclasses.replace(
            usage, window_blocks=window.num_slots, window_in_use=held, window_cached=cached
        )

    def arriving(self, seq: CachedTokens) -> None:
        """A request was added: the KV tier starts reading the blocks it may reuse that the
        pool lacks, while other sequences step (`PoolTier.read_ahead`)."""
        if self.tier is None or not self.blocks.enable_prefix_caching:
            return
        layout = seq.pic
        if layout is None:
            self.tier.read_ahead(self.blocks.prefix_keys(seq.token_ids, seq.hash_root))
            return
        planned = PicProgress(layout, self.block_size, seq.hash_root).plan(seq.token_ids)
        closed = [(block.digest, block.tokens) for block in planned if block.closed]
        self.tier.read_ahead(closed)

    def admit(self, seq: CachedTokens) -> None:
        """Give a waiting sequence its block table, starting with the cached blocks of its
        longest cached prefix; at least its last token is always computed."""
        layout = seq.pic
        if layout is not None:
            self._admit_pic(seq, layout)
            return
        keys = self.blocks.prefix_keys(seq.token_ids, seq.hash_root)
        promoted = self._promote(keys, prefix=True)
        hits, hashes = self._shareable(seq)
        if len(hits) * self.block_size >= seq.num_tokens:
            hits = hits[:-1]  # recompute the last block rather than write into a shared one
        hits = self._within_windows(seq, hits)
        for block_id in hits:
            self.blocks.share(block_id)
        self.tables[seq.seq_id] = BlockTable(list(hits), hashes[: len(hits)])
        seq.num_computed_tokens = len(hits) * self.block_size
        if self.window is not None:
            self.window.start(seq.seq_id, list(hits), seq.num_computed_tokens)
        if not seq.output_token_ids:  # a new request, not a preempted one coming back
            seq.num_cached_tokens = seq.num_computed_tokens
            from_tier = sum(block_id in promoted for block_id in hits) * self.block_size
            seq.num_tier_hit_tokens = from_tier
            _log_prefix_lookup(seq, len(hits), self.blocks.blocks_for(seq.num_tokens))

    def _within_windows(self, seq: CachedTokens, hits: list[int]) -> list[int]:
        """The longest start of a prefix hit whose last window of blocks the windowed pool
        still holds (the sliding layers' K and V before it are gone; what follows it is
        computed again); the whole hit without a windowed pool."""
        window = self.window
        if window is None:
            return hits
        kept = len(hits)
        while kept and not window.has_window(hits, kept * self.block_size):
            kept -= 1
        if kept < len(hits):
            log.debug("prefix_cache.window_cut", seq_id=seq.seq_id, blocks=len(hits), kept=kept)
        return hits[:kept]

    def _shareable(self, seq: CachedTokens) -> tuple[list[int], list[int]]:
        """The blocks ``seq`` may start with, and the hashes known of them: its longest
        cached prefix, or its leader's full prompt blocks (another completion of the same
        prompt, shared by reference even with prefix caching off), whichever is longer."""
        hits = self.blocks.match_prefix(seq.token_ids, seq.hash_root)
        hashes = [self.blocks.blocks[b].hash for b in hits]
        leader = getattr(seq, "leader", None)
        table = None if leader is None else self.tables.get(leader.seq_id)
        if table is not None and leader.prompt_token_ids == seq.prompt_token_ids:
            computed = min(leader.num_computed_tokens, len(leader.prompt_token_ids))
            full = computed // self.block_size
            if full > len(hits):
                return table.block_ids[:full], table.hashes[:full]
        return hits, hashes  # type: ignore[return-value]

    def _admit_pic(self, seq: CachedTokens, layout: PicLayout) -> None:
        """A PIC sequence's table: every block whose key the pool has, wherever it lies,
        mapped in (the block holding the last token excepted); the rest untaken."""
        progress = PicProgress(layout, self.block_size, seq.hash_root)
        tokens = seq.token_ids
        planned = progress.plan(tokens)
        hits: dict[int, PlannedBlock] = {}
        found: dict[int, int] = {}
        moved = from_tier = 0
        if self.blocks.enable_prefix_caching:
            closed = [(block.digest, block.tokens) for block in planned if block.closed]
            promoted = self._promote(closed, prefix=False)
            for block in planned:
                block_id = self.blocks.lookup(block.digest, block.tokens) if block.closed else None
                if block_id is not None and not self._has_window_slot(block_id):
                    block_id = None  # its sliding layers' K and V are gone
                if block_id is not None and block.last != len(tokens) - 1:
                    hits[block.index], found[block.index] = block, block_id
                    self.blocks.share(block_id)
                    if self.window is not None:
                        self.window.pin(seq.seq_id, block_id)
                    from_tier += (block.last + 1 - block.first) * (block_id in promoted)
            moved = self._move_shifted(seq, hits, found)
        width = max(hits, default=-1) + 1
        table = BlockTable([found.get(index, UNTAKEN) for index in range(width)])
        progress.admit(hits, len(tokens))
        self.tables[seq.seq_id], self.pic[seq.seq_id] = table, progress
        seq.num_computed_tokens = progress.start
        if not seq.output_token_ids:  # a new request, not a preempted one coming back
            seq.num_cached_tokens = progress.num_hit
            plus_hit = sum(b.last + 1 - b.first for b in hits.values() if b.plus)
            seq.num_pic_hit_tokens = plus_hit
            seq.num_pic_miss_tokens = layout.num_plus_tokens - plus_hit
            seq.num_pic_recomputed_tokens = progress.num_recomputed
            seq.num_tier_hit_tokens = from_tier
            _log_pic_lookup(seq, planned, hits, moved)

    def _promote(self, wanted: list[tuple[int, tuple[int, ...]]], prefix: bool) -> set[int]:
        """Blocks of ``wanted`` the KV tier has read into the pool (`PoolTier.promote`)."""
        if self.tier is None or not self.blocks.enable_prefix_caching:
            return set()
        return self.tier.promote(wanted, prefix)

    def _has_window_slot(self, block_id: int) -> bool:
        """Whether the block's sliding layers' K and V are in the windowed pool (always,
        without one)."""
        return self.window is None or self.window.slot_of[block_id] >= 0

    def _unshare(self, seq: CachedTokens, block_id: int) -> None:
        """Drop a PIC sequence's reference to a hit (and its pin of the block's slot)."""
        if self.window is not None:
            self.window.unpin(seq.seq_id, [block_id])
        self.blocks.unshare(block_id)

    def _move_shifted(
        self, seq: CachedTokens, hits: dict[int, PlannedBlock], found: dict[int, int]
    ) -> int:
        """Hits whose keys the pool holds for other positions (spnl's reuse rule keys an
        element by its tokens alone), copied into blocks of the sequence's own with their
        keys moved to where they now stand; dropped (computed) where that cannot be. The
        tokens moved."""
        moves: dict[int, list[tuple[int, int]]] = {}  # by distance: (source, target)
        moved = 0
        for index, block in list(hits.items()):
            source = found[index]
            stored = self.blocks.blocks[source].position
            if stored is None or stored == block.position:
                continue
            length = block.last + 1 - block.first
            if (
                self.shift is None
                or not self.shift.possible(stored, block.position, length)
                or not self.blocks.num_available
                or (self.window is not None and not self.window.available)
            ):
                del hits[index], found[index]
                self._unshare(seq, source)
            else:
                found[index] = self.blocks.take()
                if self.window is not None:
                    self.window.pin(seq.seq_id, found[index])
                moves.setdefault(block.position - stored, []).append((source, found[index]))
                moved += length
        for delta, pairs in moves.items():
            sources, targets = zip(*pairs, strict=True)
            self.shift.move(list(sources), list(targets), delta)  # type: ignore[union-attr]
            for source in sources:
                self._unshare(seq, source)
        return moved

    def reserve(self, seq: CachedTokens, num_tokens: int) -> bool:
        """Make sure the first ``num_tokens`` tokens of ``seq`` have slots."""
        progress = self.pic.get(seq.seq_id)
        if progress is not None:
            return self._reserve_pic(seq, progress, num_tokens)
        table = self.tables[seq.seq_id]
        total = self.blocks.blocks_for(num_tokens)
        needed = total - len(table.block_ids)
        window = self.window
        if window is not None:
            window.advance(seq.seq_id, table.block_ids, seq.num_computed_tokens)
            if window.missing(seq.seq_id, table.block_ids, total) > window.available:
                return False
        if needed > self.blocks.num_available:
            return False
        table.block_ids.extend(self.blocks.take() for _ in range(max(needed, 0)))
        if window is not None:
            window.extend(seq.seq_id, table.block_ids, total)
        return True

    def _reserve_pic(self, seq: CachedTokens, progress: PicProgress, num_tokens: int) -> bool:
        """Take blocks for the untaken entries up to the one holding the last token of the
        first ``num_tokens`` (hits first, then the computed ones in order)."""
        rank = num_tokens - progress.start - 1
        if rank < 0:
            return True
        last = progress.entry_slot(progress.entries(rank, 1)[0]) // self.block_size
        ids = self.tables[seq.seq_id].block_ids
        missing = [i for i in range(last + 1) if i >= len(ids) or ids[i] == UNTAKEN]
        if len(missing) > self.blocks.num_available:
            return False
        if self.window is not None and len(missing) > self.window.available:
            return False
        ids.extend([UNTAKEN] * (last + 1 - len(ids)))
        for index in missing:
            ids[index] = self.blocks.take()
            if self.window is not None:
                self.window.pin(seq.seq_id, ids[index])
        return True

    def release(self, seq: CachedTokens) -> None:
        self.pic.pop(seq.seq_id, None)
        table = self.tables.pop(seq.seq_id, None)
        if table is not None:
            if self.window is not None:
                self.window.finish(seq.seq_id, table.block_ids)
            self.blocks.release(table)

    def block_hashes(self, seq: CachedTokens) -> Sequence[int]:
        """The hashes of ``seq``'s full blocks known so far (its prefix, block by block):
        its table's own list, read each step, so not copied (not to be changed)."""
        table = self.tables.get(seq.seq_id)
        return () if table is None else table.hashes

    def limit_hit(self, seq: CachedTokens, num_blocks: int) -> None:
        """Keep only the first ``num_blocks`` of an admitted sequence's prefix hit (what
        else must be computed again: a hybrid model's state is known at fewer points)."""
        table = self.tables[seq.seq_id]
        if self.window is not None:
            raise EngineError("a windowed pool cuts no prefix hit short (no state layers)")
        self.blocks.truncate(table, num_blocks)
        seq.num_computed_tokens = num_blocks * self.block_size
        if not seq.output_token_ids:
            seq.num_cached_tokens = seq.num_computed_tokens

    def reset_prefix_cache(self) -> int:
        """Forget every cached block, prefix and PIC alike, without touching the running
        sequences: blocks they hold stay theirs until they let go. Blocks forgotten."""
        forgotten = self.blocks.reset_cache()
        if self.window is not None:
            self.window.reset()
        return forgotten

    def truncate(self, seq: CachedTokens) -> None:
        """Return the blocks past the sequence's computed tokens (rejected draft slots)."""
        table = self.tables.get(seq.seq_id)
        if table is None:
            return
        progress = self.pic.get(seq.seq_id)
        if progress is None:
            kept = self.blocks.blocks_for(seq.num_computed_tokens)
            if self.window is not None:
                self.window.shrink(seq.seq_id, table.block_ids, kept)
            self.blocks.truncate(table, kept)
            return
        # A decoding PIC sequence's prompt is all computed; its generated tokens (drafts
        # too) fill the last segment in order, after every other block of its table.
        if seq.num_computed_tokens < progress.admitted_len:
            raise EngineError("a PIC sequence is truncated only after its prompt")
        last = progress.slot(seq.num_computed_tokens - 1) // self.block_size
        if self.window is not None:
            dropped = [b for b in table.block_ids[last + 1 :] if b != UNTAKEN]
            self.window.unpin(seq.seq_id, dropped)
        self.blocks.truncate(table, last + 1)

    def after_step(self, batch: list[ScheduledSeq]) -> None:
        for item in batch:
            table = self.tables.get(item.seq.seq_id)
            progress = self.pic.get(item.seq.seq_id)
            registered: list[int] = []
            if progress is not None and table is not None:
                registered = self._register_pic(item.seq, table, progress)
            elif table is not None:
                registered = self.blocks.register_full_blocks(
                    table, item.seq.token_ids, item.seq.num_computed_tokens, item.seq.hash_root
                )
            if registered and self.tier is not None:
                self.tier.offer(registered)

    def _register_pic(
        self, seq: CachedTokens, table: BlockTable, progress: PicProgress
    ) -> list[int]:
        """Offer the blocks of a PIC sequence that are closed and computed to others; the
        ids of those newly registered."""
        if not self.blocks.enable_prefix_caching:
            return []
        registered = []
        for block in progress.ready(seq.token_ids, seq.num_computed_tokens):
            block_id = table.block_ids[block.index]
            if self.blocks.register(
                block_id, block.digest, block.tokens, block.position, block.parent
            ):
                registered.append(block_id)
        return registered

    def chunk(self, seq: CachedTokens, count: int) -> int:
        """How many of ``count`` next tokens one step may compute: all, but for a PIC
        sequence whose recomputed tokens fall due among them (`PicProgress.chunk`)."""
        progress = self.pic.get(seq.seq_id)
        if progress is None:
            return count if self.window is None else self._window_chunk(seq, count)
        return progress.chunk(seq.num_computed_tokens - progress.start, count)

    def _window_chunk(self, seq: CachedTokens, count: int) -> int:
        """At most the tokens whose blocks the windowed pool has room for beside the
        sequence's window (at least one of those offered: where none fits, `reserve` says
        so and the scheduler preempts; none where none is offered)."""
        window, size = self.window, self.block_size
        assert window is not None
        table = self.tables.get(seq.seq_id)
        if table is None or not count:
            return count
        start = seq.num_computed_tokens
        end = window.room(seq.seq_id, table.block_ids, start)
        return max(1, min(count, end * size - start))

    def probes(self, batch: list[ScheduledSeq]) -> list[RecomputeProbe]:
        """The groups whose recomputation begins in this step with its tokens still to be
        picked (`engine.pic_probe`), each with what its probe reads."""
        found = []
        for item in batch:
            progress = self.pic.get(item.seq.seq_id)
            if progress is None or not progress.unchosen:
                continue
            for end in progress.probes_due(item.seq.num_computed_tokens - progress.start):
                found.append(self._probe(item.seq, progress, end))
        return found

    def _probe(self, seq: CachedTokens, progress: PicProgress, end: int) -> RecomputeProbe:
        """The group ending at ``end``: its tokens attend as cross over the keys before
        its end as read just before its recomputation begins."""
        if not isinstance(self.cache, PagedKVCache) or self.window is not None:
            raise EngineError("a recomputation probe reads a plain paged pool, not windowed")
        layout = progress.layout
        group = range(layout.group_start(end), end)
        table = self.tables[seq.seq_id].block_ids
        rank = progress.recompute_from[end]
        keys = self._pic_keys(progress, table, [Entry(i, True) for i in group], rank - 1)
        tokens = seq.token_ids
        return RecomputeProbe(
            seq.seq_id,
            torch.tensor([tokens[i] for i in group]),
            torch.tensor([layout.position(i) for i in group]),
            keys,
            lambda part, device: self._probe_step(table, part, device),
            self.cache,
            len(progress.recomputed[end]),
            lambda indices: progress.choose(end, indices),
        )

    def _probe_step(self, table: list[int], keys: PicKeys, device: torch.device) -> StepAttention:
        """A step of one sequence's queries under ``keys`` that writes nothing (every slot
        -1): its attention reads the pool as it is."""
        count = keys.q_index.numel()
        meta = PagedMetadata(
            torch.tensor([[max(b, 0) for b in table]], device=device),
            [len(table) * self.block_size],
            [count],
            self.block_size,
            torch.full((count,), -1, device=device),
            pic=[keys.to(device)],
        )
        return self.cache.step(self.kernels, meta)

    def feed(self, seq: CachedTokens, count: int) -> Feed:
        """A sequence's next ``count`` tokens to compute: in token order, or a PIC
        sequence's in the order its progress keeps (hits skipped, recomputed tokens
        added), at their positions."""
        progress = self.pic.get(seq.seq_id)
        if progress is None:
            return in_order(seq, count)
        entries = progress.entries(seq.num_computed_tokens - progress.start, count)
        indices = [entry.index for entry in entries]
        tokens = seq.token_ids
        return [progress.layout.position(i) for i in indices], [tokens[i] for i in indices]

    def attention(self, batch: list[ScheduledSeq], device: torch.device) -> StepAttention:
        slots: list[int] = []
        tables, seq_lens, query_lens = [], [], []
        pic: list[PicKeys | None] = []
        for item in batch:
            table = self.tables[item.seq.seq_id].block_ids
            start = item.seq.num_computed_tokens
            progress = self.pic.get(item.seq.seq_id)
            if progress is None:
                logical = range(start, start + item.num_new_tokens)
                seq_lens.append(start + item.num_new_tokens)
                pic.append(None)
                size = self.block_size
                slots += [table[p // size] * size + p % size for p in logical]
            else:
                rank = item.seq.num_computed_tokens - progress.start
                entries = progress.entries(rank, item.num_new_tokens)
                keys = self._pic_keys(progress, table, entries, rank)
                slots += keys.key_slots[keys.q_index].tolist()
                seq_lens.append(len(table) * self.block_size)
                pic.append(keys.to(device))
            tables.append(table)
            query_lens.append(item.num_new_tokens)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor(
            [[max(b, 0) for b in t] + [0] * (width - len(t)) for t in tables], device=device
        )
        meta = PagedMetadata(
            block_tables,
            seq_lens,
            query_lens,
            self.block_size,
            torch.tensor(slots, device=device),
            pic=pic if any(p is not None for p in pic) else None,
        )
        if self.window is None:
            return self.cache.step(self.kernels, meta)
        window_meta = self._window_meta(meta, tables, device)
        return self.cache.step(self.kernels, meta, window_meta)  # type: ignore[call-arg]

    def _window_meta(
        self, meta: PagedMetadata, tables: list[list[int]], device: torch.device
    ) -> PagedMetadata:
        """The step in the windowed pool: every block through its windowed slot. A block
        without one lies before every window of the step's queries, never read (its entry
        points at slot 0, whose keys the window masks)."""
        # Mapped on the host, through the slots' own tensor (a copy of every block's slot
        # would cost each step the pool's size, not the step's).
        slot_of = self.window.slot_table  # type: ignore[union-attr]
        none = len(slot_of) - 1  # its last entry: -1, for padding and untaken entries
        width = meta.block_tables.shape[1]
        padded = torch.tensor([t + [none] * (width - len(t)) for t in tables])
        mapped = _through(slot_of, torch.where(padded < 0, none, padded))
        size = self.block_size
        assert meta.slot_mapping is not None
        logical = meta.slot_mapping.cpu()
        written = logical >= 0  # -1: a token not written
        slots = torch.where(written, _through(slot_of, logical.clamp(min=0) // size) * size, -1)
        slots = torch.where(written, slots + logical % size, -1)
        if bool((written & (slots < 0)).any()):
            raise EngineError("a token is stored in a block without a windowed slot")
        pic = None
        if meta.pic is not None:
            pic = [None if keys is None else _mapped_keys(keys, slot_of, size) for keys in meta.pic]
        tables_on = mapped.clamp(min=0).to(device)
        return PagedMetadata(
            tables_on, meta.seq_lens, meta.query_lens, size, slots.to(device), pic=pic
        )

    def _pic_keys(
        self, progress: PicProgress, table: list[int], entries: list[Entry], rank: int
    ) -> PicKeys:
        """The keys a PIC sequence's queries (``entries``, from todo ``rank``) may see, in
        prompt order, with their pool slots (on the CPU); a recomputed token attends as
        cross."""
        indices = torch.tensor([entry.index for entry in entries])
        count = int(indices.max()) + 1
        logical = progress.key_slots(count, rank)
        blocks = torch.tensor(table)[logical // self.block_size]
        key_blocks, key_positions = progress.layout.key_tensors(count)
        slots = blocks * self.block_size + logical % self.block_size
        if int(slots.min()) < 0:  # an untaken block: reserve missed one (never expected)
            raise EngineError("a PIC sequence's keys reach a block it has not taken")
        first_plus = progress.layout.first_plus
        q_blocks = None
        if any(entry.recomputed for entry in entries):
            redone = torch.tensor([entry.recomputed for entry in entries])
            q_blocks = torch.where(redone, CROSS, key_blocks[indices])
        return PicKeys(slots, key_blocks, key_positions, indices, first_plus, q_blocks)


def _through(slot_of: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``slot_of`` at each of ``blocks`` (any shape), by `index_select`: indexing a CPU
    tensor with a tensor (or `torch.take`) costs some 400 ns an entry, 6 ms a step for
    16 tables of 1,024 blocks, where this costs 10 µs."""
    return slot_of.index_select(0, blocks.reshape(-1)).view(blocks.shape)


def _mapped_keys(keys: PicKeys, slot_of: torch.Tensor, size: int) -> PicKeys:
    """A PIC sequence's keys in the windowed pool (every block it reads is pinned there)."""
    slots = keys.key_slots.to(slot_of.device)
    mapped = _through(slot_of, slots // size) * size + slots % size
    if bool((mapped < 0).any()):
        raise EngineError("a PIC sequence's keys reach a block without a windowed slot")
    return dataclasses.replace(keys, key_slots=mapped.to(keys.key_slots.device), _rows={})


def _log_pic_lookup(
    seq: CachedTokens, planned: list[PlannedBlock], hits: dict[int, PlannedBlock], moved: int
) -> None:
    """One event per plus element: how many of its blocks the pool had; and how many of
    the hits' tokens had their keys moved to other positions."""
    if moved:
        log.debug("pic.moved", seq_id=seq.seq_id, tokens=moved)
    elements: dict[int, list[PlannedBlock]] = {}
    for block in planned:
        if block.plus:
            elements.setdefault(block.element, []).append(block)
    for number, blocks in elements.items():
        hit = sum(block.index in hits for block in blocks)
        log.debug(
            "pic.hit" if hit == len(blocks) else "pic.miss",
            seq_id=seq.seq_id,
            element=number,
            blocks=hit,
            of_blocks=len(blocks),
            tokens=blocks[-1].last + 1 - blocks[0].first,
        )


def _log_prefix_lookup(seq: CachedTokens, hit_blocks: int, prompt_blocks: int) -> None:
    event = "prefix_cache.hit" if hit_blocks else "prefix_cache.miss"
    log.debug(
        event,
        seq_id=seq.seq_id,
        blocks=hit_blocks,
        of_blocks=prompt_blocks,
        cached_tokens=seq.num_cached_tokens,
    )
