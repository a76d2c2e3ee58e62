"""A message's turn on its own, as spnl templates the messages of a span query: each one
alone, so that a plus element's tokens do not depend on the messages around it (a
template that folds the system prompt into the first user turn, as Gemma's does, would
otherwise put the system text into the first document's span).

Two sources (``MISTRALRS_SPAN_TEMPLATE``):

- ``model`` (`ModelTurns`): the model's own chat template. A message's turn is what
  rendering it adds after a fixed anchor turn; the text before the first turn (a BOS, a
  default system turn) is the preamble, and the generation prompt is what the template
  adds for it. A system message that the template folds into the first user turn (or
  drops) is rendered as a user turn, as spnl does for such models.
- ``spnl`` (`SpnlTurns`): spnl's own formats for the families it knows, picked by the
  model's name as spnl picks them: token for token what ``spnl.tokenize_query`` gives
  (no BOS; assistant turns cut to a block boundary without their end of turn).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..errors import RequestError

Render = Callable[[list[dict], bool], str]  # (messages, add_generation_prompt) -> text
SPAN_TEMPLATES = ("model", "spnl")
_ANCHOR = "spnl-backend anchor turn"
# Unicode's White_Space, what spnl's (Rust's) trim removes; Python's strip() also removes
# the information separators \x1c-\x1f.
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B)))
_WHITE_SPACE += "\u2028\u2029\u202f\u205f\u3000"


class Turns(Protocol):
    preamble: str  # before the first message
    generation_prompt: str
    crops_assistant: bool  # spnl's rule: an assistant turn ends at a block boundary

    def turn(self, role: str, content: str) -> str: ...


class ModelTurns:
    """Each message through the model's own chat template, alone."""

    crops_assistant = False

    def __init__(self, render: Render) -> None:
        self._render = render
        self._system_as_user = False
        anchor = {"role": "user", "content": _ANCHOR}
        # Some templates insist on alternating roles: a second context ends with a reply.
        self._contexts = ([anchor], [anchor, {"role": "assistant", "content": _ANCHOR}])
        anchor_turn = self.turn("user", _ANCHOR)
        base = render([anchor], False)
        if not base.endswith(anchor_turn):
            raise RequestError(
                "this model's chat template renders a conversation's first turn unlike its "
                "others, so a message cannot be templated alone; set "
                "MISTRALRS_SPAN_TEMPLATE=spnl or send generate(blocks=...)"
            )
        self.preamble = base[: len(base) - len(anchor_turn)]
        self.generation_prompt = render([anchor], True)[len(base) :]
        self._system_as_user = not self._renders_system()

    def turn(self, role: str, content: str) -> str:
        if role == "system" and self._system_as_user:
            role = "user"
        message = {"role": role, "content": content}
        for context in self._contexts:
            try:
                before = self._render(context, False)
                text = self._render([*context, message], False)
            except RequestError:
                continue
            if text.startswith(before) and content.strip() in text[len(before) :]:
                return text[len(before) :]
        raise RequestError(
            f"this model's chat template cannot render a {role} message as a turn of its own "
            "(after another turn), which a span query or a plus message needs; set "
            "MISTRALRS_SPAN_TEMPLATE=spnl or send generate(blocks=...)"
        )

    def _renders_system(self) -> bool:
        """Whether the template gives a system message a turn of its own (not where it
        folds one into the first user turn, or drops one that is not first)."""
        try:
            self.turn("system", _ANCHOR)
        except RequestError:
            return False
        return True


@dataclass(frozen=True)
class _Format:
    """One of spnl's chat formats: a turn is ``head(role) + content + tail``."""

    head: str  # with ``{role}``
    tail: str
    generation_prompt: str
    roles: tuple[tuple[str, str], ...] = ()  # renamed roles
    strip: bool = False  # the content's surrounding whitespace removed


# spnl's formats (spnl-core's llo/chat_template.rs) for the families supported here.
_FORMATS = {
    "chatml": _Format("<|im_start|>{role}\n", "<|im_end|>", "<|im_start|>assistant"),
    "phi3": _Format("<|{role}|>\n", "<|end|>", "<|assistant|>"),
    "phi4": _Format(
        "<|im_start|>{role}<|im_sep|>", "<|im_end|>", "<|im_start|>assistant<|im_sep|>"
    ),
    "gemma": _Format(
        "<start_of_turn>{role}\n",
        "<end_of_turn>",
        "<start_of_turn>model",
        (("assistant", "model"), ("system", "user")),
        strip=True,
    ),
    "llama3": _Format(
        "<|start_header_id|>{role}<|end_header_id|>\n\n",
        "<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        strip=True,
    ),
    "glmedge": _Format("\n<|{role}|>\n", "", "\n<|assistant|>\n"),
    "granite": _Format(
        "<|start_of_role|>{role}<|end_of_role|>",
        "<|end_of_text|>",
        "<|start_of_role|>assistant<|end_of_role|>",
    ),
    "llama4": _Format(
        "<|header_start|>{role}<|header_end|>\n\n",
        "<|eot|>",
        "<|header_start|>assistant<|header_end|>\n\n",
        strip=True,
    ),
}
# spnl picks a family by the first of these that the model's name contains, in this
# order; a family named here without a format is one spnl knows and this project does not.
_DETECTION = (
    (("chatml", "Qwen"), "chatml"),
    (("mistral-v7",), None),
    (("phi3",), "phi3"),
    (("phi4",), "phi4"),
    (("falcon3", "zephyr", "monarch"), None),
    (("gemma",), "gemma"),
    (("orion", "openchat", "vicuna", "deepseek", "command-r"), None),
    (("llama3",), "llama3"),
    (("chatglm3", "chatglm4"), None),
    (("Tulu", "glmedge"), "glmedge"),
    (("minicpm", "exaone3", "exaone4", "rwkv-world"), None),
    (("granite",), "granite"),
    (("megrez", "yandex", "bailing"), None),
    (("llama4",), "llama4"),
)


class SpnlTurns:
    """spnl's own format for the family the model's name names."""

    crops_assistant = True
    preamble = ""

    def __init__(self, model_name: str) -> None:
        self.family = _detect(model_name)
        self._format = _FORMATS[self.family]
        self.generation_prompt = self._format.generation_prompt

    def turn(self, role: str, content: str) -> str:
        form = self._format
        role = dict(form.roles).get(role, role)
        return (
            form.head.format(role=role) + (content.strip() if form.strip else content) + form.tail
        )


def _detect(model_name: str) -> str:
    for needles, family in _DETECTION:
        if any(needle in model_name for needle in needles):
            if family is None:
                break
            return family
    known = ", ".join(n for needles, f in _DETECTION if f for n in needles)
    raise RequestError(
        f"MISTRALRS_SPAN_TEMPLATE=spnl: spnl picks its chat format by the model's name, and "
        f"{model_name!r} names none that is supported here (names containing {known}); "
        "serve the model under such a name, or set MISTRALRS_SPAN_TEMPLATE=model"
    )
