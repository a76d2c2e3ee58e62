"""The OpenAI-compatible HTTP API over one `Backend` (a Starlette app).

Routes: ``GET /health``, ``GET /metrics``, ``GET /v1/models``, ``POST /v1/completions``
and ``POST /v1/chat/completions`` (streamed as server-sent events with ``stream: true``);
spnl's ``POST /v1/query/execute?stream=true|false`` (its span queries, `pic.query`, as
spnl's ``spnl/`` provider posts them) and ``POST /reset_prefix_cache``; Ollama's under
``/api/``. Every route is made from one table of rules (`rules.ROUTES`). A request to
``/v1/`` passes the same gate, in this order: a web page's request that is not JSON
(403), the API key (401), the body's type (415), a loaded model (503), the body's size
(413), arrival (408) and JSON (400), its fields (400), the model's name (404), the
prompt's length (400, ``context_length_exceeded``), the queue's bound (503 with
``Retry-After``). A failure
past the gate is logged with its cause and reaches the client as OpenAI's error body,
never as a stack trace.
"""

import asyncio
import dataclasses
import hmac
import ipaddress
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..backend import Backend, Embeddings, PromptIds
from ..engine.loop import Finished, LoopRequest
from ..engine.sequence import Sequence, StepOutput
from ..errors import AdapterInUseError, ModelFileError, RequestAbortedError, RequestError, shown
from ..log import get_logger
from ..pic.query import MapQuery, SpanQuery, parse_query
from ..plain import json_value
from ..reasoning import ReasoningDelta, ReasoningParser, resolve_format
from ..request import adapter_set
from ..sampling import Adapters
from ..tools.calls import CallReader, call_reader
from ..tools.chat import template_messages
from ..version import version_info
from . import anthropic_api, collector, ollama, responses_api, router_info
from .metrics import ServerMetrics
from .models import ModelSet
from .protocol import (
    ApiError,
    EmbeddingRequest,
    EngineRequest,
    bad_request,
    check_embedding_size,
    from_request_error,
    parse_chat,
    parse_completion,
    parse_embeddings,
    parse_tokenize,
)
from .responses import Endpoint, Reply, embedding_body, json_piecewise, sse
from .rules import ROUTES, ErrorShape, RouteRule, check_page, check_type

log = get_logger()

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_WAITING = 256  # sequences waiting beyond those the engine runs at once
RETRY_AFTER_S = 1
BODY_TIMEOUT_S = 30.0  # from the headers to the body's last byte
# A body up to this size is parsed on the event loop (well under a millisecond); a larger
# one (up to MAX_BODY_BYTES: a tenth of a second or more) on a worker thread.
INLINE_JSON_CHARS = 64 * 1024
CORS_MAX_AGE_S = 600  # how long a browser may keep a preflight's answer
_DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class ServerConfig:
    model_name: str  # what /v1/models lists and requests must name
    api_key: str | None = None  # None: any bearer, or none, is accepted
    max_body_bytes: int = MAX_BODY_BYTES
    max_waiting: int = MAX_WAITING
    # /metrics without the key where one is set (a scraper that cannot send it); by
    # default it follows the key: it names the model and sizes the cache's contents.
    open_metrics: bool = False
    # The Host names requests may carry (`HostCheck`); None: any. A server on a loopback
    # address takes its own names alone by default, so that a web page whose name was
    # rebound to this machine cannot reach it.
    allowed_hosts: tuple[str, ...] | None = None
    # The web pages (origins, ``https://app.example``; ``*``: any) whose scripts may call
    # the API and read its answers (CORS). None, the default: no page's.
    allowed_origins: tuple[str, ...] = ()


@dataclass
class ServerState:
    """What changes while the server runs: the backend once loaded, the sequences in
    flight (for the queue's bound), the metrics."""

    backend: Backend | None = None
    models: ModelSet | None = None  # a server of several models (then no `backend`)
    # Where KV events are published (`kv_events.KvEventsConfig` as a dict), told to routers
    # in /get_server_info; None: not published.
    kv_events: dict[str, Any] | None = None
    publisher: Any = None  # the `kv_events.KvEventPublisher`, once the model is loaded
    in_flight: int = 0
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    responses: responses_api.ResponseStore = field(default_factory=responses_api.ResponseStore)


def create_app(config: ServerConfig, state: ServerState) -> Starlette:
    api = _Api(config, state)
    state.metrics.model_name = config.model_name
    state.metrics.watch(lambda: _engine_stats(state))
    routes = [Route(r.path, api.guarded(r), methods=[r.method], name=r.handler) for r in ROUTES]
    app = Starlette(routes=routes, exception_handlers={404: _not_found, 405: _not_allowed})
    if config.allowed_origins:  # preflights answered, and answers readable, for these alone
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "X-Api-Key", "Anthropic-Version"],
            max_age=CORS_MAX_AGE_S,
        )
    if config.allowed_hosts is not None:  # outermost: a rebound name is refused first
        app.add_middleware(HostCheck, allowed=config.allowed_hosts)
    return app


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class HostCheck:
    """Requests whose ``Host`` names none of ``allowed`` get a 403 (``*`` allows any):
    DNS rebinding gives a web page this server's address under the page's own name, and
    the name is what gives it away."""

    def __init__(self, app: Any, allowed: tuple[str, ...]) -> None:
        self.app, self.allowed = app, {name.lower() for name in allowed}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "*" not in self.allowed:
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if host_name(host) not in self.allowed:
                error = ApiError(
                    403,
                    f"the Host {shown(host)} is not one this server answers to ("
                    + ", ".join(sorted(self.allowed))
                    + "); serve --allowed-hosts adds names",
                    code="host_refused",
                )
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def host_name(host: str) -> str | None:
    """A Host header's name without its port (``[::1]:8000`` -> ``::1``), lower case;
    None where it is not ``host[:port]`` with a hostname, an IPv4 or a bracketed IPv6
    address, and a port of digits (``127.0.0.1:80@evil.example`` is refused, not read as
    ``127.0.0.1``)."""
    host = host.strip().lower()
    if len(host) > MAX_HOST_CHARS:
        return None
    if host.startswith("["):
        address, _, port = host[1:].partition("]")
        if port and not (port.startswith(":") and _is_port(port[1:])):
            return None
        return address if _is_ipv6(address) else None
    if _is_ipv6(host):  # bare, as a bound address is written (not a valid Host)
        return host
    name, colon, port = host.partition(":")
    if colon and not _is_port(port):
        return None
    return name if _is_hostname(name) else None


MAX_HOST_CHARS = 260  # a 253-character name, a colon and a port
_LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")


def _is_hostname(name: str) -> bool:
    """RFC 1123's: dot-separated labels of letters, digits and inner hyphens (an IPv4
    address is one); a final dot allowed."""
    labels = name.removesuffix(".").split(".")
    return 0 < len(name) <= 253 and all(
        0 < len(label) <= 63 and set(label) <= _LABEL_CHARS and "-" not in (label[0], label[-1])
        for label in labels
    )


def _is_port(text: str) -> bool:
    return 0 < len(text) <= 5 and text.isascii() and text.isdigit() and int(text) <= 65535


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def _engine_stats(state: ServerState) -> list[tuple[str | None, Any]]:
    """What /metrics reports of the engines: the one model's, or each loaded model's."""
    if state.models is not None:
        loaded = [(m.name, m.backend) for m in state.models.loaded()]
        return [(name, b.stats()) for name, b in loaded if b is not None and not b.closed]
    return [(None, state.backend.stats())] if _ready(state) else []  # type: ignore[union-attr]


def _ready(state: ServerState) -> bool:
    return state.backend is not None and not state.backend.closed


class _Api:
    def __init__(self, config: ServerConfig, state: ServerState) -> None:
        self.config, self.state = config, state
        # llama-server's global adapter scales (POST /lora-adapters): the adapters and
        # scales a request runs with where neither its model nor a ``lora`` list names one.
        self.lora_default: Adapters | None = None

    def guarded(self, rule: RouteRule) -> Callable[[Request], Awaitable[Response]]:
        """The route's handler behind its rules (`rules.ROUTES`), in this order: a web
        page's request (403), the API key (401), the body's type (415)."""
        handler = getattr(self, rule.handler)

        async def checked(request: Request) -> Response:
            try:
                check_page(rule, request.headers)
                if rule.key == "asked" or (rule.key == "metrics" and not self.config.open_metrics):
                    self._check_key(request)
                check_type(rule, request.headers)
            except ApiError as exc:
                if rule.method == "POST":
                    self._count(rule.handler, "rejected")
                return _error_response(exc, rule.errors)
            return await handler(request)

        return checked

    async def health(self, request: Request) -> Response:
        models = self.state.models
        if models is not None:  # each loads on its first request
            loaded = [m.name for m in models.loaded()]
            body = {"status": "ok", "models": models.names, "loaded": loaded}
            return JSONResponse({**body, **version_info()})
        if _ready(self.state):
            return JSONResponse({"status": "ok", "model": self.config.model_name, **version_info()})
        loading = {"status": "loading", **version_info()}
        return JSONResponse(loading, 503, {"Retry-After": str(RETRY_AFTER_S)})

    async def metrics(self, request: Request) -> Response:
        body = await asyncio.to_thread(generate_latest, self.state.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        owned = {"object": "model", "created": 0, "owned_by": "spnl-backend"}
        owned["meta"] = version_info()  # which server answers, as llama.cpp's `meta` says
        data = [{"id": name, **owned} for name in self._names()]
        backend, models = self.state.backend, self.state.models
        if models is not None:  # each adapter with its base, loaded or not
            data += [
                {"id": name, **owned, "parent": base, "root": path}
                for name, base, path in models.adapter_list()
            ]
        elif backend is not None and not backend.closed:
            base = self.config.model_name
            data += [
                {"id": a.name, **owned, "parent": base, "root": a.path} for a in backend.adapters()
            ]
        return JSONResponse({"object": "list", "data": data})

    def _names(self) -> list[str]:
        models = self.state.models
        return models.names if models is not None else [self.config.model_name]

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completions")

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def embeddings(self, request: Request) -> Response:
        """OpenAI's embeddings: each input's vector (`Backend.embed`), as floats or base64."""
        label = "embeddings"
        try:
            self._gate(request)
            body = await _read_json(request, self.config.max_body_bytes)
            asked = await asyncio.to_thread(parse_embeddings, body)  # a list of megabytes
            result = await self._embedded(request, asked, label)
        except Exception as exc:
            return self._refused(label, exc)
        # Rendered off the event loop: 2,048 vectors take a second or more to write.
        return await asyncio.to_thread(_openai_embeddings, result, asked, self._served(asked.model))

    async def _embedded(
        self,
        request: Request,
        asked: EmbeddingRequest,
        label: str,
        keep_alive: float | None = None,
    ) -> Embeddings:
        backend = await self._acquire(request, asked.model, keep_alive)
        try:
            check_embedding_size(asked, backend.model_config.hidden_size)
            embedding = asyncio.ensure_future(backend.aembed(asked.inputs))
            if not await _unless_gone(request, embedding):  # its texts left are dropped
                raise ClientDisconnect()
            result = embedding.result()
        finally:
            self._release(asked.model, keep_alive)
        self.state.metrics.prompt_tokens.inc(result.prompt_tokens)
        self._count(label, "ok")
        return result

    async def query(self, request: Request) -> Response:
        """spnl's span query: streamed as completion chunks (``stream=true``), else a
        ``repeat`` answered as a chat completion and a ``map`` as a completion."""
        label = "query"
        try:
            self._gate(request)
            stream = _stream_param(request.query_params.get("stream"))
            text = await _read_text(request, self.config.max_body_bytes)
            query = await asyncio.to_thread(_parsed_query, text)
            name = query.metadata.model
            adapter = self._adapter_named(name)  # its plus blocks are the adapter's own
            if adapter is None:
                backend = await self._acquire(request, name)
                chosen = self.lora_default if self.state.models is None else None
            else:
                backend, chosen = await self._adapter_base(request, name), ((adapter, 1.0),)
        except Exception as exc:
            return self._refused(label, exc)
        try:
            self._check_fits(backend, _sequences(query), "query")
            prompts, params, n = await asyncio.to_thread(_query_request, backend, query)
            if chosen is not None:
                params = dataclasses.replace(params, adapters=chosen)
            asked = EngineRequest(name, params, n, stream, include_usage=True)
            submitted = await self._submit(backend, asked, prompts)
        except Exception as exc:
            self._release(name)
            return self._refused(label, exc)
        endpoint: Endpoint = "completions" if stream or isinstance(query, MapQuery) else "chat"
        reply = Reply(endpoint, self._served(name), submitted.seqs, n, backend.token_bytes)
        return await self._answer(request, submitted, reply, asked, label)

    # ---- Anthropic's Messages API ---------------------------------------------------------

    async def messages(self, request: Request) -> Response:
        label = "messages"
        started = await self._started(request, label, anthropic_api.parse_messages, "anthropic")
        if isinstance(started, Response):
            return started
        reply, asked, submitted = started
        if asked.stream:
            stream = anthropic_api.MessageStream(reply)
            return self._typed_stream(submitted, reply, stream, label)
        body = lambda: anthropic_api.message_body(reply)  # noqa: E731
        return await self._whole(request, submitted, reply, label, body, "anthropic")

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's tokens the conversation makes (its template and tools applied)."""
        label = "count_tokens"
        try:
            self._gate(request)
            body = await _read_json(request, self.config.max_body_bytes)
            self._known(body.get("model") if isinstance(body, dict) else None)
            asked = await asyncio.to_thread(anthropic_api.parse_count, body)
            backend = await self._acquire(request, asked.model)
            try:
                (prompt,) = await asyncio.to_thread(_prompt_ids, backend, asked)
            finally:
                self._release(asked.model)
        except Exception as exc:
            return self._refused(label, exc, "anthropic")
        self._count(label, "ok")
        return JSONResponse({"input_tokens": _prompt_length(prompt)})

    # ---- OpenAI's Responses API -----------------------------------------------------------

    async def responses(self, request: Request) -> Response:
        label, store = "responses", self.state.responses
        parsed: list[responses_api.ResponsesRequest] = []

        def parse(body: object) -> EngineRequest:
            parsed.append(responses_api.parse_responses(body, store))
            return parsed[0].asked

        started = await self._started(request, label, parse)
        if isinstance(started, Response):
            return started
        reply, asked, submitted = started
        stream = responses_api.ResponseStream(reply, parsed[0], store)
        if asked.stream:
            return self._typed_stream(submitted, reply, stream, label)

        def body() -> dict[str, Any]:
            seq = reply.seqs[0]
            stream.step(seq, seq.text)  # read as a stream is, its events not sent
            stream.end(seq)
            return stream.finished(seq)

        return await self._whole(request, submitted, reply, label, body)

    async def response_get(self, request: Request) -> Response:
        stored = self._stored(request)
        return stored if isinstance(stored, Response) else JSONResponse(stored.body)

    async def response_input(self, request: Request) -> Response:
        stored = self._stored(request)
        if isinstance(stored, Response):
            return stored
        return JSONResponse(responses_api.input_items_body(stored))

    async def response_delete(self, request: Request) -> Response:
        ident = request.path_params["response_id"]
        if not self.state.responses.delete(ident):
            return _error_response(responses_api.unknown(ident))
        return JSONResponse({"id": ident, "object": "response", "deleted": True})

    def _stored(self, request: Request) -> "responses_api.Stored | Response":
        ident = request.path_params["response_id"]
        stored = self.state.responses.get(ident)
        return _error_response(responses_api.unknown(ident)) if stored is None else stored

    def _typed_stream(
        self, submitted: LoopRequest, reply: Reply, stream: "TypedStream", label: str
    ) -> Response:
        events = self._typed_events(submitted, reply, stream, label)
        return _LettingGo(
            events,
            lambda: self._let_go(submitted, reply, label),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def _typed_events(
        self, submitted: LoopRequest, reply: Reply, stream: "TypedStream", label: str
    ) -> AsyncIterator[bytes]:
        """A stream of named events (Anthropic's, the Responses API's) for one sequence."""
        outcome = "aborted"
        try:
            for event in stream.begin():
                yield event
            async for item in submitted.aitems():
                if isinstance(item, StepOutput):
                    for event in stream.step(item.seq, item.text_delta):
                        yield event
                    continue
                seq = item.seq
                self._observe(seq)
                if seq.error is not None:
                    outcome = self._failed(label, seq)
                    yield stream.error(_failure(seq.error))
                    return
                for event in stream.end(seq):
                    yield event
            outcome = "ok"
        finally:
            self._finish(reply, outcome, label)

    # ---- Ollama's API ---------------------------------------------------------------------

    async def ollama_chat(self, request: Request) -> Response:
        return await self._ollama(request, chat=True)

    async def ollama_generate(self, request: Request) -> Response:
        return await self._ollama(request, chat=False)

    async def _ollama(self, request: Request, chat: bool) -> Response:
        label = "ollama_chat" if chat else "ollama_generate"
        parse = ollama.parse_chat if chat else ollama.parse_generate
        try:
            self._gate(request)
            body = await _read_json(request, self.config.max_body_bytes)
            name = ollama.parse_model(body)
            keep_alive = ollama.keep_alive_s(body.get("keep_alive"))
            backend = await self._acquire(request, name, keep_alive)
        except Exception as exc:
            return self._refused(label, exc, shape="ollama")
        try:
            asked = await asyncio.to_thread(
                collector.without_pauses(parse), body, backend.max_model_len
            )
            if asked is None:  # a generate with no prompt: Ollama's way to (un)load a model
                self._release(name, keep_alive)
                loaded = {"model": body["model"], "created_at": ollama.stamp(), "response": ""}
                reason = "unload" if keep_alive == 0 else "load"
                return JSONResponse({**loaded, "done": True, "done_reason": reason})
            prompts = await asyncio.to_thread(_prompt_ids, backend, asked)
            asked = await asyncio.to_thread(_prepared, backend, asked, prompts)
            _check_thinks(asked, body.get("think"))
            submitted = await self._submit(backend, asked, prompts)
        except Exception as exc:
            self._release(name, keep_alive)
            return self._refused(label, exc, shape="ollama")
        endpoint: Endpoint = "chat" if chat else "completions"
        reply = Reply(
            endpoint,
            self._served(name),
            submitted.seqs,
            1,
            tools=asked.tool_format,
            reasoning=asked.reasoning,
        )
        reply.keep_alive = keep_alive
        show = asked.show_reasoning
        if asked.stream:
            lines = self._ndjson(submitted, reply, chat, label, show)
            let_go = lambda: self._let_go(submitted, reply, label)  # noqa: E731
            return _LettingGo(lines, let_go, media_type="application/x-ndjson")
        seq = submitted.seqs[0]

        def whole() -> dict[str, Any]:
            answer = reply.answer(seq)
            thinking = answer.reasoning if show else ""
            calls = reply.calls(seq) if chat else None
            return ollama.done(reply.model, chat, seq, answer.content, calls, thinking)

        return await self._whole(request, submitted, reply, label, whole, shape="ollama")

    async def _ndjson(
        self, submitted: LoopRequest, reply: Reply, chat: bool, label: str, show: bool
    ):
        reader = None  # harmony's calls are read by its reasoning parser
        if chat and reply.tools is not None and reply.tools.syntax != "harmony":
            reader = call_reader(reply.tools)
        parser = reply.reasoning.parser() if reply.reasoning is not None else None
        outcome = "aborted"
        try:
            async for item in submitted.aitems():
                if isinstance(item, StepOutput):
                    if item.text_delta:
                        line = _ollama_piece(reply, chat, item.text_delta, parser, reader, show)
                        if line is not None:
                            yield _line(line)
                    continue
                seq = item.seq
                self._observe(seq)
                if seq.error is not None:
                    outcome = self._failed(label, seq)
                    yield _line({"error": str(seq.error)})
                    return
                rest = parser.finish() if parser is not None else ReasoningDelta()
                text = reader.feed(rest.content).content if reader is not None else rest.content
                text += reader.finish().content if reader is not None else ""
                thinking = rest.reasoning if show else ""
                calls = reply.calls(seq) if chat else None
                last = ollama.done(reply.model, chat, seq, text, calls, thinking)
                yield _line(last)
            outcome = "ok"
        finally:
            self._finish(reply, outcome, label)

    async def ollama_embed(self, request: Request) -> Response:
        label = "ollama_embed"
        try:
            self._gate(request)
            body = await _read_json(request, self.config.max_body_bytes)
            asked = await asyncio.to_thread(ollama.parse_embed, body)
            keep_alive = ollama.keep_alive_s(body.get("keep_alive"))
            result = await self._embedded(request, asked, label, keep_alive)
        except Exception as exc:
            return self._refused(label, exc, shape="ollama")
        return await asyncio.to_thread(_ollama_embeddings, result, asked)

    async def ollama_tags(self, request: Request) -> Response:
        return self._ollama_models(request, running=False)

    async def ollama_ps(self, request: Request) -> Response:
        return self._ollama_models(request, running=True)

    def _ollama_models(self, request: Request, running: bool) -> Response:
        models = self.state.models
        if models is None:
            backend = self.state.backend
            if running and not _ready(self.state):
                return JSONResponse({"models": []})
            listed = [(self.config.model_name, backend, None)]
        elif running:
            listed = [(m.name, m.backend, m) for m in models.loaded()]
        else:
            listed = [(m.name, m.backend, m) for m in models.models.values()]
        entries = [_ollama_entry(n, b, m, running) for n, b, m in listed]
        return JSONResponse({"models": entries})

    async def ollama_show(self, request: Request) -> Response:
        try:
            self._gate(request)
            name = ollama.parse_name(await _read_json(request, self.config.max_body_bytes))
            backend = await self._acquire(request, ollama.bare_model(name))
            self._release(ollama.bare_model(name))  # what it says is read from the loaded model
        except Exception as exc:
            return self._refused("ollama_show", exc, shape="ollama")
        config = backend.model_config
        template = backend.tokenizer.hf.chat_template or ""
        capabilities = ["completion", "embedding"] + (["tools"] if "tools" in template else [])
        if resolve_format(backend.settings.reasoning_format, template) != "none":
            capabilities.append("thinking")  # what Ollama's clients check before `think`
        info = {
            "general.architecture": config.architecture,
            f"{config.architecture}.context_length": backend.max_model_len,
            f"{config.architecture}.embedding_length": config.hidden_size,
            f"{config.architecture}.block_count": config.num_layers,
        }
        return JSONResponse(
            {
                "modelfile": "",
                "parameters": "",
                "template": template,
                "details": ollama.details(config.architecture, backend.source.kind),
                "model_info": info,
                "capabilities": capabilities,
                "modified_at": ollama.stamp(),
            }
        )

    async def ollama_version(self, request: Request) -> Response:
        return JSONResponse({"version": ollama.VERSION})

    async def reset_prefix_cache(self, request: Request) -> Response:
        """Forget every cached prefix and PIC element (spnl's benchmark calls this before
        each run); running requests go on with what they hold."""
        try:
            self._gate(request)
            forgotten = 0
            for backend in self._loaded_backends():
                forgotten += await asyncio.to_thread(backend.reset_prefix_cache)
        except Exception as exc:
            return self._refused("reset_prefix_cache", exc)
        return JSONResponse({"status": "ok", "forgotten": forgotten})

    # ---- LoRA adapters at run time --------------------------------------------------------

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``{"lora_name", "lora_path"}``: the adapter read and checked, then known
        to requests (and /v1/models) from the next step on."""
        label = "load_lora_adapter"
        if self.state.models is not None:
            return await self._load_model_adapter(request, self.state.models)
        try:
            backend = self._adapter_backend(request)
            body = await _read_json(request, self.config.max_body_bytes)
            name, path = _text_field(body, "lora_name"), _text_field(body, "lora_path")
            if _bare_name(name) == self.config.model_name:
                raise bad_request(f"lora_name={name!r} is the served model's name", "lora_name")
            info = await asyncio.to_thread(backend.load_adapter, name, path)
        except ModelFileError as exc:
            return self._refused(label, bad_request(str(exc), "lora_path", "invalid_adapter"))
        except RequestError as exc:
            return self._refused(label, bad_request(str(exc), "lora_name"))
        except Exception as exc:
            return self._refused(label, exc)
        loaded = {"lora_name": info.name, "lora_path": info.path, "held": info.loaded}
        return JSONResponse({"status": "ok", **loaded})

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``{"lora_name"}``: a 404 for a name not loaded, a 409 while unfinished
        requests run with it (their output is never changed: retry once they finish)."""
        label = "unload_lora_adapter"
        if self.state.models is not None:
            return await self._unload_model_adapter(request, self.state.models)
        try:
            backend = self._adapter_backend(request)
            body = await _read_json(request, self.config.max_body_bytes)
            name = _text_field(body, "lora_name")
            if name not in {a.name for a in backend.adapters()}:
                raise ApiError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name")
            await asyncio.to_thread(backend.unload_adapter, name)
        except AdapterInUseError as exc:
            return self._refused(label, ApiError(409, str(exc), code="adapter_in_use"))
        except Exception as exc:
            return self._refused(label, exc)
        if self.lora_default is not None and name in dict(self.lora_default):
            self.lora_default = tuple(e for e in self.lora_default if e[0] != name) or None
        return JSONResponse({"status": "ok", "lora_name": name})

    async def lora_adapters(self, request: Request) -> Response:
        """llama-server's list: each adapter's ``id`` (its place in load order), ``path``
        and global ``scale`` (0 unless POST /lora-adapters set it), and its ``name``."""
        try:
            backend = self._adapter_backend(request)
        except Exception as exc:
            return self._refused("lora_adapters", exc)
        return JSONResponse(self._adapter_list(backend))

    async def set_lora_adapters(self, request: Request) -> Response:
        """llama-server's global scales, ``[{"id" | "name", "scale"}]``: the adapters
        given a scale other than 0 run every request that names none; none listed, or
        all at 0, runs the base model."""
        try:
            backend = self._adapter_backend(request)
            body = await _read_json(request, self.config.max_body_bytes)
            self.lora_default = self._lora_field(body, None)
        except Exception as exc:
            return self._refused("set_lora_adapters", exc)
        return JSONResponse(self._adapter_list(backend))

    def _adapter_backend(self, request: Request) -> Backend:
        if self.state.models is not None:
            raise bad_request(
                "llama-server's /lora-adapters applies with one model served; with several, "
                "GET /v1/models lists each adapter with its base and POST "
                "/v1/load_lora_adapter or /v1/unload_lora_adapter change them"
            )
        return self._backend(request)

    async def _load_model_adapter(self, request: Request, models: ModelSet) -> Response:
        """With several models, vLLM's load body plus ``model``: the served model the
        adapter belongs to (loaded first where it is not)."""
        label = "load_lora_adapter"
        try:
            self._gate(request)
            body = await _read_json(request, self.config.max_body_bytes)
            name, path = _text_field(body, "lora_name"), _text_field(body, "lora_path")
            base = _text_field(body, "model")
            if _served_name(base) not in models.models:
                raise bad_request(
                    f"model={base!r}: expected the served model the adapter belongs to, one "
                    "of " + ", ".join(repr(n) for n in models.names),
                    "model",
                )
            try:
                models.check_adapter_name(name)
            except ValueError as exc:
                raise bad_request(str(exc), "lora_name") from None
            backend = await self._acquire(request, base)
        except Exception as exc:
            return self._refused(label, exc)
        try:
            info = await asyncio.to_thread(backend.load_adapter, name, path)
            try:
                await asyncio.to_thread(models.add_adapter, _served_name(base), name, info.path)
            except ValueError:  # the name taken on another model meanwhile: not kept here
                await asyncio.to_thread(backend.unload_adapter, name)
                raise
        except ModelFileError as exc:
            return self._refused(label, bad_request(str(exc), "lora_path", "invalid_adapter"))
        except (RequestError, ValueError) as exc:
            return self._refused(label, bad_request(str(exc), "lora_name"))
        except Exception as exc:
            return self._refused(label, exc)
        finally:
            self._release(base)
        loaded = {"lora_name": info.name, "lora_path": info.path, "held": info.loaded}
        return JSONResponse({"status": "ok", "model": _served_name(base), **loaded})

    async def _unload_model_adapter(self, request: Request, models: ModelSet) -> Response:
        """With several models, vLLM's unload body: the adapter found by name on its base
        model, unloaded there if that model is loaded, and not loaded with it again."""
        label = "unload_lora_adapter"
        try:
            self._gate(request)
            body = await _read_json(request, self.config.max_body_bytes)
            name = _text_field(body, "lora_name")
            base = models.base_of(name)
            if base is None:
                raise ApiError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name")
            if base in {m.name for m in models.loaded()}:
                backend = await self._acquire(request, base)
                try:
                    await asyncio.to_thread(backend.unload_adapter, name)
                finally:
                    self._release(base)
            await asyncio.to_thread(models.remove_adapter, name)
        except AdapterInUseError as exc:
            return self._refused(label, ApiError(409, str(exc), code="adapter_in_use"))
        except Exception as exc:
            return self._refused(label, exc)
        return JSONResponse({"status": "ok", "model": base, "lora_name": name})

    def _adapter_list(self, backend: Backend) -> list[dict[str, Any]]:
        scales = dict(self.lora_default or ())
        return [
            {"id": i, "name": a.name, "path": a.path, "scale": scales.get(a.name, 0.0)}
            for i, a in enumerate(backend.adapters())
        ]

    # ---- what routers ask of a worker (`router_info`) ------------------------------------

    async def flush_cache(self, request: Request) -> Response:
        """SGLang's name for `reset_prefix_cache` (sglang-router and vllm-router send it to
        every worker)."""
        return await self.reset_prefix_cache(request)

    async def health_generate(self, request: Request) -> Response:
        """Healthy only if every loaded model generates a token (SGLang's deeper probe)."""
        backends = self._loaded_backends()
        if not backends and self.state.models is None:
            return await self.health(request)  # loading: its 503
        try:
            for backend in backends:
                await asyncio.to_thread(backend.generate, "ping", max_tokens=1, temperature=0)
        except Exception as exc:
            log.error("health_generate.failed", error=f"{type(exc).__name__}: {exc}")
            failed = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
            return JSONResponse(failed, 503)
        return JSONResponse({"status": "ok", "generated": len(backends)})

    async def model_info(self, request: Request) -> Response:
        return await self._info(request, router_info.model_info)

    async def server_info(self, request: Request) -> Response:
        events = self.state.kv_events
        return await self._info(request, lambda name, b: router_info.server_info(name, b, events))

    async def _info(
        self, request: Request, describe: Callable[[str, Backend], dict[str, Any]]
    ) -> Response:
        """The served model's info; with several models, each loaded one's by name."""
        models = self.state.models
        if models is not None:
            loaded = [(m.name, m.backend) for m in models.loaded() if m.backend is not None]
            described = await asyncio.to_thread(lambda: [describe(n, b) for n, b in loaded])
            return JSONResponse(
                {"models": models.names, "loaded": described, "memory": models.memory()}
            )
        try:
            backend = self._backend(request)
            info = await asyncio.to_thread(describe, self.config.model_name, backend)
        except Exception as exc:
            return self._refused("server_info", exc)
        return JSONResponse(info)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: the token ids the engine would compute for a completion's
        prompt or a chat's messages (chat-templated); vllm-router's ``kv_aware`` reads
        them to look the prompt's blocks up in its index of KV events."""
        try:
            self._gate(request)
            body = await _read_json(request, self.config.max_body_bytes)
            self._known(body.get("model") if isinstance(body, dict) else None)
            asked = await asyncio.to_thread(parse_tokenize, body)
            backend = await self._acquire(request, asked.model)
        except Exception as exc:
            return self._refused("tokenize", exc)
        try:
            (ids,) = await asyncio.to_thread(_prompt_ids, backend, asked)
        except Exception as exc:
            return self._refused("tokenize", exc)
        finally:
            self._release(asked.model)
        tokens = list(ids)  # type: ignore[arg-type]
        return JSONResponse(
            {
                "count": len(tokens),
                "max_model_len": backend.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def get_load(self, request: Request) -> Response:
        backends = self._loaded_backends()
        return JSONResponse(await asyncio.to_thread(router_info.load, backends))

    # ---- the gate ---------------------------------------------------------------------

    async def _serve(self, request: Request, endpoint: Endpoint) -> Response:
        parse = parse_completion if endpoint == "completions" else parse_chat
        started = await self._started(request, endpoint, parse)
        if isinstance(started, Response):
            return started
        reply, asked, submitted = started
        return await self._answer(request, submitted, reply, asked, endpoint)

    async def _started(
        self,
        request: Request,
        label: str,
        parse: Callable[[Any], EngineRequest],
        shape: ErrorShape = "openai",
    ) -> "tuple[Reply, EngineRequest, LoopRequest] | Response":
        """A completions or chat request (or another API's, ``parse``d into one) through
        the gate, tokenized, prepared and submitted; else the error's response."""
        try:
            backend, asked = await self._admit(request, parse)
        except Exception as exc:
            return self._refused(label, exc, shape)
        try:
            self._check_fits(backend, len(asked.prompts or [asked.messages]) * asked.n)
            prompts = await asyncio.to_thread(_prompt_ids, backend, asked)
            asked = await asyncio.to_thread(_prepared, backend, asked, prompts)
            submitted = await self._submit(backend, asked, prompts)
        except Exception as exc:
            self._release(asked.model)
            return self._refused(label, exc, shape)
        reply = Reply(
            "completions" if asked.messages is None else "chat",
            self._served(asked.model),
            submitted.seqs,
            asked.n,
            backend.token_bytes,
            tools=asked.tool_format,
            reasoning=asked.reasoning,
        )
        return reply, asked, submitted

    def _refused(self, label: str, exc: Exception, shape: ErrorShape = "openai") -> Response:
        """The answer to a request that failed before it was queued (in Ollama's error
        shape, ``{"error": message}``, for its routes)."""
        if isinstance(exc, RequestError):
            exc = from_request_error(exc, "input")
        if isinstance(exc, ApiError):
            self._count(label, "rejected" if exc.status < 500 else "unavailable")
            return _error_response(exc, shape)
        if isinstance(exc, ClientDisconnect):  # gone while sending its body: nobody to answer
            self._count(label, "aborted")
            return Response(status_code=499)
        return self._internal_error(label, exc, shape)  # ours: logged, no internals

    async def _answer(
        self,
        request: Request,
        submitted: LoopRequest,
        reply: Reply,
        asked: EngineRequest,
        label: str,
    ) -> Response:
        if asked.stream:
            events = self._events(submitted, reply, asked.include_usage, label)
            return _LettingGo(
                events,
                lambda: self._let_go(submitted, reply, label),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await self._whole(request, submitted, reply, label)

    async def _admit(
        self, request: Request, parse: Callable[[Any], EngineRequest]
    ) -> tuple[Backend, EngineRequest]:
        """The request through the gate, parsed, and its model's backend: the served
        model's where ``model`` or llama-server's ``lora`` names one of its adapters."""
        self._gate(request)
        body = await _read_json(request, self.config.max_body_bytes)
        model = body.get("model") if isinstance(body, dict) else None
        adapter = self._adapter_named(model)
        self._known(None if adapter is not None else model)
        chosen: Adapters | None = ((adapter, 1.0),) if adapter is not None else None
        if isinstance(body, dict) and "lora" in body:  # llama-server's way
            body = dict(body)
            chosen = self._lora_field(body.pop("lora"), chosen)
        elif chosen is None and self.state.models is None:  # its global scale, if set
            chosen = self.lora_default
        # Grammars convert here: off the loop, and with no collector pause in the middle.
        asked = await asyncio.to_thread(collector.without_pauses(parse), body)
        if chosen is not None:  # vLLM's way: the adapter's name as the model
            params = dataclasses.replace(asked.params, adapters=chosen)
            backend = await self._adapter_base(request, asked.model)
            return backend, dataclasses.replace(asked, params=params)
        return await self._acquire(request, asked.model), asked

    def _lora_field(self, field: object, by_model: Adapters | None) -> Adapters | None:
        """llama-server's ``lora: [{"id" | "name", "scale"}]``: the adapters it gives a
        scale other than 0, each row adding all their products (ids count the loaded
        adapters from 0, as /v1/models lists them), or None for the base model. Where
        ``model`` names an adapter too, the list must give it a scale."""
        accepted = (
            'a list of {"id": <index> or "name": <adapter>, "scale": <number>}, each adapter once'
        )
        backend = self.state.backend
        if self.state.models is not None or backend is None or backend.closed:
            raise bad_request("lora applies with one model served", "lora")
        names = [a.name for a in backend.adapters()]
        if not isinstance(field, list) or not all(isinstance(e, dict) for e in field):
            raise bad_request(f"lora={shown(field)}: expected {accepted}", "lora")
        chosen = []
        for entry in field:
            name = _lora_entry_name(entry, names, accepted)
            scale = entry.get("scale", 1.0)
            if isinstance(scale, bool) or not isinstance(scale, (int, float)):
                raise bad_request(f"lora scale={shown(scale)}: expected a number", "lora")
            chosen.append((name, scale))
        try:
            adapters = adapter_set(chosen, "lora")
        except RequestError as exc:
            raise bad_request(str(exc), "lora") from None
        names = [name for name, _ in adapters]
        if by_model is not None and adapters and by_model[0][0] not in names:
            raise bad_request(
                f"model names the adapter {by_model[0][0]!r} and lora gives it no scale "
                f"(lora: {', '.join(names)})",
                "lora",
            )
        return adapters or by_model

    async def _adapter_base(self, request: Request, model: str) -> Backend:
        """The backend of the base model of a request naming an adapter: the served one,
        or with several the adapter's own (held as `_acquire` holds it)."""
        if self.state.models is None:
            return self._backend(request)
        return await self._acquire(request, model, adapter=True)

    def _adapter_named(self, model: object) -> str | None:
        """``model`` where it names a LoRA adapter: one of the served model's (not the
        base model's own name), or with several models one of any model's; else None."""
        backend, models = self.state.backend, self.state.models
        if models is not None:
            if not isinstance(model, str) or models.base_of(_served_name(model)) is None:
                return None
            return _served_name(model)
        if backend is None or backend.closed:
            return None
        if not isinstance(model, str) or _bare_name(model) == self.config.model_name:
            return None
        return model if model in {a.name for a in backend.adapters()} else None

    # ---- models -----------------------------------------------------------------------

    def _gate(self, request: Request) -> None:
        """With one model, that it is loaded (several load on demand)."""
        if self.state.models is None:
            self._backend(request)

    async def _acquire(
        self, request: Request, name: str, keep_alive: float | None = None, adapter: bool = False
    ) -> Backend:
        """The named model's backend, held for this request until `_release` (several
        models: loaded first where it is not, off the event loop). ``adapter``: ``name``
        may name a LoRA adapter, its base model's backend then (only where the request
        runs with that adapter: elsewhere an adapter's name is no model's, as with one)."""
        models = self.state.models
        if models is None:
            self._check_model(name)
            return self._backend(request)
        served = _served_name(name)
        if not adapter and served not in models.models:
            base = models.base_of(served)
            if base is not None:
                raise ApiError(
                    404,
                    f"{name!r} is a LoRA adapter of {base!r}, which this endpoint does not "
                    f"run; name a served model ({', '.join(models.names)})",
                    param="model",
                    code="model_not_found",
                )
        return await asyncio.to_thread(models.acquire, served, keep_alive)

    def _release(self, name: str, keep_alive: float | None = None) -> None:
        if self.state.models is not None:
            self.state.models.release(_served_name(name), keep_alive)

    def _served(self, name: str) -> str:
        """The name answers carry: the served model's (one), or the one asked for."""
        return self.config.model_name if self.state.models is None else _served_name(name)

    def _loaded_backends(self) -> list[Backend]:
        models = self.state.models
        if models is None:
            return [b for b in (self.state.backend,) if b is not None and not b.closed]
        return [m.backend for m in models.loaded() if m.backend is not None]

    def _backend(self, request: Request) -> Backend:
        """The loaded backend."""
        backend = self.state.backend
        if backend is None or backend.closed:
            raise ApiError(
                503,
                "the model is still loading (or the server is stopping); retry shortly",
                kind="server_error",
                code="model_not_ready",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return backend

    def _known(self, model: object) -> None:
        """A model name the server does not serve is a 404 before anything else of the
        request is read (its schema compiled, its prompt tokenized); the rest of the
        checks of the name come with the body's."""
        if not isinstance(model, str):
            return
        if self.state.models is None:
            self._check_model(model)
        else:
            self.state.models.served(_served_name(model))

    def _check_model(self, model: str) -> None:
        if _bare_name(model) != self.config.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist here; this server "
                f"serves {self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _check_key(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if "x-api-key" in request.headers:  # Anthropic's clients send the key so
            scheme, key = "bearer", request.headers["x-api-key"]
        expected = self.config.api_key.encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), expected):
            raise ApiError(
                401,
                "a valid API key is required: Authorization: Bearer <key> (or X-Api-Key: <key>)",
                code="invalid_api_key",
            )

    def _check_fits(self, backend: Backend, wanted: int, param: str = "n") -> int:
        """The most sequences the server takes at once; a request for more would never
        fit (a 400, not worth a retry). Checked before a prompt is tokenized as well."""
        limit = backend.max_num_seqs + self.config.max_waiting
        if wanted > limit:
            raise bad_request(
                f"the request asks for {wanted} sequences (prompts x n); this server takes at "
                f"most {limit} at once",
                param,
            )
        return limit

    async def _submit(
        self, backend: Backend, asked: EngineRequest, prompts: list[list[int]]
    ) -> LoopRequest:
        """Checked against the queue's bound, its places taken before any await (so that
        concurrent requests cannot both take the last ones), then its sequences built off
        the loop (a grammar compiles there) and submitted; the places given back if that
        fails."""
        wanted = len(prompts) * asked.n
        limit = self._check_fits(backend, wanted)
        if self.state.in_flight + wanted > limit:
            raise ApiError(
                503,
                f"the server is at capacity ({self.state.in_flight} sequences "
                "in flight); retry shortly",
                kind="server_error",
                code="server_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.state.in_flight += wanted
        try:
            return await backend.asubmit(prompts, asked.params, n=asked.n, pieces=asked.stream)
        except BaseException as exc:
            self.state.in_flight -= wanted
            if isinstance(exc, RequestError):  # a constraint that did not compile
                raise from_request_error(exc, _param_of(exc, asked)) from None
            raise

    # ---- answers ------------------------------------------------------------------------

    async def _events(self, submitted: LoopRequest, reply: Reply, include_usage: bool, label: str):
        outcome = "aborted"  # until the stream ends: a client that hung up
        try:
            async for item in submitted.aitems():
                if isinstance(item, StepOutput):
                    if item.logprobs is not None:
                        reply.pending(item.seq).append(item.logprobs)
                    if item.text_delta:
                        chunk = reply.text_chunk(item.seq, item.text_delta)
                        if chunk is not None:
                            yield sse(chunk)
                    continue
                seq = item.seq
                self._observe(seq)
                if seq.error is not None:
                    outcome = self._failed(label, seq)
                    yield sse(_failure(seq.error).body())
                    return
                yield sse(reply.end_chunk(seq))
            if include_usage:
                yield sse(reply.usage_chunk())
            yield sse("[DONE]")
            outcome = "ok"
        finally:
            self._finish(reply, outcome, label)

    async def _whole(
        self,
        request: Request,
        submitted: LoopRequest,
        reply: Reply,
        label: str,
        body: Callable[[], dict[str, Any]] | None = None,
        shape: ErrorShape = "openai",
    ) -> Response:
        """The whole answer once every sequence is done (``body``: its JSON, OpenAI's
        by default); a client gone meanwhile aborts it."""
        outcome = "aborted"
        try:
            collecting = asyncio.ensure_future(self._collect(submitted))
            if not await _unless_gone(request, collecting):
                return Response(status_code=499)
            failed = collecting.result()
            if failed is not None:
                outcome = self._failed(label, failed)
                error = _failure(failed.error)
                return JSONResponse(_error_shaped(error, shape), _failure_status(failed.error))
            outcome = "ok"
            return JSONResponse((body or reply.body)())
        finally:
            self._finish(reply, outcome, label)

    async def _collect(self, submitted: LoopRequest) -> Sequence | None:
        """Wait for every sequence; the first that failed (the others are then aborted)."""
        async for item in submitted.aitems():
            if isinstance(item, Finished):
                self._observe(item.seq)
                if item.seq.error is not None:
                    return item.seq
        return None

    def _observe(self, seq: Sequence) -> None:
        metrics = self.state.metrics
        tokens = len(seq.output_token_ids)
        metrics.completion_tokens.inc(tokens)
        metrics.draft_tokens.inc(seq.num_draft_tokens)
        metrics.accepted_tokens.inc(seq.num_accepted_tokens)
        if seq.first_token_time is not None:
            metrics.first_token(seq.first_token_time - seq.arrival_time)
            if tokens > 1 and seq.finish_time is not None:
                metrics.itl.observe((seq.finish_time - seq.first_token_time) / (tokens - 1))

    def _failed(self, endpoint: str, seq: Sequence) -> str:
        if isinstance(seq.error, RequestError):  # the request's own doing: not our failure
            log.info(
                "server.request_rejected",
                endpoint=endpoint,
                seq_id=seq.seq_id,
                error=str(seq.error),
            )
            return "rejected"
        log.error(
            "server.request_failed",
            endpoint=endpoint,
            seq_id=seq.seq_id,
            error=f"{type(seq.error).__name__}: {seq.error}",
        )
        return "failed"

    def _let_go(self, submitted: LoopRequest, reply: Reply, label: str) -> None:
        """A stream's response has ended: where its body did not finish the request (a
        client gone before the first chunk), abort it and let its model go."""
        if not reply.finished:
            submitted.abort()
            self._finish(reply, "aborted", label)

    def _finish(self, reply: Reply, outcome: str, label: str) -> None:
        if reply.finished:  # once, whichever of the body and the response ends it first
            return
        reply.finished = True
        if self.state.models is not None:
            self._release(reply.model, reply.keep_alive)
            self.state.metrics.model_requests.labels(reply.model, outcome).inc()
        self.state.in_flight -= len(reply.seqs)
        self.state.metrics.prompt_tokens.inc(reply.usage()["prompt_tokens"])
        self._count(label, outcome)

    def _count(self, endpoint: str, outcome: str) -> None:
        self.state.metrics.requests.labels(endpoint, outcome).inc()

    def _internal_error(
        self, endpoint: str, exc: Exception, shape: ErrorShape = "openai"
    ) -> Response:
        log.error(
            "server.internal_error",
            endpoint=endpoint,
            error=f"{type(exc).__name__}: {exc}",
            exc_info=exc,
        )
        self._count(endpoint, "failed")
        error = ApiError(
            500,
            "the server failed to handle the request; its log has the cause",
            kind="server_error",
        )
        return _error_response(error, shape)


async def _unless_gone(request: Request, task: asyncio.Future[Any]) -> bool:
    """Wait for ``task``: True once it is done, False where the client left first (the
    task is then cancelled)."""
    while not task.done():
        await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            return False
    return True


def _openai_embeddings(result: Embeddings, asked: EmbeddingRequest, model: str) -> Response:
    """OpenAI's embeddings answer, rendered a vector at a time (on a worker thread)."""
    body = json_piecewise(embedding_body(result, asked, model), "data")
    return Response(body, media_type="application/json")


def _ollama_embeddings(result: Embeddings, asked: EmbeddingRequest) -> Response:
    """Ollama's embed answer, rendered a vector at a time (on a worker thread)."""
    vectors = [entry["embedding"] for entry in embedding_body(result, asked, "")["data"]]
    answer = {
        "model": asked.model,
        "embeddings": vectors,
        "total_duration": 0,
        "load_duration": 0,
        "prompt_eval_count": result.prompt_tokens,
    }
    return Response(json_piecewise(answer, "embeddings"), media_type="application/json")


class TypedStream(Protocol):
    """An API's events for one streamed sequence (`anthropic_api.MessageStream`,
    `responses_api.ResponseStream`)."""

    def begin(self) -> list[bytes]: ...
    def step(self, seq: Sequence, text: str) -> list[bytes]: ...
    def end(self, seq: Sequence) -> list[bytes]: ...
    def error(self, exc: ApiError) -> bytes: ...


def _prompt_length(prompt: PromptIds) -> int:
    return len(prompt) if isinstance(prompt, list) else len(prompt.token_ids)


def _failure_status(error: Exception | None) -> int:
    """A request that failed while it ran: 400 where the request was the cause (its
    grammar failed mid-way), 503 where it was aborted, else 500."""
    if isinstance(error, RequestAbortedError):
        return 503
    return 400 if isinstance(error, RequestError) else 500


class _LettingGo(StreamingResponse):
    """A stream that lets its request go however the response ends. A client gone while
    the head is sent cancels the stream before its body's generator starts, and a
    generator never started never runs its own ``finally``."""

    def __init__(self, body: AsyncIterator[str], let_go: Callable[[], None], **kw: Any) -> None:
        super().__init__(body, **kw)
        self._let_go = let_go

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._let_go()


def _prepared(backend: Backend, asked: EngineRequest, prompts: list[PromptIds]) -> EngineRequest:
    """``asked`` with the server's token-healing default for a completion, its tools'
    constraint and how its answer's reasoning is read, off the event loop (what it needs
    is built by `Backend.asubmit`)."""
    params, tool_format = asked.params, None
    if asked.messages is None and asked.token_healing is None:
        params = backend.default_healing(params)
    try:
        if asked.tools is not None:
            chat = backend.tool_chat(asked.tools, params, asked.chat_template)
            tool_format = chat.format
            if chat.constraint is not None:
                params = dataclasses.replace(params, constraint=chat.constraint)
                asked = dataclasses.replace(asked, constraint_field="tools")
    except RequestError as exc:
        raise from_request_error(exc, "tools") from None
    reasoning = None
    if asked.messages is not None:
        try:
            constrained = params.constraint is not None
            template = asked.chat_template
            reasoning = backend.reasoning(prompts[0], constrained, tool_format, template)
        except RequestError as exc:
            raise from_request_error(exc, "tools") from None
        kept = backend.reasoning_kept(reasoning.format)
        params = dataclasses.replace(
            params, kept_token_ids=params.kept_token_ids + kept, reasoning=reasoning
        )
    return dataclasses.replace(asked, params=params, tool_format=tool_format, reasoning=reasoning)


def _param_of(exc: RequestError, asked: EngineRequest) -> str | None:
    """The field a preparation error is about: token ids' or the constraint's."""
    message = str(exc)
    if message.startswith("logit_bias"):
        return "logit_bias"
    if message.startswith("a reasoning budget"):  # one this model's markers cannot keep
        return "thinking_token_budget"
    return asked.constraint_field


def _prompt_ids(backend: Backend, asked: EngineRequest) -> list[PromptIds]:
    """Tokenized (and chat-templated) off the event loop: a prompt of megabytes takes
    seconds, which would stall every other stream."""
    try:
        if asked.messages is not None:
            _check_names_read(backend, asked)
            variables = asked.template_variables
            template = asked.chat_template
            return [backend.chat_prompt_ids(asked.messages, asked.tools, variables, template)]
        texts = asked.prompts if isinstance(asked.prompts[0], str) else None
        prompts, _ = backend.prompt_ids(texts, None if texts else asked.prompts)
        return prompts
    except RequestError as exc:
        if str(exc).startswith("chat_template:"):  # the request's own did not compile
            raise bad_request(str(exc), "chat_template") from None
        raise from_request_error(exc, "messages" if asked.messages else "prompt") from None


def _check_names_read(backend: Backend, asked: EngineRequest) -> None:
    """A participant's ``name`` on a message reaches the model only through the chat
    template: where the template writes the same prompt without the names, they would be
    dropped silently, so the request is refused (400) instead. (A tool result's ``name``,
    the function it answers, is not a participant's and is passed on as it is.)"""
    messages = asked.messages or []
    named = [i for i, m in enumerate(messages) if _participant_named(m)]
    if not named:
        return
    tools = [tool.definition() for tool in asked.tools.tools] if asked.tools else None
    nameless = [
        {k: v for k, v in m.items() if k != "name"} if _participant_named(m) else m
        for m in messages
    ]
    try:
        render = backend.tokenizer.render_chat
        variables = asked.template_variables
        template = asked.chat_template
        read = render(template_messages(messages), True, tools, variables, template)
        unread = render(template_messages(nameless), True, tools, variables, template)
    except RequestError:
        return  # the template fails on these messages: chat_prompt_ids says how
    if read == unread:
        raise bad_request(
            f"messages[{named[0]}]: this model's chat template does not use a message's "
            "'name', so it would be dropped; put it in the message's content instead",
            "messages",
            "unsupported_parameter",
        )


def _check_thinks(asked: EngineRequest, think: object) -> None:
    """Ollama's ``think`` asked of a model that has no reasoning to show: a 400, as
    Ollama answers it (``false`` asks for nothing)."""
    if think not in (None, False) and (asked.reasoning is None or asked.reasoning.format == "none"):
        raise bad_request(
            f"think={shown(think)}: this model's chat template writes no reasoning this server "
            "reads (<think> blocks or harmony channels); see MISTRALRS_REASONING_FORMAT",
            "think",
        )


def _ollama_piece(
    reply: Reply,
    chat: bool,
    text: str,
    parser: ReasoningParser | None,
    reader: CallReader | None,
    show: bool,
) -> dict[str, Any] | None:
    """An Ollama stream's line for a piece of output: its answer text (a tool call's
    markup left out) and its reasoning as ``thinking``; None where it adds neither."""
    thinking = ""
    if parser is not None:
        split = parser.feed(text)
        thinking, text = (split.reasoning if show else ""), split.content
    if text and reader is not None:
        text = reader.feed(text).content
    if not text and not thinking:
        return None
    return ollama.chunk(reply.model, chat, text, thinking=thinking)


def _participant_named(message: object) -> bool:
    return (
        isinstance(message, dict)
        and message.get("name") is not None
        and message.get("role") != "tool"
    )


async def _read_json(request: Request, limit: int) -> Any:
    text = await _read_text(request, limit)
    try:
        if len(text) <= INLINE_JSON_CHARS:
            return json_value(text, "the request body")
        return await asyncio.to_thread(json_value, text, "the request body")
    except RequestError as exc:
        raise ApiError(400, str(exc)) from None


async def _read_text(request: Request, limit: int) -> str:
    """The body as text (its type was checked by the route's rules, `rules.check_type`)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    try:
        body = await asyncio.wait_for(_read_body(request, limit), BODY_TIMEOUT_S)
    except TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", code="timeout"
        ) from None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not UTF-8 text: {exc}") from None


async def _read_body(request: Request, limit: int) -> bytearray:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return body


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")


def _served_name(model: str) -> str:
    """A name as clients write it (spnl's ``openai/``, Ollama's ``:latest``) → ours."""
    return _bare_name(model).removesuffix(":latest")


def _text_field(body: object, name: str) -> str:
    """A body's string field ``name`` (a 400 naming it where absent or not a string)."""
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name}={shown(value)}: expected a non-empty string", name)
    return value


def _lora_entry_name(entry: dict, names: list[str], accepted: str) -> str:
    """The adapter one ``lora`` entry names, by ``id`` or ``name``."""
    if set(entry) - {"id", "name", "scale"} or ("id" in entry) == ("name" in entry):
        raise bad_request(f"lora entry {shown(entry)}: expected {accepted}", "lora")
    if "id" in entry:
        index = entry["id"]
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(names):
            raise bad_request(
                f"lora id={shown(index)}: expected 0 to {len(names) - 1} (the loaded adapters: "
                f"{', '.join(names) or 'none'})",
                "lora",
            )
        return names[index]
    if entry["name"] not in names:
        raise bad_request(
            f"lora name={shown(entry['name'])}: no adapter of that name is loaded "
            f"({', '.join(names) or 'none'})",
            "lora",
        )
    return entry["name"]


def _bare_name(model: str) -> str:
    """A model named the way spnl names it (``openai/<name>``, ``spnl/<name>``) is the
    same model."""
    return model.removeprefix("openai/").removeprefix("spnl/")


def _stream_param(value: str | None) -> bool:
    """``?stream=``: absent is false, as in spnl's server."""
    if value is None:
        return False
    answer = {"true": True, "1": True, "yes": True, "on": True}
    answer |= {"false": False, "0": False, "no": False, "off": False}
    if value.strip().lower() not in answer:
        raise bad_request(f"stream={value!r}: expected true or false", "stream")
    return answer[value.strip().lower()]


def _parsed_query(text: str) -> Any:
    try:
        return parse_query(text)
    except RequestError as exc:
        raise from_request_error(exc, "query") from None


def _sequences(query: SpanQuery) -> int:
    """The sequences a span query asks for: one per input of a map, else its ``n``."""
    return len(query.inputs) if isinstance(query, MapQuery) else query.n


def _query_request(backend: Backend, query: Any) -> tuple[list[PromptIds], Any, int]:
    """The query's prompts tokenized and its sampling checked, off the event loop."""
    try:
        return backend.span_query_request(query)
    except RequestError as exc:
        raise from_request_error(exc, "query") from None


def _failure(error: Exception | None) -> ApiError:
    """What a client is told of a request that failed while it ran."""
    if isinstance(error, RequestAbortedError):
        return ApiError(503, str(error), kind="server_error", code="aborted")
    if isinstance(error, RequestError):  # its own grammar failed mid-way
        return bad_request(str(error))
    return ApiError(500, str(error), kind="server_error")


def _error_shaped(exc: ApiError, shape: ErrorShape) -> dict[str, Any]:
    if shape == "ollama":
        return {"error": exc.message}
    return anthropic_api.error_body(exc) if shape == "anthropic" else exc.body()


def _error_response(exc: ApiError, shape: ErrorShape = "openai") -> JSONResponse:
    return JSONResponse(_error_shaped(exc, shape), exc.status, exc.headers)


def _ollama_entry(name: str, backend: Backend | None, model: Any, running: bool) -> dict:
    """A model as /api/tags (``running``: /api/ps) lists it."""
    entry: dict[str, Any] = {"name": name, "model": name, "digest": "", "size": 0}
    if backend is not None:
        entry["size"] = _file_size(backend.source.path)
        entry["details"] = ollama.details(backend.model_config.architecture, backend.source.kind)
    elif model is not None:
        entry["size"] = model.estimate()
    if not running:
        return {**entry, "modified_at": ollama.stamp()}
    expires = "9999-12-31T23:59:59Z"
    if model is not None and model.keep_alive_s >= 0:
        expires = ollama.stamp(model.keep_alive_s - (time.monotonic() - model.last_used))
    context = backend.max_model_len if backend is not None else 0
    return {**entry, "expires_at": expires, "size_vram": 0, "context_length": context}


def _line(data: dict[str, Any]) -> bytes:
    """One line of newline-delimited JSON (Ollama's stream)."""
    return (json.dumps(data, ensure_ascii=False) + "\n").encode()


def _file_size(path: Any) -> int:
    try:
        return path.stat().st_size if path.is_file() else 0
    except OSError:
        return 0


async def _not_found(request: Request, exc: Exception) -> Response:
    return _error_response(ApiError(404, f"no route {request.url.path}", code="not_found"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    """A 405 that says, as HTTP asks, which methods the route takes (`Allow`)."""
    allowed = (getattr(exc, "headers", None) or {}).get("Allow")
    response = _error_response(
        ApiError(
            405,
            f"{request.method} is not allowed on {request.url.path}"
            + (f"; it takes {allowed}" if allowed else ""),
            code="method_not_allowed",
        )
    )
    if allowed:
        response.headers["Allow"] = allowed
    return response
