"""``spnl-backend chat``: a conversation with a model in the terminal.

A prompt with line editing and history (readline), answers streamed as they are decoded,
the conversation kept between turns (the prefix cache makes each turn pay only for its
new tokens). Ctrl-C stops an answer and keeps what it said so far; at the prompt it
clears the line. Ctrl-D (or ``/bye``) leaves. Commands: ``/clear``, ``/system TEXT``,
``/save FILE``, ``/help``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from .errors import RequestError

if TYPE_CHECKING:
    from .backend import Backend

HELP = """commands:
  /clear          forget the conversation (the system prompt stays)
  /system TEXT    set the system prompt and start again
  /save FILE      write the conversation to FILE as JSON
  /bye            leave (Ctrl-D too)
Ctrl-C stops an answer; the part already written is kept."""


# Control characters a model may write (an escape sequence could clear or retitle the
# terminal) shown as U+FFFD; newlines and tabs kept.
_CONTROLS = {c: "\ufffd" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)] if c not in (9, 10)}


@dataclass
class Conversation:
    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.messages(), indent=2, ensure_ascii=False) + "\n")


def run_chat(backend: Backend, sampling: dict[str, Any], system: str | None) -> int:
    """The loop, until Ctrl-D or ``/bye``."""
    _enable_line_editing()
    conversation = Conversation(system)
    out = sys.stdout
    out.write("chat with the model: /help for commands, Ctrl-D to leave\n")
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            out.write("\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            if not _command(text, conversation, out):
                return 0
            continue
        conversation.turns.append({"role": "user", "content": line})
        try:
            answer = _answer(backend, conversation, sampling, out)
        except RequestError as exc:  # the conversation outgrew the context, say
            conversation.turns.pop()
            out.write(f"error: {exc}\n")
            continue
        conversation.turns.append({"role": "assistant", "content": answer})


def _answer(
    backend: Backend, conversation: Conversation, sampling: dict[str, Any], out: TextIO
) -> str:
    """The model's answer, streamed; what it said before a Ctrl-C."""
    ids = backend.chat_prompt_ids(conversation.messages())
    stream = backend.stream(prompt_token_ids=ids, token_healing=False, **sampling)
    said: list[str] = []
    try:
        for piece in stream:
            said.append(piece)
            out.write(piece.translate(_CONTROLS))
            out.flush()
    except KeyboardInterrupt:
        stream.close()
        out.write("\n[answer stopped]")
    out.write("\n")
    return "".join(said)


def _command(text: str, conversation: Conversation, out: TextIO) -> bool:
    """Run a slash command; False to leave."""
    name, _, rest = text.partition(" ")
    rest = rest.strip()
    if name in ("/bye", "/exit", "/quit"):
        return False
    if name == "/clear":
        conversation.turns.clear()
        out.write("(conversation cleared)\n")
    elif name == "/system":
        conversation.system, conversation.turns = (rest or None), []
        out.write("(system prompt set; conversation cleared)\n" if rest else "(no system prompt)\n")
    elif name == "/save":
        _save(conversation, rest, out)
    elif name == "/help":
        out.write(HELP + "\n")
    else:
        out.write(f"unknown command {name}; /help lists them\n")
    return True


def _save(conversation: Conversation, target: str, out: TextIO) -> None:
    if not target:
        out.write("usage: /save FILE\n")
        return
    path = Path(target).expanduser()
    try:
        conversation.save(path)
    except OSError as exc:
        out.write(f"cannot save to {path}: {exc.strerror or exc}\n")
        return
    out.write(f"(saved {len(conversation.turns)} messages to {path})\n")


def _enable_line_editing() -> None:
    """readline's editing and history for ``input()``, where Python has it."""
    with contextlib.suppress(ImportError):  # a Python built without it: plain input
        import readline  # noqa: F401  # importing it is what turns it on
