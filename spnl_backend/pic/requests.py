"""The three ways a request marks its plus spans, turned into a `PicPrompt`.

1. **Blocks**: ``generate(blocks=[("cross", text or ids), ("plus", ...), ...])``.
2. **Sentinel token ids** in ``prompt_token_ids`` (``SPNL_PIC_PLUS_TOKEN`` and
   ``SPNL_PIC_CROSS_TOKEN``): each sentinel ends the span before it and opens a plus or a
   cross span; tokens before the first are cross. Sentinels are not part of the prompt.
3. **Chat messages**: a message whose content starts with `PLUS_MARKER` (how spnl tags
   the messages of a ``plus``), or a list of messages in place of one (each a plus
   element of one group). The marker is stripped before templating; a plus message's
   span is its whole turn as the template renders it (role header, content, end of turn),
   so turns commute as a whole.

Every malformed request (an empty span, a marker with nothing after it, bad kinds) is a
`RequestError` saying what was wrong and what is accepted.
"""

from collections.abc import Callable, Sequence

from ..errors import RequestError, shown
from ..request import check_messages, check_text, checked_token_ids, read_once
from ..settings.pic import CROSS_SENTINEL_ENV, PLUS_SENTINEL_ENV, PicSentinels
from .layout import Kind, PicLayout, PicPrompt

PLUS_MARKER = "\0PIC_PLUS\0"
KINDS = ("cross", "plus")
MAX_PIC_MESSAGES = 512


def split_sentinels(ids: list[int], sentinels: PicSentinels, scheme: str) -> PicPrompt | None:
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
    return make_prompt([(kind, tokens) for kind, tokens in pieces if tokens], scheme)


def _empty_after_sentinel(sentinels: PicSentinels, token: int, position: int) -> str:
    name = PLUS_SENTINEL_ENV if token == sentinels.plus else CROSS_SENTINEL_ENV
    return (
        f"prompt_token_ids: the {name} sentinel ({token}) at index {position} opens an "
        "empty span; each sentinel must be followed by at least one token before the next "
        "sentinel or the end"
    )


def make_prompt(pieces: list[tuple[Kind, list[int]]], scheme: str) -> PicPrompt:
    """A PIC prompt from ``(kind, token ids)`` pieces (none empty)."""
    if not any(kind == "plus" for kind, _ in pieces):
        raise RequestError("a PIC prompt needs at least one plus block")
    layout = PicLayout.build([(kind, len(tokens)) for kind, tokens in pieces], scheme)
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
    messages: object,
    render: Callable[[list[dict], bool], str],
    encode: Callable[[str], list[int]],
    max_chars: int,
) -> list[tuple[Kind, list[int]]] | None:
    """Marked chat messages as ``(kind, token ids)`` pieces, or None where none is plus.

    ``render(messages, add_generation_prompt)`` is the chat template's text and ``encode``
    tokenizes text without adding special tokens. Each message's turn is the text its
    rendering adds to the conversation before it, which the template must render as a
    prefix of the whole (as templates do turn by turn). Finding the turns renders the
    conversation once per message, so at most `MAX_PIC_MESSAGES` and ``max_chars`` of
    content (more than the context could hold) are taken."""
    flat, kinds = _flatten(messages)
    if "plus" not in kinds:
        return None
    if len(flat) > MAX_PIC_MESSAGES:
        raise RequestError(
            f"a PIC chat of {len(flat)} messages: at most {MAX_PIC_MESSAGES} (each turn's "
            "span is found by rendering the conversation up to it); send more as "
            "generate(blocks=...)"
        )
    chars = sum(len(message["content"]) for message in flat)
    if chars > max_chars:
        raise RequestError(
            f"a PIC chat of {chars:,} characters of content: more than the context can hold "
            f"(at most {max_chars:,} are taken); shorten it"
        )
    full = render(flat, True)
    prefixes = [render(flat[:count], False) for count in range(1, len(flat) + 1)]
    ends = [_preamble(render, full, kinds[0])] + [len(text) for text in prefixes]
    for count, text in enumerate(prefixes, start=1):
        if not full.startswith(text) or ends[count] < ends[count - 1]:
            raise RequestError(
                "this model's chat template does not render the conversation turn by turn "
                f"(messages[:{count}] is not a prefix of the whole), so a plus message's "
                "turn cannot be told apart; send the prompt as generate(blocks=...) instead"
            )
    pieces: list[tuple[Kind, list[int]]] = []
    if ends[0]:
        pieces.append(("cross", encode(full[: ends[0]])))
    for index, kind in enumerate(kinds):
        text = full[ends[index] : ends[index + 1]]
        if text:
            pieces.append((kind, encode(text)))
        elif kind == "plus":
            raise RequestError(f"plus message {index} renders as nothing in this chat template")
    if len(full) > ends[-1]:
        pieces.append(("cross", encode(full[ends[-1] :])))
    return [(kind, tokens) for kind, tokens in pieces if tokens]


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


def _preamble(render: Callable[[list[dict], bool], str], full: str, first: Kind) -> int:
    """The length of what the template renders before any message (a BOS token's text),
    which stays cross. Where the template refuses an empty conversation (or renders it as
    something else), that is unknown: harmless when the first message is cross, whose
    span takes it; a first plus message would take it into its element, so that is
    refused."""
    try:
        before = render([], False)
    except RequestError:
        before = None
    if before is not None and full.startswith(before):
        return len(before)
    if first == "plus":
        raise RequestError(
            "this model's chat template renders something before the first message that "
            "cannot be told apart from it, so the first message cannot be plus: begin with "
            "a cross message (a system or user turn), or send generate(blocks=...)"
        )
    return 0


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
