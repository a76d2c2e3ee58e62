"""Torch reference twins of the paged-cache kernels: KV store and paged attention.

The cache of one layer is ``[num_blocks, block_size, num_kv_heads, head_dim]``; token
``t`` of a sequence lives in slot ``block_table[t // block_size] * block_size + t %
block_size``. An FP8 cache stores ``value / scale`` as float8_e4m3fn and is read back
as ``stored * scale`` in the compute dtype. These functions are what CPU and Metal run,
and what the Triton kernels are tested against.
"""

import torch
import torch.nn.functional as F

from .attention_ref import attention_ref
from .metadata import PagedMetadata
from .ops import rotate_ref
from .pic import pic_attention_ref
from .scoring import Scoring

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# An FP8 cache maps each layer's largest K (or V) magnitude on the reference text to 224,
# half of float8_e4m3fn's 448, leaving room for larger values later.
FP8_CALIBRATION_TARGET = 224.0


def fp8_scale(values: torch.Tensor) -> float:
    """The per-tensor scale that maps the largest magnitude of ``values`` to the
    calibration target (half of float8's range, leaving room for larger values later)."""
    return max(float(values.abs().max()), 1e-6) / FP8_CALIBRATION_TARGET


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedMetadata,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value [T, kv_heads, head_dim]`` to ``meta.slot_mapping``; -1 skipped."""
    keep, slots = meta.written_slots
    _write(key_cache, slots, key if keep is None else key[keep], k_scale)
    _write(value_cache, slots, value if keep is None else value[keep], v_scale)


def store_latent_ref(keys: torch.Tensor, cache: torch.Tensor, meta: PagedMetadata) -> None:
    """Write a latent layer's ``keys [T, 1, width]`` (`AttentionSpec.latent`: no values of
    their own) to ``meta.slot_mapping``; -1 skipped."""
    keep, slots = meta.written_slots
    _write(cache, slots, keys if keep is None else keys[keep], 1.0)


def paged_latent_attention_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: PagedMetadata,
    scoring: Scoring,
    latent: int,
) -> torch.Tensor:
    """Multi-head latent attention over the pool: ``q [T, heads, width]`` (the absorbed
    queries) against each sequence's cached keys ``[tokens, 1, width]``, whose first
    ``latent`` dims are also the values → ``[T, heads, latent]``. Sequences as in
    `paged_attention_ref` (their last ``query_lens[i]`` of ``seq_lens[i]`` tokens)."""
    if meta.pic is not None:
        raise ValueError("PIC sequences do not run on latent attention layers")
    out = q.new_empty(q.shape[0], q.shape[1], latent)
    start = 0
    for i, (seq_len, query_len) in enumerate(zip(meta.seq_lens, meta.query_lens, strict=True)):
        end = start + query_len
        keys = gather_kv(cache, meta.block_tables[i], seq_len, q.dtype)
        out[start:end] = attention_ref(
            q[start:end], keys, keys[..., :latent], scoring, context_len=seq_len - query_len
        )
        start = end
    return out


HALF_MAX = torch.finfo(torch.float16).max


def to_cache(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a float cache of ``dtype`` stores them: rounded to nearest; for
    float16, saturated at its largest finite value rather than turned into infinity."""
    if dtype == torch.float16 and values.dtype != torch.float16:
        values = values.clamp(-HALF_MAX, HALF_MAX)
    return values.to(dtype)


def _write(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, scale: float) -> None:
    flat = cache.view(-1, *cache.shape[2:])
    if cache.dtype == torch.float8_e4m3fn:
        values = (values.float() / scale).clamp(-FP8_MAX, FP8_MAX)
    flat[slots] = to_cache(values, cache.dtype)


def _dequantized(tokens: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if tokens.dtype == torch.float8_e4m3fn:
        return (tokens.float() * scale).to(dtype)
    return tokens.to(dtype)


def read_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    dtype: torch.dtype,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V at pool ``slots`` (any shape of slot indices), in ``dtype``."""
    k = _dequantized(key_cache.flatten(0, 1)[slots], dtype, k_scale)
    v = _dequantized(value_cache.flatten(0, 1)[slots], dtype, v_scale)
    return k, v


def gather_kv(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    dtype: torch.dtype,
    scale: float = 1.0,
) -> torch.Tensor:
    """The first ``length`` tokens of one sequence, contiguous, in ``dtype``."""
    blocks = -(-length // cache.shape[1])
    return _dequantized(cache[block_table[:blocks]].flatten(0, 1)[:length], dtype, scale)


def paged_attention_ref(
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
    """Attention for ``q [T, heads, head_dim]``, the packed queries of several sequences.

    Sequence ``i`` contributes its last ``query_lens[i]`` tokens of ``seq_lens[i]``; its
    earlier ``seq_lens[i] - query_lens[i]`` tokens are cached context. Every key, new or
    cached, is read from the cache (so an FP8 cache rounds them all alike).
    """
    batched = scoring.plain and scoring.chunk is None and alibi_slopes is None
    if meta.is_decode and batched and meta.pic is None:
        return _decode_batched(q, key_cache, value_cache, meta, scoring, k_scale, v_scale)
    out = torch.empty_like(q)
    start = 0
    for i, (seq_len, query_len) in enumerate(zip(meta.seq_lens, meta.query_lens, strict=True)):
        end = start + query_len
        pic = meta.pic_of(i)
        if pic is not None and (alibi_slopes is not None or scoring.chunk is not None):
            raise ValueError(
                "PIC sequences take neither ALiBi nor chunked attention: their positions overlap"
            )
        if pic is not None:
            k, v = read_kv(key_cache, value_cache, pic.key_slots, q.dtype, k_scale, v_scale)
            out[start:end] = pic_attention_ref(q[start:end], k, v, pic, scoring)
            start = end
            continue
        k = gather_kv(key_cache, meta.block_tables[i], seq_len, q.dtype, k_scale)
        v = gather_kv(value_cache, meta.block_tables[i], seq_len, q.dtype, v_scale)
        context_len = seq_len - query_len
        out[start:end] = attention_ref(
            q[start:end], k, v, scoring, context_len=context_len, alibi_slopes=alibi_slopes
        )
        start = end
    return out


def _decode_batched(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedMetadata,
    scoring: Scoring,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """One query per sequence: every sequence's keys gathered at once, padded, masked, and
    attended in one call."""
    slots, mask = meta.decode_keys(scoring.window)
    k, v = read_kv(key_cache, value_cache, slots, q.dtype, k_scale, v_scale)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scoring.scale,
        enable_gqa=q.shape[1] != k.shape[2],
    )
    return out.squeeze(2)


def copy_block_rotated(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    src: int | torch.Tensor,
    dst: int | torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_scale: float = 1.0,
) -> None:
    """Block ``dst`` of a layer's pool set to block ``src`` (or blocks: int64 tensors of
    ids), its keys rotated on by the angles ``cos``/``sin [rotary_dim / 2]`` (float32):
    keys stored rotated for positions ``p`` become those for ``p + d`` where the angles
    are ``d`` times the inverse frequencies. Computed in float32, stored as the pool
    stores keys."""
    keys = key_cache[src].float()
    if key_cache.dtype == torch.float8_e4m3fn:
        keys = keys * k_scale
    both = (torch.cat([cos, cos]), torch.cat([-sin, sin]))
    rotated = rotate_ref(keys, *(t.to(keys.device).view(1, 1, -1) for t in both))
    if key_cache.dtype == torch.float8_e4m3fn:
        rotated = (rotated / k_scale).clamp(-FP8_MAX, FP8_MAX)
    key_cache[dst] = to_cache(rotated, key_cache.dtype)
    value_cache[dst] = value_cache[src]
