"""The rules every route's requests meet before its handler reads them, in one table
(`ROUTES`): its method, whether the API key is asked, which body types it reads, and the
browser rule. `app.create_app` makes every route from this table, so that a route is
served only under the rules listed here.

The browser rule holds for every POST: a web page may POST a form, plain text or an
untyped body to any address without the browser asking first (no CORS preflight), but not
JSON. So a request that names a page (an ``Origin`` header, ``null`` included) must be
typed JSON, whatever its route, or it is a 403 ``origin_refused``. A client that is no
browser sends no ``Origin``; what types it may send is the route's ``body``.
"""

from dataclasses import dataclass
from typing import Literal

from starlette.datastructures import Headers

from .protocol import ApiError

# The API key (where the server has one): asked, not asked, or asked unless the server
# runs with --open-metrics (a scraper that cannot send it).
Key = Literal["asked", "open", "metrics"]
# The bodies a client that is no browser may send: JSON only (anything else: 415), any
# type (spnl posts its queries as text/plain, curl posts Ollama's JSON untyped; a body is
# read as JSON all the same), or none read (a GET).
Body = Literal["json", "any", "none"]
# The shape of a route's error bodies: OpenAI's ``{"error": {...}}``, Ollama's
# ``{"error": message}``, Anthropic's ``{"type": "error", "error": {...}}``.
ErrorShape = Literal["openai", "ollama", "anthropic"]


@dataclass(frozen=True)
class RouteRule:
    path: str
    method: Literal["GET", "POST", "DELETE"]
    handler: str  # the method of `app._Api` that answers, and its label in /metrics
    key: Key
    body: Body
    errors: ErrorShape = "openai"


ROUTES: tuple[RouteRule, ...] = (
    RouteRule("/health", "GET", "health", "open", "none"),  # orchestrators' probe
    RouteRule("/metrics", "GET", "metrics", "metrics", "none"),
    RouteRule("/v1/models", "GET", "models", "asked", "none"),
    RouteRule("/v1/completions", "POST", "completions", "asked", "json"),
    RouteRule("/v1/chat/completions", "POST", "chat", "asked", "json"),
    RouteRule("/v1/embeddings", "POST", "embeddings", "asked", "json"),
    RouteRule("/v1/messages", "POST", "messages", "asked", "json", errors="anthropic"),
    RouteRule(
        "/v1/messages/count_tokens", "POST", "count_tokens", "asked", "json", errors="anthropic"
    ),
    RouteRule("/v1/responses", "POST", "responses", "asked", "json"),
    RouteRule("/v1/responses/{response_id}", "GET", "response_get", "asked", "none"),
    RouteRule("/v1/responses/{response_id}", "DELETE", "response_delete", "asked", "none"),
    RouteRule("/v1/responses/{response_id}/input_items", "GET", "response_input", "asked", "none"),
    RouteRule("/v1/query/execute", "POST", "query", "asked", "any"),
    RouteRule("/api/chat", "POST", "ollama_chat", "asked", "any", errors="ollama"),
    RouteRule("/api/generate", "POST", "ollama_generate", "asked", "any", errors="ollama"),
    RouteRule("/api/embed", "POST", "ollama_embed", "asked", "any", errors="ollama"),
    RouteRule("/api/tags", "GET", "ollama_tags", "asked", "none", errors="ollama"),
    RouteRule("/api/ps", "GET", "ollama_ps", "asked", "none", errors="ollama"),
    RouteRule("/api/show", "POST", "ollama_show", "asked", "any", errors="ollama"),
    RouteRule("/api/version", "GET", "ollama_version", "open", "none", errors="ollama"),
    RouteRule("/reset_prefix_cache", "POST", "reset_prefix_cache", "asked", "any"),
    # What sglang-router and vllm-router ask of a worker (`router_info`), under SGLang's
    # names and the short ones sglang-router probes when a worker joins.
    RouteRule("/flush_cache", "POST", "flush_cache", "asked", "any"),
    RouteRule("/health_generate", "GET", "health_generate", "asked", "none"),
    RouteRule("/get_model_info", "GET", "model_info", "asked", "none"),
    RouteRule("/model_info", "GET", "model_info", "asked", "none"),
    RouteRule("/get_server_info", "GET", "server_info", "asked", "none"),
    RouteRule("/server_info", "GET", "server_info", "asked", "none"),
    RouteRule("/get_load", "GET", "get_load", "metrics", "none"),
    RouteRule("/tokenize", "POST", "tokenize", "asked", "json"),  # vLLM's
    # LoRA adapters at run time: vLLM's routes, and llama-server's list and global scales.
    RouteRule("/v1/load_lora_adapter", "POST", "load_lora_adapter", "asked", "json"),
    RouteRule("/v1/unload_lora_adapter", "POST", "unload_lora_adapter", "asked", "json"),
    RouteRule("/lora-adapters", "GET", "lora_adapters", "asked", "none"),
    RouteRule("/lora-adapters", "POST", "set_lora_adapters", "asked", "json"),
)


def check_page(rule: RouteRule, headers: Headers) -> None:
    """The browser rule: a POST that names a web page must be typed JSON (403)."""
    if rule.method != "POST" or "origin" not in headers:
        return
    content_type = headers.get("content-type")
    if content_type is not None and is_json(content_type):
        return
    body = "an untyped" if content_type is None else f"a {_media(content_type)}"
    raise ApiError(
        403,
        f"{body} request from a web page (it has an Origin header) is refused; send "
        "application/json, or send it from a client that is no browser",
        code="origin_refused",
    )


def check_type(rule: RouteRule, headers: Headers) -> None:
    """A JSON route's body from a client that is no browser: JSON, or untyped (415)."""
    content_type = headers.get("content-type")
    if rule.body != "json" or content_type is None or is_json(content_type):
        return
    raise ApiError(
        415,
        f"the request body must be JSON (Content-Type: application/json), not "
        f"{_media(content_type)!r}",
        code="unsupported_media_type",
    )


def is_json(content_type: str) -> bool:
    media = _media(content_type)
    return media == "application/json" or media.endswith("+json")


def _media(content_type: str) -> str:
    return content_type.partition(";")[0].strip().lower()
