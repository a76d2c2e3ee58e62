"""OpenAI request bodies → checked engine requests, and the API's error shape.

Every field a body may carry is either used, accepted at a value that asks for nothing
(``echo: false``, ``best_of: 1``), accepted and documented as without effect
(``user``), or refused with a 400 naming it: nothing is silently
ignored. Beyond OpenAI's fields, vLLM's names for the same extensions are read
(``repetition_penalty``, ``min_p``, ``stop_token_ids``, ``ignore_eos``, ``guided_json``,
``guided_regex``, ``guided_grammar``, ``guided_choice``), ``chat_template_kwargs``
(variables for the chat template), ``chat_template`` (a template's Jinja source used
instead of the model's for this request), ``thinking_token_budget`` (the most tokens the
reasoning may take, within ``max_tokens``), and ``token_healing``.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..engine.sequence import SamplingParams
from ..errors import ContextLengthError, RequestError, shown
from ..reasoning import Reasoning, check_budget, template_variables
from ..request import check_text, sampling_params
from ..tools.formats import ToolFormat
from ..tools.spec import ToolRequest, tool_request

MAX_N = 64  # completions per prompt (the engine runs 64 sequences at once)


class ApiError(Exception):
    """An error a client gets in OpenAI's shape (``{"error": {...}}``) with its status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_request_error(exc: RequestError, param: str | None = None) -> ApiError:
    if isinstance(exc, ContextLengthError):
        named = param if param in ("messages", "input") else "prompt"
        return bad_request(str(exc), named, "context_length_exceeded")
    return bad_request(str(exc), param)


@dataclass(frozen=True)
class EngineRequest:
    """What a completions or chat body asks of the engine."""

    model: str
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    prompts: list[str] | list[list[int]] | None = None  # completions
    messages: list[dict[str, Any]] | None = None  # chat
    token_healing: bool | None = None  # None: the server's MISTRALRS_TOKEN_HEALING
    constraint_field: str | None = None  # the field that asked for one, named in its errors
    tools: ToolRequest | None = None  # chat: the tools it offers
    tool_format: ToolFormat | None = None  # how its answer is read for calls, once known
    # chat: the template's variables asked for (chat_template_kwargs, reasoning_effort)
    template_variables: dict[str, Any] | None = None
    reasoning: Reasoning | None = None  # how its answer's reasoning is read, once known
    show_reasoning: bool = True  # Ollama's think: false leaves the reasoning out
    chat_template: str | None = None  # chat: the request's own template (vLLM's field)


# Fields read for their value (the sampling ones below, and the per-endpoint ones).
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "stop")
# Passed on under the same name (`request.OPTION_NAMES`).
_OPTIONS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
    "stop_token_ids",
    "ignore_eos",
    "response_format",
    "token_healing",
    "speculative",
)
# vLLM's names for the output constraints → the Python API's.
_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_grammar": "grammar",
    "guided_choice": "choice",
}
_TOOLS = ("tools", "tool_choice", "parallel_tool_calls")
# Other servers' names for an option → the Python API's. sglang-router and vllm-router add
# ``no_stop_trim`` (SGLang's) to every request they forward; vLLM's own is
# ``include_stop_str_in_output``.
_ALIASES = {"no_stop_trim": "keep_stop", "include_stop_str_in_output": "keep_stop"}
_COMMON = (
    "model",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    *_SAMPLING,
    *_OPTIONS,
    *_GUIDED,
    *_ALIASES,
)
# Accepted, with no effect: metadata, or a mode this engine's models do not have.
_NO_EFFECT = ("user", "store", "metadata", "service_tier")


def _neutral(value: object, *allowed: object) -> bool:
    return any(value is a or (value == a and type(value) is type(a)) for a in allowed)


# Accepted only at the value that asks for nothing; any other value is a 400 naming it.
_NEUTRAL: dict[str, Callable[[object], bool]] = {
    "echo": lambda v: _neutral(v, None, False),
    "best_of": lambda v: _neutral(v, None, 1),
    "suffix": lambda v: _neutral(v, None, ""),
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: _neutral(v, None, "none"),
    "parallel_tool_calls": lambda v: v is None or isinstance(v, bool),
    "modalities": lambda v: v is None or v == ["text"],
    # Added by sglang-router and vllm-router to every request they forward (SGLang's and
    # vLLM's fields), each at the value that is this server's behaviour: special tokens
    # left out of the text, a chat answer's reasoning apart from it and streamed as it
    # comes, no hidden states, a new assistant turn rather than the last one continued.
    "skip_special_tokens": lambda v: _neutral(v, None, True),
    "separate_reasoning": lambda v: _neutral(v, None, True),
    "stream_reasoning": lambda v: _neutral(v, None, True),
    "include_reasoning": lambda v: _neutral(v, None, True),
    "return_hidden_states": lambda v: _neutral(v, None, False),
    "continue_final_message": lambda v: _neutral(v, None, False),
}


def parse_completion(body: object) -> EngineRequest:
    fields = _fields(body, {*_COMMON, "prompt", "max_tokens"})
    prompts = _prompts(fields.get("prompt"))
    return engine_request(fields, fields.get("max_tokens"), "max_tokens", prompts=prompts)


def parse_chat(body: object) -> EngineRequest:
    fields = _fields(
        body,
        {
            *_COMMON,
            *_TOOLS,
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "top_logprobs",
            "chat_template_kwargs",
            "reasoning_effort",
            "thinking_token_budget",
            "chat_template",
        },
    )
    if fields.get("max_completion_tokens") is not None and fields.get("max_tokens") is not None:
        raise bad_request(
            "give max_completion_tokens or max_tokens (its older name), not both",
            "max_completion_tokens",
        )
    given = fields.get("max_completion_tokens") is not None
    name = "max_completion_tokens" if given else "max_tokens"
    try:
        tools = tool_request(*(fields.get(f) for f in _TOOLS))
    except RequestError as exc:
        raise bad_request(str(exc), _named(str(exc), _TOOLS) or "tools") from None
    try:
        variables = template_variables(
            fields.get("chat_template_kwargs"), fields.get("reasoning_effort")
        )
    except RequestError as exc:
        param = _named(str(exc), ("chat_template_kwargs", "reasoning_effort"))
        raise bad_request(str(exc), param) from None
    asked = engine_request(
        fields,
        fields.get(name),
        name,
        messages=_messages(fields),
        tools=tools,
        template_variables=variables,
    )
    template = fields.get("chat_template")
    if template is not None and (not isinstance(template, str) or not template.strip()):
        raise bad_request(
            f"chat_template={shown(template)}: expected a Jinja chat template's source",
            "chat_template",
        )
    asked = replace(asked, chat_template=template)
    return with_budget(asked, fields.get("thinking_token_budget"), "thinking_token_budget")


def with_budget(asked: EngineRequest, budget: object, name: str) -> EngineRequest:
    """``asked`` with a reasoning budget (``name``: the field that gave it), checked."""
    try:
        checked = check_budget(budget, name)
    except RequestError as exc:
        raise bad_request(str(exc), name.split(".")[0]) from None
    if checked is None:
        return asked
    return replace(asked, params=replace(asked.params, reasoning_budget=checked))


# vLLM's /tokenize fields beyond a completion's or chat's, each at the value that is what
# this server does: the model's special tokens added (BOS), a chat's generation prompt
# added, no token strings listed.
_TOKENIZE_ONLY = {
    "add_special_tokens": True,
    "add_generation_prompt": True,
    "return_token_strs": False,
}


def parse_tokenize(body: object) -> EngineRequest:
    """vLLM's ``/tokenize`` body: a completion's ``prompt`` (one) or a chat's
    ``messages``, with the fields of either (vllm-router sends its own with them)."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {_json_kind(body)}")
    rest = dict(body)
    for name, default in _TOKENIZE_ONLY.items():
        value = rest.pop(name, None)
        if value is not None and value is not default:
            raise bad_request(
                f"{name}={shown(value)} is not supported by /tokenize (only {default!r}, "
                "which is how this server tokenizes)",
                name,
                "unsupported_parameter",
            )
    asked = parse_chat(rest) if "messages" in rest else parse_completion(rest)
    if asked.prompts is not None and len(asked.prompts) != 1:
        raise bad_request("/tokenize takes one prompt, a string", "prompt")
    return asked


def _named(message: str, names: tuple[str, ...]) -> str | None:
    """The field an error message starts with."""
    return next((n for n in sorted(names, key=len, reverse=True) if message.startswith(n)), None)


def _fields(body: object, used: set[str]) -> dict[str, Any]:
    return check_fields(body, used, _NO_EFFECT, _NEUTRAL)


def check_fields(
    body: object,
    used: set[str],
    no_effect: tuple[str, ...] = (),
    neutral: dict[str, Callable[[object], bool]] | None = None,
) -> dict[str, Any]:
    """``body`` as an object whose every field is ``used``, accepted with ``no_effect``, or
    at the ``neutral`` value that asks for nothing; its ``model`` named. Anything else is a
    400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {_json_kind(body)}")
    neutral = neutral or {}
    for name, value in body.items():
        if name in used or name in no_effect:
            continue
        if name in neutral:
            if not neutral[name](value):
                raise bad_request(
                    f"{name}={shown(value)} is not supported by this server yet "
                    "(only its default, which asks for nothing, is accepted)",
                    name,
                    "unsupported_parameter",
                )
            continue
        raise bad_request(
            f"unknown or unsupported parameter {shown(name)}", name, "unsupported_parameter"
        )
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad_request(
            "model is required: the name of the served model (GET /v1/models)", "model"
        )
    return body


def engine_request(
    fields: dict[str, Any], max_tokens: object, max_name: str, **prompt: Any
) -> EngineRequest:
    """The engine request of a body's checked ``fields``, under OpenAI's names (the other
    APIs map theirs to these first); ``prompt``: its prompts, or its messages and tools."""
    params = _sampling(fields, max_tokens, max_name, chat="messages" in prompt)
    n = fields.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise bad_request(f"n={shown(n)}: expected an integer from 1 to {MAX_N}", "n")
    stream = fields.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"stream={shown(stream)}: expected true or false", "stream")
    return EngineRequest(
        model=fields["model"],
        params=params,
        n=n,
        stream=bool(stream),
        include_usage=_include_usage(fields.get("stream_options"), bool(stream)),
        token_healing=fields.get("token_healing"),
        constraint_field=next(
            (f for f in ("response_format", *_GUIDED) if fields.get(f) is not None), None
        ),
        **prompt,
    )


def _sampling(
    fields: dict[str, Any], max_tokens: object, max_name: str, chat: bool
) -> SamplingParams:
    """The sampling parameters, OpenAI's defaults where a field is absent or null
    (temperature 1, top_p 1; no max_tokens: until EOS or the end of the context)."""
    values = {name: fields.get(name) for name in _SAMPLING}
    options = {name: fields.get(name) for name in _OPTIONS}
    options["keep_stop"] = _keep_stop(fields)
    options.update({ours: fields.get(theirs) for theirs, ours in _GUIDED.items()})
    options.update(_logprobs(fields, chat))
    if chat and options["token_healing"]:
        raise bad_request(
            "token_healing applies to completions: a chat prompt ends with the chat "
            "template's turn marker, not with text cut short",
            "token_healing",
        )
    if values["temperature"] is None:
        values["temperature"] = 1.0
    if values["top_p"] is None:
        values["top_p"] = 1.0
    if values["top_k"] is None or values["top_k"] == -1:  # -1: vLLM's "off"
        values["top_k"] = 0
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        # the library's 0 ("until the end") is the server's null: one message for both
        raise bad_request(
            f"{max_name}={shown(max_tokens)}: expected an integer >= 1, or null for no limit",
            max_name,
        )
    try:
        return sampling_params(max_tokens=max_tokens, **values, **options)  # type: ignore[arg-type]
    except RequestError as exc:
        message = str(exc)
        names = ("max_tokens", *_SAMPLING, *_OPTIONS, "top_logprobs", "logprobs")
        longest_first = sorted(names, key=len, reverse=True)  # stop_token_ids before stop
        name = next((n for n in longest_first if message.startswith(n)), None)
        if name == "max_tokens":
            message = max_name + message[len(name) :]
        param = max_name if name == "max_tokens" else name
        for theirs, ours in _GUIDED.items():
            if fields.get(theirs) is not None and ours in message.split(":")[0]:
                param = theirs
        raise bad_request(message, param) from None


def _keep_stop(fields: dict[str, Any]) -> bool | None:
    """``no_stop_trim`` or ``include_stop_str_in_output``: true keeps the stop string a
    completion ended on in its text. Given both, they must agree."""
    given = {name: fields[name] for name in _ALIASES if fields.get(name) is not None}
    for name, value in given.items():
        if not isinstance(value, bool):
            raise bad_request(f"{name}={shown(value)}: expected true or false", name)
    if len(set(given.values())) > 1:
        raise bad_request(
            "no_stop_trim and include_stop_str_in_output ask for opposite things; give one",
            "no_stop_trim",
        )
    return next(iter(given.values()), None)


def _logprobs(fields: dict[str, Any], chat: bool) -> dict[str, object]:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs``; the completions endpoint's
    ``logprobs`` (how many likeliest tokens to list, 0 to 20: its presence asks for
    them)."""
    given = fields.get("logprobs")
    if chat:
        return {"logprobs": given, "top_logprobs": fields.get("top_logprobs")}
    if given is None:
        return {}
    if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given <= 20:
        raise bad_request(
            f"logprobs={shown(given)}: expected an integer from 0 to 20 (how many likeliest "
            "tokens to list with each token's log-probability)",
            "logprobs",
        )
    return {"logprobs": True, "top_logprobs": given}


def _include_usage(options: object, stream: bool) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad_request(
            f"stream_options={shown(options)}: expected {{'include_usage': true|false}}",
            "stream_options",
        )
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_request("stream_options.include_usage: expected true or false", "stream_options")
    if not stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    return include


def _prompts(prompt: object) -> list[str] | list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    expected = "a string, a list of strings, a list of token ids, or a list of such lists"
    if isinstance(prompt, str):
        return [_prompt_text(prompt, "prompt")]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(f"prompt: expected {expected} (non-empty)", "prompt")
    if all(isinstance(item, str) for item in prompt):
        return [_prompt_text(item, f"prompt[{i}]") for i, item in enumerate(prompt)]
    if all(_is_id(item) for item in prompt):
        return [list(prompt)]
    if all(isinstance(item, list) and item and all(map(_is_id, item)) for item in prompt):
        return [list(item) for item in prompt]
    raise bad_request(f"prompt: expected {expected}", "prompt")


def _prompt_text(text: str, name: str) -> str:
    if not text:
        raise bad_request(f"{name} is empty", "prompt")
    try:
        return check_text(text, name)
    except RequestError as exc:
        raise bad_request(str(exc), "prompt") from None


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _messages(fields: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages, content given as a string or as a list of text parts."""
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: expected a non-empty list of messages", "messages")
    return [_message(message, i) for i, message in enumerate(messages)]


def _message(message: object, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request(f"{where}: expected an object with a string 'role'", "messages")
    unsupported = set(message) - {"role", "content", "name", "tool_calls", "tool_call_id"}
    unsupported -= {"reasoning_content", "reasoning"}
    if unsupported:
        raise bad_request(
            f"{where}: {', '.join(sorted(map(shown, unsupported)))} not supported "
            "(audio and refusals are not served)",
            "messages",
            "unsupported_parameter",
        )
    message = _reasoning_named(message, where)
    content = message.get("content")
    if content is None and message.get("tool_calls") is not None:
        return {**message, "content": ""}  # an assistant turn that only calls tools
    return {**message, "content": _content(content, where)}


def _reasoning_named(message: dict[str, Any], where: str) -> dict[str, Any]:
    """A past turn's reasoning sent back, under either name, as ``reasoning_content``:
    the name templates read (Qwen3's keeps the last turn's)."""
    given = {
        k: message[k] for k in ("reasoning_content", "reasoning") if message.get(k) is not None
    }
    if not given:
        return {k: v for k, v in message.items() if k not in ("reasoning_content", "reasoning")}
    texts = set(given.values())
    if len(texts) > 1 or not isinstance(next(iter(texts)), str):
        raise bad_request(
            f"{where}: reasoning_content (or reasoning, its other name) is one string",
            "messages",
        )
    rest = {k: v for k, v in message.items() if k != "reasoning"}
    return {**rest, "reasoning_content": texts.pop()}


_TEXT_PART = {"type", "text"}


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            part.get("text")
            for part in content
            if isinstance(part, dict) and part.get("type") == "text" and set(part) <= _TEXT_PART
        ]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)  # type: ignore[arg-type]
        raise bad_request(
            f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}, no other "
            "keys) are served",
            "messages",
            "unsupported_parameter",
        )
    raise bad_request(f"{where}.content: expected a string or a list of text parts", "messages")


def _json_kind(value: object) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on one request's inputs, on both APIs
# The values (inputs x dimensions) one embeddings answer carries at most: 16 MiB as
# float32, some 90 MB as JSON numbers; 2,048 inputs of 2,048 dimensions, 1,024 of 4,096.
MAX_EMBEDDING_VALUES = 1 << 22


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: str | list[str] | list[int] | list[list[int]]
    base64: bool  # encoding_format "base64": each vector's float32 bytes, little-endian
    dimensions: int | None  # the first this many, normalized again (None: all)


def parse_embeddings(body: object) -> EmbeddingRequest:
    fields = _fields(body, {"model", "input", "encoding_format", "dimensions"})
    try:
        prompts = _prompts(fields.get("input"))
    except ApiError as exc:
        raise bad_request(exc.message.replace("prompt", "input"), "input") from None
    check_input_count(len(prompts))
    encoding = fields.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad_request(
            f"encoding_format={shown(encoding)}: expected 'float' or 'base64'", "encoding_format"
        )
    dimensions = checked_dimensions(fields.get("dimensions"))
    return EmbeddingRequest(fields["model"], prompts, encoding == "base64", dimensions)


def check_input_count(count: int) -> None:
    """An embeddings request (OpenAI's or Ollama's) names at most `MAX_EMBEDDING_INPUTS`."""
    if count > MAX_EMBEDDING_INPUTS:
        raise bad_request(
            f"input: {count} inputs; at most {MAX_EMBEDDING_INPUTS} are accepted", "input"
        )


def check_embedding_size(asked: EmbeddingRequest, hidden: int) -> None:
    """``asked``'s ``dimensions`` within the model's ``hidden`` size, and its answer within
    `MAX_EMBEDDING_VALUES`: refused before anything is computed."""
    if asked.dimensions is not None and asked.dimensions > hidden:
        raise bad_request(
            f"dimensions={asked.dimensions}: this model's embeddings have {hidden}",
            "dimensions",
        )
    width = asked.dimensions or hidden
    if len(asked.inputs) * width > MAX_EMBEDDING_VALUES:
        raise bad_request(
            f"input: {len(asked.inputs)} inputs of {width} dimensions make "
            f"{len(asked.inputs) * width} values; one answer carries at most "
            f"{MAX_EMBEDDING_VALUES} ({MAX_EMBEDDING_VALUES // width} inputs at this size): "
            "split the inputs over several requests, or ask for fewer dimensions",
            "input",
        )


def checked_dimensions(value: object) -> int | None:
    """An embeddings request's ``dimensions``: an integer >= 1, or None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise bad_request(f"dimensions={shown(value)}: expected an integer >= 1", "dimensions")
    return value
