"""Reasoning separated from the answer, for every API that shows it apart.

    fmt = resolve_format(settings.reasoning_format, template)   # "think", "harmony", ...
    reasoning = Reasoning(fmt, starts_inside(fmt, prompt_tail))
    parser = reasoning.parser()            # one per output; None for "none"
    delta = parser.feed(text_delta)        # .reasoning, .content, .started, .arguments
    delta = parser.finish()                # at the output's end
    whole = reasoning.split(text)          # a finished output at once: the same result

`Backend.reasoning` builds the `Reasoning` for a prompt; the formats: `formats`.
"""

from dataclasses import dataclass

from .formats import (
    HARMONY_TAGS,
    REASONING_FORMATS,
    check_budget,
    check_effort,
    detect_format,
    markers,
    parse_reasoning_format,
    resolve_format,
    starts_inside,
    template_variables,
)
from .parsers import HarmonyParser, ReasoningDelta, ReasoningParser, ThinkParser


@dataclass(frozen=True)
class Reasoning:
    """How one prompt's outputs are read: the format in effect, whether the output
    starts inside the reasoning (the generation prompt opened it), and (harmony) whether
    its tool calls are read as calls (tools were offered and may be called) or kept in the
    answer as written."""

    format: str
    inside: bool = False
    calls: bool = False

    def parser(self) -> ReasoningParser | None:
        """A fresh parser for one output; None where there is nothing to separate."""
        if self.format == "harmony":
            return HarmonyParser(calls=self.calls)
        if self.format in ("think", "granite"):
            return ThinkParser(self.inside, wrapped=self.format == "granite")
        return None

    def split(self, text: str) -> ReasoningDelta:
        """A whole output's reasoning, answer and (harmony) calls."""
        parser = self.parser()
        if parser is None:
            return ReasoningDelta(content=text)
        delta = parser.feed(text)
        delta.add(parser.finish())
        return delta


__all__ = [
    "HARMONY_TAGS",
    "REASONING_FORMATS",
    "HarmonyParser",
    "Reasoning",
    "ReasoningDelta",
    "ReasoningParser",
    "ThinkParser",
    "check_budget",
    "check_effort",
    "detect_format",
    "markers",
    "parse_reasoning_format",
    "resolve_format",
    "starts_inside",
    "template_variables",
]
