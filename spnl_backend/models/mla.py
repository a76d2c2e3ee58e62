"""Multi-head latent attention (DeepSeek-V2 and V3): every head's keys and values are
made from one latent per token, so the cache keeps the latent (normed) and the one
rotated key all heads share, not K and V per head.

The step attends in the absorbed form: each head's non-rotated query is taken through
its key projection into the latent's space (``k_b_proj``), so scores are products with
the cached latents themselves; the heads' outputs, weighted sums of latents, are taken
through their value projections (``v_b_proj``) after. The expanded form (`expanded`:
keys and values per head, as the checkpoint's ``kv_b_proj`` makes them) is the same
arithmetic regrouped, and the tests hold the two equal.

``k_b_proj [heads, kv_lora_rank, qk_nope_head_dim]`` and ``v_b_proj [heads, v_head_dim,
kv_lora_rank]`` are the checkpoint's ``kv_b_proj`` split per head (llama.cpp's GGUF files
store them split so; `models.arch.deepseek` splits a checkpoint's).
"""

import torch
from torch import nn

from ..kernels.attention_ref import attention_ref
from ..kernels.cpu import CpuKernels
from .config import ModelConfig
from .layers import AttentionMixer
from .linear import Linear
from .norms import RMSNorm
from .rope import RotaryTables
from .step_attention import StepAttention

# transformers and DeepSeek's own code norm the two low-rank bottlenecks with their
# RMSNorm's default eps, whatever the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class HeadProjection(nn.Module):
    """A projection per head: ``weight [heads, out, in]``; ``x [T, heads, in]`` →
    ``[T, heads, out]``."""

    def __init__(self, heads: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return torch.einsum("thi,hoi->tho", x, weight)


class LatentAttention(nn.Module):
    """One DeepSeek attention layer; its parameters carry the checkpoint's names."""

    def __init__(
        self, config: ModelConfig, mixer: AttentionMixer, native: CpuKernels | None = None
    ) -> None:
        super().__init__()
        mla = mixer.latent
        assert mla is not None
        self.mla, self.spec = mla, mixer.spec
        self.num_heads = heads = mixer.num_heads
        hidden, q_size = config.hidden_size, heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_size, bias=False)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, native=native)
            self.q_b_proj = Linear(mla.q_lora_rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_width, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, native=native)
        self.k_b_proj = HeadProjection(heads, mla.kv_lora_rank, mla.qk_nope_head_dim)
        self.v_b_proj = HeadProjection(heads, mla.v_head_dim, mla.kv_lora_rank)
        self.o_proj = Linear(heads * mla.v_head_dim, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, rotary: RotaryTables | None, attention: StepAttention
    ) -> torch.Tensor:
        """``x [T, hidden]`` (normed) → ``[T, hidden]``: the absorbed form, the cache given
        each token's latent and rotated key ``[T, 1, latent_width]``."""
        q_nope, q_rope, latent, k_rope = self.parts(x, rotary)
        queries = torch.cat([self.k_b_proj(q_nope), q_rope], dim=-1)
        keys = torch.cat([latent.unsqueeze(1), k_rope], dim=-1)
        out = attention.attend(queries, keys, None, self.spec)  # [T, heads, kv_lora_rank]
        return self.o_proj(self.v_b_proj(out).flatten(1))

    def parts(
        self, x: torch.Tensor, rotary: RotaryTables | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries' non-rotated and rotated parts ``[T, heads, *]``, the normed latents
        ``[T, kv_lora_rank]`` and the rotated shared keys ``[T, 1, qk_rope_head_dim]``."""
        mla, tokens = self.mla, x.shape[0]
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[:, : mla.kv_lora_rank].contiguous())
        k_rope = compressed[:, None, mla.kv_lora_rank :].contiguous()
        if rotary is None:  # (every DeepSeek layer rotates; the probe path passes tables)
            raise ValueError("a latent attention layer needs its rotary tables")
        return q_nope, rotary.apply(q_rope.contiguous()), latent, rotary.apply(k_rope)

    def expanded(self, x: torch.Tensor, rotary: RotaryTables) -> torch.Tensor:
        """One sequence's causal attention ``x [T, hidden]`` → ``[T, hidden]`` in the
        expanded form: keys and values made per head from the latents, as the checkpoint's
        ``kv_b_proj`` would (the absorbed form's twin)."""
        mla = self.mla
        q_nope, q_rope, latent, k_rope = self.parts(x, rotary)
        heads_latent = latent.unsqueeze(1).expand(-1, self.num_heads, -1)
        k_nope = torch.einsum("thr,hrn->thn", heads_latent, self.k_b_proj.weight.to(x.dtype))
        values = torch.einsum("thr,hvr->thv", heads_latent, self.v_b_proj.weight.to(x.dtype))
        keys = torch.cat([k_nope, k_rope.expand(-1, self.num_heads, -1)], dim=-1)
        queries = torch.cat([q_nope, q_rope], dim=-1)
        out = attention_ref(queries, keys, values, self.spec.scoring, context_len=0)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * mla.v_head_dim))
