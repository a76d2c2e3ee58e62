"""Grammar matchers on llguidance: one per sequence, compiled in the caller's thread; and
llguidance's view of the vocabulary, which token healing reads too.

llguidance was kept over xgrammar by measurement (docs/constrained_decoding_libraries.md):
on the default model's 262k-token vocabulary it compiles a schema in about a millisecond
and fills a mask in well under one, where xgrammar took 0.5-1.2 s to compile. Its view of
the tokenizer is built once per backend, on the first constrained request (about 2 s).
"""

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..engine.token_bitmask import new_bitmask
from ..errors import RequestError
from ..log import get_logger
from ..memory import MIB, heap_in_use, release_freed_memory
from ..signals import leave_interrupts_to_the_main_thread
from .healing import TokenPrefixIndex
from .spec import KIND_NAMES, ConstraintSpec, library_failure

log = get_logger()

COMPILED_KEPT = 64  # compiled specs kept, each forked for the sequences that use it
# ... and at most this many bytes of compiled grammar among them (as `_measured` counts
# them); a grammar that holds more is compiled for its request and not kept.
COMPILED_KEPT_BYTES = 100 * MIB
# A grammar whose compiled form holds more than this is refused: what it holds stays for
# as long as a request uses it. A literal regex of 900,000 characters holds 203 MB; a
# 100,000-alternative regex (800,000 characters) 43 MB, a 10,000-property schema 65 MB.
MAX_COMPILED_BYTES = 128 * MIB
# From this length a grammar is large: large ones compile one at a time, measured (a
# compile takes about twice what it keeps while it runs, and eight at once took 1.2 GB).
LARGE_GRAMMAR_CHARS = 100_000
LARGE_COMPILES_AT_ONCE = 1
# A small grammar is counted at this many bytes per character, not measured (which would
# count a large one's compile beside it): the most measured, 250 for a 10,000-property schema.
SMALL_BYTES_PER_CHAR = 256
# 1 GiB of address space: a chain of rules as long as MAX_SOURCE_CHARS allows (about
# 3 KB of stack per rule) fits. Only what the recursion touches is ever mapped.
COMPILE_STACK_BYTES = 1 << 30
_STACK_SIZE_SET = threading.Lock()  # threading.stack_size is process-wide
_LARGE_COMPILES = threading.BoundedSemaphore(LARGE_COMPILES_AT_ONCE)
T = TypeVar("T")


class GrammarConstraint:
    """A sequence's llguidance matcher (the engine's `Constraint`)."""

    active = True
    _executor = None  # llguidance's thread pool for filling many rows at once, when first needed

    def __init__(self, matcher: object) -> None:
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        # The library's own pointer calls (they drop the GIL), not llguidance.torch's
        # wrappers: importing that module torch.compiles a kernel (seconds, with the GIL).
        target = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)  # type: ignore[attr-defined]
        self._check()

    @classmethod
    def fill_rows(
        cls, bitmask: torch.Tensor, members: list[tuple["GrammarConstraint", int]]
    ) -> dict[int, Exception]:
        """Fill every member's row in one call on llguidance's threads; the rows whose
        matcher failed, with its error."""
        from llguidance import LLExecutor

        if GrammarConstraint._executor is None:
            GrammarConstraint._executor = LLExecutor()
        batch, words = bitmask.shape
        GrammarConstraint._executor.unsafe_compute_mask_ptr(
            [(c.matcher, row) for c, row in members], bitmask.data_ptr(), words * 4, batch
        )
        errors: dict[int, Exception] = {}
        for constraint, row in members:
            try:
                constraint._check()
            except RequestError as exc:
                errors[row] = exc
        return errors

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):  # type: ignore[attr-defined]
            error = self.matcher.get_error() or "it cannot follow the output so far"  # type: ignore[attr-defined]
            raise RequestError(f"the output's constraint refused token {token_id}: {_brief(error)}")

    def fork(self) -> "GrammarConstraint":
        return GrammarConstraint(self.matcher.deep_copy())  # type: ignore[attr-defined]

    def _check(self) -> None:
        """A matcher in error (a grammar past llguidance's limits: too many items, a lexer
        too complex) fails its request with a `RequestError`: the grammar is the cause."""
        if self.matcher.is_error():  # type: ignore[attr-defined]
            raise RequestError(
                f"the output's constraint failed: {_brief(self.matcher.get_error())}"  # type: ignore[attr-defined]
            )


@dataclass(frozen=True)
class Compiled:
    """A compiled grammar and the bytes it holds (`GrammarCompiler._measured`)."""

    constraint: GrammarConstraint
    bytes: int


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
        self._compiled: OrderedDict[ConstraintSpec, Compiled] = OrderedDict()
        self._compiled_bytes = 0
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
        """A matcher of its own for ``spec``, forked from one compiled once (the last
        `COMPILED_KEPT` specs are kept, holding at most `COMPILED_KEPT_BYTES` among them);
        a grammar that does not compile, or holds more than `MAX_COMPILED_BYTES`, is a
        `RequestError`."""
        with self._building:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
        if compiled is None:
            compiled = on_a_large_stack(lambda: self._measured(spec))
            self._keep(spec, compiled)
        return compiled.constraint.fork()

    def _measured(self, spec: ConstraintSpec) -> "Compiled":
        """``spec`` compiled with the bytes it holds: a small grammar's counted at
        `SMALL_BYTES_PER_CHAR`, a large one's measured as the heap's growth while it
        compiles, one at a time (so that the growth is its own, but for small compiles
        beside it) and refused past `MAX_COMPILED_BYTES`."""
        chars = len(spec.grammar)
        if chars < LARGE_GRAMMAR_CHARS:
            return Compiled(self._compile(spec), chars * SMALL_BYTES_PER_CHAR)
        self.tokenizer  # noqa: B018  # built first: the vocabulary's view is not the grammar's
        with _LARGE_COMPILES:
            before = heap_in_use()
            constraint = self._compile(spec)
            held = _held(before, heap_in_use(), chars)
            log.info("grammar.compiled", kind=spec.kind, chars=chars, mib=round(held / MIB, 1))
            if held > MAX_COMPILED_BYTES:
                del constraint  # freed before the next large compile measures the heap
                release_freed_memory()
                raise RequestError(
                    f"the {KIND_NAMES[spec.kind]} is too large: compiled, it holds "
                    f"{held / MIB:,.0f} MiB, and at most {MAX_COMPILED_BYTES // MIB:,} MiB "
                    f"is accepted (a shorter or simpler one is)"
                )
        return Compiled(constraint, held)

    def _keep(self, spec: ConstraintSpec, compiled: "Compiled") -> None:
        """``compiled`` kept, the least recently used dropped beyond either bound."""
        if compiled.bytes > COMPILED_KEPT_BYTES:
            return
        with self._building:
            previous = self._compiled.pop(spec, None)
            self._compiled_bytes -= previous.bytes if previous is not None else 0
            self._compiled[spec] = compiled
            self._compiled_bytes += compiled.bytes
            while len(self._compiled) > COMPILED_KEPT or self._compiled_bytes > COMPILED_KEPT_BYTES:
                _, dropped = self._compiled.popitem(last=False)
                self._compiled_bytes -= dropped.bytes

    def kept(self) -> tuple[int, int]:
        """How many compiled grammars are kept, and the bytes they hold (as counted)."""
        with self._building:
            return len(self._compiled), self._compiled_bytes

    def clear(self) -> None:
        """Drop every compiled grammar and the vocabulary's views (a closed backend's)."""
        with self._building:
            self._compiled.clear()
            self._compiled_bytes = 0
            self._tokenizer = self._prefixes = None

    def _compile(self, spec: ConstraintSpec) -> GrammarConstraint:
        from llguidance import LLMatcher

        tokenizer = self.tokenizer
        what = KIND_NAMES[spec.kind]
        try:
            problem = LLMatcher.validate_grammar(spec.grammar, tokenizer)
            if not problem:
                matcher = LLMatcher(tokenizer, spec.grammar, log_level=0)
        except BaseException as exc:  # a panic of the library's (pyo3: a BaseException)
            if not library_failure(exc):
                raise
            problem = f"the grammar engine failed on it: {str(exc).splitlines()[0][:200]}"
        if problem:
            raise RequestError(f"the {what} does not compile: {_brief(problem)}")
        constraint = GrammarConstraint(matcher)
        # The first mask here, not in the engine's step: llguidance builds parts of its
        # lexer lazily (seconds for a first JSON schema), which would stall every request.
        try:
            constraint.fill(new_bitmask(1, self.vocab_size), 0)
        except RequestError as exc:
            raise RequestError(f"the {what} does not compile: {exc}") from None
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


def on_a_large_stack(compile_grammar: Callable[[], T]) -> T:
    """``compile_grammar()`` run on a thread with a `COMPILE_STACK_BYTES` stack, its
    result or exception returned here: llguidance's grammar checks recurse natively once
    per rule a chain of rules reaches, and a few thousand (a 50 KB grammar) overflowed a
    default 8 MB stack, which kills the process. The stack is address space, touched only
    as deep as the recursion goes."""
    outcome: list[object] = []

    def run() -> None:
        leave_interrupts_to_the_main_thread()
        try:
            outcome.append(compile_grammar())
        except BaseException as exc:  # raised in the caller's thread below
            outcome.append(exc)

    with _STACK_SIZE_SET:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="spnl-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    (result,) = outcome
    if isinstance(result, BaseException):
        raise result
    return result  # type: ignore[return-value]


def _held(before: int | None, after: int | None, chars: int) -> int:
    """The bytes a large grammar holds: the heap's growth while it compiled, at least its
    text (another thread may have freed meanwhile); where the heap cannot be read, its
    characters at `SMALL_BYTES_PER_CHAR`."""
    if before is None or after is None:
        return chars * SMALL_BYTES_PER_CHAR
    return max(after - before, chars)


def _brief(message: str) -> str:
    """llguidance's message without the parser-state dump it may append."""
    return message.split("<state>")[0].strip()
