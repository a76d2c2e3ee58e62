"""What the sampler sees: the model's logits with each row's penalties, biases and
constraint mask applied, batched on the logits' device.

Order: the repetition penalty, then the presence and frequency penalties, then the
logit bias, then the constraint mask. The log-probabilities a request asks for are the
log-softmax of these logits (before temperature, top-k, top-p and min-p), so they do
not depend on how the token was then drawn.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..sampling import SamplingParams
from .token_bitmask import Constraint, apply_bitmask, new_bitmask


@dataclass(frozen=True, slots=True)
class RowHistory:
    """The tokens one row of logits follows: a sequence's prompt and output, and, for a
    speculative verification row, the drafts before it."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    after: Sequence[int] = ()

    def completion(self) -> list[int]:
        return [*self.output_ids, *self.after]


def adjust(
    logits: torch.Tensor, rows: Sequence[RowHistory], bitmask: torch.Tensor | None = None
) -> torch.Tensor:
    """``logits [rows, vocab]`` (float32) with every row's penalties and biases applied,
    and ``bitmask`` (one row each, or None: no row constrained); a new tensor where
    anything changes."""
    penalized = [i for i, row in enumerate(rows) if row.params.adjusts_logits]
    if not penalized and bitmask is None:
        return logits
    logits = logits.clone()
    if penalized:
        logits[penalized] = _penalize(logits[penalized], [rows[i] for i in penalized])
    if bitmask is not None:
        apply_bitmask(logits, bitmask)
    return logits


def fill_masks(
    constraints: Sequence[Constraint | None], vocab_size: int
) -> tuple[torch.Tensor | None, dict[int, Exception]]:
    """One bitmask row per constraint (every token allowed where there is none, or it
    is no longer active; None where no row is constrained), and the rows whose matcher
    failed, with its error (their rows allow every token: they are not sampled)."""
    if not any(c is not None and c.active for c in constraints):
        return None, {}
    bitmask = new_bitmask(len(constraints), vocab_size)
    groups: dict[type, list[tuple[Constraint, int]]] = {}
    for row, constraint in enumerate(constraints):
        if constraint is not None and constraint.active:
            groups.setdefault(type(constraint), []).append((constraint, row))
        else:
            bitmask[row] = -1  # every bit set
    errors: dict[int, Exception] = {}
    for kind, members in groups.items():
        fill_rows = getattr(kind, "fill_rows", None)  # a kind that fills many rows at once
        if fill_rows is not None and len(members) > 1:
            errors.update(fill_rows(bitmask, members))
            continue
        for constraint, row in members:
            try:
                constraint.fill(bitmask, row)
            except Exception as exc:  # this sequence's matcher alone
                errors[row] = exc
    for row in errors:
        bitmask[row] = -1
    return bitmask, errors


def _penalize(logits: torch.Tensor, rows: list[RowHistory]) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[-1]
    params = [row.params for row in rows]
    repeat = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if repeat:
        seen = _counts([rows[i].prompt_ids + rows[i].completion() for i in repeat], vocab, device)
        penalty = _column([params[i].repetition_penalty for i in repeat], device)
        part = logits[repeat]
        scaled = torch.where(part > 0, part / penalty, part * penalty)
        logits[repeat] = torch.where(seen > 0, scaled, part)
    counted = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if counted:
        counts = _counts([rows[i].completion() for i in counted], vocab, device)
        presence = _column([params[i].presence_penalty for i in counted], device)
        frequency = _column([params[i].frequency_penalty for i in counted], device)
        logits[counted] -= frequency * counts + presence * (counts > 0)
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    for i in biased:  # a few entries per request: one indexed add each
        ids, values = zip(*params[i].logit_bias, strict=True)
        index = torch.tensor(ids, device=device)
        logits[i, index] += torch.tensor(values, device=device, dtype=logits.dtype)
    return logits


def _counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each list: float32 ``[lists, vocab]``."""
    width = max((len(ids) for ids in token_lists), default=0)
    ids = torch.zeros(len(token_lists), max(width, 1), dtype=torch.int64)
    weights = torch.zeros(ids.shape)
    for row, tokens in enumerate(token_lists):
        tokens = [t for t in tokens if t < vocab]  # a draft's id past the target's logits
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        weights[row, : len(tokens)] = 1.0
    counts = torch.zeros(len(token_lists), vocab, device=device)
    return counts.scatter_add_(1, ids.to(device), weights.to(device))


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, device=device, dtype=torch.float32)[:, None]
