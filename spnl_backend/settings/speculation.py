"""``MISTRALRS_SPECULATIVE_METHOD`` resolved: what proposes the tokens the target verifies.

The one place where ``auto`` is decided. An explicit method is kept as set (the engine
refuses it, with the reason, where it cannot run); ``auto`` is the draft where one is set,
else per-sequence n-gram lookup (`engine.ngram`) wherever speculation can run, else none.
N-gram lookup, not the suffix store, because a request's proposals then come from its own
tokens alone: with the shared store a sampled request's tokens would depend on what other
requests sent. The choice rests on docs/benchmarks.md ("N-gram speculation"): n-gram
lookup decoded 1.2-3.6x faster than none on every copying workload at 1 and 16 clients,
and no slower on free text, with the same greedy tokens.
"""

from dataclasses import dataclass
from typing import Literal

from .backend_settings import BackendSettings, env_name

SpeculationMethod = Literal["draft", "ngram", "suffix"]


@dataclass(frozen=True)
class SpeculationChoice:
    """The method that runs (None: no speculation) and why it was chosen."""

    method: SpeculationMethod | None
    why: str


def choose_speculation(
    settings: BackendSettings, *, tensor_parallel: bool, cache_rolls_back: bool | None
) -> SpeculationChoice:
    """What proposes tokens with these settings, given what the caller knows of the model:
    whether it runs under tensor parallelism, and whether its KV cache can drop tokens
    after a step (rejected proposals); None where no cache is built yet."""
    variable = env_name("speculative_method")
    asked = settings.speculative_method
    if asked != "auto":
        return SpeculationChoice(settings.speculative, f"{variable}={asked}")
    if settings.speculative == "draft":
        return SpeculationChoice("draft", f"{variable}=auto, and a draft is set")
    obstacle = _obstacle(settings, tensor_parallel, cache_rolls_back)
    if obstacle is not None:
        return SpeculationChoice(None, f"{variable}=auto, and {obstacle}; none runs")
    why = f"{variable}=auto, no draft is set: n-gram lookup in each sequence's own tokens"
    if cache_rolls_back is None and settings.kv_cache_compression != "none":
        why += " (none where the compression method's caches cannot drop tokens)"
    return SpeculationChoice("ngram", why)


def _obstacle(
    settings: BackendSettings, tensor_parallel: bool, cache_rolls_back: bool | None
) -> str | None:
    """Why n-gram speculation would not run here (set explicitly it is refused), or None."""
    if tensor_parallel:
        # Speculation under tensor parallelism takes the adapters away (engine.build).
        return (
            "under tensor parallelism speculation runs without LoRA adapters (none at start, "
            "none loaded later)"
        )
    if cache_rolls_back is False:
        return (
            f"the caches of {env_name('kv_cache_compression')}="
            f"{settings.kv_cache_compression} cannot drop rejected tokens (no truncate)"
        )
    return None
