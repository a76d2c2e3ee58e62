"""PolarQuant / TurboQuant: rotate each head vector at random, then quantize coordinates.

After a random orthogonal rotation, the coordinates of any unit vector in ``dim``
dimensions are close to ``N(0, 1/dim)`` whatever the data, so one precomputed Lloyd-Max
codebook for the normal distribution is near-optimal for every model and needs no
calibration. A record is the packed codes plus one float16 gain per vector (the
least-squares scale of the codebook vector, which is never worse than the vector's norm).
Expected relative squared error ``|x - x'|^2 / |x|^2`` is at most the codebook's
distortion `DISTORTION` (about 0.117, 0.035 and 0.0095 at 2, 3 and 4 bits).

Three refinements, the last aimed at keys, whose errors reach every attention score:

- centring: a mean per layer and head is subtracted before quantizing (the rest is what
  the codes spend their precision on). The engine gives the model's means over a short
  reference text (`KVGeometry.kv_means`); without them, each layer's first stored
  vectors set it. Any fixed vector is exact to subtract, so a poor centre costs
  precision, not correctness;
- the anchor: the first vector each layer stores (position 0, the attention sink that
  most heads attend heavily, so that its error is not averaged away) is kept exactly,
  and every later vector equal to it within `ANCHOR_TOLERANCE` (position 0 of every
  sequence that starts with the same token) is stored as a reference to it: a NaN gain;
- outliers: the ``outliers`` largest coordinates of each centred vector are kept as
  float16 with their indices, outside the rotation, which would otherwise spread them
  over all coordinates (real keys put a third to a half of their energy in 8 of 256).

The optional QJL stage spends one more bit per coordinate on the residual ``r = y - y'``
of the rotated codes: it stores ``sign(S r)`` for a second random orthogonal ``S`` and
``|r|``, from which ``q.r`` is estimated without bias as
``sqrt(pi / 2) / sqrt(dim) * |r| * (S q) . sign(S r)``: the attention's logit bias.
"""

import copy
import math
from functools import cache

import torch

from ..kernels.attention_ref import raw_scores
from .codecs import bytes_float, float_bytes, pack_bits, unpack_bits

# Lloyd-Max mean squared error of the unit normal at 1-4 bits (Max, 1960).
DISTORTION = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}
ROTATION_SEED = 0x5EED
ANCHOR_TOLERANCE = 1e-3  # of the anchor's largest coordinate: rounding, not a new vector
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
    """Codes of the rotated, centred vector; its gain; outliers; optionally QJL bits."""

    def __init__(
        self,
        num_layers: int,
        head_dim: int,
        bits: int,
        device: torch.device,
        *,
        qjl: bool = False,
        outliers: int = 0,
        centers: torch.Tensor | None = None,
    ) -> None:
        """``centers [num_layers, heads, head_dim]``: fixed centres (None: each layer's
        first stored vectors set its own)."""
        if head_dim % 8:
            raise ValueError(f"PolarQuant packs codes in groups of 8; head_dim {head_dim} is not")
        if outliers and head_dim > 256:
            raise ValueError(f"outlier indices are one byte; head_dim {head_dim} is over 256")
        self.head_dim, self.bits, self.outliers, self.qjl = head_dim, bits, outliers, qjl
        self.rotation = random_orthogonal(head_dim, ROTATION_SEED, device)
        self.sketch = random_orthogonal(head_dim, QJL_SEED, device) if qjl else None
        scale = 1.0 / math.sqrt(head_dim)  # coordinates of a rotated unit vector
        self.codebook = torch.tensor(normal_codebook(bits), device=device) * scale
        self.edges = (self.codebook[1:] + self.codebook[:-1]) / 2
        sizes = [head_dim * bits // 8, 2, outliers, 2 * outliers]
        sizes += [head_dim // 8, 4] if qjl else [0, 0]
        self.fields = _Fields(sizes)
        self.record_bytes = sum(sizes)
        self.centers: list[torch.Tensor | None] = (
            [None] * num_layers if centers is None else [c.float().to(device) for c in centers]
        )
        self.anchors: list[torch.Tensor | None] = [None] * num_layers

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.centers[layer] is None:
            self.centers[layer] = x.mean(0)
        if self.anchors[layer] is None:
            self.anchors[layer] = x[0].clone()
        anchored = self._anchored(layer, x).unsqueeze(-1)
        x = x - self.centers[layer]
        if self.outliers:
            index = x.abs().topk(self.outliers, dim=-1).indices
            kept = x.gather(-1, index).masked_fill(anchored, 0.0)
            x = x.scatter(-1, index, 0.0)
        y = x @ self.rotation
        norm = y.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        codes = torch.bucketize(y / norm, self.edges)
        unit = self.codebook[codes]
        gain = (y * unit).sum(-1, keepdim=True) / (unit * unit).sum(-1, keepdim=True)
        gain = gain.masked_fill(anchored, math.nan)
        parts = [pack_bits(codes, self.bits), gain.half().view(torch.uint8)]
        if self.outliers:
            parts += [index.to(torch.uint8), kept.half().view(torch.uint8)]
        if self.qjl:
            residual = (y - gain * unit).masked_fill(anchored, 0.0)
            signs = (residual @ self.sketch.T) >= 0
            parts += [pack_bits(signs, 1), float_bytes(residual.norm(dim=-1, keepdim=True))]
        return torch.cat(parts, dim=-1)

    def _anchored(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Which vectors of ``x [T, heads, dim]`` (float32) are the layer's anchor, which
        `encode` has set: ``[T, heads]``."""
        anchor = self.anchors[layer]
        return (x - anchor).abs().amax(-1) <= ANCHOR_TOLERANCE * anchor.abs().amax(-1)

    def decode(self, layer: int, records: torch.Tensor) -> torch.Tensor:
        """The rotated codes with the centre (the anchor where a record refers to it):
        everything but the outliers."""
        codes = unpack_bits(self.fields.get(records, 0), self.bits)
        gain = self.gains(records)
        coded = self.codebook[codes] * gain + self.centers[layer] @ self.rotation
        if self.anchors[layer] is None:
            return coded
        return torch.where(gain.isnan(), self.anchors[layer] @ self.rotation, coded)

    def gains(self, records: torch.Tensor) -> torch.Tensor:
        """float32 ``[..., 1]`` (NaN: the record is the anchor)."""
        return self.fields.get(records, 1).contiguous().view(torch.float16).float()

    def dequantize(self, layer: int, records: torch.Tensor) -> torch.Tensor:
        return self.decode(layer, records) @ self.rotation.T + self._outliers(records)

    def scores(self, layer: int, q: torch.Tensor, records: torch.Tensor) -> torch.Tensor:
        scores = raw_scores(q.float() @ self.rotation, self.decode(layer, records))
        if self.outliers:
            scores = scores + raw_scores(q, self._outliers(records))
        bias = self.logit_bias(layer, q, records)
        return scores if bias is None else scores + bias

    def logit_bias(self, layer: int, q: torch.Tensor, records: torch.Tensor) -> torch.Tensor | None:
        """QJL's estimate of ``q . r`` for queries ``[nq, heads, dim]`` and the keys'
        records ``[nk, kv_heads, bytes]``: ``[heads, nq, nk]``."""
        if not self.qjl:
            return None
        signs = unpack_bits(self.fields.get(records, 4), 1).float() * 2 - 1
        residual_norm = bytes_float(self.fields.get(records, 5))  # [nk, kv_heads, 1]
        sketched = (q.float() @ self.rotation) @ self.sketch.T
        coefficient = math.sqrt(math.pi / 2) / math.sqrt(self.head_dim)
        return coefficient * raw_scores(sketched, signs * residual_norm)

    def _outliers(self, records: torch.Tensor) -> torch.Tensor:
        """The kept coordinates, in place in an otherwise zero ``[T, heads, dim]``."""
        out = torch.zeros((*records.shape[:-1], self.head_dim), device=records.device)
        if self.outliers:
            index = self.fields.get(records, 2).to(torch.int64)
            kept = self.fields.get(records, 3).contiguous().view(torch.float16).float()
            out.scatter_(-1, index, kept)
        return out

    def fork(self) -> "PolarCodec":
        twin = copy.copy(self)
        twin.centers, twin.anchors = list(self.centers), list(self.anchors)
        return twin


class _Fields:
    """Byte ranges of a record's fields, in order."""

    def __init__(self, sizes: list[int]) -> None:
        self.bounds = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]

    def get(self, records: torch.Tensor, field: int) -> torch.Tensor:
        start, end = self.bounds[field]
        return records[..., start:end]
