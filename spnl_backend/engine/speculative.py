"""Speculative decoding: a draft model proposes tokens, the target verifies them in one pass.

In a step, every decoding sequence may take up to ``gamma`` drafts: the draft model
first catches up on the tokens it has not seen, then proposes one token per pass, all
such sequences batched. The target then computes the step's tokens and the drafts
together, and each sequence keeps the drafts the target accepts plus one token of the
target's own (a correction, or a bonus when every draft passed), so a step always
yields at least one token. A prompt's first token comes from the prompt's own pass.

Both models keep their own caches (paged or not, as configured). K/V written for
rejected drafts are rolled back: the computed counts stop at the last accepted token
and blocks held only for rejected positions go back to the pool. Drafts are
opportunistic: a sequence whose caches cannot take them this step decodes plainly.
"""

from dataclasses import dataclass, field

import torch

from ..errors import EngineError
from ..log import get_logger
from ..models.step_attention import StepAttention
from ..models.transformer import CausalLM
from .cache import CacheManager, Feed, PoolUsage
from .logits import RowHistory, adjust
from .pic_probe import choose_recomputed
from .runner import Picked, Sampled, forward_with_adapters, logprobs_of, pack_inputs
from .sampler import argmax_rows, distribution, row_error
from .sequence import ScheduledSeq, Sequence
from .token_bitmask import Constraint, apply_bitmask, constraint_row
from .verification import verify

log = get_logger()


@dataclass(eq=False)
class CacheView:
    """A sequence as the draft's cache sees it: the same tokens, its own computed count.

    ``pending`` holds tokens the step accepted but the engine has not appended yet, so
    the draft cache can register full blocks before the sequence grows."""

    seq: Sequence
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_tier_hit_tokens: int = 0
    num_pic_hit_tokens: int = 0
    num_pic_recomputed_tokens: int = 0
    num_pic_miss_tokens: int = 0
    pending: list[int] = field(default_factory=list)

    @property
    def pic(self) -> None:
        """None: a backend with a draft refuses PIC prompts, so its draft never sees one."""
        return None

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def hash_root(self) -> int:
        """The base's: the draft model runs no adapter (its tokens are only proposals,
        which the target verifies with the sequence's adapters), so its K/V is the base's."""
        return 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.pending

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens + len(self.pending)


class SpeculativeCache:
    """The target's cache manager, with the draft's beside it: whatever takes a sequence's
    target cache away (finish, abort, preemption) takes its draft cache too."""

    def __init__(self, target: CacheManager, draft: CacheManager) -> None:
        self.target, self.draft = target, draft
        self.views: dict[int, CacheView] = {}

    @property
    def capacity_tokens(self) -> int | None:
        return self.target.capacity_tokens

    @property
    def num_holders(self) -> int:
        return self.target.num_holders

    def pool_usage(self) -> PoolUsage | None:
        return self.target.pool_usage()

    def arriving(self, seq: Sequence) -> None:
        self.target.arriving(seq)

    def admit(self, seq: Sequence) -> None:
        self.target.admit(seq)  # the draft's view is admitted when it first drafts

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        return self.target.reserve(seq, num_tokens)

    def release(self, seq: Sequence) -> None:
        self.target.release(seq)
        view = self.views.pop(seq.seq_id, None)
        if view is not None:
            self.draft.release(view)

    def truncate(self, seq: Sequence) -> None:
        self.target.truncate(seq)

    def after_step(self, batch: list[ScheduledSeq]) -> None:
        self.target.after_step(batch)

    def chunk(self, seq: Sequence, count: int) -> int:
        return self.target.chunk(seq, count)

    def probes(self, batch: list[ScheduledSeq]) -> list:
        return self.target.probes(batch)

    def feed(self, seq: Sequence, count: int) -> Feed:
        return self.target.feed(seq, count)

    def reset_prefix_cache(self) -> int:
        return self.target.reset_prefix_cache() + self.draft.reset_prefix_cache()

    def attention(self, batch: list[ScheduledSeq], device: torch.device) -> StepAttention:
        return self.target.attention(batch, device)

    def draft_view(self, seq: Sequence) -> CacheView:
        view = self.views.get(seq.seq_id)
        if view is None:
            view = self.views[seq.seq_id] = CacheView(seq)
            self.draft.admit(view)
        return view


@dataclass
class Proposal:
    """A sequence's drafts and, when it samples, the draft distribution of each; for a
    constrained sequence, the bitmask row at each position (before each draft, and after
    the last), which the target's rows are verified under as well."""

    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)


class Drafter:
    """The draft model: proposes up to k tokens for each of a batch of sequences."""

    def __init__(
        self,
        model: CausalLM,
        cache: SpeculativeCache,
        device: torch.device,
        max_len: int,
        vocab_size: int | None = None,
    ) -> None:
        self.model, self.cache, self.device, self.max_len = model, cache, device, max_len
        # The target's vocabulary, which constraint masks are built for.
        self.vocab_size = vocab_size or model.config.vocab_size

    def reserve(self, seq: Sequence, num_drafts: int) -> bool:
        """Room in the draft cache for the tokens before the last draft."""
        view = self.cache.draft_view(seq)
        return self.cache.draft.reserve(view, seq.num_tokens + num_drafts - 1)

    def unreserve(self, seq: Sequence) -> None:
        """Give back draft slots reserved for a step that will not draft after all."""
        self.cache.draft.truncate(self.cache.views[seq.seq_id])

    def propose(self, requests: list[tuple[Sequence, int]]) -> dict[int, Proposal]:
        """Drafts for each ``(sequence, k)``: one batched pass per draft position."""
        views = {seq.seq_id: self.cache.draft_view(seq) for seq, _ in requests}
        feeds = {s.seq_id: s.token_ids[views[s.seq_id].num_computed_tokens :] for s, _ in requests}
        proposals = {seq.seq_id: Proposal() for seq, _ in requests}
        forks = {  # drafts advance a copy: the sequence's matcher sees only kept tokens
            seq.seq_id: seq.constraint.fork()
            for seq, _ in requests
            if seq.constraint is not None and seq.constraint.active
        }
        stopped: set[int] = set()
        for position in range(max(k for _, k in requests)):
            active = [seq for seq, k in requests if k > position and seq.seq_id not in stopped]
            if not active:
                break
            logits = self._forward([(views[s.seq_id], feeds[s.seq_id]) for s in active])
            for seq, row in zip(active, logits, strict=True):
                try:
                    proposal, fork = proposals[seq.seq_id], forks.get(seq.seq_id)
                    feeds[seq.seq_id] = [self._draw(row, seq, proposal, fork)]
                except Exception as exc:  # drafts are optional: verify those drawn so far
                    stopped.add(seq.seq_id)
                    log.warning("speculative.draft_failed", seq_id=seq.seq_id, error=str(exc))
        for seq_id, fork in forks.items():
            self._close_masks(proposals[seq_id], fork)
        return proposals

    def settle(self, seq: Sequence, accepted: list[int], num_valid: int) -> None:
        """After verification: keep the draft's K/V of the first ``num_valid`` tokens,
        register its full blocks with the accepted tokens, return the rest."""
        view = self.cache.views[seq.seq_id]
        view.num_computed_tokens = min(view.num_computed_tokens, num_valid)
        view.pending = accepted
        self.cache.draft.after_step([ScheduledSeq(view, 0)])
        view.pending = []
        self.cache.draft.truncate(view)

    def _forward(self, feeds: list[tuple[CacheView, list[int]]]) -> torch.Tensor:
        """The draft's logits after each view's fed tokens; advances their computed counts."""
        batch = [ScheduledSeq(view, len(tokens)) for view, tokens in feeds]
        ids, positions = pack_inputs(
            [(view.num_computed_tokens, tokens) for view, tokens in feeds], self.device
        )
        hidden = self.model(ids, positions, self.cache.draft.attention(batch, self.device))
        for view, tokens in feeds:
            view.num_computed_tokens += len(tokens)
        return self.model.compute_logits(hidden[_last_rows(batch)])

    def _draw(
        self,
        logits: torch.Tensor,
        seq: Sequence,
        proposal: Proposal,
        constraint: Constraint | None,
    ) -> int:
        """A draft under the constraint's mask (``constraint``: the sequence's matcher
        forked for this step, advanced past each draft); the target's penalties are not
        applied to drafts: verification keeps the output the target's all the same."""
        if constraint is not None:  # a row for every position, inactive ones all ones
            mask = constraint_row(constraint, self.vocab_size)
            logits = logits.clone()[None]
            apply_bitmask(logits, mask[None])
            logits = logits[0]
            proposal.masks.append(mask)
        token = self._choose(logits, seq, proposal)
        if constraint is not None and constraint.active:
            constraint.accept(token)
        proposal.tokens.append(token)
        return token

    def _close_masks(self, proposal: Proposal, fork: Constraint) -> None:
        """The mask after the last draft (the target's row for its bonus token)."""
        drafted = len(proposal.tokens)
        proposal.masks = proposal.masks[: drafted + 1]
        if len(proposal.masks) == drafted:
            proposal.masks.append(constraint_row(fork, self.vocab_size))

    def _choose(self, logits: torch.Tensor, seq: Sequence, proposal: Proposal) -> int:
        if seq.params.greedy:
            token = argmax_rows(logits[None])[0]
        else:
            probs = distribution(logits, seq.params)
            token = int(torch.multinomial(probs, 1, generator=seq.generator))
            proposal.probs.append(probs)
        return token


def _last_rows(batch: list[ScheduledSeq]) -> list[int]:
    """Row of each item's last token in the packed step."""
    rows, row = [], -1
    for item in batch:
        row += item.num_new_tokens
        rows.append(row)
    return rows


class VerifyingRunner:
    """The target's step with proposed tokens: propose, verify in one target pass, roll
    back. What proposes (`_propose`) and what follows a verification (`_settle`) is the
    subclass's: a draft model (`SpeculativeRunner`) or the sequence's own text
    (`engine.ngram.NgramRunner`)."""

    cache: CacheManager

    def __init__(self, model: CausalLM, gamma: int, device: torch.device, vocab_size: int) -> None:
        self.model, self.gamma, self.device, self.vocab_size = model, gamma, device, vocab_size

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> Sampled:
        choose_recomputed(self.model, self.cache.probes(batch), self.device)
        proposals = self._propose(batch)
        steps = [
            ScheduledSeq(item.seq, item.num_new_tokens + len(_drafts(proposals, item.seq)))
            for item in batch
        ]
        ids, positions = self._inputs(batch, proposals)
        attention = self.cache.attention(steps, self.device)
        # Drafts are verified by the rows of the sequence's own adapters: what it keeps is
        # what it would compute without proposals.
        hidden = forward_with_adapters(self.model, steps, ids, positions, attention)
        rows, verifying, row = [], [], 0
        for item, step in zip(batch, steps, strict=True):
            row += step.num_new_tokens
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.seq.num_computed_tokens == item.seq.num_tokens:
                rows += range(row - (step.num_new_tokens - item.num_new_tokens) - 1, row)
                verifying.append(item.seq)
        if not verifying:
            return {}
        logits = self.model.compute_logits(hidden[rows])
        sampled: Sampled = {}
        start = 0
        for seq in verifying:
            proposal = proposals.get(seq.seq_id, Proposal())
            end = start + len(proposal.tokens) + 1
            sampled[seq.seq_id] = self._verified(seq, logits[start:end], proposal)
            start = end
        return sampled

    def _propose(self, batch: list[ScheduledSeq]) -> dict[int, Proposal]:
        raise NotImplementedError

    def _settle(self, seq: Sequence, num_drafts: int, accepted: int, tokens: list[int]) -> None:
        """After a verification of ``num_drafts`` proposed tokens (``tokens``: those kept)."""
        raise NotImplementedError

    def _verified(
        self, seq: Sequence, logits: torch.Tensor, proposal: Proposal
    ) -> Picked | Exception:
        """The tokens the target keeps, or the error that ends this sequence alone."""
        try:
            logits = self._adjusted(seq, logits, proposal)
            accepted, tokens = verify(
                logits, proposal.tokens, proposal.probs, seq.params, seq.generator
            )
            logprobs = logprobs_of(seq, logits, tokens)
        except Exception as exc:  # this sequence's failure is its own
            return row_error(exc)
        if proposal.tokens:
            self._roll_back(seq, len(proposal.tokens), accepted, tokens)
        return Picked(tokens, logprobs)

    def _adjusted(self, seq: Sequence, logits: torch.Tensor, proposal: Proposal) -> torch.Tensor:
        """The target's rows with the penalties of the tokens before each (the drafts
        before it included) and the constraint's mask at each position."""
        drafts = proposal.tokens
        rows = [
            RowHistory(seq.params, seq.prompt_token_ids, seq.output_token_ids, drafts[:i])
            for i in range(len(drafts) + 1)
        ]
        bitmask = None
        if proposal.masks:
            bitmask = torch.stack(proposal.masks)
        elif seq.constraint is not None and seq.constraint.active:
            bitmask = constraint_row(seq.constraint, self.vocab_size)[None]
        return adjust(logits, rows, bitmask)

    def draft_budget(self, seq: Sequence, max_len: int) -> int:
        """The most drafts ``seq`` may take this step: the gamma, or its request's own
        cap; fewer near its length limits (the last token is always the target's)."""
        remaining = seq.max_len - seq.num_tokens
        if seq.params.max_tokens:
            remaining = min(remaining, seq.params.max_tokens - len(seq.output_token_ids))
        cap = seq.params.speculative
        gamma = self.gamma if cap is None else min(self.gamma, cap)
        return max(0, min(gamma, remaining - 1, max_len - seq.num_tokens))

    def _inputs(
        self, batch: list[ScheduledSeq], proposals: dict[int, Proposal]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's tokens (in the order the cache computes them) with each sequence's
        drafts after them, and their positions. Only a sequence decoding in token order
        drafts, so its drafts' positions follow its last token's."""
        feeds: list[Feed] = []
        for item in batch:
            start, tokens = self.cache.feed(item.seq, item.num_new_tokens)
            drafts = _drafts(proposals, item.seq)
            if drafts:
                tokens = tokens + drafts
                if not isinstance(start, int):  # a PIC sequence's: positions count on
                    layout = item.seq.pic
                    if layout is None:
                        raise EngineError("drafts follow a sequence computed in order")
                    first = item.seq.num_tokens
                    start = [*start, *(layout.position(first + i) for i in range(len(drafts)))]
            feeds.append((start, tokens))
        return pack_inputs(feeds, self.device)

    def _roll_back(self, seq: Sequence, num_drafts: int, accepted: int, tokens: list[int]) -> None:
        """Keep the accepted drafts' K/V, return what only rejected ones held."""
        seq.num_draft_tokens += num_drafts
        seq.num_accepted_tokens += accepted
        seq.num_computed_tokens += accepted
        self.cache.truncate(seq)
        self._settle(seq, num_drafts, accepted, tokens)


class SpeculativeRunner(VerifyingRunner):
    """Drafts from a draft model, which keeps a cache of its own beside the target's."""

    def __init__(self, model: CausalLM, drafter: Drafter, gamma: int, device: torch.device) -> None:
        super().__init__(model, gamma, device, drafter.vocab_size)
        self.drafter = drafter
        self.cache = drafter.cache

    def _propose(self, batch: list[ScheduledSeq]) -> dict[int, Proposal]:
        requests = []
        for item in batch:
            if decodes(item):
                k = self._reserve_drafts(item.seq)
                if k:
                    requests.append((item.seq, k))
        return self.drafter.propose(requests) if requests else {}

    def _reserve_drafts(self, seq: Sequence) -> int:
        """How many drafts ``seq`` takes this step, with room for them in both caches."""
        k = self.draft_budget(seq, self.drafter.max_len)
        if k <= 0:
            return 0
        if not self.drafter.reserve(seq, k):
            log.debug("speculative.skipped", seq_id=seq.seq_id, reason="draft cache full")
            return 0
        if not self.cache.reserve(seq, seq.num_tokens + k):
            self.drafter.unreserve(seq)
            log.debug("speculative.skipped", seq_id=seq.seq_id, reason="target cache full")
            return 0
        return k

    def _settle(self, seq: Sequence, num_drafts: int, accepted: int, tokens: list[int]) -> None:
        self.drafter.settle(seq, tokens, seq.num_computed_tokens)


def decodes(item: ScheduledSeq) -> bool:
    """Whether the step computes just the sequence's last token. A prompt's own pass
    samples its first token plainly, so that pass computes what it would without drafts."""
    return item.num_new_tokens == 1 and item.seq.num_computed_tokens + 1 == item.seq.num_tokens


def _drafts(proposals: dict[int, Proposal], seq: Sequence) -> list[int]:
    proposal = proposals.get(seq.seq_id)
    return proposal.tokens if proposal else []
