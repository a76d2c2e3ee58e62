"""Triton kernels and their torch reference twins, chosen through one dispatch point."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from ..log import get_logger
from .cpu import cpu_kernels
from .metadata import PagedMetadata
from .paged_ref import paged_attention_ref, store_kv_ref

log = get_logger()

# Queries per sequence up to which a CPU step attends query by query with the native
# decode kernel: faster than the torch twin for short queries, and a speculative
# verification then computes each token exactly as decoding it alone would.
CPU_DECODE_ROWS = 32


@dataclass(frozen=True)
class Kernels:
    """The kernels the paged engine calls; every set has the same signatures."""

    name: str
    store_kv: Callable[..., None]
    paged_attention: Callable[..., object]


TORCH_KERNELS = Kernels("torch", store_kv_ref, paged_attention_ref)


def _cpu_store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedMetadata,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    native = cpu_kernels()
    if native and key.dtype == key_cache.dtype == torch.float32:
        native.store_kv(key, value, key_cache, value_cache, meta.slot_mapping)
    else:
        store_kv_ref(key, value, key_cache, value_cache, meta, k_scale, v_scale)


def _cpu_paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    native = cpu_kernels()
    if (
        native
        and max(meta.query_lens) <= CPU_DECODE_ROWS
        and alibi_slopes is None
        and q.dtype == key_cache.dtype == torch.float32
    ):
        rows = meta.memo("decode_rows", lambda: decode_rows(meta))
        lens = meta.memo("seq_lens_i64", lambda: torch.tensor(rows.seq_lens))
        return native.paged_decode(
            q, key_cache, value_cache, rows.decode_slots, lens, scale, sliding_window, softcap
        )
    return paged_attention_ref(
        q,
        key_cache,
        value_cache,
        meta,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        k_scale=k_scale,
        v_scale=v_scale,
    )


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


# The CPU: the native decode kernels for float32 caches, the torch twins otherwise.
CPU_KERNELS = Kernels("cpu", _cpu_store_kv, _cpu_paged_attention)


def select_kernels(kind: Literal["torch", "cpu", "triton"]) -> Kernels:
    """The kernel set for the platform's decision (``PlatformDecisions.kernels``).

    Triton is imported only here, so platforms without it never load it.
    """
    if kind == "torch":
        return TORCH_KERNELS
    if kind == "cpu":
        return CPU_KERNELS
    from .triton_attention import paged_attention_triton
    from .triton_store import store_kv_triton

    log.debug("kernels.selected", kernels="triton")
    return Kernels("triton", store_kv_triton, paged_attention_triton)
