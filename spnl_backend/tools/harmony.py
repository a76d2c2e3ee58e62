"""The grammar gpt-oss's output is held to when it may call tools (llguidance's Lark).

The output starts in a message's header (the generation prompt ends ``<|start|>assistant``)
and is, optionally, a reasoning message, then the answer or one call:

    <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant
    <|channel|>final<|message|>ANSWER<|return|>
    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

``auto``: the answer or a call; ``required``: a call; a named tool: a call of it. A call
names one of the callable tools and its arguments match that tool's schema, written in
the layout the other formats use. ``<|return|>`` and ``<|call|>`` may be left out: they
are gpt-oss's end-of-sequence tokens, which end the output before they are written. The
output is read by the reasoning module's harmony parser (`reasoning.parsers`).

A tag that is one special token in the vocabulary is written as that token; where the
vocabulary spells it as text, the reasoning and the answer may not hold ``<`` (so that
where they end is never in doubt).
"""

import json

from .formats import LAYOUT, ToolFormat
from .spec import Tool, ToolRequest


def harmony_grammar(fmt: ToolFormat, request: ToolRequest) -> str:
    special = dict(fmt.kept)
    tag = {name: _tag(text, special) for name, text in _TAGS.items()}
    tools = request.callable()
    text = "/(?s:.*)/" if "<|end|>" in special and "<|return|>" in special else "/[^<]*/"
    answer = "final | call" if request.choice == "auto" else "call"
    rules = [
        f"start: analysis? ({answer})",
        f'analysis: {tag["channel"]} "analysis" {tag["message"]} TEXT {tag["end"]} '
        f'{tag["start"]} "assistant"',
        f'final: {tag["channel"]} "final" {tag["message"]} TEXT {tag["return"]}?',
        f"call: {' | '.join(f'call_{i}' for i in range(len(tools)))}",
        *(f"call_{i}: {_call(tool, tag)}" for i, tool in enumerate(tools)),
        f"TEXT: {text}",
    ]
    return "%llguidance {}\n" + "\n".join(rules) + "\n"


_TAGS = {
    "start": "<|start|>",
    "channel": "<|channel|>",
    "message": "<|message|>",
    "constrain": "<|constrain|>",
    "end": "<|end|>",
    "return": "<|return|>",
    "call": "<|call|>",
}


def _tag(text: str, special: dict[str, int]) -> str:
    """A tag as Lark writes it: its special token, or its text."""
    return f"<[{special[text]}]>" if text in special else json.dumps(text)


def _call(tool: Tool, tag: dict[str, str]) -> str:
    """One tool's call message, its arguments a JSON sub-grammar of their own."""
    head = json.dumps(f"commentary to=functions.{tool.name} ")
    schema = {**json.loads(tool.parameters), "x-guidance": LAYOUT}
    arguments = json.dumps(schema, ensure_ascii=False)
    return (
        f'{tag["channel"]} {head} {tag["constrain"]} "json" {tag["message"]} '
        f"%json {arguments} {tag['call']}?"
    )
