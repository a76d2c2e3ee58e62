"""A conversation with tools made ready for the model: its messages as chat templates read
them (an assistant turn's calls with their arguments as objects, the tools' result turns)
and the output's constraint in the model's own call syntax."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..constrain.spec import ConstraintSpec
from ..errors import RequestError, shown
from ..plain import json_value
from .formats import ToolFormat, template_format
from .grammar import tool_grammar
from .spec import ToolRequest


@dataclass(frozen=True)
class ToolChat:
    """What a chat with tools adds to the request: the format its output is read in
    (None where ``tool_choice`` is ``none``: a text answer, not read for calls) and the
    constraint that holds the output to it."""

    format: ToolFormat | None
    constraint: ConstraintSpec | None


def tool_chat(
    request: ToolRequest, template: str | None, special_id: Callable[[str], int | None]
) -> ToolChat:
    fmt = template_format(template, special_id)
    if not request.constrained:
        return ToolChat(None, None)
    kept = tuple(token for _, token in fmt.kept)
    return ToolChat(fmt, ConstraintSpec("tools", tool_grammar(fmt, request), kept))


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each assistant call's arguments as an object (templates write
    them with ``tojson``; OpenAI's clients send them as JSON text), and an assistant turn
    that only calls given empty content."""
    return [_templated(message, i) for i, message in enumerate(messages)]


def one_call_a_turn(messages: list[dict[str, Any]]) -> None:
    """gpt-oss's turns make one call each (its template renders an assistant message's
    first call only): a message with more is refused rather than cut."""
    for index, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list) and len(calls) > 1:
            raise RequestError(
                f"messages[{index}]['tool_calls']: {len(calls)} calls in one assistant "
                "message; gpt-oss's chat template renders one call a turn, so give each call "
                "its own assistant message, followed by its tool result"
            )


def _templated(message: object, index: int) -> Any:
    if not isinstance(message, dict):
        return message  # refused by the messages' own check
    calls = dict.get(message, "tool_calls")
    if calls is None:
        return message
    where = f"messages[{index}]['tool_calls']"
    if dict.get(message, "role") != "assistant" or not isinstance(calls, list):
        raise RequestError(f"{where}: only an assistant message calls tools, as a list")
    content = dict.get(message, "content")
    return {**message, "content": content or "", "tool_calls": [_call(c, where) for c in calls]}


def _call(call: object, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise RequestError(
            f"{where}: each call is {{'id': ..., 'type': 'function', 'function': {{'name': "
            f"..., 'arguments': ...}}}}, not {shown(call)}"
        )
    arguments = function.get("arguments", {})  # type: ignore[union-attr]
    if isinstance(arguments, str):
        arguments = json_value(arguments, f"{where}: the arguments of the call to {name!r}")
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}: the arguments of the call to {name!r} are not an object")
    body = {"name": name, "arguments": arguments}
    return {**call, "type": "function", "function": body}  # type: ignore[dict-item]
