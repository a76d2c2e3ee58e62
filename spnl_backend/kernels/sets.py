"""The kernel sets the paged engine calls: the torch twins, the CPU's, Triton's.

Every set has the same signatures (`AttentionKernels`); `kernels.dispatch` picks one per model.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from .attention_ref import attention_ref
from .cpu import POOL_DTYPES, CpuKernels, KernelArgumentError
from .metadata import PagedMetadata
from .paged_ref import paged_attention_ref, store_kv_ref
from .pic import first_keys
from .scoring import Scoring
from .thresholds import native_attention_queries


@dataclass(frozen=True)
class AttentionKernels:
    """The kernels the paged engine calls; every set has the same signatures. ``native``
    is the compiled CPU library the set calls (the CPU set only)."""

    name: str
    store_kv: Callable[..., None]
    paged_attention: Callable[..., object]
    native: CpuKernels | None = None
    # Every query of a float pool attends through ``native``'s decode kernel (the CPU set
    # with batch invariance): what the native layer blocks rely on.
    every_query_native: bool = False


TORCH_ATTENTION = AttentionKernels("torch", store_kv_ref, paged_attention_ref)


def _cpu_store_kv(
    native: CpuKernels,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedMetadata,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    if key.dtype == torch.float32 and key_cache.dtype in POOL_DTYPES:
        check_step_slots(meta, key_cache)
        native.store_kv(key, value, key_cache, value_cache, meta.slot_mapping)
    else:
        store_kv_ref(key, value, key_cache, value_cache, meta, k_scale, v_scale)


def _cpu_paged_attention(
    native: CpuKernels,
    longest: int | None,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedMetadata,
    scoring: Scoring,
    *,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    if (
        (longest is None or max(meta.query_lens) <= longest)
        and alibi_slopes is None
        and q.dtype == torch.float32
        and key_cache.dtype in POOL_DTYPES
    ):
        check_step_slots(meta, key_cache)
        if meta.pic is not None:
            # A step with PIC sequences, in one call: their queries attend over the key
            # lists their mask gives (windowed by position already, from their first key),
            # the others' over their lists as in a step without them: each row's own.
            slots, lens, firsts = pic_step_keys(meta, scoring.window)
        else:
            (slots, lens), firsts = _decode_keys(meta), None
        return native.paged_decode(q, key_cache, value_cache, slots, lens, scoring, firsts)
    return paged_attention_ref(
        q,
        key_cache,
        value_cache,
        meta,
        scoring,
        alibi_slopes=alibi_slopes,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def pic_step_keys(
    meta: PagedMetadata, window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Every query's ``(slots [queries, width], lens, first keys)`` in a step with PIC
    sequences, for layers with ``window`` (made once per step and window): a plain query's
    row as `decode_rows` gives it, first key the window's; a PIC query's its visible keys,
    first key 0. No first keys without a window (every row from its start)."""
    return meta.memo(("pic_step_keys", window), lambda: _pic_step_keys(meta, window))


def _pic_step_keys(meta: PagedMetadata, window: int | None):
    pic = [keys.rows(window) if keys is not None else None for keys in meta.pic or ()]
    plain_index = [i for i, rows in enumerate(pic) if rows is None]
    plain = _decode_keys(_only(meta, plain_index)) if plain_index else None
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    start = 0  # into the plain sequences' rows
    for index, rows in enumerate(pic):
        if rows is None:
            count = meta.query_lens[index]
            slots, lens = plain[0][start : start + count], plain[1][start : start + count]
            parts.append((slots, lens, first_keys(lens, window)))
            start += count
        else:
            parts.append(rows)
    width = max(part[0].shape[1] for part in parts)
    slots = torch.cat([F.pad(part[0], (0, width - part[0].shape[1])) for part in parts])
    lens = torch.cat([part[1] for part in parts])
    firsts = torch.cat([part[2] for part in parts]) if window else None
    return slots, lens, firsts


def _only(meta: PagedMetadata, index: list[int]) -> PagedMetadata:
    """The step's sequences ``index`` alone (their rows are what the step's would be)."""
    pick = torch.tensor(index, device=meta.device)
    return PagedMetadata(
        meta.block_tables[pick],
        [meta.seq_lens[i] for i in index],
        [meta.query_lens[i] for i in index],
        meta.block_size,
        None,
    )


@dataclass(frozen=True)
class NativeKeys:
    """Where one step's keys go and which each query sees, for the native layer blocks:
    the same slots, tables and lengths the CPU set's store and attention take. In a step
    with PIC sequences the layers with a window read ``windowed`` (slots, lens, first
    keys): their PIC queries' lists are windowed by position, so they differ."""

    slot_mapping: torch.Tensor  # [tokens] int64
    slots: torch.Tensor  # [queries, width] int64, rows contiguous
    lens: torch.Tensor  # [queries] int64
    num_slots: int
    windowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Where the layers with a window keep their own pool (`engine.window_pool`): their
    # tokens' slots there and its slot count (their keys are then ``windowed``'s).
    window_pool: tuple[torch.Tensor, int] | None = None


def native_keys(
    kernels: AttentionKernels, meta: PagedMetadata, pool: torch.Tensor, windows: tuple[int, ...]
) -> NativeKeys | None:
    """The step's `NativeKeys` where the CPU set would store and attend natively for every
    query of every layer (a float pool, every query through the decode kernel), else None.
    ``pool`` is one layer's key cache (they all share its shape); ``windows`` the model's
    sliding windows (a step with PIC sequences takes the blocks with at most one)."""
    if not (
        kernels.every_query_native
        and pool.dtype in POOL_DTYPES
        and pool.is_cpu
        and meta.slot_mapping is not None
        and (meta.pic is None or len(windows) <= 1)
    ):
        return None
    check_step_slots(meta, pool)
    windowed = None
    if meta.pic is None:
        slots, lens = _decode_keys(meta)
    else:
        slots, lens, _ = pic_step_keys(meta, None)
        if windows:
            windowed = _contiguous_rows(pic_step_keys(meta, windows[0]))  # type: ignore[arg-type]
    num_slots = pool.shape[0] * pool.shape[1]
    slot_mapping = meta.slot_mapping.to(torch.int64).contiguous()
    slots = slots if slots.stride(1) == 1 else slots.contiguous()
    return NativeKeys(slot_mapping, slots, lens, num_slots, windowed)


def windowed_native_keys(
    kernels: AttentionKernels,
    meta: PagedMetadata,
    pool: torch.Tensor,
    window_meta: PagedMetadata,
    window_pool: torch.Tensor,
    window: int,
) -> NativeKeys | None:
    """The step's `NativeKeys` where the layers with ``window`` keep a pool of their own
    (``window_pool``, one layer's key cache of it, read through ``window_meta``) beside
    the other layers' (``pool``, through ``meta``); None where either would not run
    natively."""
    keys = native_keys(kernels, meta, pool, ())
    own = native_keys(kernels, window_meta, window_pool, (window,))
    if keys is None or own is None:
        return None
    # a step with PIC sequences lists their keys windowed by position already
    windowed = own.windowed or (own.slots, own.lens, first_keys(own.lens, window))
    return dataclasses.replace(
        keys, windowed=windowed, window_pool=(own.slot_mapping, own.num_slots)
    )


def _contiguous_rows(keys: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(k if k.is_contiguous() else k.contiguous() for k in keys)


def contiguous_kernels(
    native: CpuKernels | None, dtype: torch.dtype, device: torch.device
) -> CpuKernels | None:
    """The compiled kernels where a contiguous store of ``dtype`` on ``device`` attends
    through them (`attend_contiguous`): a float pool on the CPU."""
    return native if dtype in POOL_DTYPES and device.type == "cpu" else None


def attend_contiguous(
    native: CpuKernels | None,
    longest: int | None,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scoring: Scoring,
    *,
    context_len: int,
) -> torch.Tensor:
    """One sequence's queries over its contiguous ``keys``/``values [capacity, kv_heads,
    dim]`` (the first ``context_len + len(q)`` written; float32 or float16 for the native
    kernel), as `attention_ref` computes them in ``q``'s dtype. Where ``native`` runs
    (`contiguous_kernels`) and the step has at most ``longest`` queries (None: any number),
    through the native decode kernel instead: query ``i`` is a decode over the first
    ``context_len + i + 1`` keys, as it would be alone."""
    nq = q.shape[0]
    total = context_len + nq
    if native is None or (longest is not None and nq > longest):
        k, v = keys[:total].to(q.dtype), values[:total].to(q.dtype)
        return attention_ref(q, k, v, scoring, context_len=context_len)
    slots = torch.arange(total).expand(nq, total)  # one table, shared by every query
    lens = torch.arange(context_len + 1, total + 1)
    queries = q.float().contiguous()
    out = native.paged_decode(queries, keys[None], values[None], slots, lens, scoring)
    return out.to(q.dtype)


def _decode_keys(meta: PagedMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's key slots ``[queries, width]`` and key counts ``[queries]`` as a decode
    of its own (`decode_rows`), made once per step. The queries of a step of one sequence
    share its one row of slots (stride 0): a long prompt's chunk of 2,048 queries would
    otherwise copy its key list once per query (256 MB at 16k keys)."""
    rows = meta.memo("decode_rows", lambda: decode_rows(meta))
    lens = meta.memo("seq_lens_i64", lambda: torch.tensor(rows.seq_lens))
    if len(meta.seq_lens) == 1 and not meta.is_decode:
        return meta.decode_slots.expand(len(rows.seq_lens), -1), lens
    return rows.decode_slots, lens


def decode_rows(meta: PagedMetadata) -> PagedMetadata:
    """The step with each query as a sequence of its own, seeing the keys up to its
    position: what a decode of that token alone would attend to."""
    if meta.is_decode:
        return meta
    owners, lens = [], []
    for index, (seq_len, query_len) in enumerate(zip(meta.seq_lens, meta.query_lens, strict=True)):
        owners += [index] * query_len
        lens += range(seq_len - query_len + 1, seq_len + 1)
    tables = meta.block_tables[torch.tensor(owners, device=meta.device)]
    return PagedMetadata(tables, lens, [1] * len(lens), meta.block_size, meta.slot_mapping)


def check_step_slots(meta: PagedMetadata, pool: torch.Tensor) -> None:
    """Once per step: every block table entry and slot the step uses lies in ``pool``
    (``[blocks, block_size, ...]``), so the native kernels never follow an index out of it."""
    num_blocks, block_size = pool.shape[:2]
    meta.memo(("slots_checked", num_blocks, block_size), lambda: _slots_in(meta, num_blocks))


def _slots_in(meta: PagedMetadata, num_blocks: int) -> bool:
    tables, slots = meta.block_tables, meta.slot_mapping
    if tables.numel():
        low, high = _bounds(tables)
        if not 0 <= low <= high < num_blocks:
            raise KernelArgumentError(
                f"a block table holds block {high} or {low}, "
                f"outside the pool of {num_blocks} blocks"
            )
    if slots is not None and slots.numel():
        low, high = _bounds(slots)
        if low < -1 or high >= num_blocks * meta.block_size:
            raise KernelArgumentError(f"the slot mapping holds slot {high} or {low}")
    if max(meta.seq_lens) > tables.shape[1] * meta.block_size:
        raise KernelArgumentError("a sequence is longer than its block table")
    return True


def _bounds(values: torch.Tensor) -> tuple[int, int]:
    """The least and greatest of ``values``, in one op (a step's few ops each start cold)."""
    low, high = torch.aminmax(values)
    return int(low), int(high)


def triton_kernel_set() -> AttentionKernels:
    """Triton's kernels, imported only here: platforms without Triton never load it."""
    from .triton_attention import paged_attention_triton
    from .triton_store import store_kv_triton

    return AttentionKernels("triton", store_kv_triton, paged_attention_triton)


def cpu_kernel_set(native: CpuKernels, batch_invariant: bool = True) -> AttentionKernels:
    """The CPU: the native decode kernels for float32 and float16 caches, the torch twins
    otherwise.
    With batch invariance every query attends through the native kernel as a decode of its
    own; without, queries longer than `CPU_DECODE_ROWS` take the torch twin."""
    store = partial(_cpu_store_kv, native)
    longest = native_attention_queries(batch_invariant)
    attend = partial(_cpu_paged_attention, native, longest)
    return AttentionKernels("cpu", store, attend, native, every_query_native=longest is None)
