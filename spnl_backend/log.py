"""Structured logging that stays out of the host application's way.

Events are structlog events with stable names (``event="platform.detected"``).
They are delivered to the stdlib logger ``spnl_backend``, which carries only a
`NullHandler`: nothing is printed unless the host configures logging, or the
user asks with ``MISTRALRS_VERBOSE=1``. The global structlog configuration is
never touched; the CLI, which owns its process, sets up console output itself.
"""

import logging
from typing import Any

LOGGER_NAME = "spnl_backend"

_stdlib_logger = logging.getLogger(LOGGER_NAME)
_stdlib_logger.addHandler(logging.NullHandler())
_verbose = False
_pinned = False  # debug events kept on whatever settings load later (`pin_verbose`)


def _drop_debug_unless_verbose(_logger: Any, method: str, event_dict: dict) -> dict:
    if method == "debug" and not _verbose:
        import structlog

        raise structlog.DropEvent
    return event_dict


def _to_stdlib_call(_logger: Any, _method: str, event_dict: dict) -> tuple[tuple, dict]:
    """Render ``event k=v ...`` as the message and keep the fields for structured hosts.
    An ``exc_info`` goes to the stdlib record as such, so that handlers print a plain
    traceback (never the frames' local variables, which hold prompts)."""
    event = event_dict.pop("event")
    exc_info = event_dict.pop("exc_info", None)
    fields = " ".join(f"{key}={value!r}" for key, value in event_dict.items())
    message = f"{event} {fields}" if fields else event
    extra = {"spnl_event": event, "spnl_fields": dict(event_dict)}
    return (message,), {"extra": extra, "exc_info": exc_info}


def get_logger(**initial: Any) -> "Logger":
    """The library's logger: structlog's, bound to the ``spnl_backend`` stdlib logger."""
    return Logger(initial)


class Logger:
    """A structlog logger built at the first event that a handler would see. An event no
    one would see (the host's level above it, or a debug event without verbose output) is
    dropped here, as structlog would drop it: a host that logs nothing never imports
    structlog, whose import (rich and pygments with it) costs half a second."""

    def __init__(self, initial: dict[str, Any]) -> None:
        self._initial = initial
        self._structlog: Any = None

    def bind(self, **fields: Any) -> "Logger":
        return Logger({**self._initial, **fields})

    def debug(self, event: str, *args: Any, **fields: Any) -> None:
        self._emit("debug", logging.DEBUG, event, args, fields)

    def info(self, event: str, *args: Any, **fields: Any) -> None:
        self._emit("info", logging.INFO, event, args, fields)

    def warning(self, event: str, *args: Any, **fields: Any) -> None:
        self._emit("warning", logging.WARNING, event, args, fields)

    def error(self, event: str, *args: Any, **fields: Any) -> None:
        self._emit("error", logging.ERROR, event, args, fields)

    def exception(self, event: str, *args: Any, **fields: Any) -> None:
        self._emit("exception", logging.ERROR, event, args, fields)

    def critical(self, event: str, *args: Any, **fields: Any) -> None:
        self._emit("critical", logging.CRITICAL, event, args, fields)

    def _emit(self, method: str, level: int, event: str, args: tuple, fields: dict) -> None:
        if (level == logging.DEBUG and not _verbose) or not _stdlib_logger.isEnabledFor(level):
            return
        getattr(self._bound(), method)(event, *args, **fields)

    def _bound(self) -> Any:
        if self._structlog is None:
            import structlog

            self._structlog = structlog.wrap_logger(
                _stdlib_logger,
                processors=[_drop_debug_unless_verbose, _to_stdlib_call],
                wrapper_class=structlog.stdlib.BoundLogger,
            ).bind(**self._initial)
        return self._structlog


def set_verbose(verbose: bool) -> None:
    """Turn debug events on or off (``MISTRALRS_VERBOSE``).

    When verbose output is asked for and the host has configured no handler at
    all, a stderr handler is attached to our own logger so the events are seen.
    """
    global _verbose
    if _pinned:
        return
    _verbose = verbose
    if not verbose:
        return
    if _stdlib_logger.level == logging.NOTSET or _stdlib_logger.level > logging.DEBUG:
        _stdlib_logger.setLevel(logging.DEBUG)
    if not _host_has_handlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        _stdlib_logger.addHandler(handler)


def pin_verbose() -> None:
    """Debug events on for the rest of the process, whatever ``MISTRALRS_VERBOSE`` a later
    load reads: the CLI's ``-v``, which owns its process."""
    global _pinned
    set_verbose(True)
    _pinned = True


def _host_has_handlers() -> bool:
    logger: logging.Logger | None = _stdlib_logger
    while logger is not None:
        if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False
