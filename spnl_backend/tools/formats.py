"""How a model family writes its tool calls, known from its chat template.

Every family writes a call as one JSON object, ``{"name": ..., "<arguments>": {...}}``,
between fixed texts; the families differ in those texts, in the arguments' key and in
whether the opening is a special token (which the output's text leaves out):

- Hermes (Qwen 2.5/3, Hermes, many fine-tunes): ``<tool_call>\\n{...}\\n</tool_call>``,
  one block per call;
- Mistral: ``[TOOL_CALLS][{...}, {...}]``, ``[TOOL_CALLS]`` a special token;
- Llama 3.x: ``{"name": ..., "parameters": {...}}``, several joined by ``; ``;
- Gemma (FunctionGemma): ``<start_function_call>call:NAME{key:value,...}<end_function_call>``
  per call, not JSON: keys bare, strings between ``<escape>`` tokens (`tools.gemma`);
- Harmony (gpt-oss): a message of its own, ``<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>{...}<|call|>``, one call per turn (the template renders an
  assistant turn's first call only); read by the reasoning module's harmony parser, which
  splits the output's channels (`tools.harmony`).
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..errors import RequestError

# gpt-oss's message syntax: <|start|>ROLE<|channel|>CHANNEL<|message|>TEXT<|end|>, a
# turn's last message ending in <|return|> (an answer) or <|call|> (a tool call); the
# reasoning module's harmony parser reads it too.
START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
HARMONY_TAGS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)

# The layout structured output uses too (constrain.spec): no whitespace the model could
# pad with until max_tokens runs out.
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolFormat:
    family: str
    opening: str  # before the first call, as the output's text has it
    call_open: str  # before each call's object
    call_close: str  # after each call's object
    separator: str  # between two calls
    closing: str  # after the last call
    arguments_key: str
    marker: str = ""  # a text that opens the calls and may be one special token
    marker_id: int | None = None  # that token, where it is special (not in the text)
    syntax: str = "json"  # how a call is written: a JSON object, or "gemma"
    kept: tuple[tuple[str, int], ...] = ()  # fixed texts that are one special token each,
    # kept in the output's text (the reader needs them; Gemma's <escape> delimits strings)

    @property
    def trigger(self) -> str:
        """What a text answer may not start with: the calls' first fixed text, or a
        call's opening brace where there is none (where a text answer and a call could
        share a longer start, the lexer would have to take back what it read)."""
        return self.opening + self.call_open or "{"


HERMES = ToolFormat("hermes", "", "<tool_call>\n", "\n</tool_call>", "\n", "", "arguments")
MISTRAL = ToolFormat("mistral", "[", "", "", ", ", "]", "arguments", marker="[TOOL_CALLS]")
LLAMA3 = ToolFormat("llama3", "", "", "", "; ", "", "parameters")
GEMMA_CALL, GEMMA_END, GEMMA_ESCAPE = "<start_function_call>", "<end_function_call>", "<escape>"
GEMMA = ToolFormat("gemma", "", GEMMA_CALL + "call:", GEMMA_END, "", "", "", syntax="gemma")
HARMONY = ToolFormat("harmony", "", "", "", "", "", "", syntax="harmony")
FAMILIES = (HERMES, MISTRAL, LLAMA3, GEMMA, HARMONY)


def template_format(template: str | None, special_id: Callable[[str], int | None]) -> ToolFormat:
    """The format a model with this chat template calls tools in; a `RequestError` saying
    why where it has none (``special_id``: a text's token where it is a special one)."""
    if not template:
        raise RequestError("tools need a chat template, and this model has none")
    if "tools" not in template:
        raise RequestError(
            "this model's chat template does not render tools (it never reads 'tools'), so "
            "the model was not trained to call them; use a model whose template does"
        )
    found = _family(template)
    if found is None:
        raise RequestError(
            "this model's chat template renders tools, but in a call syntax this server does "
            "not parse; supported: Hermes/Qwen <tool_call>, Mistral [TOOL_CALLS], Llama 3.x "
            "JSON, Gemma <start_function_call>, gpt-oss harmony (commentary to=functions.NAME)"
        )
    if found.syntax == "harmony":
        kept = tuple((text, i) for text in HARMONY_TAGS if (i := special_id(text)) is not None)
        return replace(found, kept=kept)
    if found.syntax == "gemma":
        texts = (GEMMA_CALL, GEMMA_END, GEMMA_ESCAPE)
        kept = tuple((text, i) for text in texts if (i := special_id(text)) is not None)
        return replace(found, kept=kept)
    if not found.marker:
        return found
    marker_id = special_id(found.marker)
    if marker_id is not None:
        return replace(found, marker_id=marker_id)
    return replace(found, opening=found.marker + found.opening, marker="")  # written as text


def _family(template: str) -> ToolFormat | None:
    if "<|channel|>" in template and "<|call|>" in template:  # a call message's end
        return HARMONY
    if GEMMA_CALL in template:
        return GEMMA
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|start_header_id|>" in template:
        return LLAMA3
    return None
