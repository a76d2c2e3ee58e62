"""A direct reference for PIC prompts, written from the rule alone: the whole sequence
recomputed every token, attention under a dense mask, positions counted here."""

import torch

from spnl_backend.models.step_attention import WithoutLayerBlocks
from spnl_backend.models.transformer import CausalLM


def reference_layout(pieces: list[tuple[str, int]], scheme: str) -> tuple[list[int], list[int]]:
    """Each token's element (0: cross) and position, for ``(kind, length)`` pieces."""
    elements: list[int] = []
    positions: list[int] = []
    cross = 0  # the next cross position
    element = 0
    group_start, longest, in_group = 0, 0, False
    for kind, length in pieces:
        if kind == "plus":
            if not in_group:
                in_group, group_start, longest = True, cross, 0
            element += 1
            first = {"after_prefix": group_start, "local": 0, "sequential": len(positions)}[scheme]
            elements += [element] * length
            positions += list(range(first, first + length))
            longest = max(longest, length)
            continue
        if in_group and scheme == "after_prefix":
            cross += longest
        if scheme == "sequential":
            cross = len(positions)
        in_group = False
        elements += [0] * length
        positions += list(range(cross, cross + length))
        cross += length
    if in_group and scheme == "after_prefix":
        cross += longest
    return elements, positions


class DenseMask(WithoutLayerBlocks):
    """An attention backend over the whole sequence at once, with an explicit mask."""

    def __init__(self, elements: list[int], positions: list[int]) -> None:
        n = len(elements)
        self.positions = torch.tensor(positions)
        element = torch.tensor(elements)
        order = torch.arange(n)
        same = element[:, None] == element[None, :]
        cross = (element[:, None] == 0) | (element[None, :] == 0)
        self.mask = (order[None, :] <= order[:, None]) & (same | cross)

    def attend(self, q, k, v, spec):
        mask = self.mask
        if spec.scoring.window is not None:
            distance = self.positions[:, None] - self.positions[None, :]
            mask = mask & (distance < spec.scoring.window)
        group = q.shape[1] // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * spec.scoring.scale
        if spec.scoring.softcap is not None:
            scores = torch.tanh(scores / spec.scoring.softcap) * spec.scoring.softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
        return out.to(q.dtype)


@torch.inference_mode()
def reference_greedy(
    model: CausalLM, pieces: list[tuple[str, list[int]]], scheme: str, count: int
) -> tuple[list[int], torch.Tensor]:
    """``count`` greedy tokens after the PIC prompt, and the logits of the first."""
    prompt = [t for _, ids in pieces for t in ids]
    lengths = [(kind, len(ids)) for kind, ids in pieces]
    out: list[int] = []
    first = None
    for _ in range(count):
        generated = [("cross", len(out))] if out else []
        backend = DenseMask(*reference_layout(lengths + generated, scheme))
        hidden = model(torch.tensor(prompt + out), backend.positions, backend)
        logits = model.compute_logits(hidden[-1:])[0]
        first = logits if first is None else first
        out.append(int(logits.argmax()))
    return out, first


def recomputed_order(
    pieces: list[tuple[str, int]],
    fraction: float,
    chosen: dict[int, list[int]] | None = None,
) -> tuple[list[int], list[bool], dict[int, int]]:
    """The dense reference's sequence under recomputation: every prompt index in order,
    with a copy of each group's recomputed tokens (the first ``ceil(fraction × length)``
    of each element, or ``chosen``'s by group end) right after the group where a cross
    piece follows it. Returns each entry's prompt index, whether it is a copy, and each
    recomputed index's group end."""
    import math

    order: list[int] = []
    copies: list[bool] = []
    group_of: dict[int, int] = {}
    start, group = 0, []
    for number, (kind, length) in enumerate(pieces):
        order += range(start, start + length)
        copies += [False] * length
        start += length
        if kind != "plus":
            continue
        group += range(start - length, start - length + math.ceil(fraction * length))
        after = pieces[number + 1][0] if number + 1 < len(pieces) else None
        if after == "plus":
            continue
        if after == "cross" and group:
            group = group if chosen is None else chosen[start]
            order += group
            copies += [True] * len(group)
            group_of.update((index, start) for index in group)
        group = []
    return order, copies, group_of


class RecomputeMask(DenseMask):
    """The dense mask over `recomputed_order`'s sequence: an original token sees by the
    PIC rule, a copy as cross; each reads a recomputed token's copy once due (a copy: of
    its own group or an earlier one; an original: at or after the copy's group end),
    else the original."""

    def __init__(
        self,
        elements: list[int],
        positions: list[int],
        order: list[int],
        copies: list[bool],
        group_of: dict[int, int],
    ) -> None:
        index = torch.tensor(order)
        copy = torch.tensor(copies)
        element = torch.tensor(elements)[index]
        self.positions = torch.tensor(positions)[index]
        ends = torch.tensor([group_of.get(i, -1) for i in order])
        key_end = ends[None, :]
        # Whether the query reads key index j's copy: it has one, and it is due.
        due = torch.where(copy[:, None], ends[:, None] >= key_end, index[:, None] >= key_end)
        reads_copy = (key_end >= 0) & due
        rule = (element[:, None] == element[None, :]) | (element[:, None] == 0)
        rule |= (element[None, :] == 0) | copy[:, None]
        self.mask = (index[None, :] <= index[:, None]) & rule & (copy[None, :] == reads_copy)


@torch.inference_mode()
def recompute_reference_greedy(
    model: CausalLM,
    pieces: list[tuple[str, list[int]]],
    scheme: str,
    fraction: float,
    count: int,
    chosen: dict[int, list[int]] | None = None,
) -> tuple[list[int], torch.Tensor]:
    """`reference_greedy` with each group's recomputed tokens (`recomputed_order`)."""
    prompt = [t for _, ids in pieces for t in ids]
    lengths = [(kind, len(ids)) for kind, ids in pieces]
    order, copies, group_of = recomputed_order(lengths, fraction, chosen)
    out: list[int] = []
    first = None
    for _ in range(count):
        generated = [("cross", len(out))] if out else []
        elements, positions = reference_layout(lengths + generated, scheme)
        tokens = prompt + out
        extended = order + list(range(len(prompt), len(tokens)))
        flags = copies + [False] * len(out)
        backend = RecomputeMask(elements, positions, extended, flags, group_of)
        hidden = model(torch.tensor([tokens[i] for i in extended]), backend.positions, backend)
        logits = model.compute_logits(hidden[-1:])[0]
        first = logits if first is None else first
        out.append(int(logits.argmax()))
    return out, first


class LayerKeys(DenseMask):
    """`DenseMask` over a mask given whole, keeping one layer's K and V."""

    def __init__(self, mask: torch.Tensor, positions: list[int], layer: int) -> None:
        self.mask, self.positions, self.layer = mask, torch.tensor(positions), layer
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def attend(self, q, k, v, spec):
        if spec.layer == self.layer:
            self.kv = (k.float(), v.float())
        return super().attend(q, k, v, spec)


@torch.inference_mode()
def probe_deviations(
    model: CausalLM, pieces: list[tuple[str, list[int]]], scheme: str, first: int, end: int
) -> torch.Tensor:
    """CacheBlend's deviation of each token of the group ``[first, end)``, from the rule
    alone: its layer-1 K/V with the group's tokens attending as cross (over every token
    before them) less its layer-1 K/V under the PIC mask, squared and summed."""
    prompt = torch.tensor([t for _, ids in pieces for t in ids])
    elements, positions = reference_layout([(kind, len(ids)) for kind, ids in pieces], scheme)
    pic = DenseMask(elements, positions).mask
    full = pic.clone()
    full[first:end] = torch.tril(torch.ones(end - first, len(elements), dtype=torch.bool), first)
    found = []
    for mask in (full, pic):
        backend = LayerKeys(mask, positions, 1)
        model(prompt, backend.positions, backend)
        found.append([t[first:end] for t in backend.kv])
    (k, v), (k0, v0) = found
    return ((k - k0) ** 2).flatten(1).sum(1) + ((v - v0) ** 2).flatten(1).sum(1)
