"""Grammar matchers on llguidance: one per sequence, compiled in the caller's thread; and
llguidance's view of the vocabulary, which token healing reads too.

llguidance was kept over xgrammar by measurement (docs/constrained_decoding_libraries.md):
on the default model's 262k-token vocabulary it compiles a schema in about a millisecond
and fills a mask in well under one, where xgrammar took 0.5-1.2 s to compile. Its view of
the tokenizer is built once per backend, on the first constrained request (about 2 s).
"""

import threading
import time
from collections.abc import Callable

import torch

from ..engine.constraint import new_bitmask
from ..errors import EngineError, RequestError
from ..log import get_logger
from .healing import TokenPrefixIndex
from .spec import ConstraintSpec

log = get_logger()


class GrammarConstraint:
    """A sequence's llguidance matcher (the engine's `Constraint`)."""

    active = True
    _executor = None  # llguidance's thread pool for filling many rows at once, when first needed

    def __init__(self, matcher: object) -> None:
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, bitmask, row)
        self._check()

    @classmethod
    def fill_rows(
        cls, bitmask: torch.Tensor, members: list[tuple["GrammarConstraint", int]]
    ) -> dict[int, Exception]:
        """Fill every member's row in one call on llguidance's threads; the rows whose
        matcher failed, with its error."""
        from llguidance import LLExecutor
        from llguidance.torch import fill_next_token_bitmask_par

        if GrammarConstraint._executor is None:
            GrammarConstraint._executor = LLExecutor()
        fill_next_token_bitmask_par(
            GrammarConstraint._executor, [(c.matcher, row) for c, row in members], bitmask
        )
        errors: dict[int, Exception] = {}
        for constraint, row in members:
            try:
                constraint._check()
            except EngineError as exc:
                errors[row] = exc
        return errors

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):  # type: ignore[attr-defined]
            raise EngineError(
                f"the output's constraint refused token {token_id}: "
                f"{self.matcher.get_error() or 'it cannot follow the output so far'}"  # type: ignore[attr-defined]
            )

    def fork(self) -> "GrammarConstraint":
        return GrammarConstraint(self.matcher.deep_copy())  # type: ignore[attr-defined]

    def _check(self) -> None:
        if self.matcher.is_error():  # type: ignore[attr-defined]
            raise EngineError(f"the output's constraint failed: {self.matcher.get_error()}")  # type: ignore[attr-defined]


class GrammarCompiler:
    """Compiles specs against one model's vocabulary; safe from any thread."""

    def __init__(
        self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: frozenset[int]
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: object | None = None
        self._prefixes: TokenPrefixIndex | None = None
        self._building = threading.Lock()

    @property
    def tokenizer(self) -> object:
        """llguidance's view of the vocabulary, built on first use."""
        with self._building:
            if self._tokenizer is None:
                self._tokenizer = self._build()
            return self._tokenizer

    def prefix_index(self) -> TokenPrefixIndex:
        """Every token's bytes, sorted for token healing, built on first use."""
        tokenizer = self.tokenizer
        with self._building:
            if self._prefixes is None:
                count = tokenizer.vocab_size  # type: ignore[attr-defined]
                decode, special = tokenizer.decode_bytes, tokenizer.is_special_token  # type: ignore[attr-defined]
                self._prefixes = TokenPrefixIndex(
                    [decode([i]) for i in range(count)],
                    {i for i in range(count) if special(i)},
                    self.vocab_size,
                )
            return self._prefixes

    def compile(self, spec: ConstraintSpec) -> GrammarConstraint:
        """A fresh matcher for ``spec``; a grammar that does not compile is a
        `RequestError` with llguidance's message."""
        from llguidance import LLMatcher

        tokenizer = self.tokenizer
        problem = LLMatcher.validate_grammar(spec.grammar, tokenizer)
        if problem:
            raise RequestError(f"the {_NAMES[spec.kind]} does not compile: {problem.strip()}")
        matcher = LLMatcher(tokenizer, spec.grammar, log_level=0)
        constraint = GrammarConstraint(matcher)
        # The first mask here, not in the engine's step: llguidance builds parts of its
        # lexer lazily (seconds for a first JSON schema), which would stall every request.
        try:
            constraint.fill(new_bitmask(1, self.vocab_size), 0)
        except EngineError as exc:
            raise RequestError(f"the {_NAMES[spec.kind]} does not compile: {exc}") from None
        if matcher.is_error():
            raise RequestError(
                f"the {_NAMES[spec.kind]} does not compile: {matcher.get_error().strip()}"
            )
        return constraint

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """Each token's bytes (a special token's as its name)."""
        decode = self.tokenizer.decode_bytes  # type: ignore[attr-defined]
        return [decode([token]) for token in token_ids]

    def _build(self) -> object:
        from llguidance import LLTokenizer

        start = time.perf_counter()
        tokenizer = LLTokenizer(
            self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
        )
        log.info("grammar.tokenizer_ready", seconds=round(time.perf_counter() - start, 2))
        return tokenizer


_NAMES = {
    "json_object": "JSON-object format",
    "json_schema": "JSON schema",
    "regex": "regex",
    "grammar": "grammar",
    "choice": "choice",
}
