"""The torch twin of the fused mixture-of-experts kernel (`triton_moe`): every
(token, slot) pair through its expert's gated MLP, weighted, then each token's slots summed
in slot order."""

import torch
import torch.nn.functional as F


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """``x [T, H]`` through the experts ``w13 [E, 2I, H]`` (gate rows, then up) and
    ``w2 [E, H, I]``, each token's ``topk_ids [T, k]`` weighted by ``topk_weights`` →
    ``[T, H]`` in float32."""
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
    return pairs.view(tokens, top_k, -1).sum(dim=1)
