"""Triton KV store: new K/V rows into their cache slots (twin: `paged_ref.store_kv_ref`)."""

import torch
import triton
import triton.language as tl

from .metadata import PagedMetadata
from .triton_fp8 import fp8_e4m3_encode


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    row_size,
    stride_key,
    stride_value,
    BLOCK: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    token = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    # A padding token (slot -1) writes nothing; rows need not be a power of two long.
    mask = (offsets < row_size) & ((offsets * 0 + slot) >= 0)
    key = tl.load(key_ptr + token * stride_key + offsets, mask=mask, other=0.0)
    value = tl.load(value_ptr + token * stride_value + offsets, mask=mask, other=0.0)
    target = slot * row_size + offsets
    if IS_FP8:  # 448: float8_e4m3fn's largest finite value
        key = fp8_e4m3_encode(tl.clamp(key.to(tl.float32) / k_scale, -448.0, 448.0))
        value = fp8_e4m3_encode(tl.clamp(value.to(tl.float32) / v_scale, -448.0, 448.0))
    tl.store(key_cache_ptr + target, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + target, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedMetadata,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value [T, kv_heads, head_dim]`` to ``meta.slot_mapping``; -1 skipped."""
    tokens = key.shape[0]
    if tokens == 0:
        return
    row_size = key.shape[1] * key.shape[2]
    key, value = key.reshape(tokens, row_size), value.reshape(tokens, row_size)
    is_fp8 = key_cache.dtype == torch.float8_e4m3fn
    if is_fp8:  # stored as bytes: the kernel encodes them itself
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    block = min(triton.next_power_of_2(row_size), 1024)
    grid = (tokens, triton.cdiv(row_size, block))
    _store_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        meta.slot_mapping,
        float(k_scale),
        float(v_scale),
        row_size,
        key.stride(0),
        value.stride(0),
        BLOCK=block,
        IS_FP8=is_fp8,
    )
