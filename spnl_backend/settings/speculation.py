"""``MISTRALRS_SPECULATIVE_METHOD`` resolved: what proposes the tokens the target verifies.

The one place where ``auto`` is decided. An explicit method is kept as set (the engine
refuses it, with the reason, where it cannot run); ``auto`` is the draft where one is set,
else per-sequence n-gram lookup (`engine.ngram`) wherever speculation can run and has been
measured (not on models with state layers), else none.
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
    settings: BackendSettings,
    *,
    tensor_parallel: bool,
    state_layers: bool | None,
    cache_rolls_back: bool | None,
) -> SpeculationChoice:
    """What proposes tokens with these settings, given what the caller knows of the model:
    whether it runs under tensor parallelism, whether it has state layers (None: no model
    known yet), and whether its KV cache can drop tokens after a step (rejected
    proposals; None: no cache built yet)."""
    variable = env_name("speculative_method")
    asked = settings.speculative_method
    if asked != "auto":
        return SpeculationChoice(settings.speculative, f"{variable}={asked}")
    if settings.speculative == "draft":
        return SpeculationChoice("draft", f"{variable}=auto, and a draft is set")
    obstacle = _obstacle(settings, tensor_parallel, state_layers, cache_rolls_back)
    if obstacle is not None:
        return SpeculationChoice(None, f"{variable}=auto, and {obstacle}; none runs")
    why = f"{variable}=auto, no draft is set: n-gram lookup in each sequence's own tokens"
    unknown = []
    if state_layers is None:
        unknown.append("for a model with state layers")
    if cache_rolls_back is None and settings.kv_cache_compression != "none":
        unknown.append("where the compression method's caches cannot drop tokens")
    if unknown:
        why += f" (none {', and '.join(unknown)})"
    return SpeculationChoice("ngram", why)


def _obstacle(
    settings: BackendSettings,
    tensor_parallel: bool,
    state_layers: bool | None,
    cache_rolls_back: bool | None,
) -> str | None:
    """Why auto runs no n-gram speculation here, or None. Tensor parallelism and caches
    that cannot drop tokens refuse an explicit ngram too; state layers do not, but there
    each running sequence keeps 2 x (gamma + 1) more states to go back to
    (`engine.state_cache.copies_per_slot`), which the measurements did not cover."""
    if tensor_parallel:
        # Speculation under tensor parallelism takes the adapters away (engine.build).
        return (
            "under tensor parallelism speculation runs without LoRA adapters (none at start, "
            "none loaded later)"
        )
    if state_layers:
        return (
            "the model has state layers, where speculation keeps "
            f"{2 * (settings.speculative_gamma + 1)} more states per running sequence; set "
            "ngram to have it"
        )
    if cache_rolls_back is False:
        return (
            f"the caches of {env_name('kv_cache_compression')}="
            f"{settings.kv_cache_compression} cannot drop rejected tokens (no truncate)"
        )
    return None
