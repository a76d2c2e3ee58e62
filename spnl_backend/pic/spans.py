"""A span query's input (or a chat's marked messages) as PIC pieces, tokenized as spnl
tokenizes it (``spnl.tokenize_query``): every message its own turn (`pic.turns`), each
child of a ``plus`` an element of its own, a ``cross``'s last child a cross span, a map
input one plus element, and the generation prompt at the end.

Where spnl's engine attends causally and this one attends by the PIC rule, two places
differ in span only (never in tokens): a message that follows a plus group inside a
``cross`` (spnl's stream leaves it in the last element, which causally still sees every
element) is cross, and so is the generation prompt (spnl opens a plus before it when
the input ends inside one). spnl's padding and marker tokens are not tokens here: every
span starts a block of its own in the pool. The stream's length with them is still
followed, because spnl cuts an assistant turn to end on a block boundary of it.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from .layout import Kind
from .query import Message, Node
from .turns import Turns

Pieces = list[tuple[Kind, list[int]]]


@dataclass
class _Stream:
    """The pieces so far, and the length of spnl's token stream for them (its padding to a
    block boundary before each marker and its marker tokens counted)."""

    block_size: int
    pieces: Pieces = field(default_factory=list)
    length: int = 0

    @property
    def kind(self) -> Kind | None:
        return self.pieces[-1][0] if self.pieces else None

    def open(self, kind: Kind) -> None:
        self.pieces.append((kind, []))

    def extend(self, ids: list[int]) -> None:
        self.pieces[-1][1].extend(ids)
        self.length += len(ids)

    def pad(self) -> None:
        self.length = -(-self.length // self.block_size) * self.block_size

    def marker(self, kind: Kind) -> None:
        """spnl's padding and marker before a span of ``kind``, which opens here."""
        self.pad()
        self.length += 1
        self.open(kind)


class SpanTokenizer:
    """Span inputs → PIC pieces for one model: its turns, its tokenizer (``encode``: text
    to ids with no special tokens added) and the pool's block size."""

    def __init__(self, turns: Turns, encode: Callable[[str], list[int]], block_size: int) -> None:
        self.turns, self.encode, self.block_size = turns, encode, block_size
        self._preamble = encode(turns.preamble) if turns.preamble else []
        self._generation = encode(turns.generation_prompt)
        self._assistant_suffix = _assistant_suffix(turns, encode) if turns.crops_assistant else 0

    def generate_pieces(self, node: Node) -> Pieces:
        """A generate's input, then the generation prompt (cross)."""
        stream = self._start()
        self._walk(node, stream, cross=True)
        if stream.kind == "plus":
            stream.marker("cross")
        stream.extend(self._generation)
        return _nonempty(stream.pieces)

    def map_pieces(self, text: str) -> Pieces:
        """A map input: one plus element, the user's turn (no generation prompt)."""
        stream = self._start()
        stream.marker("plus")
        self._message(Message("user", text), stream)
        return _nonempty(stream.pieces)

    def _start(self) -> _Stream:
        stream = _Stream(self.block_size)
        stream.open("cross")
        stream.pieces[-1][1].extend(self._preamble)  # not in spnl's stream
        return stream

    def _walk(self, node: Node, stream: _Stream, cross: bool) -> None:
        """``cross``: whether ``node`` stands outside any plus element."""
        if isinstance(node, Message):
            if cross and stream.kind == "plus":
                stream.open("cross")
            self._message(node, stream)
            return
        children = node.children
        if node.kind == "plus":
            for child in children:
                stream.marker("plus")
                self._walk(child, stream, cross=False)
        elif node.kind == "cross":
            for child in children[:-1]:
                self._walk(child, stream, cross)
            stream.marker("cross")
            self._walk(children[-1], stream, cross=True)
        else:  # seq, par: in order
            for child in children:
                self._walk(child, stream, cross)

    def _message(self, message: Message, stream: _Stream) -> None:
        ids = self.encode(self.turns.turn(message.role, message.content))
        if message.role == "assistant" and self.turns.crops_assistant:
            ids = ids[: max(len(ids) - self._assistant_suffix, 0)]
            end = stream.length + len(ids)
            ids = ids[: len(ids) - min(len(ids), end % self.block_size)]
        stream.extend(ids)


def _assistant_suffix(turns: Turns, encode: Callable[[str], list[int]]) -> int:
    """How many tokens an assistant turn has after its content, found as spnl finds it:
    from the first token of a word's own tokens in the word's turn."""
    word = "hello"
    turn, alone = encode(turns.turn("assistant", word)), encode(word)
    if not alone or alone[0] not in turn:
        return 0
    return max(len(turn) - (turn.index(alone[0]) + len(alone)), 0)


def _nonempty(pieces: Pieces) -> Pieces:
    return [(kind, ids) for kind, ids in pieces if ids]
