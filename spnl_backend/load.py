"""`load_backend`: a model name and the MISTRALRS_* settings → a running `Backend` (the
platform decided, the model resolved, loaded on one process or split over several, the
engine built on the thread that will step it); and every backend still open closed at
interpreter exit."""

import atexit
import os
import sys
import weakref

from .backend import Backend
from .engine.build import build_engine
from .engine.engine import Engine
from .engine.loop import EngineLoop
from .errors import SettingsError
from .loader.chat_template import user_chat_template
from .loader.default_model import default_model_path
from .loader.draft import load_draft
from .loader.model import LoadedModel, load_model
from .loader.progress import LogProgress, Progress, TqdmProgress
from .loader.resolve import ModelSource, resolve_model
from .log import get_logger, set_verbose
from .memory import release_freed_memory
from .settings import BackendSettings, PlatformDecisions, detect_platform, load_settings
from .settings.topology import (
    Topology,
    check_distributed_settings,
    check_layer_map_settings,
    decide_layer_map,
    decide_topology,
    launch_environment,
)

log = get_logger()

# Backends not closed yet: closed at interpreter exit, so that no engine thread is still
# inside a step while the interpreter tears torch down.
_OPEN: "weakref.WeakSet[Backend]" = weakref.WeakSet()


@atexit.register
def _close_open_backends() -> None:
    for backend in list(_OPEN):
        backend.close()


def load_backend(
    model: str | os.PathLike[str] | None = None,
    settings: BackendSettings | None = None,
    *,
    progress: Progress | None = None,
) -> Backend:
    """Load a model (the argument, else ``MISTRALRS_MODEL``, else the embedded default).

    ``settings`` default to the MISTRALRS_* environment; ``progress`` receives loading
    progress (by default progress bars where stderr is a terminal, else ``load.progress``
    log events), called from the backend's engine thread, which loads the model while
    this call waits. A load that fails or is interrupted ends the bars' lines first.
    """
    _check_load_arguments(model, settings, progress)
    if settings is None:
        settings = load_settings()
    else:
        set_verbose(settings.verbose)
    decisions = detect_platform(settings)
    name = os.fspath(model) if model is not None else settings.model
    source = (
        resolve_model(name)
        if name
        else ModelSource("gguf", default_model_path(), "embedded default")
    )
    log.info("model.resolved", name=source.name, kind=source.kind, path=str(source.path))
    template = user_chat_template(settings.chat_template)
    progress = progress or (TqdmProgress() if sys.stderr.isatty() else LogProgress())
    try:
        backend = _load(source, settings, decisions, progress)
        if template is not None:
            backend.tokenizer.hf.chat_template = template
            log.info("tokenizer.chat_template_chosen", by="MISTRALRS_CHAT_TEMPLATE")
        return backend
    except BaseException:
        close = getattr(progress, "close", None)
        if close is not None:
            close()
        raise


def _load(
    source: ModelSource,
    settings: BackendSettings,
    decisions: PlatformDecisions,
    progress: Progress,
) -> Backend:
    topology = decide_topology(
        settings, decisions.device_type, decisions.cuda_device_count, launch_environment()
    )
    layer_map = decide_layer_map(
        settings, topology, decisions.device_type, decisions.cuda_device_count
    )
    if topology.distributed:
        return _load_distributed(source, settings, decisions, topology, progress)
    if layer_map is not None:
        check_layer_map_settings(settings, decisions)

    def build() -> tuple[Engine, LoadedModel]:
        loaded = load_model(
            source,
            settings.isq,
            decisions,
            progress,
            layer_map=layer_map,
            model_impl=settings.model_impl,
        )
        draft = load_draft(loaded, settings, decisions, progress)
        engine = build_engine(loaded, settings, decisions, draft)
        return engine, loaded

    loop, loaded = EngineLoop.start(build)  # built on the thread that will step it
    return _opened(Backend(loaded, loop, settings, decisions))


def _load_distributed(
    source: ModelSource,
    settings: BackendSettings,
    decisions: PlatformDecisions,
    topology: Topology,
    progress: Progress,
) -> Backend:
    """A model over several ranks (`distributed`): this process is its machine's first.
    Rank 0 returns the backend; any other first rank follows rank 0's steps until rank 0
    closes, then ends its process (under torchrun, every rank but 0)."""
    from .distributed.driver import Ranks, check_model_splits, start_ranks
    from .distributed.launch import rank_decisions
    from .distributed.worker import follow

    check_distributed_settings(settings, decisions)
    check_model_splits(source, topology.world_size)
    decisions = rank_decisions(decisions, topology)
    log.info("distributed.topology", why=topology.why, rank=topology.rank)

    def load_share() -> tuple[LoadedModel, Ranks]:
        split, ranks = start_ranks(source, settings, decisions, topology)
        try:
            loaded = load_model(
                source,
                settings.isq,
                decisions,
                progress,
                split=split,
                model_impl=settings.model_impl,
            )
            return loaded, ranks
        except BaseException:
            ranks.stop()
            raise

    def build() -> tuple[Engine, LoadedModel]:
        loaded, ranks = load_share()
        try:
            draft = load_draft(loaded, settings, decisions, progress)  # whole, on rank 0
            engine = build_engine(loaded, settings, decisions, draft)
            ranks.attach(engine, settings)
        except BaseException:
            ranks.stop()
            raise
        return engine, loaded

    if topology.rank != 0:
        loaded, ranks = load_share()
        try:
            follow(loaded, ranks.tp, settings, decisions)
        finally:
            ranks.stop()
        raise SystemExit(0)
    loop, loaded = EngineLoop.start(build)
    return _opened(Backend(loaded, loop, settings, decisions))


def _opened(backend: Backend) -> Backend:
    """A backend just loaded: closed at exit unless closed before, and what loading freed
    handed back to the system."""
    _OPEN.add(backend)
    release_freed_memory()
    return backend


def _check_load_arguments(model: object, settings: object, progress: object) -> None:
    if (model is not None and not isinstance(model, str | os.PathLike)) or (
        isinstance(model, os.PathLike) and not isinstance(os.fspath(model), str)
    ):
        raise SettingsError(
            f"model={type(model).__name__}: expected a model name or path (str or os.PathLike)"
        )
    if model is not None and not os.fspath(model).strip():
        raise SettingsError(
            f"model={os.fspath(model)!r}: expected a model name or path; leave it out "
            "(None) for MISTRALRS_MODEL, else the embedded default"
        )
    if settings is not None and not isinstance(settings, BackendSettings):
        raise SettingsError(
            f"settings={type(settings).__name__}: expected a BackendSettings "
            "(build one with BackendSettings(field=value, ...))"
        )
    if progress is not None and not callable(progress):
        raise SettingsError(
            f"progress={type(progress).__name__}: expected a callable (stage, done, total)"
        )
