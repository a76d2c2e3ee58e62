"""The gated delta rule (Gated DeltaNet's memory), in torch: the twin of the C kernel.

Per value head the state is a matrix ``S [dk, dv]``; each token decays it by ``exp(g)``,
writes the part of its value the state does not yet predict (the delta, scaled by
``beta``) under its key, and reads it back with its query:

    S = S * exp(g_t);  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

`recurrent` applies that token by token; `chunked` gives the same values a chunk of
tokens at a time (the intra-chunk part as triangular matrix products, the chunks in
sequence), the form prefill takes. Both take one sequence's heads as the batch and
update ``state`` in place. `rule` is what the layer calls: the compiled kernel (the
twin of `recurrent`) where it runs, else these.
"""

import torch
import torch.nn.functional as F

from .cpu import CpuKernels
from .ops import native_for

CHUNK = 64


def rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    native: CpuKernels | None = None,
) -> torch.Tensor:
    """The rule as a layer runs it over a piece of a sequence: token by token in C where
    ``native`` runs float32 on the CPU, for every piece alike (one token's arithmetic
    whatever the piece, so a resumed sequence gets a cold run's bits); else `recurrent`
    for one token and `chunked` for more."""
    if (native := native_for(native, q)) is not None:
        return native.delta_rule_(q, k, v, g, beta, state)
    return (recurrent if q.shape[0] == 1 else chunked)(q, k, v, g, beta, state)


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """``q``, ``k [T, H, dk]`` (normed, ``q`` scaled), ``v [T, H, dv]``, ``g``, ``beta
    [T, H]``, ``state [H, dk, dv]`` (float32, updated) → outputs ``[T, H, dv]``."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state.mul_(g[t].exp()[:, None, None])
        predicted = (state * k[t, :, :, None]).sum(1)
        delta = (v[t] - predicted) * beta[t, :, None]
        state.add_(k[t, :, :, None] * delta[:, None, :])
        out[t] = (state * q[t, :, :, None]).sum(1)
    return out


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """`recurrent`'s values, ``chunk`` tokens at a time (the last chunk padded with
    tokens that change nothing: zero key, value, beta and decay)."""
    length = q.shape[0]
    pad = -length % chunk
    # [H, chunks, C, d] and [H, chunks, C]
    q, k, v = (_chunks(F.pad(x, (0, 0, 0, 0, 0, pad)), chunk) for x in (q, k, v))
    g, beta = (_chunks(F.pad(x, (0, 0, 0, pad)), chunk) for x in (g, beta))
    decay = g.cumsum(-1)  # log of the decay from the chunk's start to each token
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    pair_decay = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, -torch.inf).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # The delta rule within a chunk: each token's write corrects for the writes before
    # it, a unit lower-triangular system solved once for the values and the keys.
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    keys = torch.linalg.solve_triangular(
        system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True
    )
    inner = (q @ k.transpose(-1, -2)) * pair_decay
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        fresh = values[:, c] - keys[:, c] @ state  # what the state does not predict
        out[:, c] = q_decayed[:, c] @ state + inner[:, c] @ fresh
        state.mul_(chunk_decay[:, c, None, None]).add_(k_to_end[:, c].transpose(-1, -2) @ fresh)
    return out.flatten(1, 2)[:, :length].transpose(0, 1)


def _chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[T, H, ...]`` → ``[H, T / chunk, chunk, ...]``."""
    x = x.transpose(0, 1)
    return x.reshape(x.shape[0], -1, chunk, *x.shape[2:])
