"""Ollama's API, for the apps that speak it: its bodies → the same engine requests as
OpenAI's routes, and the engine's sequences → its answers (newline-delimited JSON when
streamed, which is its default).

Read from a body: ``model``, ``messages`` or ``prompt`` (with ``system``, and ``raw`` to
skip the chat template), ``tools``, ``format`` (``"json"`` or a JSON schema, held by the
grammar engine), ``stream``, ``keep_alive``, ``think``, and the ``options``
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``num_predict``, ``stop``,
``repeat_penalty``, ``presence_penalty``, ``frequency_penalty`` and ``num_ctx``. Anything
else is a 400 naming it. ``think`` (``true``, ``false``, or an effort ``"low"``,
``"medium"``, ``"high"``) sets the chat template's ``enable_thinking`` (and
``reasoning_effort``); the reasoning comes back as ``message.thinking`` (``thinking`` on
generate), left out with ``think: false``. Ollama's sampling defaults apply where an
option is absent (temperature 0.8, top_k 40, top_p 0.9). ``num_ctx`` cannot resize this
server's context: a value up to it is accepted, a larger one refused. ``keep_alive`` is a
model's time loaded once idle, in a server of several (`models.ModelSet`); one model
stays loaded for the server's life. A message's ``thinking`` (a past turn's reasoning, as
Ollama's clients send it back) reaches the template as ``reasoning_content``.
"""

import json
import math
import re
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from ..engine.sequence import Sequence
from ..errors import RequestError, shown
from ..request import sampling_params
from ..sampling import SamplingParams
from ..tools.calls import ToolCall
from ..tools.spec import tool_request
from .protocol import (
    EmbeddingRequest,
    EngineRequest,
    bad_request,
    check_input_count,
    checked_dimensions,
)

VERSION = "0.12.0"  # the Ollama API version whose shapes these are
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# A duration's parts, read one after the other from where the last ended (never searched
# for: a search from each position of a long digit run is quadratic).
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_DURATION_PART = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
MAX_DURATION_CHARS = 64  # far more than "-1", "300" or "1h30m45.5s" take
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_chat(body: object, max_model_len: int) -> EngineRequest:
    fields = _fields(body, {"messages", "tools"})
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: expected a non-empty list of messages", "messages")
    try:
        tools = tool_request(fields.get("tools"))
    except RequestError as exc:
        raise bad_request(str(exc), "tools") from None
    return _engine_request(
        fields,
        max_model_len,
        messages=[_message(m, i) for i, m in enumerate(messages)],
        tools=tools,
    )


def parse_generate(body: object, max_model_len: int) -> EngineRequest | None:
    """The request; None for one with no prompt (Ollama's way to load a model)."""
    fields = _fields(body, {"prompt", "system", "raw"})
    prompt, system = fields.get("prompt"), fields.get("system")
    if prompt is None or prompt == "":
        return None
    if not isinstance(prompt, str):
        raise bad_request(f"prompt={shown(prompt)}: expected a string", "prompt")
    if system is not None and not isinstance(system, str):
        raise bad_request(f"system={shown(system)}: expected a string", "system")
    raw = fields.get("raw")
    if raw is not None and not isinstance(raw, bool):
        raise bad_request(f"raw={shown(raw)}: expected true or false", "raw")
    if raw:
        if system:
            raise bad_request("system is templated: with raw, put it in the prompt", "system")
        return _engine_request(fields, max_model_len, prompts=[prompt])
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return _engine_request(fields, max_model_len, messages=messages)


def parse_embed(body: object) -> EmbeddingRequest:
    fields = _fields(body, {"input", "truncate", "dimensions"})
    if fields.get("format") not in (None, ""):
        raise bad_request("format applies to generated text, not to embeddings", "format")
    _params(fields.get("options"), None, 1 << 62)  # the options are checked, and none used
    inputs = fields.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str) for i in inputs):
        raise bad_request("input: expected a string or a non-empty list of strings", "input")
    if not all(inputs):
        raise bad_request("input: an empty string has no embedding", "input")
    check_input_count(len(inputs))
    truncate = fields.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        raise bad_request(f"truncate={shown(truncate)}: expected true or false", "truncate")
    if truncate is True:
        raise bad_request(
            "truncate: true is not served; inputs longer than the context are refused "
            "(send truncate: false)",
            "truncate",
        )
    dimensions = checked_dimensions(fields.get("dimensions"))
    return EmbeddingRequest(fields["model"], inputs, False, dimensions)


def parse_model(body: object) -> str:
    """A body's ``model``, checked before anything else is read from it."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad_request("model is required: a name from /api/tags", "model")
    return bare_model(body["model"])


def parse_name(body: object) -> str:
    """``/api/show``'s model name (``model``, or its older ``name``)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("model is required", "model")
    return name


def bare_model(name: str) -> str:
    """Ollama names carry a tag; ``:latest`` is the name alone."""
    return name.removesuffix(":latest")


def keep_alive_s(value: object) -> float | None:
    """``keep_alive`` in seconds (negative: for ever), as Ollama takes it: a number of
    seconds or a duration such as ``"5m"`` or ``"1h30m"``; None where absent. Text is
    read only up to `MAX_DURATION_CHARS`, so that the parse is short on the event loop."""
    if value is None:
        return None
    seconds = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = _finite(value)
    elif isinstance(value, str) and len(value) <= MAX_DURATION_CHARS:
        seconds = _duration_s(value.strip())
    if seconds is None:
        raise bad_request(
            f"keep_alive={shown(value)}: expected seconds or a duration such as '5m' or '1h' "
            f"(at most {MAX_DURATION_CHARS} characters)",
            "keep_alive",
        )
    return seconds


def _duration_s(text: str) -> float | None:
    """A number of seconds or a duration's parts, each anchored where the last ended."""
    if _NUMBER.fullmatch(text):
        return _finite(text)
    total, at = 0.0, 0
    while at < len(text):
        part = _DURATION_PART.match(text, at)
        if part is None:
            return None
        total += float(part.group(1)) * _UNIT_S[part.group(2)]
        at = part.end()
    return _finite(total) if text else None


def _finite(value: object) -> float | None:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (OverflowError, ValueError):
        return None
    return seconds if math.isfinite(seconds) else None


# ---- answers --------------------------------------------------------------------------


def stamp(later_s: float = 0.0) -> str:
    """The time now (or ``later_s`` seconds from now) as Ollama writes it."""
    at = datetime.now(UTC) + timedelta(seconds=max(later_s, 0.0))
    return at.isoformat().replace("+00:00", "Z")


def chunk(
    model: str, chat: bool, text: str, calls: list[dict] | None = None, thinking: str = ""
) -> dict[str, Any]:
    """One streamed line of an answer in progress (``thinking``: the reasoning it adds)."""
    line: dict[str, Any] = {"model": model, "created_at": stamp()}
    if chat:
        line["message"] = {"role": "assistant", "content": text}
        if thinking:
            line["message"]["thinking"] = thinking
        if calls:
            line["message"]["tool_calls"] = calls
    else:
        line["response"] = text
        if thinking:
            line["thinking"] = thinking
    return {**line, "done": False}


def done(
    model: str,
    chat: bool,
    seq: Sequence,
    text: str,
    calls: list[ToolCall] | None,
    thinking: str = "",
) -> dict:
    """The last line (streamed), or the whole answer, with Ollama's counts and times;
    ``calls``: the whole calls the answer made (None where it answered in text)."""
    line = chunk(model, chat, text, thinking=thinking)
    reason = "length" if seq.finish_reason == "length" else "stop"
    if chat and calls is not None:
        shaped = [
            {"function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in calls
        ]
        line["message"] = {**line["message"], "content": "", "tool_calls": shaped}
    return {**line, "done": True, "done_reason": reason, **counts(seq)}


def counts(seq: Sequence) -> dict[str, int]:
    now = time.monotonic()
    first = seq.first_token_time or now
    finish = seq.finish_time or now
    return {
        "total_duration": _ns(finish - seq.arrival_time),
        "load_duration": 0,
        "prompt_eval_count": len(seq.prompt_token_ids),
        "prompt_eval_duration": _ns(first - seq.arrival_time),
        "eval_count": len(seq.output_token_ids),
        "eval_duration": _ns(finish - first),
    }


def error_line(message: str) -> dict[str, str]:
    return {"error": message}


def details(architecture: str, kind: str) -> dict[str, Any]:
    """What Ollama's listings say of a model's file (its size in parameters and its
    quantization are not read from the file, and left empty)."""
    return {
        "parent_model": "",
        "format": "gguf" if kind == "gguf" else "safetensors",
        "family": architecture,
        "families": [architecture],
        "parameter_size": "",
        "quantization_level": "",
    }


# ---- checks ---------------------------------------------------------------------------

_COMMON = {"model", "options", "format", "stream", "keep_alive", "think"}


def _fields(body: object, used: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = set(body) - used - _COMMON
    if unknown:
        name = sorted(unknown)[0]
        raise bad_request(f"unknown or unsupported field {shown(name)}", name)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad_request("model is required: a name from /api/tags", "model")
    think_variables(body.get("think"))
    keep_alive_s(body.get("keep_alive"))
    return body


def think_variables(think: object) -> dict[str, Any] | None:
    """``think``'s chat template variables: ``enable_thinking`` (and ``reasoning_effort``
    for a level); None where it is absent."""
    if think is None:
        return None
    if isinstance(think, bool):
        return {"enable_thinking": think}
    if think in ("low", "medium", "high"):
        return {"enable_thinking": True, "reasoning_effort": think}
    raise bad_request(
        f"think={shown(think)}: expected true, false, 'low', 'medium' or 'high'", "think"
    )


def _engine_request(fields: dict[str, Any], max_model_len: int, **prompt: Any) -> EngineRequest:
    stream = fields.get("stream", True)
    if not isinstance(stream, bool):
        raise bad_request(f"stream={shown(stream)}: expected true or false", "stream")
    if fields.get("think") is not None and "prompts" in prompt:
        raise bad_request("think is templated: with raw, the prompt is given as it is", "think")
    return EngineRequest(
        template_variables=think_variables(fields.get("think")),
        show_reasoning=fields.get("think") is not False,
        model=bare_model(fields["model"]),
        params=_params(fields.get("options"), fields.get("format"), max_model_len),
        n=1,
        stream=stream,
        include_usage=False,
        token_healing=False,
        constraint_field="format" if fields.get("format") else None,
        **prompt,
    )


def _params(options: object, output_format: object, max_model_len: int) -> SamplingParams:
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise bad_request(f"options={shown(options)}: expected an object", "options")
    unknown = set(options) - set(_OPTIONS) - {"num_predict", "num_ctx"}
    if unknown:
        name = sorted(unknown)[0]
        raise bad_request(
            f"options.{name} is not supported; supported: "
            + ", ".join(sorted([*_OPTIONS, "num_predict", "num_ctx"])),
            "options",
        )
    _check_num_ctx(options.get("num_ctx"), max_model_len)
    values = {ours: options[theirs] for theirs, ours in _OPTIONS.items() if theirs in options}
    if values.get("stop") == []:  # Ollama's "no stop strings"
        del values["stop"]
    values = {**DEFAULTS, **values}
    try:
        return sampling_params(
            max_tokens=_max_tokens(options.get("num_predict")),
            token_healing=False,
            response_format=_format(output_format),
            **values,
        )
    except RequestError as exc:
        message = str(exc)
        for theirs, ours in _OPTIONS.items():
            if message.startswith(ours):
                message = f"options.{theirs}{message[len(ours) :]}"
                break
        raise bad_request(
            message, "format" if message.startswith("response_format") else "options"
        ) from None


def _max_tokens(value: object) -> int | None:
    """``num_predict``: a count, or -1 (until EOS) and -2 (until the context is full),
    which here are the same."""
    if value is None or value in (-1, -2):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(
            f"options.num_predict={shown(value)}: expected a count >= 1, -1 or -2", "options"
        )
    return value


def _check_num_ctx(value: object, max_model_len: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= max_model_len:
        raise bad_request(
            f"options.num_ctx={shown(value)}: this server's context holds {max_model_len} "
            "tokens, set when it starts; give at most that",
            "options",
        )


def _format(value: object) -> dict[str, Any] | None:
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"schema": value}}
    raise bad_request(f"format={shown(value)}: expected 'json' or a JSON schema", "format")


def _message(message: object, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request(f"{where}: expected an object with a string 'role'", "messages")
    if message.get("images"):
        raise bad_request(f"{where}: images are not served (text models only)", "messages")
    unknown = set(message) - {"role", "content", "images", "tool_calls", "tool_name", "thinking"}
    if unknown:
        raise bad_request(f"{where}: unknown field {shown(sorted(unknown)[0])}", "messages")
    content = message.get("content")
    content = "" if content is None else content
    for name in ("content", "tool_name", "thinking"):
        if not isinstance(message.get(name, ""), str):
            raise bad_request(f"{where}.{name}: expected a string", "messages")
    out: dict[str, Any] = {"role": message["role"], "content": content}
    if message.get("thinking"):
        out["reasoning_content"] = message["thinking"]
    if message.get("tool_name"):
        out["name"] = message["tool_name"]
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls: expected a list", "messages")
        out["tool_calls"] = [{"type": "function", "function": _function(c, where)} for c in calls]
    return out


def _function(call: object, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(
            f"{where}.tool_calls: each is {{'function': {{'name': ..., 'arguments': {{...}}}}}}",
            "messages",
        )
    return {"name": function["name"], "arguments": function.get("arguments") or {}}


def _ns(seconds: float) -> int:
    return max(int(seconds * 1e9), 0)
