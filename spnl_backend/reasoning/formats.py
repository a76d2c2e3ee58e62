"""Which reasoning syntax a model writes, known from its chat template or chosen by the
``MISTRALRS_REASONING_FORMAT`` setting (``serve --reasoning-format``).

- ``think``: a ``<think>...</think>`` block before the answer (Qwen3/3.5, QwQ, DeepSeek-R1
  and its distills, SmolLM3); where the template opens the block in the generation
  prompt, the output starts inside it;
- ``granite``: the same block, the answer then wrapped in ``<response>...</response>``
  (Granite 3.x in thinking mode);
- ``harmony``: gpt-oss's channels: ``analysis`` is the reasoning, ``final`` the answer,
  ``commentary`` a preamble or a tool call (``to=functions.NAME``);
- ``none``: no separation: the whole output is the answer;
- ``auto`` (the default): one of the above, read from the chat template.
"""

from typing import Any

from ..errors import RequestError, shown
from ..settings.values import (
    REASONING_ALIASES,
    REASONING_FORMATS,
    RESERVED_VARIABLES,
    parse_reasoning_format,
)
from ..tools.formats import (  # gpt-oss's message syntax (its tool calls' too)
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    HARMONY_TAGS,
    MESSAGE,
    RETURN,
    START,
)

__all__ = [
    "CALL",
    "CHANNEL",
    "CONSTRAIN",
    "END",
    "HARMONY_TAGS",
    "MESSAGE",
    "REASONING_ALIASES",
    "REASONING_FORMATS",
    "RETURN",
    "START",
    "parse_reasoning_format",
]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<response>", "</response>"


def detect_format(template: str | None) -> str:
    """The reasoning syntax a chat template writes: ``harmony``, ``granite``, ``think``, or
    ``none`` where it has none."""
    if not template:
        return "none"
    if CHANNEL in template and MESSAGE in template:
        return "harmony"
    if THINK_CLOSE in template or THINK_OPEN in template:
        return "granite" if RESPONSE_OPEN in template else "think"
    return "none"


def resolve_format(setting: str, template: str | None) -> str:
    """The format in effect: the setting, or for ``auto`` the template's."""
    return detect_format(template) if setting == "auto" else setting


def markers(fmt: str) -> tuple[str, ...]:
    """The texts the parser reads: where one is a special token, decoding must keep it."""
    if fmt == "harmony":
        return HARMONY_TAGS
    if fmt == "granite":
        return (THINK_OPEN, THINK_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE)
    if fmt == "think":
        return (THINK_OPEN, THINK_CLOSE)
    return ()


def starts_inside(fmt: str, prompt_tail: str) -> bool:
    """Whether the output starts inside the reasoning: the prompt (its last characters are
    enough) ends with the template's opening of the thinking block, as DeepSeek-R1's and
    Qwen3-Thinking's generation prompts do."""
    return fmt in ("think", "granite") and prompt_tail.rstrip().endswith(THINK_OPEN)


def check_effort(value: object, name: str = "reasoning_effort") -> str | None:
    """A ``reasoning_effort`` value (``low``, ``medium``, ``high``), or None where absent."""
    if value is None or value in ("low", "medium", "high"):
        return value  # type: ignore[return-value]
    raise RequestError(f"{name}={shown(value)}: expected 'low', 'medium' or 'high'")


def check_budget(value: object, name: str = "thinking_token_budget") -> int | None:
    """A reasoning budget: the most tokens the reasoning may take (an integer >= 0), or
    None where absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(
            f"{name}={shown(value)}: expected an integer >= 0 (the most tokens the "
            "reasoning may take before it is closed)"
        )
    return value


def template_variables(
    kwargs: object, effort: object = None, kwargs_name: str = "chat_template_kwargs"
) -> dict[str, Any] | None:
    """A request's chat template variables: ``kwargs`` (passed to the template as they
    are, as vLLM does: ``enable_thinking`` and whatever else the template reads) and the
    ``reasoning_effort`` (the variable gpt-oss's template writes as ``Reasoning: X``).
    None where there are none; a `RequestError` naming the field where one is wrong."""
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise RequestError(f"{kwargs_name}={shown(kwargs)}: expected an object of variables")
    reserved = sorted(set(kwargs) & set(RESERVED_VARIABLES))
    if reserved:
        raise RequestError(
            f"{kwargs_name}: {shown(reserved[0])} is the template's own input, set by the "
            "request itself; not a variable to give"
        )
    variables = dict(kwargs)
    effort = check_effort(effort)
    if effort is not None:
        if variables.get("reasoning_effort", effort) != effort:
            raise RequestError(
                f"reasoning_effort={shown(effort)} and {kwargs_name}.reasoning_effort="
                f"{shown(variables['reasoning_effort'])} disagree; give one"
            )
        variables["reasoning_effort"] = effort
    return variables or None
