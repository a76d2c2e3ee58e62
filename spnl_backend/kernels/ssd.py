"""Mamba-2's selective state space (the SSD scan), in torch: the twin of the C kernel.

Per head the state is a matrix ``h [P, N]`` (a state of N per channel); each token decays
it by ``exp(dt_t A)``, writes its input scaled by its step under its B, and reads it out
with its C:

    h = h * exp(dt_t A);  h = h + (dt_t x_t) B_t^T;  y_t = h C_t

`recurrent` applies that token by token (decode); `chunked` gives the same values a
chunk of tokens at a time (prefill): within a chunk the scan is a masked, decayed
attention of C over B, and the state enters and leaves each chunk once. Both take one
sequence's heads as the batch and update ``state`` in place; the skip term D x is the
layer's. `scan` is what the layer calls: the compiled kernel (the twin of `recurrent`)
where it runs, else these.
"""

import torch
import torch.nn.functional as F

from .cpu import CpuKernels
from .ops import native_for

CHUNK = 256


def scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
    native: CpuKernels | None = None,
) -> torch.Tensor:
    """The scan as a layer runs it over a piece of a sequence: token by token in C where
    ``native`` runs float32 on the CPU, for every piece alike (one token's arithmetic
    whatever the piece, so a resumed sequence gets a cold run's bits); else `recurrent`
    for one token and `chunked` for more."""
    if (native := native_for(native, x)) is not None:
        return native.ssd_scan_(x, dt, a, b, c, state)
    if x.shape[0] == 1:
        return recurrent(x, dt, a, b, c, state)
    return chunked(x, dt, a, b, c, state, chunk)


def recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """``x [T, H, P]``, ``dt [T, H]`` (positive steps), ``a [H]`` (negative rates), ``b``,
    ``c [T, H, N]`` (each head's), ``state [H, P, N]`` (float32, updated) → ``y [T, H, P]``."""
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        state.mul_((dt[t] * a).exp()[:, None, None])
        state.add_((dt[t, :, None] * x[t])[:, :, None] * b[t, :, None, :])
        out[t] = (state * c[t, :, None, :]).sum(-1)
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
    """`recurrent`'s values, ``chunk`` tokens at a time (the last chunk padded with tokens
    that change nothing: a zero step neither decays nor writes)."""
    length = x.shape[0]
    pad = -length % chunk
    written = x * dt[..., None]  # what each token writes, scaled by its step
    # [H, chunks, C, P or N] and [H, chunks, C]
    written, b, c = (_chunks(F.pad(t, (0, 0, 0, 0, 0, pad)), chunk) for t in (written, b, c))
    decay = _chunks(F.pad(dt * a, (0, 0, 0, pad)), chunk).cumsum(-1)  # log, from chunk start
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    pair_decay = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, -torch.inf).exp()
    inner = ((c @ b.transpose(-1, -2)) * pair_decay) @ written  # the chunk's own tokens
    from_start = decay.exp()[..., None]  # the state entering the chunk, decayed to each token
    to_end = (decay[..., -1:] - decay).exp()[..., None]  # each write, decayed to the chunk's end
    chunk_decay = decay[..., -1].exp()
    out = torch.empty_like(inner)
    for i in range(written.shape[1]):
        out[:, i] = inner[:, i] + (c[:, i] @ state.transpose(-1, -2)) * from_start[:, i]
        writes = (written[:, i] * to_end[:, i]).transpose(-1, -2) @ b[:, i]
        state.mul_(chunk_decay[:, i, None, None]).add_(writes)
    return out.flatten(1, 2)[:, :length].transpose(0, 1)


def _chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[T, H, ...]`` → ``[H, T / chunk, chunk, ...]``."""
    x = x.transpose(0, 1)
    return x.reshape(x.shape[0], -1, chunk, *x.shape[2:])
