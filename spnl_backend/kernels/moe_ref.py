"""The torch twin of the fused mixture-of-experts kernel (`triton_moe`): every
(token, slot) pair through its expert's gated MLP, weighted, then each token's slots summed
in slot order. Experts kept in GGML blocks are dequantized first, then taken as floats."""

from typing import Protocol

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType


class PackedExperts(Protocol):
    """One projection of every expert as GGML blocks of one type
    (`quant.linear.QuantizedExperts`)."""

    data: torch.Tensor  # [experts, rows, row_bytes] uint8
    qtype: GGMLQuantizationType
    shape: tuple[int, int]  # one expert's (rows, cols)

    def dequantize(self) -> torch.Tensor: ...  # [experts, rows, cols] float32


# A projection of every expert: float ``[E, rows, cols]``, or packed.
Experts = torch.Tensor | PackedExperts


def fused_moe_ref(
    x: torch.Tensor,
    w13: Experts,
    w2: Experts,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """``x [T, H]`` through the experts ``w13 [E, 2I, H]`` (gate rows, then up) and
    ``w2 [E, H, I]``, each token's ``topk_ids [T, k]`` weighted by ``topk_weights`` →
    ``[T, H]`` in float32."""
    w13, w2 = _floats(w13, x.device), _floats(w2, x.device)
    tokens, top_k = topk_ids.shape
    inner = w13.shape[1] // 2
    pairs = torch.zeros(tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.flatten()
    for expert in torch.unique(flat).tolist():
        pair = (flat == expert).nonzero().flatten()
        h = x[pair // top_k].float() @ w13[expert].float().T
        act = F.silu(h[:, :inner]) * h[:, inner:]
        weights = topk_weights.flatten()[pair].float()[:, None]
        pairs[pair] = (act @ w2[expert].float().T) * weights
    return sum_slots(pairs, top_k)


def sum_slots(pairs: torch.Tensor, top_k: int) -> torch.Tensor:
    """``pairs [T * top_k, H]`` (token after token, each token's slots in order) summed per
    token, slot after slot: a reduction kernel may order its sums by the tensor's size, and
    a token's output must not depend on how many share its step."""
    slots = pairs.view(-1, top_k, pairs.shape[-1])
    out = slots[:, 0].clone()
    for slot in range(1, top_k):
        out += slots[:, slot]
    return out


def _floats(w: Experts, device: torch.device) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w.dequantize().to(device)
