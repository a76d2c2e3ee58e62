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

from .formats import LAYOUT, ToolFormat
from .gemma import gemma_grammar
from .harmony import harmony_grammar
from .spec import Tool, ToolRequest


def tool_grammar(fmt: ToolFormat, request: ToolRequest) -> str:
    if fmt.syntax == "gemma":
        return gemma_grammar(fmt, request)
    if fmt.syntax == "harmony":
        return harmony_grammar(fmt, request)
    tools = request.callable()
    opening = (f"<[{fmt.marker_id}]> " if fmt.marker_id is not None else "") + _literal(fmt.opening)
    more = f" ({_literal(fmt.separator)} call)*" if request.parallel else ""
    rules = [
        f"calls: {opening} call{more} {_literal(fmt.closing)}",
        f"call: {_literal(fmt.call_open)} ({' | '.join(f'call_{i}' for i in range(len(tools)))})"
        f" {_literal(fmt.call_close)}",
        *(f"call_{i}: {_call(fmt, tool)}" for i, tool in enumerate(tools)),
    ]
    if request.choice == "auto":
        trigger = re.escape(fmt.trigger)
        rules.insert(0, "start: TEXT | calls")
        rules.append(f"TEXT: /(?s:.+)/ & ~/(?s:[ \\t\\r\\n]*{_lark_regex(trigger)}.*)/")
    else:
        rules.insert(0, "start: calls")
    return "%llguidance {}\n" + "\n".join(rules) + "\n"


def _call(fmt: ToolFormat, tool: Tool) -> str:
    """One tool's call object: its name and key written out, its arguments a JSON
    sub-grammar of their own (so that the schema's ``#`` references resolve in it)."""
    head = f'{{"name": "{tool.name}", {json.dumps(fmt.arguments_key)}: '
    schema = {**json.loads(tool.parameters), "x-guidance": LAYOUT}
    return f"{_literal(head)} %json {json.dumps(schema, ensure_ascii=False)} {_literal('}')}"


def _literal(text: str) -> str:
    """``text`` as a Lark string (nothing where it is empty)."""
    return json.dumps(text, ensure_ascii=False) if text else ""


def _lark_regex(pattern: str) -> str:
    """An escaped regex made safe between Lark's slashes, on one line."""
    escapes = {"/": "\\/", "\\\n": "\\n", "\\\t": "\\t", "\\\r": "\\r"}
    for raw, escaped in escapes.items():
        pattern = pattern.replace(raw, escaped)
    return pattern
