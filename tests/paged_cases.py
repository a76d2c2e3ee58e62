"""Random paged-cache scenarios shared by the torch and Triton kernel tests."""

import torch

from spnl_backend.kernels.attention_ref import attention_ref
from spnl_backend.kernels.metadata import PagedMetadata
from spnl_backend.kernels.paged_ref import store_kv_ref
from spnl_backend.kernels.scoring import Scoring

# name: (total KV length per sequence, query tokens per sequence)
CASES = {
    "prefill": ([17], [17]),
    "prefix hit": ([40], [9]),
    "chunked prefill": ([64, 30], [16, 30]),
    "decode": ([5, 33, 70], [1, 1, 1]),
    "mixed": ([50, 7, 90], [1, 7, 12]),
}


def paged_case(
    seq_lens, query_lens, kv_heads, heads, block_size, head_dim=32, dtype=torch.float32, seed=0
):
    """Random K/V per sequence scattered into shuffled blocks of a cache, plus queries.

    Returns ``(q, key_cache, value_cache, meta, keys, values)``.
    """
    gen = torch.Generator().manual_seed(seed)
    per_seq_blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq_blocks) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    cache_k = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    cache_v = torch.zeros_like(cache_k)
    tables, keys, values = [], [], []
    for n, blocks in zip(seq_lens, per_seq_blocks, strict=True):
        table = [order.pop() for _ in range(blocks)]
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor(
            [table[t // block_size] * block_size + t % block_size for t in range(n)]
        )
        store_kv_ref(k, v, cache_k, cache_v, writes(slots, block_size))
        tables.append(table)
        keys.append(k)
        values.append(v)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype)
    meta = PagedMetadata(block_tables, list(seq_lens), list(query_lens), block_size)
    return q, cache_k, cache_v, meta, keys, values


def writes(slots: torch.Tensor, block_size: int) -> PagedMetadata:
    """Metadata for a store of ``slots`` (a store reads nothing else)."""
    return PagedMetadata(torch.zeros(1, 1, dtype=torch.long), [1], [1], block_size, slots)


def scored(options: dict) -> tuple[Scoring, dict]:
    """A test's keyword options split into the `Scoring` they name (``scale``,
    ``sliding_window``, ``softcap``, ``sinks``, ``chunk``) and the rest (ALiBi, FP8 scales)."""
    rest = dict(options)
    scoring = Scoring(
        rest.pop("scale"),
        window=rest.pop("sliding_window", None),
        softcap=rest.pop("softcap", None),
        sinks=rest.pop("sinks", None),
        chunk=rest.pop("chunk", None),
    )
    return scoring, rest


def scoring_of(scale: float, options: dict, **more) -> Scoring:
    """The `Scoring` of ``scale`` and a test's options that name only scoring."""
    scoring, rest = scored({"scale": scale, **options, **more})
    assert not rest, f"not scoring options: {rest}"
    return scoring


def contiguous_attention(q, keys, values, seq_lens, query_lens, **options):
    """What the paged attention must equal: plain attention per sequence."""
    scoring, rest = scored(options)
    outs, start = [], 0
    for k, v, n, m in zip(keys, values, seq_lens, query_lens, strict=True):
        outs.append(attention_ref(q[start : start + m], k, v, scoring, context_len=n - m, **rest))
        start += m
    return torch.cat(outs)
