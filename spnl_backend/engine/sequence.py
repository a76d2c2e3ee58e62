"""A request as the engine sees it: prompt, sampling parameters, generated tokens, status."""

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch

from ..pic.layout import PicLayout
from ..sampling import SamplingParams

if TYPE_CHECKING:
    from .sampler import TokenLogprobs
    from .token_bitmask import Constraint


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    max_len: int  # the context limit: prompt plus completion never exceeds it
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of the prompt, reused from a prefix cache
    num_draft_tokens: int = 0  # proposed by a speculative draft model
    num_accepted_tokens: int = 0  # of those, accepted by the target
    finish_reason: str | None = None  # "stop", "length", "error" or "abort"
    error: Exception | None = None  # why it failed or was aborted: raised to its caller
    # What steps produced that its reader has not taken yet; while the reader is far
    # behind the sequence is paused (not scheduled). ``read_at``: its last take.
    outbox: "list[StepOutput]" = field(default_factory=list)
    paused: bool = False
    read_at: float = field(default_factory=time.monotonic)
    text: str = ""  # the completion's text, set when the sequence finishes
    stop_string: str | None = None  # the stop string it finished at (not in ``text``)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None
    # Another completion of the same prompt (a request's ``n``): this one waits until the
    # leader's prompt is computed, then shares its full prompt blocks instead of computing.
    leader: "Sequence | None" = None
    # Its plus and cross spans where the prompt is a PIC prompt (`pic.layout`), and of its
    # plus tokens, those the pool had and those computed; and the tokens computed again
    # (`PicLayout.recomputed`).
    pic: "PicLayout | None" = None
    num_pic_hit_tokens: int = 0
    num_pic_miss_tokens: int = 0
    num_pic_recomputed_tokens: int = 0
    num_tier_hit_tokens: int = 0  # of the prompt's reused tokens, those the KV tier read back
    # Where the output is constrained (a grammar, or token healing's first token): the
    # matcher, advanced with every accepted token.
    constraint: "Constraint | None" = None
    # Token healing: the text of the prompt tokens backed off, which the completion's
    # first token starts with and its returned text leaves out.
    healed_text: str = ""
    logprobs: "list[TokenLogprobs]" = field(default_factory=list)  # with params.logprobs
    # The LoRA adapters its rows take, ``(slot, factor)`` each (`models.lora`; none: the
    # base model) and the first link of its blocks' prefix-cache hash chain (0 for the
    # base; that of its set of adapters and scales otherwise: `models.lora.set_root`).
    lora: tuple[tuple[int, float], ...] = ()
    hash_root: int = 0

    def __post_init__(self) -> None:
        if not self.params.greedy:
            self.generator = torch.Generator()
            if self.params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.params.seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def waits_for_leader(self) -> bool:
        leader = self.leader
        return (
            leader is not None
            and not leader.is_finished
            and leader.num_computed_tokens < len(leader.prompt_token_ids)
        )

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_token_ids.append(token_id)

    def finish(self, reason: str, error: Exception | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason, self.error = reason, error
        self.finish_time = time.perf_counter()


@dataclass(frozen=True)
class StepOutput:
    """What one step did for one sequence: its new token and the text it added."""

    seq: Sequence
    token_id: int
    text_delta: str
    logprobs: "TokenLogprobs | None" = None  # where the request asks for them


class CachedTokens(Protocol):
    """What a KV cache manager reads of a sequence: its tokens (and PIC spans), and how
    many of them are computed or came from the prefix cache, the KV tier or, for a PIC
    prompt, the pool. An engine `Sequence` is one; so is a speculative draft's view of one
    (`speculative.CacheView`), which has its own counts."""

    num_computed_tokens: int
    num_cached_tokens: int
    num_tier_hit_tokens: int
    num_pic_hit_tokens: int
    num_pic_miss_tokens: int
    num_pic_recomputed_tokens: int

    @property
    def hash_root(self) -> int: ...  # its blocks' hash chain's first link (LoRA adapters)

    @property
    def pic(self) -> PicLayout | None: ...

    @property
    def seq_id(self) -> int: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def num_tokens(self) -> int: ...


S = TypeVar("S", bound=CachedTokens, covariant=True)


@dataclass(frozen=True)
class ScheduledSeq(Generic[S]):
    """A sequence in a step, and how many of its tokens the step computes."""

    seq: S
    num_new_tokens: int
