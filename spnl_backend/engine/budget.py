"""How many KV blocks the paged cache gets: from exactly one budget, checked before allocation."""

from dataclasses import dataclass

from ..errors import PlatformError, SettingsError
from ..memory import MIB
from ..models.config import ModelConfig
from ..settings.backend_settings import KvBudget, env_name

# Kept free beside the cache for what a step allocates (activations, logits, the slices a
# prefill dequantizes): a budget may take what is free less this.
STEP_RESERVE_BYTES = 256 * MIB


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_tokens * self.bytes_per_token


def plan_kv_cache(
    config: ModelConfig,
    budget: KvBudget,
    block_size: int,
    per_token: int,
    available_bytes: int,
) -> KVCachePlan:
    """Blocks for the budget, at ``per_token`` bytes of K and V per token; an error if it
    gives none, or more than ``available_bytes`` (what the process may still allocate)
    less `STEP_RESERVE_BYTES`. A memory fraction is of that same usable memory."""
    per_block = per_token * block_size
    usable = max(available_bytes - STEP_RESERVE_BYTES, 0)
    variable = env_name(f"paged_attn_{budget.kind}")
    if block_size > config.max_position_embeddings:
        raise SettingsError(
            f"MISTRALRS_PAGED_ATTN_BLOCK_SIZE={block_size} is larger than the model's "
            f"context ({config.max_position_embeddings} tokens); use a smaller block size"
        )
    if budget.kind == "context_len":
        num_blocks = -(-int(budget.value) // block_size)
    elif budget.kind == "memory_mb":
        num_blocks = int(budget.value * MIB) // per_block
    else:
        num_blocks = int(budget.value * usable) // per_block
    if num_blocks == 0:
        raise SettingsError(
            f"{variable}={budget.value:g} gives no KV-cache block: one block of {block_size} "
            f"tokens needs {per_block / MIB:.2f} MB ({per_token:,} bytes of K and V per token for "
            f"{_kv_layers(config)}); raise the budget"
        )
    plan = KVCachePlan(num_blocks, block_size, per_token)
    if plan.nbytes > usable:
        raise PlatformError(
            f"the KV cache for {variable}={budget.value:g}"
            f"{'' if budget.explicit else ' (the default)'} needs {plan.nbytes / MIB:,.0f} MB "
            f"({plan.num_tokens:,} tokens), but this process may allocate only "
            f"{available_bytes / MIB:,.0f} MB more on the device (its free memory, cgroup "
            f"and ulimit, the least of them), of which {STEP_RESERVE_BYTES // MIB} MB are "
            "kept for each step's activations; lower the budget"
        )
    return plan


def _kv_layers(config: ModelConfig) -> str:
    """The pool's layers in words: their count and shape, each shape's where they differ."""
    counts: dict[tuple[int, int], int] = {}
    for shape in config.kv_shapes:
        counts[shape] = counts.get(shape, 0) + 1
    return " + ".join(
        f"{count} layers x {heads} KV heads x {dim} dims" for (heads, dim), count in counts.items()
    )
