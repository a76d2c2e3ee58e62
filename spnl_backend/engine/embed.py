"""Text embeddings: the model's last hidden states over each text, pooled and normalized.

The texts of a batch run as one forward pass packed sequence after sequence, with no KV
cache: each attends causally within itself only (`SelfAttention`), and every row of the
model's layers is computed as a one-row pass computes it (the engine's batch invariance),
so a text's embedding does not depend on what it came with. Pooling: ``last`` (the last
token's state, which has seen the whole text: what causal embedding models such as
e5-mistral and Qwen3-Embedding use), ``mean`` over the tokens, or ``first`` (a
classification token); a GGUF's ``pooling_type`` says which, ``last`` otherwise.
"""

from typing import Literal

import torch

from ..kernels.attention_ref import attention_ref
from ..models.step_attention import AttentionSpec, StateSegment, WithoutLayerBlocks
from ..models.transformer import CausalLM
from .state_cache import StateCache

Pooling = Literal["last", "mean", "first"]
POOLINGS: tuple[Pooling, ...] = ("last", "mean", "first")


class SelfAttention(WithoutLayerBlocks):
    """The attention backend of a cache-free pass: each packed text attends causally over
    its own tokens alone (and, for state layers, runs from a fresh state: ``states``). A
    layer reading another's K and V (``spec.shared_kv``) gets those its layer gave."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.states: list[StateSegment] = []
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by KV place

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        if spec.shared_kv:
            k, v = self.kv[spec.layer]
        if spec.latent and k is not None:  # a latent layer's values: its keys' first dims
            v = k[..., : spec.latent]
        assert k is not None
        assert v is not None
        self.kv[spec.layer] = (k, v)
        outputs, start = [], 0
        for length in self.lengths:
            rows = slice(start, start + length)
            outputs.append(attention_ref(q[rows], k[rows], v[rows], spec.scoring, context_len=0))
            start += length
        return torch.cat(outputs)


@torch.inference_mode()
def embed(
    model: CausalLM, device: torch.device, texts: list[list[int]], pooling: Pooling
) -> torch.Tensor:
    """``texts`` (token ids, none empty) → their embeddings ``[len(texts), hidden]`` in
    float32 on the CPU, each of unit length."""
    lengths = [len(ids) for ids in texts]
    input_ids = torch.tensor([t for ids in texts for t in ids], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    attention = SelfAttention(lengths)
    if model.config.num_state_layers:  # each text from a fresh state
        table = model.model.embed_tokens  # a quantized one keeps its dtype, not a weight
        dtype = table.dtype if hasattr(table, "weight_q") else table.weight.dtype
        cache = StateCache(model.config, dtype, device)
        attention.states = cache.standalone(lengths)
    hidden = model(input_ids, positions, attention).float()
    pooled = torch.stack([_pool(part, pooling) for part in hidden.split(lengths)])
    return torch.nn.functional.normalize(pooled, dim=-1).cpu()


def _pool(states: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    if pooling == "mean":
        return states.mean(dim=0)
    return states[0] if pooling == "first" else states[-1]


def chunk_end(lengths: list[int], start: int, budget: int) -> int:
    """Where the chunk of texts from ``start`` ends that packs at most ``budget`` tokens
    (one text at least: a longer one runs alone, whole, as it needs no cache)."""
    end, tokens = start + 1, lengths[start]
    while end < len(lengths) and tokens + lengths[end] <= budget:
        tokens += lengths[end]
        end += 1
    return end
