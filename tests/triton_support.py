"""The Triton kernels (interpreted on the CPU, compiled on CUDA) and the checks that compare
them with their torch twins."""

import os
from types import SimpleNamespace

import torch
from paged_cases import CASES, contiguous_attention, paged_case, scored, writes

from spnl_backend.kernels.metadata import PagedMetadata
from spnl_backend.kernels.paged_ref import paged_attention_ref, store_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def load_kernels() -> SimpleNamespace:
    """The Triton kernels: compiled on a GPU, interpreted on the CPU (conftest sets
    TRITON_INTERPRET=1 there before Triton is first imported)."""
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "without a GPU the Triton tests need TRITON_INTERPRET=1 set "
            "before triton is imported (tests/conftest.py does this)"
        )
    from spnl_backend.kernels.triton_attention import paged_attention_triton
    from spnl_backend.kernels.triton_store import store_kv_triton

    return SimpleNamespace(store_kv=store_kv_triton, paged_attention=paged_attention_triton)


def check_attention(
    kernels,
    device,
    case,
    kv_heads=2,
    heads=8,
    block_size=8,
    head_dim=32,
    dtype=torch.float32,
    num_splits=None,
    atol=1e-5,
    **options,
):
    seq_lens, query_lens = CASES[case]
    q, key_cache, value_cache, meta, keys, values = paged_case(
        seq_lens, query_lens, kv_heads, heads, block_size, head_dim, dtype
    )
    on_device = {k: v.to(device) if torch.is_tensor(v) else v for k, v in options.items()}
    device_scoring, device_rest = scored(on_device)
    out = kernels.paged_attention(
        q.to(device),
        key_cache.to(device),
        value_cache.to(device),
        on(meta, device),
        device_scoring,
        num_splits=num_splits,
        **device_rest,
    )
    scoring, rest = scored(options)
    expected = paged_attention_ref(q, key_cache, value_cache, meta, scoring, **rest)
    torch.testing.assert_close(out.cpu(), expected, atol=atol, rtol=atol)
    if "k_scale" not in options:  # and the twin equals plain attention (FP8 is tested apart)
        plain = contiguous_attention(
            q.float(),
            [k.float() for k in keys],
            [v.float() for v in values],
            seq_lens,
            query_lens,
            **options,
        )
        torch.testing.assert_close(expected.float(), plain, atol=atol, rtol=atol)


def fp8_case(kernels, device, case):
    """FP8 caches written by the Triton store, read by both attentions."""
    seq_lens, query_lens = CASES[case]
    q, key_cache, value_cache, meta, _, _ = paged_case(seq_lens, query_lens, 2, 4, 8)
    k_fp8 = (key_cache / 0.5).to(torch.float8_e4m3fn)
    v_fp8 = (value_cache / 0.25).to(torch.float8_e4m3fn)
    scales = {"scale": 0.2, "k_scale": 0.5, "v_scale": 0.25}
    scoring, fp8 = scored(scales)
    out = kernels.paged_attention(
        q.to(device), k_fp8.to(device), v_fp8.to(device), on(meta, device), scoring, **fp8
    )
    expected = paged_attention_ref(q, k_fp8, v_fp8, meta, scoring, **fp8)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def check_store(kernels, device, kv_heads, head_dim, cache_dtype, scales=(1.0, 1.0)):
    """The Triton store writes the same bytes as the torch twin, skipping slot -1."""
    gen = torch.Generator().manual_seed(kv_heads * head_dim)
    tokens, blocks, block_size = 7, 4, 8
    key = torch.randn(tokens, kv_heads, head_dim, generator=gen) * 50
    value = torch.randn(tokens, kv_heads, head_dim, generator=gen) * 1e-3
    slots = torch.tensor([3, -1, 17, 0, -1, 31, 9])
    caches = [
        torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=cache_dtype) for _ in range(4)
    ]
    store_kv_ref(key, value, caches[0], caches[1], writes(slots, block_size), *scales)
    on_device = [c.to(device) for c in caches[2:]]
    kernels.store_kv(
        key.to(device), value.to(device), *on_device, writes(slots.to(device), block_size), *scales
    )
    for ours, theirs in zip(on_device, caches[:2], strict=True):
        assert torch.equal(ours.cpu().view(torch.uint8), theirs.view(torch.uint8))


def on(meta: PagedMetadata, device: str) -> PagedMetadata:
    return PagedMetadata(
        meta.block_tables.to(device), meta.seq_lens, meta.query_lens, meta.block_size
    )
