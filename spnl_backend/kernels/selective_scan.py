"""Mamba-1's selective scan, in torch: the twin of the C kernel.

Each channel d keeps a state of N (``h [D, N]``), decayed at its own rates A ``[D, N]``:
each token decays it by ``exp(dt_t A)``, writes its input scaled by its step under its B,
and reads it out with its C:

    h = h * exp(dt_t A) + (dt_t B_t) x_t;  y_t = h C_t

`recurrent` applies that token by token (decode, and prefill on the torch path);
`chunked` gives the same values a chunk of tokens at a time (prefill): within a chunk
every token's state is the entering state and the chunk's writes so far, each decayed
by the log-rates summed since (a ``[chunk, chunk, D, N]`` product, so chunks stay small).
Both take one sequence and update ``state`` in place; the skip term D x and the gate are
the layer's. `scan` is what the layer calls: the compiled kernel (the twin of
`recurrent`) where it runs, else these.
"""

import torch

from .cpu import CpuKernels
from .ops import native_for

CHUNK = 16


def scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    native: CpuKernels | None = None,
) -> torch.Tensor:
    """The scan as a layer runs it over a piece of a sequence: token by token in C where
    ``native`` runs float32 on the CPU, for every piece alike (one token's arithmetic
    whatever the piece, so a resumed sequence gets a cold run's bits); else `recurrent`
    for one token and `chunked` for more."""
    if (native := native_for(native, x)) is not None:
        return native.selective_scan_(x, dt, a, b, c, state)
    if x.shape[0] == 1:
        return recurrent(x, dt, a, b, c, state)
    return chunked(x, dt, a, b, c, state)


def recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """``x``, ``dt [T, D]`` (positive steps), ``a [D, N]`` (negative rates), ``b``, ``c
    [T, N]``, ``state [D, N]`` (float32, updated) → ``y [T, D]``."""
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        step = dt[t, :, None]
        state.mul_((step * a).exp()).add_((step * b[t]) * x[t, :, None])
        out[t] = (state * c[t]).sum(-1)
    return out


def chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """`recurrent`'s values, ``chunk`` tokens at a time."""
    out = torch.empty_like(x)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    for start in range(0, x.shape[0], chunk):
        rows = slice(start, min(start + chunk, x.shape[0]))
        step, count = dt[rows, :, None], dt[rows].shape[0]
        decay = (step * a).cumsum(0)  # [count, D, N]: log-decay from the chunk's start
        written = (step * b[rows, None, :]) * x[rows, :, None]  # [count, D, N]
        # pair[t, s] = exp(decay[t] - decay[s]) for s <= t: write s decayed to token t
        pair = (decay[:, None] - decay[None, :]).masked_fill(
            ~causal[:count, :count, None, None], -torch.inf
        )
        states = (pair.exp() * written[None]).sum(1) + decay.exp() * state
        out[rows] = (states * c[rows, None, :]).sum(-1)
        state.copy_(states[-1])
    return out
