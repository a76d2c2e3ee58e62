"""PolarQuant / TurboQuant: rotate each head vector at random, then quantize coordinates.

After a random orthogonal rotation, the coordinates of any unit vector in ``dim``
dimensions are close to ``N(0, 1/dim)`` whatever the data, so one precomputed Lloyd-Max
codebook for the normal distribution is near-optimal for every model and needs no
calibration. A record is the packed codes plus one float32 gain per vector (the
least-squares scale of the codebook vector, which is never worse than the vector's norm).
Expected relative squared error ``|x - x'|^2 / |x|^2`` is at most the codebook's
distortion `DISTORTION` (about 0.117, 0.035 and 0.0095 at 2, 3 and 4 bits).

The optional QJL stage (keys only) spends one more bit per coordinate on the residual
``r = y - y'``: it stores ``sign(S r)`` for a second random orthogonal ``S`` and ``|r|``,
from which ``q.r`` is estimated without bias as
``sqrt(pi / 2) / sqrt(dim) * |r| * (S q) . sign(S r)``; that estimate, scaled like the
scores, is the attention's logit bias.
"""

import math
from functools import cache

import torch

from .codecs import bytes_float, float_bytes, pack_bits, unpack_bits

# Lloyd-Max mean squared error of the unit normal at 1-4 bits (Max, 1960).
DISTORTION = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}
ROTATION_SEED = 0x5EED
QJL_SEED = 0x0A11


@cache
def normal_codebook(bits: int) -> tuple[float, ...]:
    """The Lloyd-Max centroids for ``N(0, 1)`` at ``bits`` bits, ascending: each is the
    mean of its cell (closed form for the normal), cells split halfway between them."""
    levels = 1 << bits
    quantiles = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    centroids = math.sqrt(2.0) * torch.erfinv(2 * quantiles - 1)
    infinity = torch.tensor([math.inf], dtype=torch.float64)
    for _ in range(10_000):
        edges = torch.cat([-infinity, (centroids[1:] + centroids[:-1]) / 2, infinity])
        cdf = 0.5 * (1 + torch.erf(edges / math.sqrt(2.0)))
        pdf = torch.exp(-0.5 * edges.nan_to_num(posinf=50, neginf=-50) ** 2)
        moved = (pdf[:-1] - pdf[1:]) / math.sqrt(2 * math.pi) / (cdf[1:] - cdf[:-1])
        if float((moved - centroids).abs().max()) < 1e-10:
            break
        centroids = moved
    return tuple(moved.tolist())


@cache
def random_orthogonal(dim: int, seed: int, device: torch.device) -> torch.Tensor:
    """A fixed Haar-random orthogonal ``[dim, dim]`` float32 matrix (QR of a Gaussian)."""
    generator = torch.Generator().manual_seed(seed)
    gaussian = torch.randn((dim, dim), generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    q = q * torch.sign(torch.diagonal(r))  # makes the distribution Haar
    return q.float().to(device)


class PolarCodec:
    """``bits``-bit codes of the rotated unit vector, a gain, and optionally QJL bits."""

    def __init__(self, head_dim: int, bits: int, device: torch.device, qjl: bool = False):
        if head_dim % 8:
            raise ValueError(f"PolarQuant packs codes in groups of 8; head_dim {head_dim} is not")
        self.head_dim, self.bits, self.has_logit_bias = head_dim, bits, qjl
        self.rotation = random_orthogonal(head_dim, ROTATION_SEED, device)
        self.sketch = random_orthogonal(head_dim, QJL_SEED, device) if qjl else None
        scale = 1.0 / math.sqrt(head_dim)  # coordinates of a rotated unit vector
        self.codebook = torch.tensor(normal_codebook(bits), device=device) * scale
        self.edges = (self.codebook[1:] + self.codebook[:-1]) / 2
        self.code_bytes = head_dim * bits // 8
        self.record_bytes = self.code_bytes + 4 + (head_dim // 8 + 4 if qjl else 0)

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        y = x.float() @ self.rotation
        norm = y.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        codes = torch.bucketize(y / norm, self.edges)
        unit = self.codebook[codes]
        gain = (y * unit).sum(-1, keepdim=True) / (unit * unit).sum(-1, keepdim=True)
        parts = [pack_bits(codes, self.bits), float_bytes(gain)]
        if self.has_logit_bias:
            residual = y - gain * unit
            signs = (residual @ self.sketch.T) >= 0
            parts += [pack_bits(signs, 1), float_bytes(residual.norm(dim=-1, keepdim=True))]
        return torch.cat(parts, dim=-1)

    def decode(self, layer: int, records: torch.Tensor) -> torch.Tensor:
        codes = unpack_bits(records[..., : self.code_bytes], self.bits)
        gain = bytes_float(records[..., self.code_bytes : self.code_bytes + 4])
        return self.codebook[codes] * gain

    def logit_bias(self, q: torch.Tensor, records: torch.Tensor, scale: float) -> torch.Tensor:
        """``scale * estimate(q . r)`` for rotated queries ``q [nq, heads, dim]`` and the
        keys' records ``[nk, kv_heads, bytes]`` → ``[heads, nq, nk]``."""
        start = self.code_bytes + 4
        signs = unpack_bits(records[..., start : start + self.head_dim // 8], 1)
        signs = signs.float() * 2 - 1  # [nk, kv_heads, dim]
        residual_norm = bytes_float(records[..., start + self.head_dim // 8 :])
        groups = q.shape[1] // records.shape[1]
        sketched = (q.float() @ self.sketch.T).transpose(0, 1)  # [heads, nq, dim]
        signs = signs.repeat_interleave(groups, dim=1).permute(1, 2, 0)  # [heads, dim, nk]
        norms = residual_norm.repeat_interleave(groups, dim=1).permute(1, 2, 0)  # [heads,1,nk]
        coefficient = scale * math.sqrt(math.pi / 2) / math.sqrt(self.head_dim)
        return coefficient * (sketched @ signs) * norms

    def fork(self) -> "PolarCodec":
        return self
