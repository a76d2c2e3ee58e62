"""A PIC prompt in the paged pool: where its tokens live, the keys of its blocks, and the
order in which the tokens the pool did not have are computed.

**Layout.** Every span starts a new block, so that an element's blocks can be mapped into
any other sequence's block table: an element's last block is partly empty and, once the
element is computed, never written again (what follows it starts a block of its own).
Generated tokens continue the last span if it is cross, else start a block after it.
Padding costs less than a block per span.

**Keys.** A block's key chains the keys of the blocks before it in its span from the
span's root, as the prefix cache chains a prompt's (`block_manager.block_hash`): the
prompt's first cross span starts from the prefix cache's own root, so plain prompts and
PIC prompts share those blocks. An element's root depends on the layout's reuse rule:
everything before its group (``exact``: the context, every token and span boundary
before it), so equal keys mean equal K/V bit for bit; only the element's first position
(``relaxed``); or nothing at all (``tokens``, spnl's rule: the element's tokens are its
key, and a hit computed at other positions has its keys moved, `engine.kv_shift`). A
hit under the last two need not equal a recompute. A cross span after a group is rooted in
the context, which takes in the group's elements in their order; but under ``tokens``
the last span, where the completion goes, is keyed as an element is (spnl's nested
generates put a completion into a later query as an assistant message, whose turn is the
generation prompt and the completion's tokens: its blocks then hit). The pool belongs to one
model, dtype and cache codec, so those are parts of every key implicitly; every key
derives from the sequence's hash root too (0 for the base model, else its LoRA adapters'
and their scales'), so an element cached under one set of adapters is never another's.

**Order.** The blocks whose keys the pool has are mapped in at admission; the other
tokens are computed in prompt order. A query sees only keys at or before it, which are
then in the pool: hits anywhere, and the misses computed before it.

**Recomputation** (`PicLayout.recomputed`). A group's recomputed tokens are computed
again, attending as cross, just before the first token after the group that the pool
lacks (the last prompt token always is one), into a run of blocks of their own placed
after the group's: the pool's blocks, shared or being registered, are never written.
From then on the sequence's keys for those tokens are the recomputed ones. A step never
holds both a group's first computation and its recomputation (`chunk`), so that within
a step every query reads one version of each key. Whether an element hits or is
computed, the recomputed keys are the same, bit for bit; and since what follows a group
reads them, its key takes in the fraction recomputed (and how they were picked: a
probe's pick, `PicProgress.choose`, takes the planned tokens' ranks and run slots).
"""

import bisect
import hashlib
from dataclasses import dataclass, field

import torch

from ..pic.layout import PicLayout, Span
from ..settings.pic import RECOMPUTE_SELECTIONS
from .block_manager import block_hash

_ROOT = 0  # the prefix cache's root: a prompt's first cross span chains from it


def _mix(tag: bytes, *values: int) -> int:
    data = tag + b"".join(v.to_bytes(8, "little") for v in values)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(frozen=True)
class PlannedBlock:
    """One block of a PIC sequence: its place in the block table, the tokens it holds
    (prompt order, ``[first, last]``) and its key. ``closed``: no token will be added to
    it (full, or the partial last block of a span that another follows)."""

    index: int
    first: int
    last: int
    digest: int
    tokens: tuple[int, ...]
    closed: bool
    element: int  # the plus element it belongs to (1, 2, ...), 0 for cross
    position: int  # its first token's position (where its keys are rotated for)
    parent: int | None = None  # the key its own chains (None: its span's first block)

    @property
    def plus(self) -> bool:
        return self.element != 0


@dataclass(frozen=True)
class Entry:
    """One token a PIC sequence computes in a step: its prompt-order index, and whether
    this is its recomputation (attending as cross, written to the group's own run)."""

    index: int
    recomputed: bool = False


@dataclass
class _Segment:
    span: Span  # the tokens; the open last segment's end grows with generated tokens
    base: int  # its first token's slot in the sequence's logical slots (block aligned)
    digests: list[int]  # its blocks' keys, each chaining the one before from its root


def _segments(
    layout: PicLayout, tokens: list[int], block_size: int, origin: int = _ROOT
) -> tuple[list[_Segment], dict[int, int]]:
    """The spans as block-aligned segments with their roots; generated tokens extend the
    last one (cross) or a cross segment of their own after a final plus span. And the
    first slot of each group's recomputed run, by the group's end. ``origin``: the
    sequence's hash root (its LoRA adapters'; `models.lora.set_root`), which every key
    derives from, so no block is shared between different adapters."""
    spans = list(layout.spans)
    last = spans[-1]
    if len(tokens) > last.end or last.kind == "plus":
        if last.kind == "cross":
            spans[-1] = Span("cross", last.start, len(tokens))
        else:
            spans.append(Span("cross", last.end, max(len(tokens), last.end)))
    segments: list[_Segment] = []
    runs: dict[int, int] = {}
    recomputed = dict(layout.recomputed)
    context, base, group = origin, 0, [0]
    loose = (origin,) if origin != _ROOT else ()  # in the keys that take no context
    for index, span in enumerate(spans):
        if span.kind == "plus":
            exact = _mix(b"plus", context)
            root = _element_root(layout, span, exact, loose)
        else:
            exact = root = origin if index == 0 else _mix(b"cross", context)
            if layout.reuse == "tokens" and index == len(spans) - 1 and index:
                root = _mix(b"tokens", *loose)  # after a group: reusable as an element
        chunks = tokens[span.start : span.end]
        digests = _chain(root, chunks, block_size)
        segments.append(_Segment(span, base, digests))
        base += -(-max(span.length, 1) // block_size) * block_size
        # The context chains exact keys whatever the reuse: what follows a group is keyed by
        # everything before it, even where the group's own elements are reused loosely.
        end_digest = (digests if exact == root else _chain(exact, chunks, block_size))[-1]
        if span.kind == "plus":
            group.append(end_digest)
            if index + 1 == len(spans) or spans[index + 1].kind != "plus":
                redone = recomputed.get(span.end, ())
                if redone:  # what follows reads the recomputed keys
                    group.append(round(layout.recompute * 1_000_000))
                    if layout.recompute_select != "first":
                        group.append(RECOMPUTE_SELECTIONS.index(layout.recompute_select))
                    runs[span.end] = base
                    base += -(-len(redone) // block_size) * block_size
                context, group = _mix(b"group", *group), [0]
        else:
            context = end_digest
    return segments, runs


def _element_root(layout: PicLayout, span: Span, exact: int, loose: tuple[int, ...]) -> int:
    if layout.reuse == "relaxed":
        return _mix(b"relaxed", layout.position(span.start), *loose)
    if layout.reuse == "tokens":
        return _mix(b"tokens", *loose)
    if layout.scheme == "sequential":  # its place depends on the elements before it
        return _mix(b"placed", exact, layout.position(span.start))
    return exact


def _chain(root: int, tokens: list[int], block_size: int) -> list[int]:
    """The keys of ``tokens``' blocks chained from ``root`` (``[root]`` for no tokens)."""
    digests, digest = [], root
    for start in range(0, len(tokens), block_size):
        digest = block_hash(digest, tuple(tokens[start : start + block_size]))
        digests.append(digest)
    return digests or [root]


@dataclass
class PicProgress:
    """A PIC sequence's place in the pool: its segments, the blocks whose keys it knows,
    and, once admitted, the tokens the pool had (``num_hit``) and the order in which the
    rest are computed (``order``, with the recomputed tokens: `Entry`).

    The sequence's ``num_computed_tokens`` counts that order's entries: it starts at
    ``start``, the prompt's length less the entries to compute (below zero where more
    tokens are recomputed than the pool had), and reaches the prompt's length when the
    prompt is done, as a plain prompt's does."""

    layout: PicLayout
    block_size: int
    root: int = _ROOT  # the sequence's hash root (its LoRA adapters'; 0: the base model)
    segments: list[_Segment] = field(default_factory=list)
    todo: list[int] = field(default_factory=list)  # prompt order of the missing tokens
    order: list[Entry] = field(default_factory=list)
    num_hit: int = 0
    start: int = 0
    admitted_len: int = 0  # tokens at admission; later ones are computed after ``order``
    registered: set[int] = field(default_factory=set)  # logical indices offered to others
    runs: dict[int, int] = field(default_factory=dict)  # a group's recomputed run, by its end
    # Where in ``order`` each group's recomputed tokens begin, and which they are (in
    # prompt order), by the group's end; the groups whose tokens a probe is still to pick
    # (`engine.pic_probe`: when their recomputation begins, from the group's pooled keys).
    recompute_from: dict[int, int] = field(default_factory=dict)
    recomputed: dict[int, tuple[int, ...]] = field(default_factory=dict)
    unchosen: set[int] = field(default_factory=set)
    num_recomputed: int = 0
    _unit: dict[int, int] = field(default_factory=dict)  # a todo token's place in ``order``
    _run_slot: dict[int, int] = field(default_factory=dict)  # a recomputed token's slot
    # The closed blocks not offered yet, as planned for ``_planned_for`` open-segment blocks.
    _pending: list[PlannedBlock] = field(default_factory=list)
    _planned_for: int = -1

    def plan(self, tokens: list[int]) -> list[PlannedBlock]:
        """Every block of the sequence's ``tokens`` (prompt and generated) with its key."""
        self.segments, self.runs = _segments(self.layout, tokens, self.block_size, self.root)
        blocks: list[PlannedBlock] = []
        for number, segment in enumerate(self.segments):
            span = segment.span
            is_last = number + 1 == len(self.segments)
            for block, start in enumerate(range(span.start, span.end, self.block_size)):
                end = min(start + self.block_size, span.end)
                chunk = tuple(tokens[start:end])
                digest = segment.digests[block]
                closed = len(chunk) == self.block_size or not is_last
                index = (segment.base + start - span.start) // self.block_size
                element = self.layout.block_ids[span.start] if span.kind == "plus" else 0
                position = self.layout.position(start)
                parent = segment.digests[block - 1] if block else None
                blocks.append(
                    PlannedBlock(
                        index, start, end - 1, digest, chunk, closed, element, position, parent
                    )
                )
        return blocks

    def admit(self, hits: dict[int, PlannedBlock], num_tokens: int) -> None:
        """Record the blocks mapped in (by logical index) and the order of the rest: the
        missing tokens in prompt order, each group's recomputed tokens before the first
        of them after the group (the last prompt token always is one)."""
        covered = [False] * num_tokens
        for block in hits.values():
            covered[block.first : block.last + 1] = [True] * (block.last + 1 - block.first)
        self.todo = [i for i in range(num_tokens) if not covered[i]]
        self.num_hit = num_tokens - len(self.todo)
        self.admitted_len = num_tokens
        self.registered = set(hits)
        due: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        for end, indices in self.layout.recomputed:
            due.setdefault(bisect.bisect_left(self.todo, end), []).append((end, indices))
        self.order, self.recompute_from, self._unit, self._run_slot = [], {}, {}, {}
        self.recomputed = dict(self.layout.recomputed)
        probed = self.layout.recompute_select == "deviation"
        self.unchosen = set(self.recomputed) if probed else set()
        for rank, index in enumerate(self.todo):
            for end, indices in due.get(rank, ()):
                self.recompute_from[end] = len(self.order)
                self.order += [Entry(i, True) for i in indices]
                self._run_slot.update((i, self.runs[end] + n) for n, i in enumerate(indices))
            self._unit[index] = len(self.order)
            self.order.append(Entry(index))
        self.num_recomputed = len(self.order) - len(self.todo)
        self.start = num_tokens - len(self.order)

    def ready(self, tokens: list[int], num_computed: int) -> list[PlannedBlock]:
        """The closed blocks whose tokens are all computed and that were not offered yet
        (planned again only when the open last segment has filled another block)."""
        last = self.segments[-1]
        filled = (len(tokens) - last.span.start) // self.block_size
        if filled != self._planned_for:
            self._planned_for = filled
            self._pending = [
                b for b in self.plan(tokens) if b.closed and b.index not in self.registered
            ]
        ready = [b for b in self._pending if self.computed(b.last, num_computed)]
        if ready:
            self.registered.update(b.index for b in ready)
            self._pending = [b for b in self._pending if b.index not in self.registered]
        return ready

    def probes_due(self, rank: int) -> list[int]:
        """The groups (by end) whose recomputation begins at ``rank`` with its tokens not
        picked yet."""
        return [end for end in self.unchosen if self.recompute_from[end] == rank]

    def choose(self, end: int, indices: list[int]) -> None:
        """The group ending at ``end`` recomputes ``indices`` (as many as planned, in
        prompt order) in the places of its planned tokens: the same ranks and run slots."""
        planned = self.recomputed[end]
        if len(indices) != len(planned) or sorted(set(indices)) != list(indices):
            raise ValueError(f"{len(planned)} distinct tokens in prompt order expected")
        at = self.recompute_from[end]
        for index in planned:
            del self._run_slot[index]
        self.order[at : at + len(indices)] = [Entry(i, True) for i in indices]
        self._run_slot.update((i, self.runs[end] + n) for n, i in enumerate(indices))
        self.recomputed[end] = tuple(indices)
        self.unchosen.discard(end)

    def entries(self, rank: int, count: int) -> list[Entry]:
        """The entries ``rank .. rank + count - 1`` of the order (ranks count from
        admission; past ``order``, the tokens generated since, in turn)."""
        order, extra = self.order, self.admitted_len - len(self.order)
        return [order[r] if r < len(order) else Entry(extra + r) for r in range(rank, rank + count)]

    def entry_slot(self, entry: Entry) -> int:
        """Where ``entry`` writes its keys, in the sequence's logical slots."""
        return self._run_slot[entry.index] if entry.recomputed else self.slot(entry.index)

    def chunk(self, rank: int, count: int) -> int:
        """How many of the ``count`` entries from ``rank`` one step computes: it stops
        where a group's recomputed tokens begin (before them, the step's queries read the
        group's keys as first computed; from them on, as recomputed)."""
        inside = [at for at in self.recompute_from.values() if rank < at < rank + count]
        return min(inside) - rank if inside else count

    def key_slots(self, num_tokens: int, rank: int) -> torch.Tensor:
        """Logical slots of the keys of tokens ``0 .. num_tokens - 1`` as a step from
        ``rank`` reads them: a recomputed token's in its group's run once its group's
        recomputation has begun."""
        slots = self.slots(num_tokens)
        for end, indices in self.recomputed.items():
            if self.recompute_from[end] <= rank and indices[0] < num_tokens:
                run = torch.arange(self.runs[end], self.runs[end] + len(indices))
                kept = torch.tensor(indices) < num_tokens
                slots[torch.tensor(indices)[kept]] = run[kept]
        return slots

    def slot(self, index: int) -> int:
        """Token ``index``'s slot in the sequence's logical slots (padding skipped)."""
        segments = self.segments
        number = bisect.bisect_right([s.span.start for s in segments], index) - 1
        if number + 1 == len(segments) or index < segments[number].span.end:
            segment = segments[number]
            return segment.base + index - segment.span.start
        raise IndexError(f"token {index} lies in no segment")

    def slots(self, num_tokens: int) -> torch.Tensor:
        """Logical slots of tokens ``0 .. num_tokens - 1`` (int64)."""
        parts, covered = [], 0
        for number, segment in enumerate(self.segments):
            span = segment.span
            end = num_tokens if number + 1 == len(self.segments) else min(span.end, num_tokens)
            if end > span.start:
                parts.append(torch.arange(segment.base, segment.base + end - span.start))
                covered = end
        if covered < num_tokens:
            raise IndexError(f"tokens {covered}..{num_tokens - 1} lie in no segment")
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def computed(self, index: int, num_computed: int) -> bool:
        """Whether token ``index`` is in the pool (as first computed) when the sequence's
        ``num_computed_tokens`` is ``num_computed``."""
        if index >= self.admitted_len:  # generated since admission: computed in order
            return index < num_computed
        unit = self._unit.get(index)
        return unit is None or unit < num_computed - self.start
