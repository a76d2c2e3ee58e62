"""The grammar a tool-calling output is held to (llguidance's Lark dialect).

``auto``: a text answer, which may not open as a call does, or the calls; ``required`` or
a named tool: the calls only. Each call's object names one of the callable tools and its
arguments match that tool's schema, written compactly in a fixed layout, so a returned
call always parses and validates. Where a text answer begins is open until its first
characters differ from the calls' opening (the lexer follows both), which is llama.cpp's
lazy grammar without a trigger list.
"""

import json
import re

from .formats import ToolFormat
from .spec import ToolRequest

# The layout structured output uses too (constrain.spec): no whitespace the model could
# pad with until max_tokens runs out.
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_grammar(fmt: ToolFormat, request: ToolRequest) -> str:
    call = _literal(fmt.call_open) + " " + _call_json(fmt, request) + " " + _literal(fmt.call_close)
    opening = (f"<[{fmt.marker_id}]> " if fmt.marker_id is not None else "") + _literal(fmt.opening)
    more = f" ({_literal(fmt.separator)} call)*" if request.parallel else ""
    rules = [
        f"calls: {opening} call{more} {_literal(fmt.closing)}",
        f"call: {call}",
    ]
    if request.choice == "auto":
        trigger = re.escape(fmt.trigger)
        rules.insert(0, "start: TEXT | calls")
        rules.append(f"TEXT: /(?s:.+)/ & ~/(?s:[ \\t\\r\\n]*{_lark_regex(trigger)}.*)/")
    else:
        rules.insert(0, "start: calls")
    return "%llguidance {}\n" + "\n".join(rules) + "\n"


def _call_json(fmt: ToolFormat, request: ToolRequest) -> str:
    """A call's object: the schema of each callable tool's call, any one of them."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                fmt.arguments_key: json.loads(tool.parameters),
            },
            "required": ["name", fmt.arguments_key],
            "additionalProperties": False,
        }
        for tool in request.callable()
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": LAYOUT}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _literal(text: str) -> str:
    """``text`` as a Lark string (nothing where it is empty)."""
    return json.dumps(text, ensure_ascii=False) if text else ""


def _lark_regex(pattern: str) -> str:
    """An escaped regex made safe between Lark's slashes, on one line."""
    escapes = {"/": "\\/", "\\\n": "\\n", "\\\t": "\\t", "\\\r": "\\r"}
    for raw, escaped in escapes.items():
        pattern = pattern.replace(raw, escaped)
    return pattern
