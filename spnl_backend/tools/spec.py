"""A request's tools, checked: OpenAI's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (Ollama's ``tools`` take the same shape)."""

import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import RequestError, shown
from ..plain import check_text, plain_str, read_once

MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class Tool:
    """One function the model may call; ``parameters`` is its JSON schema's text."""

    name: str
    description: str
    parameters: str

    def definition(self) -> dict[str, Any]:
        """As chat templates read it (OpenAI's shape, the schema as a dict)."""
        function = {"name": self.name, "description": self.description}
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """The tools offered, and how the model may use them: ``choice`` is ``auto``,
    ``none``, ``required`` or one tool's name; ``parallel``: more than one call."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool

    @property
    def constrained(self) -> bool:
        """Whether the output is held to the calls' grammar (``none``: free text)."""
        return self.choice != "none"

    def callable(self) -> tuple[Tool, ...]:
        """The tools a call may name."""
        if self.choice in CHOICES:
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)


def tool_request(
    tools: object, tool_choice: object = None, parallel_tool_calls: object = None
) -> ToolRequest | None:
    """The checked request; None where no tools are given (an empty list, or null)."""
    items = read_once(tools, list | tuple)
    if tools is not None and items is None:
        raise RequestError(f"tools={shown(tools)}: expected a list of function tools")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise RequestError(
            f"parallel_tool_calls={shown(parallel_tool_calls)}: expected true or false"
        )
    if not items:
        if tool_choice not in (None, "none", "auto"):
            raise RequestError(f"tool_choice={shown(tool_choice)} needs tools to choose from")
        return None
    if len(items) > MAX_TOOLS:
        raise RequestError(f"tools: {len(items)} given; at most {MAX_TOOLS} are accepted")
    checked = tuple(_tool(item, i) for i, item in enumerate(items))
    names = [t.name for t in checked]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise RequestError(f"tools: the names {twice} are given more than once")
    choice = _choice(tool_choice, set(names))
    return ToolRequest(checked, choice, parallel_tool_calls is not False)


def _tool(item: object, index: int) -> Tool:
    where = f"tools[{index}]"
    if not isinstance(item, dict) or dict.get(item, "type", "function") != "function":
        raise RequestError(
            f"{where}={shown(item)}: expected {{'type': 'function', 'function': {{'name': "
            "..., 'description': ..., 'parameters': {...}}}}"
        )
    function = dict.get(item, "function")
    if not isinstance(function, dict):
        raise RequestError(f"{where}['function']={shown(function)}: expected a dict")
    given = dict.get(function, "name")
    name = plain_str(given)
    if name is None or not NAME.fullmatch(name):
        raise RequestError(
            f"{where}['function']['name']={shown(given)}: expected 1 to 64 letters, digits, "
            "'_' or '-'"
        )
    description = dict.get(function, "description", "")
    if plain_str(description) is None:
        raise RequestError(f"{where}['function']['description']: expected a string")
    return Tool(name, check_text(description, where), _parameters(function, where))


def _parameters(function: dict, where: str) -> str:
    """The parameters' schema as JSON text; no parameters is an object with none."""
    schema = dict.get(function, "parameters")
    if schema is None:
        schema = {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise RequestError(
            f"{where}['function']['parameters']={shown(schema)}: expected a JSON schema (a dict)"
        )
    if dict.get(schema, "type", "object") != "object":
        raise RequestError(
            f"{where}['function']['parameters']: a function's arguments are an object; its "
            f"schema's type is {shown(dict.get(schema, 'type'))}"
        )
    try:
        return json.dumps(schema, allow_nan=False, ensure_ascii=False)
    except Exception as exc:  # a cycle, NaN, a value JSON has no form for
        raise RequestError(
            f"{where}['function']['parameters'] cannot be written as JSON: {exc}"
        ) from None


def _choice(value: object, names: set[str]) -> str:
    """``auto`` (the default), ``none``, ``required``, or a function by name."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value in CHOICES:
            return value
        raise RequestError(
            f"tool_choice={shown(value)}: expected 'auto', 'none', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}"
        )
    function = dict.get(value, "function") if isinstance(value, dict) else None
    name = plain_str(dict.get(function, "name")) if isinstance(function, dict) else None
    if name is None or dict.get(value, "type", "function") != "function":  # type: ignore[arg-type]
        raise RequestError(
            f"tool_choice={shown(value)}: expected {{'type': 'function', 'function': "
            "{'name': ...}}"
        )
    if name not in names:
        raise RequestError(f"tool_choice names {name!r}, which is not among the tools given")
    return name
