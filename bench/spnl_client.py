"""spnl's two ways to a local server, as spnl 0.22.1's client speaks them, for the speed-up
benchmark and the tests (spnl's Python package carries only the ``openai/`` provider, so
the ``spnl/`` one is spoken here from its source, `crates/spnl-run/src/generate/backend`).

- ``spnl/`` (`execute_spnl`): the whole query, its model name without the prefix, posted
  as compact JSON with ``Content-Type: text/plain`` to ``/v1/query/execute?stream=...``,
  ``stream=false`` exactly when the query's ``max_tokens`` is 1. Streamed, every line
  starting ``data: `` except ``data: [DONE]`` is read as an OpenAI ``text_completion``
  chunk and a line that does not parse as one is dropped, as the client drops it (a bad
  stream is an empty answer, not an error); choice ``i``'s text is its chunks joined.
  Not streamed, a ``repeat`` is read as a chat completion, a ``map`` as a completion.
  A non-2xx status is an error.
- ``openai/`` (`execute_openai`): the query flattened, as spnl's ``openai/`` provider
  sends it: a generate's messages in order as a streamed chat completion (``n`` from a
  repeat), a map's inputs as a streamed completion of a list of prompts.

Both return each choice's text and the time from the request's start to the first
non-empty text.
"""

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

FINISH_REASONS = (None, "stop", "length", "content_filter")


class ProtocolError(Exception):
    """The server answered something spnl's client would fail on."""


@dataclass
class Answer:
    texts: list[str]
    ttft_s: float | None = None  # to the first non-empty text
    usage: dict[str, Any] | None = None  # the final chunk's (or the body's)
    dropped: list[str] = field(default_factory=list)  # stream lines the client drops


def query_json(query: dict) -> str:
    """The body spnl posts: compact JSON, the ``spnl/`` prefix off the model's name."""
    return json.dumps(_bare_models(query), separators=(",", ":"))


def execute_spnl(base_url: str, query: dict, timeout: float = 600) -> Answer:
    meta = _metadata(query)
    stream = meta.get("max_tokens") != 1
    count = len(query["map"]["inputs"]) if "map" in query else query["repeat"]["n"]
    started = time.perf_counter()
    with httpx.Client(timeout=timeout) as client:
        request = client.build_request(
            "POST",
            base_url + "/v1/query/execute",
            params={"stream": "true" if stream else "false"},
            headers={"Content-Type": "text/plain"},
            content=query_json(query).encode(),
        )
        response = client.send(request, stream=stream)
        try:
            if not stream:
                return _whole(response, "map" in query, started)
            if not response.is_success:
                response.read()
                raise ProtocolError(f"{response.status_code}: {response.text[:500]}")
            return _streamed(response, count, started)
        finally:
            response.close()


def _whole(response: httpx.Response, is_map: bool, started: float) -> Answer:
    try:
        body = response.json()
    except ValueError as exc:
        raise ProtocolError(f"{response.status_code}: not JSON: {response.text[:500]}") from exc
    ttft = time.perf_counter() - started
    if not response.is_success or "choices" not in body:
        raise ProtocolError(f"{response.status_code}: {json.dumps(body)[:500]}")
    if is_map:
        check_completion(body)
        texts = [choice["text"] for choice in body["choices"]]
    else:
        check_chat_completion(body)
        texts = [c["message"]["content"] for c in body["choices"] if c["message"]["content"]]
    return Answer(texts, ttft, body.get("usage"))


def _streamed(response: httpx.Response, count: int, started: float) -> Answer:
    answer = Answer([""] * count)
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            chunk = json.loads(line[len("data: ") :])
            check_completion(chunk)
        except (ValueError, ProtocolError):
            answer.dropped.append(line)
            continue
        if chunk.get("usage"):
            answer.usage = chunk["usage"]
        for choice in chunk["choices"]:
            if choice["text"] and answer.ttft_s is None:
                answer.ttft_s = time.perf_counter() - started
            if choice["index"] < count:
                answer.texts[choice["index"]] += choice["text"]
    return answer


def check_completion(body: Any) -> None:
    """What spnl's client (async-openai's ``CreateCompletionResponse``) needs to parse."""
    _head(body)
    for choice in body["choices"]:
        _need(isinstance(choice, dict), "a choice is not an object")
        _need(isinstance(choice.get("text"), str), "a choice has no text")
        _need(_u32(choice.get("index")), "a choice has no index")
        _need(choice.get("finish_reason") in FINISH_REASONS, "an unknown finish_reason")


def check_chat_completion(body: Any) -> None:
    """What async-openai's ``CreateChatCompletionResponse`` needs to parse."""
    _head(body)
    for choice in body["choices"]:
        message = choice.get("message")
        _need(_u32(choice.get("index")), "a choice has no index")
        _need(isinstance(message, dict) and message.get("role") == "assistant", "no message")
        _need(message.get("content") is None or isinstance(message["content"], str), "content")
        reason = choice.get("finish_reason")
        _need(reason in (*FINISH_REASONS, "tool_calls", "function_call"), "finish_reason")


def _head(body: Any) -> None:
    _need(isinstance(body, dict), "not an object")
    for key in ("id", "model", "object"):
        _need(isinstance(body.get(key), str), f"no {key}")
    _need(_u32(body.get("created")), "created is not a whole number of seconds")
    _need(isinstance(body.get("choices"), list), "no choices")


def _u32(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def _need(condition: bool, what: str) -> None:
    if not condition:
        raise ProtocolError(what)


def execute_openai(base_url: str, query: dict, timeout: float = 600) -> Answer:
    """The query flattened, as spnl's ``openai/`` provider sends it."""
    meta = _metadata(query)
    max_tokens = meta.get("max_tokens") or 2048  # spnl sends 2048 for 0
    temperature = meta.get("temperature", 0.6) or 0.0
    model = meta["model"].split("/", 1)[-1]
    if "map" in query:
        inputs = query["map"]["inputs"]
        body = {"prompt": inputs, "stream": True}
        path, count = "/v1/completions", len(inputs)
    else:
        g = query["repeat"]["g"]
        body = {"messages": messages_of(g["input"]), "n": query["repeat"]["n"], "stream": True}
        body |= {"max_completion_tokens": max_tokens, "reasoning_effort": "low"}
        path, count = "/v1/chat/completions", query["repeat"]["n"]
    if "map" in query:
        body["max_tokens"] = max_tokens
    body |= {"model": model, "temperature": temperature}
    answer = Answer([""] * count)
    started = time.perf_counter()  # as for spnl/: from the request's start
    with (
        httpx.Client(timeout=timeout) as client,
        client.stream("POST", base_url + path, json=body) as response,
    ):
        if not response.is_success:
            response.read()
            raise ProtocolError(f"{response.status_code}: {response.text[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices", []):
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if text and answer.ttft_s is None:
                    answer.ttft_s = time.perf_counter() - started
                answer.texts[choice["index"]] += text
            if chunk.get("usage"):
                answer.usage = chunk["usage"]
    return answer


def messages_of(node: dict) -> list[dict]:
    """spnl's ``messagify``: every message of the tree in order, spans dropped."""
    ((key, value),) = node.items()
    if key in ("seq", "par", "plus", "cross"):
        return [message for child in value for message in messages_of(child)]
    return [{"role": key, "content": value}] if value or key != "user" else []


def _metadata(query: dict) -> dict:
    if "map" in query:
        return query["map"]["metadata"]
    return query["repeat"]["g"]


def _bare_models(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: v.removeprefix("spnl/") if k == "model" and isinstance(v, str) else _bare_models(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_bare_models(item) for item in value]
    return value
