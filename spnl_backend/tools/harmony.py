"""gpt-oss's output split into its harmony messages: each message's channel (analysis:
reasoning; commentary: tool calls and preambles; final: the answer), its recipient (a
tool call's ``functions.NAME``) and content type, and its text.

The model writes its first message after the prompt's ``<|start|>assistant``, so that one
starts at its header; later ones start with ``<|start|>assistant``. A header is ``[
to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ CONTENT_TYPE]``, the text follows
``<|message|>`` and ends at ``<|end|>``, ``<|call|>`` (a tool call) or ``<|return|>`` (the
last answer). Pure text in, messages out: for the text of a finished generation or of one
still streaming (its last message unfinished, a header not yet whole left out). The text
must keep the special tokens (`Tokenizer.decode_keeping`).
"""

import re
from dataclasses import dataclass

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_END = re.compile("|".join(map(re.escape, ENDS)))


@dataclass(frozen=True)
class HarmonyMessage:
    channel: str | None  # analysis, commentary, final; None where the header names none
    text: str
    recipient: str | None = None  # a tool call's "functions.NAME"
    content_type: str | None = None  # "json", "<|constrain|>json"
    end: str | None = None  # the token that ended it; None while it is being written


def split_channels(text: str) -> list[HarmonyMessage]:
    """The messages of ``text`` (generated after ``<|start|>assistant``), in order. A piece
    that ends before its header is whole is the message being written: left out if it is
    the last, else the text breaks the format and a ValueError says where."""
    pieces = text.split(START)
    messages = []
    for index, piece in enumerate(pieces):
        if index > 0:
            piece = _without_role(piece)
        header, found, rest = piece.partition(MESSAGE)
        if not found:
            if index == len(pieces) - 1 or not piece:
                continue  # a header still being written (or nothing before <|start|>)
            raise ValueError(
                f"harmony message {index + 1} has no {MESSAGE} after its header: {piece[:80]!r}"
            )
        end = _END.search(rest)
        body = rest if end is None else rest[: end.start()]
        messages.append(_message(header, body, None if end is None else end.group()))
    return messages


def _without_role(piece: str) -> str:
    """A message's header after ``<|start|>``: its role (the model's own messages are the
    assistant's) dropped, a recipient after it kept."""
    marks = [i for i in (piece.find(CHANNEL), piece.find(" to="), piece.find(MESSAGE)) if i >= 0]
    return piece[min(marks, default=len(piece)) :]


def _message(header: str, body: str, end: str | None) -> HarmonyMessage:
    before, has_channel, after = header.partition(CHANNEL)
    words = after.split()
    channel = words.pop(0) if has_channel and words else None
    recipient, others = None, []
    for word in before.split() + words:  # a recipient before the channel or after it
        if word.startswith("to="):
            recipient = word.removeprefix("to=")
        else:
            others.append(word)
    return HarmonyMessage(channel, body, recipient, " ".join(others) or None, end)
