"""`SamplingParams`: how a request's tokens are picked and when its completion ends, as
the request checks made them (`request.sampling_params`) and the engine reads them."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .constrain.spec import ConstraintSpec
    from .reasoning import Reasoning

# A request's LoRA adapters: (name, factor) pairs by name (`SamplingParams.adapters`).
Adapters = tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens; ``max_tokens=None`` runs until EOS or the context ends."""

    max_tokens: int | None = None
    temperature: float = 0.6
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_p: float = 0.0  # drop tokens below this fraction of the likeliest one's probability
    # OpenAI's: subtracted once a token occurs in the completion, and per occurrence.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # CTRL's, over prompt and completion: a positive logit divided by it, a negative one
    # multiplied (1 is off).
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    stop_token_ids: frozenset[int] = frozenset()  # end the completion like EOS does
    ignore_eos: bool = False  # EOS is a token like any other: only length ends it
    logprobs: bool = False  # each token's log-probability, and its ``top_logprobs`` likeliest
    top_logprobs: int = 0
    # What the output must match (`constrain.spec`), compiled per sequence at admission.
    constraint: "ConstraintSpec | None" = None
    token_healing: bool = False
    # Special tokens the output's text keeps (reasoning markers such as gpt-oss's
    # <|channel|>, which a reasoning parser reads), beside the constraint's own.
    kept_token_ids: tuple[int, ...] = ()
    keep_stop: bool = False  # the text ends with the stop string it matched, not before it
    # The most tokens a chat answer's reasoning may take before the engine closes it
    # (`reasoning.gate`); within max_tokens, which counts the whole output.
    reasoning_budget: int | None = None
    # A chat answer's reasoning format and start, set once the prompt is templated: with
    # a budget or a constraint, the engine follows where the reasoning ends.
    reasoning: "Reasoning | None" = None
    # Speculative decoding for this request: None, the backend's (its method and gamma);
    # 0, off; n, at most n proposed tokens per step.
    speculative: int | None = None
    # The LoRA adapters the request runs with: (name it was loaded under, factor), the
    # factor multiplying the adapter's own scale (llama-server's "scale"); by name, none
    # twice, none at 0 (`request.adapter_set`). Empty: the base model. Each row adds
    # every one's product; the engine refuses a name it has not loaded.
    adapters: Adapters = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties or biases)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )
