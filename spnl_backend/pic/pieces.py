"""The ways a request marks its plus spans, turned into a `PicPrompt`.

1. **Blocks**: ``generate(blocks=[("cross", text or ids), ("plus", ...), ...])``.
2. **Sentinel token ids** in ``prompt_token_ids`` (``SPNL_PIC_PLUS_TOKEN`` and
   ``SPNL_PIC_CROSS_TOKEN``): each sentinel ends the span before it and opens a plus or a
   cross span; tokens before the first are cross. Sentinels are not part of the prompt.
3. **Chat messages**: a message whose content starts with `PLUS_MARKER` (how spnl tags
   the messages of a ``plus``), or a list of messages in place of one (each a plus
   element of one group). The marker is stripped; every message is templated alone, as
   spnl templates a span query's messages (`pic.spans`), so a plus message's span is its
   whole turn (role header, content, end of turn) whatever the conversation around it.
4. **spnl's span queries** (`pic.query`, served at ``/v1/query/execute``): the same
   rule, on spnl's query tree.

Every malformed request (an empty span, a marker with nothing after it, bad kinds) is a
`RequestError` saying what was wrong and what is accepted.
"""

from collections.abc import Callable, Sequence

from ..errors import RequestError, shown
from ..request import check_messages, check_text, checked_token_ids, read_once
from ..settings.pic import CROSS_SENTINEL_ENV, PLUS_SENTINEL_ENV, PicSentinels
from .layout import Kind, PicLayout, PicPrompt
from .query import Group, MapQuery, Message, Node, SpanQuery
from .spans import Pieces, SpanTokenizer

PLUS_MARKER = "\0PIC_PLUS\0"
KINDS = ("cross", "plus")
MAX_PIC_MESSAGES = 4096


def split_sentinels(
    ids: list[int], sentinels: PicSentinels, scheme: str, reuse: str = "exact"
) -> PicPrompt | None:
    """``ids`` as a PIC prompt if a sentinel is in it, else None (a plain prompt)."""
    if sentinels.plus not in ids and sentinels.cross not in ids:
        return None
    pieces: list[tuple[Kind, list[int]]] = [("cross", [])]
    for position, token in enumerate(ids):
        if token in (sentinels.plus, sentinels.cross):
            if position and not pieces[-1][1]:
                raise RequestError(
                    _empty_after_sentinel(sentinels, ids[position - 1], position - 1)
                )
            pieces.append(("plus" if token == sentinels.plus else "cross", []))
        else:
            pieces[-1][1].append(token)
    if not pieces[-1][1]:
        raise RequestError(_empty_after_sentinel(sentinels, ids[-1], len(ids) - 1))
    return make_prompt([(kind, tokens) for kind, tokens in pieces if tokens], scheme, reuse)


def _empty_after_sentinel(sentinels: PicSentinels, token: int, position: int) -> str:
    name = PLUS_SENTINEL_ENV if token == sentinels.plus else CROSS_SENTINEL_ENV
    return (
        f"prompt_token_ids: the {name} sentinel ({token}) at index {position} opens an "
        "empty span; each sentinel must be followed by at least one token before the next "
        "sentinel or the end"
    )


def make_prompt(
    pieces: list[tuple[Kind, list[int]]], scheme: str, reuse: str = "exact"
) -> PicPrompt:
    """A PIC prompt from ``(kind, token ids)`` pieces (none empty)."""
    if not any(kind == "plus" for kind, _ in pieces):
        raise RequestError("a PIC prompt needs at least one plus block")
    layout = PicLayout.build([(kind, len(tokens)) for kind, tokens in pieces], scheme, reuse)
    return PicPrompt([t for _, tokens in pieces for t in tokens], layout)


def block_pieces(
    blocks: object, encode: Callable[[str], list[int]], vocab_size: int, bos: list[int]
) -> list[tuple[Kind, list[int]]]:
    """``generate(blocks=...)``: a non-empty list of ``(kind, text or token ids)``, read
    once. Text is checked and tokenized block by block (``encode``: no special tokens);
    where the first block is text, the ``bos`` tokens a prompt starts with come first, as
    a cross span."""
    items = read_once(blocks, list | tuple)
    if not items:
        raise RequestError(
            f"blocks={shown(blocks)}: expected a non-empty list of (kind, content) pairs, kind "
            "'cross' or 'plus', content a string or a list of token ids"
        )
    pieces: list[tuple[Kind, list[int]]] = []
    for index, item in enumerate(items):
        pair = read_once(item, list | tuple) or []
        kind = str.__str__(pair[0]) if len(pair) == 2 and isinstance(pair[0], str) else None
        if kind not in KINDS:
            raise RequestError(
                f"blocks[{index}] = {shown(item)}: expected a pair (kind, content) with kind "
                "'cross' or 'plus'"
            )
        content, name = pair[1], f"blocks[{index}] content"
        if isinstance(content, str):
            text = check_text(str.__str__(content), name)
            tokens = encode(text) if text else []
            if index == 0 and bos:
                pieces.append(("cross", list(bos)))
        else:
            tokens = checked_token_ids(content, vocab_size, name)
        if not tokens:
            raise RequestError(
                f"blocks[{index}]: the {kind} block is empty; every block needs some text "
                "or token ids"
            )
        pieces.append((kind, tokens))  # type: ignore[arg-type]
    return pieces


def chat_pieces(
    messages: object, spans: SpanTokenizer, max_chars: int
) -> list[tuple[Kind, list[int]]] | None:
    """Marked chat messages as ``(kind, token ids)`` pieces, or None where none is plus.

    As spnl tokenizes a span query (`pic.spans`): every message templated alone, each plus
    message an element of its own (adjacent ones one group), the generation prompt last;
    so an element's tokens never depend on the messages around it, whatever the template
    does with a conversation. At most `MAX_PIC_MESSAGES` messages and ``max_chars`` of
    content (more than the context could hold) are taken."""
    flat, kinds = _flatten(messages)
    if "plus" not in kinds:
        return None
    if len(flat) > MAX_PIC_MESSAGES:
        raise RequestError(
            f"a PIC chat of {len(flat)} messages: at most {MAX_PIC_MESSAGES}; send more as "
            "generate(blocks=...)"
        )
    chars = sum(len(message["content"]) for message in flat)
    if chars > max_chars:
        raise RequestError(
            f"a PIC chat of {chars:,} characters of content: more than the context can hold "
            f"(at most {max_chars:,} are taken); shorten it"
        )
    nodes: list[Node] = []
    for message, kind in zip(flat, kinds, strict=True):
        node = Message(message["role"], message["content"])  # type: ignore[arg-type]
        if kind == "cross":
            nodes.append(node)
        elif nodes and isinstance(nodes[-1], Group):
            nodes[-1] = Group("plus", (*nodes[-1].children, node))
        else:
            nodes.append(Group("plus", (node,)))
    return spans.generate_pieces(Group("seq", tuple(nodes)))


def _flatten(messages: object) -> tuple[list[dict], list[Kind]]:
    """The messages in order with each one's kind; groups (lists) are plus, and so is a
    message whose content starts with the marker (stripped here). Adjacent plus messages
    are one group, however they were given."""
    entries = read_once(messages, list | tuple)
    if not entries:
        raise RequestError("messages must be a non-empty list of {'role', 'content'} dicts")
    flat: list[dict] = []
    kinds: list[Kind] = []
    for index, entry in enumerate(entries):
        group = isinstance(entry, list)
        if group:
            items = read_once(entry, list)  # whatever the list's own methods do
            if not items:
                raise RequestError(
                    f"messages[{index}] is an empty group (or one that cannot be read); a "
                    "group is a non-empty list of plus messages"
                )
            members = check_messages(items, f"messages[{index}]")
        else:
            members = check_messages([entry], "messages", index)
        for member in members:
            content = member["content"]
            marked = isinstance(content, str) and content.startswith(PLUS_MARKER)
            if marked:
                content = content[len(PLUS_MARKER) :]
                if not content:
                    raise RequestError(
                        f"messages[{index}]: the plus marker is followed by nothing; a plus "
                        "message needs content after the marker"
                    )
            flat.append({**member, "content": content})
            kinds.append("plus" if group or marked else "cross")
    return flat, kinds


def has_marker(messages: Sequence[object]) -> bool:
    """Whether any message is marked plus or grouped (cheap: before any checking; a list
    that cannot be read is left to the checks)."""
    for entry in read_once(messages, list | tuple) or []:
        if isinstance(entry, list):
            return True
        if isinstance(entry, dict):
            content = dict.get(entry, "content")
            if isinstance(content, str) and str.startswith(content, PLUS_MARKER):
                return True
    return False


def query_pieces(query: SpanQuery, spans: SpanTokenizer) -> list[Pieces]:
    """A span query's prompts as pieces: a map's inputs each, or a generate's input."""
    if isinstance(query, MapQuery):
        return [spans.map_pieces(text) for text in query.inputs]
    return [spans.generate_pieces(query.input)]
