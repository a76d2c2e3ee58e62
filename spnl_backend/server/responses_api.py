"""OpenAI's Responses API (``POST /v1/responses``; ``GET``/``DELETE
/v1/responses/{id}`` and ``.../input_items``) over the chat machinery: a body's ``input``
items and ``instructions`` become the chat request the chat route builds, and the
answer is written back as output items (``message`` with ``output_text``,
``function_call``), whole or as the Responses stream's typed events.

Responses are kept (``store``, true by default) in a bounded store in this process's
memory (`ResponseStore`: the newest `MAX_STORED` responses; none survives a restart), so
that ``previous_response_id`` continues a conversation: its input, output and their
predecessors, without their ``instructions`` and ``tools`` (as OpenAI's API does).

Accepted without effect: ``metadata`` (kept and returned), ``user``,
``safety_identifier``, ``prompt_cache_key`` (the prefix cache reuses every shared prefix
by itself), ``service_tier`` and ``reasoning.summary`` (the reasoning is given whole);
``truncation``, ``include`` and ``background`` at the values that ask for nothing.
``reasoning.effort`` and ``chat_template_kwargs`` are the chat template's variables.
"""

import dataclasses
import json
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine.sequence import Sequence
from ..errors import RequestError, shown
from ..plain import json_value
from ..reasoning import template_variables
from ..tools.spec import ToolRequest, tool_request
from .answer import AnswerReader, Piece
from .protocol import ApiError, EngineRequest, bad_request, check_fields, engine_request
from .responses import Reply

MAX_STORED = 1024  # responses kept for previous_response_id, the oldest dropped first

_USED = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "store",
    "previous_response_id",
    "text",
    "metadata",
    "reasoning",
    "chat_template_kwargs",  # vLLM's extension, as on chat completions
}
_NO_EFFECT = ("user", "safety_identifier", "prompt_cache_key", "service_tier")
_NEUTRAL: dict[str, Callable[[object], bool]] = {
    "truncation": lambda v: v in (None, "disabled"),
    "include": lambda v: v is None or v == [],
    "background": lambda v: v is None or v is False,
}


@dataclass(frozen=True)
class Stored:
    """A kept response: its body, and the conversation that continues from it (its
    predecessors', its input and its output as chat messages, without instructions)."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]
    input_items: list[dict[str, Any]]


class ResponseStore:
    """The newest `MAX_STORED` responses, by id (safe from any thread)."""

    def __init__(self, limit: int = MAX_STORED) -> None:
        self.limit = limit
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, ident: str) -> Stored | None:
        with self._lock:
            return self._kept.get(ident)

    def put(self, ident: str, stored: Stored) -> None:
        with self._lock:
            self._kept[ident] = stored
            while len(self._kept) > self.limit:
                self._kept.popitem(last=False)

    def delete(self, ident: str) -> bool:
        with self._lock:
            return self._kept.pop(ident, None) is not None


def unknown(ident: str) -> ApiError:
    return ApiError(
        404,
        f"no stored response has the id {shown(ident)}: it was never stored (store: false), "
        f"was deleted, or is older than the newest {MAX_STORED} this server keeps in memory",
        code="response_not_found",
    )


@dataclass(frozen=True)
class ResponsesRequest:
    """A ``/v1/responses`` body: the chat request, and what its response repeats and
    keeps."""

    asked: EngineRequest
    echo: dict[str, Any]  # the request's settings as the response reports them
    store: bool
    history: list[dict[str, Any]]  # the conversation before the answer (no instructions)
    input_items: list[dict[str, Any]]


def parse_responses(body: object, store: ResponseStore) -> ResponsesRequest:
    fields = check_fields(body, _USED, _NO_EFFECT, _NEUTRAL)
    previous = _previous(fields.get("previous_response_id"), store)
    items = _input_items(fields.get("input"))
    history = [*(previous.conversation if previous else []), *_chat_messages(items)]
    instructions = fields.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions: expected a string (the system message)", "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    tools = _tools(fields)
    max_tokens = fields.get("max_output_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise bad_request(
            f"max_output_tokens={shown(max_tokens)}: expected an integer >= 1", "max_output_tokens"
        )
    keep = fields.get("store", True)
    if not isinstance(keep, bool):
        raise bad_request(f"store={shown(keep)}: expected true or false", "store")
    openai = {k: fields.get(k) for k in ("model", "temperature", "top_p", "stream")}
    openai["response_format"], text = _text_format(fields.get("text"))
    reasoning, variables = _reasoning(fields.get("reasoning"), fields.get("chat_template_kwargs"))
    asked = engine_request(
        openai,
        max_tokens,
        "max_output_tokens",
        messages=[*system, *history],
        tools=tools,
        template_variables=variables,
    )
    if asked.constraint_field == "response_format":
        asked = dataclasses.replace(asked, constraint_field="text")
    metadata = fields.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_request("metadata: expected an object of strings", "metadata")
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_tokens,
        "metadata": metadata or {},
        "parallel_tool_calls": fields.get("parallel_tool_calls", True) is not False,
        "previous_response_id": fields.get("previous_response_id"),
        "store": keep,
        "temperature": asked.params.temperature,
        "text": text,
        "tool_choice": fields.get("tool_choice") or "auto",
        "tools": fields.get("tools") or [],
        "top_p": asked.params.top_p,
        "reasoning": reasoning,
    }
    return ResponsesRequest(asked, echo, keep, history, items)


_SUMMARIES = (None, "auto", "concise", "detailed")


def _reasoning(reasoning: object, kwargs: object) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``reasoning`` (its ``effort`` the template's ``reasoning_effort``; ``summary``
    accepted, the reasoning being given whole, not summarized) and ``chat_template_kwargs``
    as the template's variables; and ``reasoning`` as the response repeats it."""
    given = reasoning if isinstance(reasoning, dict) else {}
    summary = given.get("summary", given.get("generate_summary"))
    if (reasoning is not None and not isinstance(reasoning, dict)) or (
        set(given) - {"effort", "summary", "generate_summary"} or summary not in _SUMMARIES
    ):
        raise bad_request(
            f"reasoning={shown(reasoning)}: expected {{'effort': 'low' | 'medium' | 'high', "
            "'summary': 'auto' | 'concise' | 'detailed'}} (both optional)",
            "reasoning",
        )
    try:
        variables = template_variables(kwargs, given.get("effort"))
    except RequestError as exc:
        message = str(exc).replace("reasoning_effort", "reasoning.effort")
        param = "chat_template_kwargs" if message.startswith("chat_template") else "reasoning"
        raise bad_request(message, param) from None
    return {"effort": given.get("effort"), "summary": summary}, variables


def _previous(ident: object, store: ResponseStore) -> Stored | None:
    if ident is None:
        return None
    if not isinstance(ident, str):
        raise bad_request("previous_response_id: expected a response's id", "previous_response_id")
    stored = store.get(ident)
    if stored is None:
        error = unknown(ident)
        raise bad_request(error.message, "previous_response_id", "previous_response_not_found")
    return stored


def _input_items(given: object) -> list[dict[str, Any]]:
    """``input`` as a list of items (a string is one user message)."""
    if isinstance(given, str):
        return [{"id": _ident("msg"), "type": "message", "role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad_request("input: expected a string or a non-empty list of input items", "input")
    return [_item(item, f"input[{i}]") for i, item in enumerate(given)]


_ITEM_KEYS = {
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
    "message": {"type", "role", "content", "id", "status"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
}


def _item(item: object, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise bad_request(f"{where}: expected an input item (an object)", "input")
    kind = item.get("type", "message" if "role" in item else None)
    if kind not in _ITEM_KEYS:
        raise bad_request(
            f"{where}: a {shown(kind)} item is not served; input items are messages, "
            "'function_call' and 'function_call_output'",
            "input",
        )
    extra = set(item) - _ITEM_KEYS[kind]
    if extra:
        raise bad_request(
            f"{where}: unknown or unsupported field(s) {', '.join(map(shown, sorted(extra)))}",
            "input",
        )
    checked = {"id": item.get("id") or _ident("msg" if kind == "message" else "fc"), **item}
    checked["type"] = kind
    if kind == "message":
        checked["content"] = _content(item.get("content"), item.get("role"), where)
    elif kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise bad_request(f"{where}.{name}: expected a string", "input")
        try:  # here, where the error can name the item (the chat's check names a message)
            json_value(item["arguments"], f"{where}.arguments")
        except RequestError as exc:
            raise bad_request(str(exc), "input") from None
    elif kind == "reasoning":
        checked["text"] = _reasoning_text(item, where)
    else:
        if not isinstance(item.get("call_id"), str):
            raise bad_request(f"{where}.call_id: expected the id of the call it answers", "input")
        checked["output"] = _output_text(item.get("output"), where)
    return checked


_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")


def _content(content: object, role: object, where: str) -> str:
    if role not in _ROLES:
        raise bad_request(
            f"{where}.role={shown(role)}: expected 'user', 'assistant', 'system' or 'developer'",
            "input",
        )
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: expected a string or a list of text parts", "input")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):  # type: ignore[union-attr]
            raise bad_request(
                f"{where}.content[{i}]: only text parts ({{'type': 'input_text' | "
                f"'output_text', 'text': ...}}) are served, not {shown(kind)}",
                "input",
                "unsupported_parameter",
            )
        texts.append(part["text"])  # type: ignore[index]
    return "".join(texts)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A past turn's reasoning item: its ``reasoning_text`` parts (or, without them, its
    summary's ``summary_text`` parts)."""
    if item.get("encrypted_content"):
        raise bad_request(
            f"{where}: encrypted_content (another service's encrypted reasoning) cannot be "
            "read here",
            "input",
        )
    parts = item.get("content") or item.get("summary") or []
    kinds = ("reasoning_text", "summary_text")
    if not isinstance(parts, list) or not all(
        isinstance(p, dict) and p.get("type") in kinds and isinstance(p.get("text"), str)
        for p in parts
    ):
        raise bad_request(
            f"{where}: a reasoning item's content (or summary) is a list of "
            "{'type': 'reasoning_text' | 'summary_text', 'text': ...} parts",
            "input",
        )
    return "".join(p["text"] for p in parts)


def _output_text(output: object, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _content(output, "user", f"{where}.output")
    raise bad_request(f"{where}.output: expected a string or a list of text parts", "input")


def _chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: a reasoning item opens the assistant turn that
    follows it (as its ``reasoning_content``), and each call joins the assistant turn
    before it."""
    chat: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            if _opened(chat):
                chat[-1]["reasoning_content"] += item["text"]
            else:
                chat.append({"role": "assistant", "content": "", "reasoning_content": item["text"]})
        elif kind == "message":
            role = _ROLES[item["role"]]
            if role == "assistant" and _opened(chat):
                chat[-1]["content"] = item["content"]
            else:
                chat.append({"role": role, "content": item["content"]})
        elif kind == "function_call_output":
            chat.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        else:
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": item["name"], "arguments": item["arguments"]}
            if not chat or chat[-1]["role"] != "assistant":
                chat.append({"role": "assistant", "content": ""})
            chat[-1]["tool_calls"] = [*chat[-1].get("tool_calls", []), call]
    return chat


def _opened(chat: list[dict[str, Any]]) -> bool:
    """Whether the last turn is an assistant turn its reasoning opened, with nothing else
    yet."""
    last = chat[-1] if chat else {}
    return "reasoning_content" in last and not last["content"] and "tool_calls" not in last


def _tools(fields: dict[str, Any]) -> ToolRequest | None:
    """The Responses API's function tools (flat: ``{"type": "function", "name", ...}``)
    and ``tool_choice`` as the chat route's `ToolRequest`."""
    tools = fields.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("tools: expected a list of function tools", "tools")
    functions = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(
                f"tools[{i}]: only function tools are served, not {shown(kind)}", "tools"
            )
        extra = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if extra:
            raise bad_request(f"tools[{i}]: unknown field(s) {sorted(extra)}", "tools")
        function = {k: tool.get(k) for k in ("name", "description", "parameters")}
        functions.append(
            {
                "type": "function",
                "function": {**function, "description": function["description"] or ""},
            }
        )
    choice = fields.get("tool_choice")
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and set(choice) <= {"type", "name"}
    ):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    try:
        return tool_request(functions, choice, fields.get("parallel_tool_calls"))
    except RequestError as exc:
        message = str(exc).replace("['function']", "")
        param = "tool_choice" if message.startswith("tool_choice") else "tools"
        if message.startswith("parallel_tool_calls"):
            param = "parallel_tool_calls"
        raise bad_request(message, param) from None


def _text_format(text: object) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``text.format`` as the chat route's ``response_format``, and as it is echoed."""
    fmt = text.get("format") if isinstance(text, dict) else None
    keys = set(fmt) if isinstance(fmt, dict) else set()
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    only_format = isinstance(text, dict) and set(text) <= {"format"}
    if text is None or (only_format and (fmt is None or (kind == "text" and keys == {"type"}))):
        return None, {"format": {"type": "text"}}
    if only_format and kind == "json_object" and keys == {"type"}:
        return {"type": "json_object"}, {"format": fmt}
    if only_format and kind == "json_schema" and keys <= _SCHEMA_KEYS and "schema" in keys:
        schema = {k: fmt[k] for k in ("name", "schema", "strict") if k in keys}  # type: ignore[index]
        return {"type": "json_schema", "json_schema": schema}, {"format": fmt}
    raise bad_request(
        f"text={shown(text)}: expected {{'format': {{'type': 'text' | 'json_object'}}}} or "
        "{'format': {'type': 'json_schema', 'name': ..., 'schema': {...}, 'strict': ...}}",
        "text",
    )


_SCHEMA_KEYS = {"type", "name", "schema", "strict"}  # a description has no place here


# ---- answers --------------------------------------------------------------------------------


def _ident(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage(seq: Sequence, reasoned: bool = False) -> dict[str, Any]:
    prompt, output = len(seq.prompt_token_ids), len(seq.output_token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": seq.num_cached_tokens},
        "output_tokens": output,
        # Tokens are not counted apart where the answer reasoned: null, not a guess.
        "output_tokens_details": {"reasoning_tokens": None if reasoned else 0},
        "total_tokens": prompt + output,
    }


class ResponseStream:
    """One answer's output items, built piece by piece, and the stream's typed events
    (numbered) that build them; a whole answer is the same reading with its events left
    unsent, so both give the same items."""

    def __init__(self, reply: Reply, asked: ResponsesRequest, store: ResponseStore) -> None:
        self.reply, self.asked, self.store = reply, asked, store
        self.id = _ident("resp")
        self.created = int(time.time())
        self.reader = AnswerReader(reply.tools, reply.reasoning)
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.number = 0

    def response(self, status: str, seq: Sequence | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.reply.model,
            "output": self.items,
            **self.asked.echo,
            "truncation": "disabled",
            "usage": usage(seq, bool(self.reader.answer.reasoning)) if seq is not None else None,
        }
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body

    def begin(self) -> list[bytes]:
        created = self.response("in_progress")
        return [
            self._event("response.created", response=created),
            self._event("response.in_progress", response=created),
        ]

    def step(self, seq: Sequence, text: str) -> list[bytes]:
        return [e for piece in (self.reader.feed(text) if text else []) for e in self._piece(piece)]

    def end(self, seq: Sequence) -> list[bytes]:
        events = [e for piece in self.reader.finish() for e in self._piece(piece)]
        events += self._close(self._status(seq))
        done = self.finished(seq)
        if self.asked.store:  # kept for previous_response_id and GET
            stored = Stored(done, self.conversation(), self.asked.input_items)
            self.store.put(self.id, stored)
        return [*events, self._event(f"response.{done['status']}", response=done)]

    def finished(self, seq: Sequence) -> dict[str, Any]:
        """The response once ``seq`` is done (and `end` has read the rest)."""
        return self.response(self._status(seq), seq)

    @staticmethod
    def _status(seq: Sequence) -> str:
        return "incomplete" if seq.finish_reason == "length" else "completed"

    def error(self, exc: ApiError) -> bytes:
        failed = self.response("failed")
        failed["error"] = {"code": exc.code or exc.kind, "message": exc.message}
        return self._event("response.failed", response=failed)

    def conversation(self) -> list[dict[str, Any]]:
        """The conversation this response continues, its answer as the last turn."""
        answer = self.reader.answer
        turn: dict[str, Any] = {"role": "assistant", "content": answer.text}
        if answer.reasoning:  # the template decides whether a past turn's reasoning shows
            turn["reasoning_content"] = answer.reasoning
        calls = [item for item in self.items if item["type"] == "function_call"]
        if calls:
            turn["tool_calls"] = [
                {
                    "id": c["call_id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls
            ]
        return [*self.asked.history, turn]

    def _piece(self, piece: Piece) -> list[bytes]:
        if piece.kind == "call":
            assert piece.call is not None
            item = {"id": _ident("fc"), "type": "function_call", "status": "in_progress"}
            item |= {"call_id": piece.call.id, "name": piece.call.name, "arguments": ""}
            return self._add(item)
        if piece.kind == "arguments":
            assert self.open is not None
            self.open["arguments"] += piece.text
            return [
                self._event(
                    "response.function_call_arguments.delta", **self._at(), delta=piece.text
                )
            ]
        kind = "message" if piece.kind == "text" else "reasoning"
        events = (
            [] if self.open is not None and self.open["type"] == kind else self._open_text(kind)
        )
        part = self.open["content"][0]  # type: ignore[index]
        part["text"] += piece.text
        name = "output_text" if kind == "message" else "reasoning_text"
        extra = {"logprobs": []} if kind == "message" else {}
        return [
            *events,
            self._event(
                f"response.{name}.delta", **self._at(), content_index=0, delta=piece.text, **extra
            ),
        ]

    def _open_text(self, kind: str) -> list[bytes]:
        if kind == "message":
            item = {
                "id": _ident("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _ident("rs"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        events = self._add(item)
        item["content"].append(part)
        added = self._event("response.content_part.added", **self._at(), content_index=0, part=part)
        return [*events, added]

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        events = self._close("completed")
        self.items.append(item)
        self.open = item
        return [
            *events,
            self._event("response.output_item.added", output_index=len(self.items) - 1, item=item),
        ]

    def _close(self, status: str) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        at = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "function_call":
            events = [
                self._event(
                    "response.function_call_arguments.done", **at, arguments=item["arguments"]
                )
            ]
        else:
            part = item["content"][0]
            name = "output_text" if item["type"] == "message" else "reasoning_text"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events = [
                self._event(
                    f"response.{name}.done", **at, content_index=0, text=part["text"], **extra
                ),
                self._event("response.content_part.done", **at, content_index=0, part=part),
            ]
        if item["type"] != "reasoning":
            item["status"] = status
        return [
            *events,
            self._event("response.output_item.done", output_index=at["output_index"], item=item),
        ]

    def _at(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _event(self, kind: str, **data: Any) -> bytes:
        """One typed event, numbered; its data is written now (items change later)."""
        self.number += 1
        body = {"type": kind, "sequence_number": self.number - 1, **data}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as the API lists it: a message's text as one part."""
    if item["type"] != "message":
        return item
    kind = "output_text" if item["role"] == "assistant" else "input_text"
    return {**item, "content": [{"type": kind, "text": item["content"]}]}


def input_items_body(stored: Stored) -> dict[str, Any]:
    items = [_listed(item) for item in stored.input_items]
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": False,
    }
