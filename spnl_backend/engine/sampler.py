"""Next-token selection: greedy, or temperature with top-k, top-p and min-p, seeded per
sequence; and the log-probabilities a request asks for.

Each row is chosen on its own and may fail on its own: a row whose logits are NaN, or
whose distribution cannot be sampled, gives an `EngineError` for that sequence alone,
never an exception that would abandon the rest of the step.
"""

import math
from dataclasses import dataclass

import torch

from ..errors import EngineError, RequestError
from ..sampling import SamplingParams

# Temperatures below float32's smallest normal number would divide logits by zero (or by
# a denormal); the distribution has reached its limit long before (all mass on the tied
# largest logits), so they compute as this.
_MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int | EngineError]:
    """One token per row of ``logits [rows, vocab]`` (float32), or the row's error."""
    choices = _greedy_choices(logits)
    tokens: list[int | EngineError] = []
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        try:
            if p.greedy:
                tokens.append(_checked_greedy(*choices[row]))
            else:
                tokens.append(_sample_row(logits[row], p, generator))
        except Exception as exc:  # this row's failure is its request's alone
            tokens.append(row_error(exc))
    return tokens


@dataclass(frozen=True)
class TokenLogprobs:
    """A chosen token's log-probability and the ``top_logprobs`` likeliest tokens at its
    position (``(token id, log-probability)``, likeliest first), from the logits the
    sampler saw (`logits.adjust`), before temperature and the top-k/p and min-p filters."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprobs]:
    """The log-probabilities of ``tokens[i]`` under row ``i`` of ``logits``, each with the
    row's ``top`` likeliest."""
    logprobs = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    index = torch.tensor(tokens, device=logits.device)[:, None]
    chosen = logprobs.gather(1, index)[:, 0].tolist()
    if top:  # a token a constraint forbids (-inf) is no alternative: the list is shorter
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)
        tops = [
            tuple((i, v) for i, v in zip(row_ids, row_values, strict=True) if v != -math.inf)
            for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
        ]
    else:
        tops = [()] * len(tokens)
    return [
        TokenLogprobs(token, logprob, best)
        for token, logprob, best in zip(tokens, chosen, tops, strict=True)
    ]


def row_error(exc: Exception) -> EngineError | RequestError:
    """``exc`` as the error of the one request whose row raised it (a `RequestError`
    stays one: the request itself was the cause, as a grammar past its limits is)."""
    if isinstance(exc, EngineError | RequestError):
        return exc
    error = EngineError(f"choosing the next token failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """First index of each row's largest value (NaN counts as largest, as in torch)."""
    if logits.device.type == "cpu":  # numpy's is ~10x faster over a 262k vocabulary
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


def _greedy_choices(logits: torch.Tensor) -> list[tuple[int, float]]:
    """Each row's `argmax_rows` token and its logit, read without a torch op per row (a
    decode step finds torch's code out of the caches: each op skipped is a saving)."""
    if logits.device.type == "cpu":
        values = logits.numpy()
        tokens = values.argmax(-1).tolist()
        return [(token, float(values[row, token])) for row, token in enumerate(tokens)]
    tokens = argmax_rows(logits)
    chosen = logits[torch.arange(len(tokens), device=logits.device), tokens].tolist()
    return list(zip(tokens, chosen, strict=True))


def _checked_greedy(token: int, logit: float) -> int:
    if math.isnan(logit):  # argmax lands on a NaN whenever the row has one
        raise EngineError(_non_finite("NaN"))
    return token


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(distribution(logits, p), 1, generator=generator))


def distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The probabilities one row of logits samples from under ``p`` (not greedy).

    The largest logit is subtracted before dividing by the temperature, so no temperature
    overflows: the largest logits map to 0 and the rest to at most 0, down to -inf."""
    peak = logits.max()
    if not torch.isfinite(peak):
        raise EngineError(_non_finite("NaN" if torch.isnan(peak) else "infinite"))
    scaled = (logits - peak) / max(p.temperature, _MIN_TEMPERATURE)
    return torch.softmax(_filter(scaled, p.top_k, p.top_p, p.min_p), dim=-1)


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Mask all but the ``top_k`` largest logits, the smallest set holding ``top_p``
    mass, and those whose probability is below ``min_p`` times the largest one's (these
    logits are already shifted so that the largest is 0); the largest always stays."""
    if min_p > 0.0:
        logits = logits.masked_fill(logits < math.log(min_p), float("-inf"))
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the crossing token stays
        drop[0] = False  # even where top_p rounds to 0 in float32
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def _non_finite(kind: str) -> str:
    return (
        f"the model's logits for this request are {kind}, so no token can be chosen "
        "(the weights or the arithmetic produced non-finite values)"
    )
