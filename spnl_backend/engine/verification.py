"""Verifying drafts against the target, so that the output is exactly the target's.

Greedy: a draft is accepted while it equals the target's argmax at its position; the
first mismatch is replaced by the target's argmax. Sampling: draft ``x`` drawn from the
draft distribution ``q`` is accepted with probability ``min(1, p(x) / q(x))``; on
rejection the token is drawn from ``max(p - q, 0)`` normalised. Either way, after
``a`` accepted drafts one more token comes from the target (the correction, or a bonus
from the position after the last draft), so each token has the target's distribution.
"""

import torch

from ..sampling import SamplingParams
from .sampler import argmax_rows, distribution


def verify(
    target_logits: torch.Tensor,
    drafts: list[int],
    draft_probs: list[torch.Tensor],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, list[int]]:
    """``target_logits [k + 1, vocab]`` at the positions of the last known token and the
    ``k`` drafts → (accepted drafts, the tokens to append: those drafts and one more)."""
    if params.greedy:
        return _verify_greedy(argmax_rows(target_logits), drafts)
    target_probs = [distribution(row, params) for row in target_logits]
    return verify_sampled(target_probs, drafts, draft_probs, generator)


def _verify_greedy(choices: list[int], drafts: list[int]) -> tuple[int, list[int]]:
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
        accepted += 1
    return accepted, [*drafts[:accepted], choices[accepted]]


def verify_sampled(
    target_probs: list[torch.Tensor],
    drafts: list[int],
    draft_probs: list[torch.Tensor],
    generator: torch.Generator | None,
) -> tuple[int, list[int]]:
    """The rejection rule over probability rows (``len(drafts) + 1`` target rows)."""
    for i, token in enumerate(drafts):
        p, q = _same_width(target_probs[i], draft_probs[i])
        if float(torch.rand((), generator=generator)) * float(q[token]) < float(p[token]):
            continue
        residual = (p - q).clamp_min_(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had mass ~0
            residual = p
        return i, [*drafts[:i], _draw(residual, generator)]
    return len(drafts), [*drafts, _draw(target_probs[len(drafts)], generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights, 1, generator=generator))


def _same_width(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad the narrower distribution with zeros (a draft vocabulary padded differently:
    ids one model lacks have probability 0 under it)."""
    width = max(p.shape[-1], q.shape[-1])
    return (
        torch.nn.functional.pad(p, (0, width - p.shape[-1])),
        torch.nn.functional.pad(q, (0, width - q.shape[-1])),
    )
