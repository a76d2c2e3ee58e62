"""The reasoning's bounds in the engine's sampling: a budget that closes the reasoning,
and a constraint that holds the answer alone.

A `ReasoningGate` is a sequence's `Constraint` (`engine.token_bitmask`): while the
output is in the reasoning it allows every token (the model's own choice, exact); once
the reasoning has taken its budget it allows only the next token of the format's
closing sequence (``</think>`` and the separator the template writes after it, or
harmony's ``<|end|><|start|>assistant<|channel|>final<|message|>``), one per step, and
from where the reasoning ends it is the answer's own constraint, if any. Each sequence
has its own gate, so the other rows of a batch never change; a speculative draft
advances a fork of it, so a forced token is drafted and verified under the same
one-token mask, and counted once, when the sequence keeps it.

The markers must each be one token of the vocabulary (`GateTokens.build` says when
they are not): the gate follows token ids, not text.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..engine.token_bitmask import Constraint
from ..errors import EngineError
from .formats import CHANNEL, END, MESSAGE, START, THINK_CLOSE, THINK_OPEN

# What the think templates write between the closed block and the answer.
THINK_SEPARATOR = "\n\n"
HARMONY_FINAL = f"{END}{START}assistant{CHANNEL}final{MESSAGE}"
HARMONY_REOPEN = f"{END}{START}assistant"
_CHANNEL_NAME = re.compile(r"^\s*([A-Za-z_]+)")


@dataclass(frozen=True)
class GateTokens:
    """A format's marker ids in one vocabulary: ``close`` ends the reasoning where the
    model writes it (``</think>``; harmony: ``<|message|>`` after a ``final`` header),
    ``forced`` is the closing sequence a spent budget writes, ``after_close`` what follows
    a close the model wrote itself, where a constraint holds the answer (the separator)."""

    format: str
    close: int
    forced: tuple[int, ...]
    after_close: tuple[int, ...] = ()
    open: int | None = None  # <think>
    channel: int | None = None  # harmony's <|channel|>, <|end|>
    end: int | None = None
    # harmony: the close where a constraint spans the whole output (gpt-oss's tool-call
    # grammar): the analysis message ended, the next header left to the model and grammar
    reopen: tuple[int, ...] = ()

    @staticmethod
    def build(
        fmt: str, token_id: Callable[[str], int | None], encode: Callable[[str], list[int]]
    ) -> "GateTokens | str":
        """``fmt``'s ids, or why the gate cannot follow it in this vocabulary."""
        if fmt == "think":
            opening, closing = token_id(THINK_OPEN), token_id(THINK_CLOSE)
            if opening is None or closing is None:
                return f"{THINK_OPEN} and {THINK_CLOSE} are not single tokens of its vocabulary"
            separator = tuple(encode(THINK_SEPARATOR))
            return GateTokens(fmt, closing, (closing, *separator), separator, open=opening)
        if fmt == "harmony":
            ids = [token_id(tag) for tag in (CHANNEL, MESSAGE, END, START)]
            if None in ids:
                return "its harmony tags are not single tokens of its vocabulary"
            channel, message, end, _ = ids
            forced, reopen = tuple(encode(HARMONY_FINAL)), tuple(encode(HARMONY_REOPEN))
            return GateTokens(fmt, message, forced, channel=channel, end=end, reopen=reopen)
        return f"the gate follows the think and harmony formats, not {fmt}"


class ReasoningGate:
    """One sequence's reasoning bound and lazy answer constraint (the engine's
    `Constraint`). ``budget``: the most reasoning tokens (None: unbounded); ``answer``:
    the answer's constraint (None: free); ``inside``: the output starts in the reasoning
    (the prompt opened it); ``decode``: a harmony header's text, to read its channel;
    ``spanning``: the constraint holds the whole output, reasoning included (gpt-oss's
    tool-call grammar), so it follows every token and a spent budget only ends the
    analysis message (`GateTokens.reopen`), the grammar choosing what follows."""

    def __init__(
        self,
        tokens: GateTokens,
        budget: int | None,
        answer: Constraint | None,
        inside: bool,
        decode: Callable[[list[int]], str],
        spanning: bool = False,
    ) -> None:
        self.tokens, self.budget, self.answer, self.decode = tokens, budget, answer, decode
        self.spanning = spanning and answer is not None
        self.phase = "start"  # start, reasoning, header, forcing, answer
        self.used = 0  # reasoning tokens kept so far
        self.pending: tuple[int, ...] = ()  # forced tokens still to come
        self.header: list[int] | None = None  # harmony: a header's tokens after <|channel|>
        self.counting = False  # harmony: in an analysis message's body
        if tokens.format == "harmony":
            self.phase = "header"  # the generation prompt ends with <|start|>assistant
        elif inside:
            self._enter_reasoning()

    @property
    def active(self) -> bool:
        if self.phase != "answer":
            return True
        return self.answer is not None and self.answer.active

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.spanning and self.phase != "forcing":
            self.answer.fill(bitmask, row)  # type: ignore[union-attr]
            return
        if self.phase == "forcing":
            bitmask[row] = 0
            _allow(bitmask, row, self.pending[0])
        elif self.phase == "answer":
            self.answer.fill(bitmask, row)  # type: ignore[union-attr]  # active: it has one
        elif self.phase == "start" and self.answer is not None:
            # Either the model opens its reasoning, or the answer begins at once.
            self.answer.fill(bitmask, row)
            _allow(bitmask, row, self.tokens.open)  # type: ignore[arg-type]
        else:
            bitmask[row] = -1  # the reasoning is the model's own

    def accept(self, token_id: int) -> None:
        if self.spanning and self.phase != "answer" and self.answer.active:  # type: ignore[union-attr]
            self.answer.accept(token_id)  # type: ignore[union-attr]
        if self.phase == "forcing":
            self._forced(token_id)
        elif self.phase == "answer":
            if self.answer is not None and self.answer.active:
                self.answer.accept(token_id)
        elif self.tokens.format == "harmony":
            self._harmony(token_id)
        else:
            self._think(token_id)

    def fork(self) -> "ReasoningGate":
        twin = object.__new__(ReasoningGate)
        twin.__dict__.update(self.__dict__)
        twin.answer = self.answer.fork() if self.answer is not None else None
        twin.header = list(self.header) if self.header is not None else None
        return twin

    # ---- the formats ---------------------------------------------------------------------

    def _think(self, token_id: int) -> None:
        if self.phase == "start":
            if token_id == self.tokens.open:
                self._enter_reasoning()
            else:
                self._begin_answer(token_id)
            return
        if token_id == self.tokens.close:
            self._closed_by_model()
            return
        self._spend()

    def _harmony(self, token_id: int) -> None:
        t = self.tokens
        if self.phase == "header":
            if token_id == t.channel:
                self.header = []
            elif token_id == t.close:  # <|message|>: the header's channel decides
                channel = self._channel()
                self.header = None
                if channel == "final":
                    self._closed_by_model()
                    return
                self.phase, self.counting = "reasoning", channel == "analysis"
                self._check_budget()
            elif self.header is not None:
                self.header.append(token_id)
            return
        if token_id == t.end:  # a message ends: the next one's header follows
            self.phase, self.counting = "header", False
        elif self.counting:
            self._spend()

    def _channel(self) -> str:
        match = _CHANNEL_NAME.match(self.decode(self.header or []))
        return match.group(1) if match else ""

    # ---- moves -----------------------------------------------------------------------------

    def _enter_reasoning(self) -> None:
        self.phase, self.counting = "reasoning", True
        self._check_budget()

    def _spend(self) -> None:
        self.used += 1
        self._check_budget()

    def _check_budget(self) -> None:
        if self.budget is not None and self.used >= self.budget and self.counting:
            self._force(self.tokens.reopen if self.spanning else self.tokens.forced)

    def _closed_by_model(self) -> None:
        """The model ended its reasoning: the answer's constraint starts after the
        separator the template writes (forced, so the constraint sees the answer alone)."""
        if self.answer is not None and self.tokens.after_close:
            self._force(self.tokens.after_close)
        else:
            self.phase = "answer"

    def _force(self, tokens: tuple[int, ...]) -> None:
        self.phase, self.pending, self.counting = "forcing", tokens, False

    def _forced(self, token_id: int) -> None:
        if token_id != self.pending[0]:
            raise EngineError(
                f"the reasoning's closing sequence expected token {self.pending[0]}, not {token_id}"
            )
        self.pending = self.pending[1:]
        if not self.pending:  # a reopened header is read as the model's own
            self.phase = "header" if self.spanning else "answer"
            self.header = None

    def _begin_answer(self, token_id: int) -> None:
        self.phase = "answer"
        if self.answer is not None and self.answer.active:
            self.answer.accept(token_id)


def _allow(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set ``token_id``'s bit in ``bitmask[row]`` (int32 words, bit 31 the sign)."""
    word, bit = divmod(token_id, 32)
    value = int(bitmask[row, word]) & 0xFFFFFFFF | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


__all__ = ["GateTokens", "ReasoningGate"]
