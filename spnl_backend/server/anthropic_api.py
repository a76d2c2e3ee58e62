"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over
the chat machinery: a body is checked in Anthropic's terms, turned into the chat request
the OpenAI route builds (messages as chat templates read them, tools, sampling), and the
finished or streaming sequence is written back as content blocks and Anthropic's events.

Accepted without effect: ``metadata`` (its ``user_id`` is a label), ``cache_control`` on
any block or tool (the prefix cache reuses every shared prefix by itself; its hits are
``usage.cache_read_input_tokens``), ``service_tier`` and ``inference_geo``. ``thinking``
sets the template's ``enable_thinking`` (``enabled``/``adaptive``: true, ``disabled``:
false); its ``budget_tokens`` bounds the reasoning: once it has taken that many tokens
the engine closes it and the answer follows, ``max_tokens`` counting both (as Anthropic
defines it). On a model whose template writes no reasoning it has nothing to bound.
``output_config.effort`` is the template's ``reasoning_effort``. A ``tool_result`` with
``is_error`` reaches the template as its text after ``Error: ``. Everything else not
listed here is a 400 naming it.
"""

import json
import secrets
from collections.abc import Callable
from typing import Any

from ..engine.sequence import Sequence
from ..errors import RequestError, shown
from ..reasoning import template_variables
from ..tools.calls import ToolCall
from ..tools.spec import ToolRequest, tool_request
from .answer import AnswerReader, Piece, read_answer
from .protocol import (
    ApiError,
    EngineRequest,
    bad_request,
    check_fields,
    engine_request,
    with_budget,
)
from .responses import Reply

_COMMON = ("model", "messages", "system", "tools", "tool_choice")
_NO_EFFECT = ("metadata", "service_tier", "cache_control", "inference_geo")
_NEUTRAL: dict[str, Callable[[object], bool]] = {"speed": lambda v: v in (None, "standard")}
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
_SAMPLING["stop_sequences"] = "stop"
_ROLES = ("user", "assistant")


def parse_messages(body: object) -> EngineRequest:
    """A ``/v1/messages`` body as the chat request it asks for."""
    fields = check_fields(
        body,
        {*_COMMON, *_SAMPLING, "max_tokens", "stream", "output_config", "thinking"},
        _NO_EFFECT,
        _NEUTRAL,
    )
    max_tokens = fields.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad_request(
            f"max_tokens={shown(max_tokens)}: required, an integer >= 1 (the most tokens "
            "the answer may take)",
            "max_tokens",
        )
    if fields.get("stop_sequences") is not None and not isinstance(fields["stop_sequences"], list):
        raise bad_request("stop_sequences: expected a list of strings", "stop_sequences")
    openai = {"model": fields["model"], "stream": fields.get("stream")}
    openai |= {ours: fields.get(theirs) for theirs, ours in _SAMPLING.items()}
    openai["response_format"] = _output_format(fields.get("output_config"))
    messages, tools = _conversation(fields)
    variables = _variables(fields.get("thinking"), fields.get("output_config"), max_tokens)
    try:
        asked = engine_request(
            openai,
            max_tokens,
            "max_tokens",
            messages=messages,
            tools=tools,
            template_variables=variables,
        )
    except ApiError as exc:
        if exc.param == "stop":  # named as Anthropic's clients know it
            raise bad_request("stop_sequences" + exc.message[4:], "stop_sequences") from None
        if exc.param == "response_format":
            raise bad_request(exc.message, "output_config") from None
        raise
    return with_budget(asked, _budget(fields.get("thinking")), "thinking.budget_tokens")


def _budget(thinking: object) -> int | None:
    """The reasoning budget of an enabled ``thinking`` (checked by `_variables`)."""
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        return thinking.get("budget_tokens")
    return None


def _variables(thinking: object, config: object, max_tokens: int | None) -> dict[str, Any] | None:
    """``thinking`` and ``output_config.effort`` as the chat template's variables."""
    variables: dict[str, Any] = {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    keys = {"type", "budget_tokens"} if kind == "enabled" else {"type"}
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    if thinking is not None and (
        kind not in ("enabled", "adaptive", "disabled")
        or set(thinking) - keys  # type: ignore[arg-type]
        or (kind == "enabled" and not _below(budget, max_tokens))
    ):
        raise bad_request(
            f"thinking={shown(thinking)}: expected {{'type': 'enabled', 'budget_tokens': N}} "
            "(N an integer >= 1, below max_tokens), {'type': 'adaptive'} or "
            "{'type': 'disabled'}",
            "thinking",
        )
    if kind is not None:
        variables["enable_thinking"] = kind != "disabled"
    effort = config.get("effort") if isinstance(config, dict) else None
    try:
        return template_variables(variables, effort, "thinking") or None
    except RequestError as exc:
        raise bad_request(
            "output_config.effort" + str(exc).removeprefix("reasoning_effort"), "output_config"
        ) from None


def _below(budget: object, max_tokens: int | None) -> bool:
    """A thinking budget as Anthropic's API takes it: an integer >= 1, below max_tokens."""
    integer = isinstance(budget, int) and not isinstance(budget, bool)
    return integer and budget >= 1 and (max_tokens is None or budget < max_tokens)  # type: ignore[operator]


def _output_format(config: object) -> dict[str, Any] | None:
    """``output_config``'s JSON schema as the chat route's ``response_format`` (its
    ``effort`` is a template variable: `_variables`)."""
    if config is None:
        return None
    fmt = config.get("format") if isinstance(config, dict) else None
    schema = fmt.get("schema") if isinstance(fmt, dict) else None
    if (
        not isinstance(config, dict)
        or set(config) - {"format", "effort"}
        or (fmt is not None and (fmt.get("type") != "json_schema" or not isinstance(schema, dict)))
    ):
        raise bad_request(
            f"output_config={shown(config)}: expected {{'format': {{'type': 'json_schema', "
            "'schema': {...}}, 'effort': 'low' | 'medium' | 'high'}} (both optional)",
            "output_config",
        )
    if fmt is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def parse_count(body: object) -> EngineRequest:
    """A ``/v1/messages/count_tokens`` body: the conversation whose prompt is counted."""
    fields = check_fields(body, {*_COMMON, "thinking", "output_config"}, _NO_EFFECT, _NEUTRAL)
    messages, tools = _conversation(fields)
    _output_format(fields.get("output_config"))
    variables = _variables(fields.get("thinking"), fields.get("output_config"), None)
    return engine_request(
        {"model": fields["model"]},
        None,
        "max_tokens",
        messages=messages,
        tools=tools,
        template_variables=variables,
    )


def _conversation(
    fields: dict[str, Any],
) -> tuple[list[dict[str, Any]], ToolRequest | None]:
    system = _system(fields.get("system"))
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: expected a non-empty list of messages", "messages")
    chat = [{"role": "system", "content": system}] if system is not None else []
    for index, message in enumerate(messages):
        chat += _message(message, f"messages[{index}]")
    if messages[-1].get("role") == "assistant":
        raise bad_request(
            f"messages[{len(messages) - 1}]: a conversation that ends with an assistant turn "
            "asks for that turn to be continued (a prefill), which is not served; end it with "
            "a user turn",
            "messages",
        )
    return chat, _tools(fields.get("tools"), fields.get("tool_choice"))


def _system(system: object) -> str | None:
    if system is None or isinstance(system, str):
        return system
    if isinstance(system, list):
        return "".join(_text_block(block, f"system[{i}]") for i, block in enumerate(system))
    raise bad_request("system: expected a string or a list of text blocks", "system")


def _message(message: object, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn's tool results become tool
    turns (in their order), an assistant turn's ``tool_use`` blocks its tool calls."""
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise bad_request(
            f"{where}: expected {{'role': 'user' | 'assistant', 'content': ...}} (a system "
            "prompt goes in the top-level 'system')",
            "messages",
        )
    if set(message) - {"role", "content"}:
        extra = ", ".join(map(shown, sorted(set(message) - {"role", "content"})))
        raise bad_request(f"{where}: unknown field(s) {extra}", "messages")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list) or not content:
        raise bad_request(
            f"{where}.content: expected a string or a non-empty list of content blocks",
            "messages",
        )
    read = _assistant_blocks if role == "assistant" else _user_blocks
    return read(content, f"{where}.content")


def _user_blocks(blocks: list[object], where: str) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        kind = _kind(block, f"{where}[{i}]", ("text", "tool_result"))
        if kind == "tool_result":
            chat.append(_tool_result(block, f"{where}[{i}]"))  # type: ignore[arg-type]
            continue
        text = _text_block(block, f"{where}[{i}]")
        if chat and chat[-1]["role"] == "user":
            chat[-1]["content"] += text
        else:
            chat.append({"role": "user", "content": text})
    return chat


def _assistant_blocks(blocks: list[object], where: str) -> list[dict[str, Any]]:
    text, thought, calls = "", "", []
    for i, block in enumerate(blocks):
        kind = _kind(block, f"{where}[{i}]", ("text", "tool_use", "thinking"))
        if kind == "text":
            text += _text_block(block, f"{where}[{i}]")
        elif kind == "thinking":
            thought += _thinking_block(block, f"{where}[{i}]")
        else:
            calls.append(_tool_use(block, f"{where}[{i}]"))  # type: ignore[arg-type]
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    if thought:  # the template decides whether a past turn's reasoning is shown again
        turn["reasoning_content"] = thought
    return [{**turn, "tool_calls": calls} if calls else turn]


def _thinking_block(block: object, where: str) -> str:
    """A past turn's reasoning (its ``signature``, this server's empty one or another's,
    is not checked: nothing here signs reasoning)."""
    _only(block, {"type", "thinking", "signature", "cache_control"}, where)  # type: ignore[arg-type]
    text = block.get("thinking")  # type: ignore[union-attr]
    if not isinstance(text, str):
        raise bad_request(f"{where}.thinking: expected a string", "messages")
    return text


def _kind(block: object, where: str, kinds: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in kinds:
        return kind  # type: ignore[return-value]
    if kind == "redacted_thinking":
        raise bad_request(
            f"{where}: redacted_thinking blocks (another service's encrypted reasoning) "
            "cannot be read here",
            "messages",
        )
    raise bad_request(
        f"{where}: a {shown(kind)} block is not served here; this turn takes "
        + " or ".join(map(repr, kinds))
        + " blocks",
        "messages",
    )


def _text_block(block: object, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise bad_request(f"{where}: expected {{'type': 'text', 'text': ...}}", "messages")
    _only(block, {"type", "text", "cache_control", "citations"}, where)
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{where}.text: expected a string", "messages")
    if block.get("citations"):
        raise bad_request(f"{where}.citations: citations are not served", "messages")
    return block["text"]


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    _only(block, {"type", "id", "name", "input", "cache_control", "caller", "toolset_name"}, where)
    if block.get("caller") not in (None, {"type": "direct"}) or block.get("toolset_name"):
        raise bad_request(
            f"{where}: only calls the model made itself are served ('caller' null or "
            "{'type': 'direct'}, no 'toolset_name')",
            "messages",
        )
    ident, name, given = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(ident, str) or not isinstance(name, str) or not isinstance(given, dict):
        raise bad_request(
            f"{where}: a tool_use block is {{'type': 'tool_use', 'id': str, 'name': str, "
            "'input': {...}}",
            "messages",
        )
    return {"id": ident, "type": "function", "function": {"name": name, "arguments": given}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    _only(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, where)
    ident, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(ident, str):
        raise bad_request(
            f"{where}.tool_use_id: expected the id of the tool_use it answers", "messages"
        )
    if isinstance(content, list):
        content = "".join(_text_block(b, f"{where}.content[{i}]") for i, b in enumerate(content))
    elif not isinstance(content, str):
        raise bad_request(
            f"{where}.content: expected a string or a list of text blocks", "messages"
        )
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise bad_request(f"{where}.is_error: expected true or false", "messages")
    text = "Error: " + content if is_error else content
    return {"role": "tool", "tool_call_id": ident, "content": text}


def _only(block: dict[str, Any], keys: set[str], where: str) -> None:
    extra = set(block) - keys
    if extra:
        raise bad_request(
            f"{where}: unknown or unsupported field(s) {', '.join(map(shown, sorted(extra)))}",
            "messages",
        )


def _tools(tools: object, choice: object) -> ToolRequest | None:
    """Anthropic's tools and ``tool_choice`` as the chat route's `ToolRequest`."""
    if tools is not None and not isinstance(tools, list):
        raise bad_request("tools: expected a list of tools", "tools")
    functions = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools or [])]
    openai_choice, parallel = _choice(choice)
    try:
        return tool_request(functions, openai_choice, parallel)
    except RequestError as exc:
        message = str(exc).replace("['function']['parameters']", "['input_schema']")
        message = message.replace("['function']['name']", "['name']")
        raise bad_request(message, "tools") from None


def _tool(tool: object, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad_request(
            f"{where}: only client tools ({{'name', 'description', 'input_schema'}}) are "
            f"served, not {shown(kind)}",
            "tools",
        )
    _only(tool, {"type", "name", "description", "input_schema", "cache_control"}, where)
    if not isinstance(tool.get("input_schema"), dict):
        raise bad_request(f"{where}.input_schema: required, a JSON schema (an object)", "tools")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    function["description"] = tool.get("description") or ""
    return {"type": "function", "function": function}


def _choice(choice: object) -> tuple[object, bool | None]:
    """``tool_choice`` → OpenAI's choice and ``parallel_tool_calls``."""
    if choice is None:
        return None, None
    kinds = {"auto": "auto", "any": "required", "none": "none", "tool": None}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in kinds or set(choice) - {"type", "name", "disable_parallel_tool_use"}:  # type: ignore[arg-type]
        raise bad_request(
            f"tool_choice={shown(choice)}: expected {{'type': 'auto' | 'any' | 'none'}} or "
            "{'type': 'tool', 'name': ...}, with 'disable_parallel_tool_use' optional",
            "tool_choice",
        )
    disable = choice.get("disable_parallel_tool_use")  # type: ignore[union-attr]
    if disable is not None and not isinstance(disable, bool):
        raise bad_request(
            "tool_choice.disable_parallel_tool_use: expected true or false", "tool_choice"
        )
    if kind == "tool":
        name = choice.get("name")  # type: ignore[union-attr]
        if not isinstance(name, str):
            raise bad_request(
                "tool_choice: {'type': 'tool'} names its tool ('name')", "tool_choice"
            )
        return {
            "type": "function",
            "function": {"name": name},
        }, None if disable is None else not disable
    return kinds[kind], None if disable is None else not disable


# ---- errors -------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(exc: ApiError) -> dict[str, Any]:
    """Anthropic's error shape for ``exc`` (its status stays the HTTP status)."""
    kind = _ERROR_TYPES.get(exc.status)
    if kind is None:
        kind = "api_error" if exc.status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


# ---- answers --------------------------------------------------------------------------------


def _message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_id(call: ToolCall) -> str:
    """Anthropic's spelling of a call's id (``toolu_``)."""
    return "toolu_" + call.id.removeprefix("call_")


def stop_reason(seq: Sequence, called: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``."""
    if seq.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if seq.stop_string is not None:
        return "stop_sequence", seq.stop_string
    return "end_turn", None


def usage(seq: Sequence) -> dict[str, int]:
    """Anthropic counts the prompt's tokens read from the cache apart from the others."""
    cached = seq.num_cached_tokens
    return {
        "input_tokens": len(seq.prompt_token_ids) - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": len(seq.output_token_ids),
    }


def message_body(reply: Reply) -> dict[str, Any]:
    """The whole answer as a ``message``."""
    seq = reply.seqs[0]
    answer = read_answer(reply.tools, seq.text, reply.reasoning)
    content: list[dict[str, Any]] = []
    if answer.reasoning:
        content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.text:
        content.append({"type": "text", "text": answer.text})
    for call in answer.calls:
        content.append(_tool_block(call, json.loads(call.arguments)))
    reason, sequence = stop_reason(seq, bool(answer.calls))
    return {
        **_head(reply.model, content),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(seq),
    }


def _head(model: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": _message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
    }


def _tool_block(call: ToolCall, given: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_id(call), "name": call.name, "input": given}


def event(kind: str, data: dict[str, Any]) -> bytes:
    """One of Anthropic's server-sent events."""
    text = json.dumps({"type": kind, **data}, ensure_ascii=False)
    return f"event: {kind}\ndata: {text}\n\n".encode()


class MessageStream:
    """The events of one streamed answer: ``message_start`` (with the prompt's usage, once
    the prompt is computed) and a ``ping``, each content block's start, deltas and stop,
    then ``message_delta`` (stop reason, usage) and ``message_stop``."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.reader = AnswerReader(reply.tools, reply.reasoning)
        self.started = False
        self.block: str | None = None  # the open block's type
        self.index = -1  # the open block's index

    def begin(self) -> list[bytes]:
        return []  # message_start waits for the prompt's usage

    def step(self, seq: Sequence, text: str) -> list[bytes]:
        events = self._start(seq)
        for piece in self.reader.feed(text) if text else []:
            events += self._piece(piece)
        return events

    def end(self, seq: Sequence) -> list[bytes]:
        events = self._start(seq)
        for piece in self.reader.finish():
            events += self._piece(piece)
        events += self._close()
        reason, sequence = stop_reason(seq, bool(self.reader.answer.calls))
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        events.append(event("message_delta", {"delta": delta, "usage": usage(seq)}))
        return [*events, event("message_stop", {})]

    def error(self, exc: ApiError) -> bytes:
        return f"event: error\ndata: {json.dumps(error_body(exc))}\n\n".encode()

    def _start(self, seq: Sequence) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        message = {**_head(self.reply.model, []), "stop_reason": None, "stop_sequence": None}
        message["usage"] = {**usage(seq), "output_tokens": 0}
        return [event("message_start", {"message": message}), event("ping", {})]

    def _piece(self, piece: Piece) -> list[bytes]:
        if piece.kind == "arguments":
            delta = {"type": "input_json_delta", "partial_json": piece.text}
            return [event("content_block_delta", {"index": self.index, "delta": delta})]
        if piece.kind == "call":
            assert piece.call is not None
            return self._open("tool_use", _tool_block(piece.call, {}))
        kind, key = ("thinking", "thinking") if piece.kind == "reasoning" else ("text", "text")
        events = [] if self.block == kind else self._open(kind, {"type": kind, key: ""})
        delta = {"type": f"{kind}_delta", key: piece.text}
        return [*events, event("content_block_delta", {"index": self.index, "delta": delta})]

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.block, self.index = kind, self.index + 1
        if kind == "thinking":
            block["signature"] = ""
        return [
            *events,
            event("content_block_start", {"index": self.index, "content_block": block}),
        ]

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        self.block = None
        return [event("content_block_stop", {"index": self.index})]
