"""`serve`: listen first, load the model in the background (``/health`` says 503 until
it is ready), serve until SIGINT or SIGTERM, then stop gracefully.

Stopping: the listening socket closes at once; requests in flight get up to
``grace_s`` seconds to finish; what is left then is aborted through the backend (a
stream ends with an error event, a whole answer is a 503 error body, the blocks are
freed), and `serve` returns 0.
"""

import asyncio
import dataclasses
import functools
import math
import signal
import socket
import threading
import time
from pathlib import Path
from types import FrameType

import uvicorn

from ..backend import Backend
from ..errors import SettingsError
from ..load import load_backend
from ..loader.chat_template import user_chat_template
from ..loader.default_model import DEFAULT_MODEL_NAME
from ..log import get_logger
from ..settings import BackendSettings, load_settings
from ..settings.serving import api_key_from_env
from ..settings.values import lora_adapter_list
from ..signals import leave_interrupts_to_the_main_thread
from . import collector
from .app import (
    LOOPBACK_NAMES,
    MAX_BODY_BYTES,
    MAX_WAITING,
    ServerConfig,
    ServerState,
    create_app,
    host_name,
)
from .kv_events import KvEventPublisher, KvEventsConfig, check_kv_events_installed
from .models import DEFAULT_KEEP_ALIVE_S, ModelSet

log = get_logger()

GRACE_S = 30.0
ABORT_DRAIN_S = 5
REAP_EVERY_S = 1.0  # after the grace period: for aborted requests to send their errors


class _Server(uvicorn.Server):
    """uvicorn's server, except that a stopping signal is not raised again once it has
    stopped (a server stopped on purpose exits with status 0), and that when the grace
    period ends the requests left are aborted through the backend, so that they answer
    with an error, before uvicorn would cancel their handlers mid-answer."""

    def __init__(self, config: uvicorn.Config, grace_s: float, state: ServerState) -> None:
        super().__init__(config)
        self.grace_s, self.state = grace_s, state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        expiry = asyncio.ensure_future(self._abort_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            expiry.cancel()

    async def _abort_after_grace(self) -> None:
        await asyncio.sleep(self.grace_s)
        if not self.state.in_flight:
            return
        log.warning("server.grace_expired", aborted=self.state.in_flight)
        if self.state.models is not None:
            await asyncio.to_thread(self.state.models.close)
        elif self.state.backend is not None:
            await asyncio.to_thread(self.state.backend.close)


def serve(
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model: str | list[str] | None = None,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_waiting: int = MAX_WAITING,
    max_body_bytes: int = MAX_BODY_BYTES,
    grace_s: float = GRACE_S,
    verbose: bool = False,
    open_metrics: bool = False,
    allowed_hosts: list[str] | None = None,
    allowed_origins: list[str] | None = None,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
    memory_budget_mb: int | None = None,
    chat_template: str | list[str] | None = None,
    reasoning_format: str | None = None,
    lora: list[str] | None = None,
    kv_events: str | None = None,
    kv_events_replay: str | None = None,
    kv_events_topic: str = "",
    default_chat_template_kwargs: str | None = None,
) -> int:
    """Run the server until it is told to stop; returns the exit status. ``model``: one
    model (loaded at once, kept for the server's life), or a list of several (each
    ``PATH`` or ``NAME=PATH``, loaded on its first request and unloaded once idle for
    ``keep_alive_s``, within ``memory_budget_mb``). ``chat_template`` (a file or Jinja
    source; with several models, items ``NAME=FILE`` give one model its own),
    ``reasoning_format`` and ``default_chat_template_kwargs`` (a JSON object):
    over ``MISTRALRS_CHAT_TEMPLATE``, ``MISTRALRS_REASONING_FORMAT`` and
    ``MISTRALRS_DEFAULT_CHAT_TEMPLATE_KWARGS``, for every model served. ``lora``:
    ``NAME=PATH`` LoRA adapters over ``MISTRALRS_LORA_ADAPTERS``; with several models,
    ``MODEL:NAME=PATH``, each adapter on the served model ``MODEL``.
    ``kv_events``: a ZMQ endpoint to publish the prefix cache's KV events on, in vLLM's
    format (`kv_events`), with ``kv_events_replay`` a replay endpoint for late
    subscribers."""
    api_key = api_key if api_key is not None else api_key_from_env()
    _check_options(port, max_waiting, max_body_bytes, grace_s)
    chat_template, own_templates = _chat_templates(chat_template, model)
    chosen = {
        "chat_template": chat_template,
        "reasoning_format": reasoning_format,
        "default_chat_template_kwargs": default_chat_template_kwargs,
        "lora_adapters": ",".join(lora) if lora else None,
    }
    # A bad MISTRALRS_* variable or chat template fails before anything starts.
    settings = load_settings(**{k: v for k, v in chosen.items() if v is not None})
    user_chat_template(settings.chat_template)
    several = _several(
        model, served_model_name, keep_alive_s, memory_budget_mb, settings, own_templates
    )
    events = _events_config(kv_events, kv_events_replay, kv_events_topic, several)
    if isinstance(model, list):  # one given (several are the model set's)
        model = model[0] if len(model) == 1 else None
    model = None if several is not None else model or settings.model or None
    sock = _listen(host, port)
    name = served_model_name or _model_name(model)
    state = ServerState(models=several, kv_events=events and dataclasses.asdict(events))
    hosts = _allowed_hosts(host, allowed_hosts)
    origins = tuple(origin.strip() for origin in allowed_origins or () if origin.strip())
    config = ServerConfig(name, api_key, max_body_bytes, max_waiting, open_metrics, hosts, origins)
    server = _Server(
        uvicorn.Config(
            create_app(config, state),
            log_level="info" if verbose else "warning",
            access_log=verbose,
            timeout_graceful_shutdown=math.ceil(grace_s) + ABORT_DRAIN_S,
            lifespan="off",
        ),
        grace_s,
        state,
    )
    failure: list[BaseException] = []
    if several is None:
        loader = threading.Thread(
            target=_load,
            args=(model, settings, state, server, failure, events),
            name="spnl-load",
            daemon=True,
        )
        loader.start()
    else:
        threading.Thread(
            target=_reap, args=(several, server), name="spnl-reap", daemon=True
        ).start()
    log.info(
        "server.listening",
        url=f"http://{_url_host(host)}:{sock.getsockname()[1]}/v1",
        model=several.names if several is not None else name,
        api_key=api_key is not None,
    )
    try:
        server.run(sockets=[sock])
    finally:
        if several is not None:
            several.close()
        elif state.backend is not None:
            state.backend.close()  # aborts what the grace period left
        if state.publisher is not None:
            state.publisher.close()
        log.info("server.stopped")
    if failure:
        raise failure[0]
    return 0


def _load(
    model: str | None,
    settings: BackendSettings,
    state: ServerState,
    server: _Server,
    failure: list[BaseException],
    events: KvEventsConfig | None = None,
) -> None:
    leave_interrupts_to_the_main_thread()
    try:
        backend = _served_backend(model, settings)
        if events is not None:
            state.publisher = _publish(backend, events)
    except BaseException as exc:  # reported by `serve` once the server has stopped
        failure.append(exc)
        server.should_exit = True
        return
    if server.should_exit:  # stopped while loading
        backend.close()
        return
    state.backend = backend
    log.info("server.ready", model=backend.source.name)


def _events_config(
    endpoint: str | None, replay: str | None, topic: str, several: ModelSet | None
) -> KvEventsConfig | None:
    """The KV events asked for, checked before anything starts."""
    if endpoint is None:
        if replay is not None:
            raise SettingsError("--kv-events-replay replays --kv-events: give both")
        return None
    if several is not None:
        raise SettingsError(
            "--kv-events publishes one model's blocks; serve one model per process (a "
            "replica each) to publish their events"
        )
    for given in (endpoint, replay):
        if given is not None and not given.startswith(("tcp://", "ipc://", "inproc://")):
            raise SettingsError(
                f"--kv-events endpoint {given!r}: expected a ZMQ address, tcp://HOST:PORT "
                "(tcp://*:PORT to bind), ipc://PATH or inproc://NAME"
            )
    check_kv_events_installed()
    return KvEventsConfig(endpoint, replay, topic)


def _publish(backend: Backend, events: KvEventsConfig) -> KvEventPublisher:
    """The publisher, told of the backend's blocks from now on."""
    block_size = backend.cache_info().block_size
    if block_size is None:
        raise SettingsError("--kv-events needs the paged KV cache (MISTRALRS_PAGED_ATTN)")
    publisher = KvEventPublisher(events, block_size)
    try:
        backend.watch_blocks(publisher)
    except BaseException:
        publisher.close()
        raise
    return publisher


def _several(
    models: str | list[str] | None,
    served_model_name: str | None,
    keep_alive_s: float,
    memory_budget_mb: int | None,
    settings: BackendSettings,
    own_templates: dict[str, str] | None = None,
) -> ModelSet | None:
    """The model set where several models are given (None for one); ``own_templates``:
    the chat templates of the models given their own (`_chat_templates`)."""
    if not isinstance(models, list) or len(models) < 2:
        return None
    if served_model_name:
        raise SettingsError("--served-model-name names one model; with several, give NAME=PATH")
    if memory_budget_mb is not None and memory_budget_mb < 1:
        raise SettingsError(f"--memory-budget-mb {memory_budget_mb}: expected an integer >= 1")
    sources: dict[str, str] = {}
    for given in models:
        name, _, path = given.rpartition("=") if "=" in given else ("", "", given)
        name = name or _model_name(path)
        if not path or name in sources:
            raise SettingsError(f"--model {given!r}: expected PATH or NAME=PATH, each name once")
        sources[name] = path
    budget = memory_budget_mb << 20 if memory_budget_mb is not None else None
    adapters = _model_adapters(settings.lora_adapters, sources)
    settings = settings.model_copy(update={"lora_adapters": None})
    named = {}
    for name in sorted(set(own_templates or {}) | set(adapters)):
        update: dict[str, str] = {}
        if name in (own_templates or {}):
            update["chat_template"] = own_templates[name]  # type: ignore[index]
        if name in adapters:
            update["lora_adapters"] = ",".join(f"{a}={p}" for a, p in adapters[name].items())
        own = settings.model_copy(update=update)
        named[name] = functools.partial(_served_backend, settings=own)
    try:
        return ModelSet(
            sources,
            lambda path: _served_backend(path, settings),
            keep_alive_s,
            budget,
            named,
            adapters,
        )
    except ValueError as exc:
        raise SettingsError(f"--lora (MISTRALRS_LORA_ADAPTERS): {exc}") from None


def _model_adapters(given: str | None, models: dict[str, str]) -> dict[str, dict[str, str]]:
    """With several models, each ``MODEL:NAME=PATH`` adapter under its served model's name
    (the longest served name that ``MODEL:`` begins the item with, as names may hold
    ``:``)."""
    adapters: dict[str, dict[str, str]] = {}
    for item, path in lora_adapter_list(given):
        owners = [m for m in models if item.startswith(m + ":") and len(item) > len(m) + 1]
        if not owners:
            raise SettingsError(
                f"--lora (MISTRALRS_LORA_ADAPTERS) {item}={path}: with several models, "
                "expected MODEL:NAME=PATH, MODEL one of the served models ("
                + ", ".join(models)
                + ")"
            )
        model = max(owners, key=len)
        adapters.setdefault(model, {})[item[len(model) + 1 :]] = path
    return adapters


def _chat_templates(
    given: str | list[str] | None, models: str | list[str] | None
) -> tuple[str | None, dict[str, str]]:
    """``--chat-template`` values: the one for every model, and the models' own (an item
    ``NAME=FILE`` whose NAME is a served model's, with several), each checked now."""
    items = [given] if isinstance(given, str) else list(given or ())
    names = _served_names(models)
    shared: list[str] = []
    own: dict[str, str] = {}
    for item in items:
        name, _, value = item.partition("=")
        if name in names and value:
            if name in own:
                raise SettingsError(f"--chat-template: model {name!r} is given two templates")
            user_chat_template(value)
            own[name] = value
        else:
            shared.append(item)
    if len(shared) > 1:
        raise SettingsError(
            "--chat-template: give one template for every model, or NAME=FILE for each of "
            f"several models (served as {', '.join(sorted(names)) or 'one model'})"
        )
    return (shared[0] if shared else None), own


def _served_names(models: str | list[str] | None) -> set[str]:
    """The names several models are served as (none for one model)."""
    if not isinstance(models, list) or len(models) < 2:
        return set()
    return {given.rpartition("=")[0] or _model_name(given.rpartition("=")[2]) for given in models}


def _served_backend(model: str | None, settings: BackendSettings) -> Backend:
    """The backend loaded with the grammar library's view of its vocabulary built: seconds
    that hold the GIL, spent before the model is served rather than under a request."""
    backend = load_backend(model, settings)
    try:
        backend.prepare_constraints()
    except BaseException:
        backend.close()
        raise
    collector.freeze_loaded()
    return backend


def _reap(models: ModelSet, server: "_Server") -> None:
    """Unload idle models, once a second, until the server stops."""
    leave_interrupts_to_the_main_thread()
    while not server.should_exit:
        time.sleep(REAP_EVERY_S)
        try:
            models.reap()
        except Exception as exc:  # a backend that fails to close: logged, the loop goes on
            log.error("models.reap_failed", error=f"{type(exc).__name__}: {exc}")


def _listen(host: str, port: int) -> socket.socket:
    """Bind before the model loads, so that a port in use fails at once and clearly."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: without it a response written in two parts (head,
    # then body) waited for the client's delayed ACK, 40 ms on every kept-alive request.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SettingsError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _model_name(model: str | None) -> str:
    """The name clients use: a file's or directory's name without .gguf, a hub id as
    given, or the embedded default's file name."""
    if not model:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    if path.exists():
        return path.name.removesuffix(".gguf")
    return model


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _check_options(port: int, max_waiting: int, max_body_bytes: int, grace_s: float) -> None:
    checks = [
        (0 <= port <= 65535, f"--port {port}: expected 0 to 65535 (0: any free port)"),
        (max_waiting >= 0, f"--max-waiting {max_waiting}: expected an integer >= 0"),
        (max_body_bytes >= 1024, f"--max-body-bytes {max_body_bytes}: expected >= 1024"),
        (grace_s >= 0, f"--grace {grace_s}: expected seconds >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise SettingsError(message)


def _allowed_hosts(bound: str, given: list[str] | None) -> tuple[str, ...] | None:
    """The Host names requests may carry: those given (``*``: any); else, on a loopback
    address, the machine's own names; else (a server its operator exposed) any."""
    if given:
        return tuple(name.strip() for name in given if name.strip())
    if host_name(bound) in LOOPBACK_NAMES:
        return (*LOOPBACK_NAMES, host_name(bound))
    return None
