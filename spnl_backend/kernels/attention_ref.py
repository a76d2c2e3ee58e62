"""Attention over one sequence's keys and values: the torch reference every kernel matches.

Queries are the last ``q.shape[0]`` positions of a sequence whose first
``context_len`` keys were already cached (a prefix hit, a chunked prefill or a
decode step), so the causal mask is offset by ``context_len``.
"""

import torch
import torch.nn.functional as F

from .scoring import Scoring


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scoring: Scoring,
    *,
    context_len: int,
    alibi_slopes: torch.Tensor | None = None,
    logit_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [nq, heads, d]``, ``k``/``v [context_len + nq, kv_heads, d]`` → ``[nq, heads, d]``.

    A key at position ``j`` is visible to the query at position ``i`` when
    ``j <= i`` and, with a sliding window ``w``, ``j > i - w``; with chunks of ``c``,
    ``j // c == i // c``. Scores are
    ``scale * q.k`` plus ``logit_bias [heads, nq, nk]`` if given (a compressed cache's
    correction), then softcapped (``cap * tanh(s / cap)``), then biased by
    ``slope * (j - i)`` with ALiBi, then masked; softmax is in float32, over the visible
    keys and, where given, each head's sink logit (a column of no value).
    """
    if scoring.plain and alibi_slopes is None and logit_bias is None:
        return _sdpa(q, k, v, scoring, context_len)
    scores = raw_scores(q, k) * scoring.scale
    if logit_bias is not None:
        scores = scores + logit_bias.float()
    out = attend_scores(scores, v, scoring, context_len=context_len, alibi_slopes=alibi_slopes)
    return out.to(q.dtype)


def raw_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q [nq, heads, d]`` . ``k [nk, kv_heads, d]`` → float32 ``[heads, nq, nk]`` (each
    KV head serves ``heads / kv_heads`` consecutive query heads)."""
    nq, heads, dim = q.shape
    kv_heads = k.shape[1]
    qg = q.float().view(nq, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3)
    scores = qg @ k.float().permute(1, 2, 0).unsqueeze(1)  # [kv, groups, nq, nk]
    return scores.flatten(0, 1)


def attend_scores(
    scores: torch.Tensor,
    v: torch.Tensor,
    scoring: Scoring,
    *,
    context_len: int,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled ``scores [heads, nq, nk]`` and ``v [nk, kv_heads, d]`` → float32
    ``[nq, heads, d]``: softcap, ALiBi, the causal (and window) mask, softmax (with the
    sinks), sum."""
    heads, nq, nk = scores.shape
    scores = scoring.capped(scores)
    q_pos, k_pos = _positions(nq, nk, context_len, scores.device)
    if alibi_slopes is not None:
        distance = (k_pos - q_pos.unsqueeze(-1)).float()
        scores = scores + alibi_slopes.float().view(heads, 1, 1) * distance
    return softmax_sum(scores, v, _visible(q_pos, k_pos, scoring), scoring.sinks)


def softmax_sum(
    scores: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Final ``scores [heads, nq, nk]``, ``v [nk, kv_heads, d]`` and which keys each query
    sees ``[nq, nk]`` → float32 ``[nq, heads, d]``: the masked softmax and the weighed sum.
    ``sinks [heads]``: a last column per head in the softmax, dropped before the sum."""
    heads, nq, nk = scores.shape
    kv_heads = v.shape[1]
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        column = sinks.float().to(scores.device).view(heads, 1, 1).expand(heads, nq, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :nk]
    probs = probs.view(kv_heads, heads // kv_heads, nq, nk)
    out = probs @ v.float().permute(1, 0, 2).unsqueeze(1)  # [kv, groups, nq, d]
    return out.flatten(0, 1).transpose(0, 1)


def _positions(
    nq: int, nk: int, context_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    q_pos = torch.arange(context_len, context_len + nq, device=device)
    return q_pos, torch.arange(nk, device=device)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, scoring: Scoring) -> torch.Tensor:
    """``[nq, nk]``: the keys each query sees (causal, from its window's or chunk's start)."""
    q_pos = q_pos.unsqueeze(-1)
    return (k_pos <= q_pos) & (k_pos >= scoring.first_visible(q_pos))


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scoring: Scoring,
    context_len: int,
) -> torch.Tensor:
    """The common case through torch's fused attention; the mask only where it cuts."""
    nq, nk = q.shape[0], k.shape[0]
    window_cuts = scoring.window is not None and nk > scoring.window
    chunk_cuts = scoring.chunk is not None and nk > scoring.chunk
    mask, causal = None, False
    if window_cuts or chunk_cuts or (nq > 1 and context_len > 0):
        mask = _visible(*_positions(nq, nk, context_len, q.device), scoring)
    elif nq > 1:
        causal = True
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=causal,
        scale=scoring.scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)
