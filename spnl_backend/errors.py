"""The exceptions a host application can catch.

Every error the library raises on bad input derives from `SpnlError`, and the
ones about bad values also derive from `ValueError`, so hosts may catch either.
"""


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about a caller's input:
    a value whose repr raises (a hostile ``__repr__``, an int past Python's digit limit)
    is named by its type."""
    try:
        text = str.__str__(repr(value))
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SpnlError(Exception):
    """Base class of every error raised by spnl-backend."""


class SettingsError(SpnlError, ValueError):
    """A MISTRALRS_* variable (or a setting built in code) has an invalid value."""


class PlatformError(SpnlError, RuntimeError):
    """The settings ask for something this machine cannot do."""


class ModelNotFoundError(SpnlError, FileNotFoundError):
    """A model name resolved to nothing; the message lists every place that was tried."""


class ModelFileError(SpnlError, ValueError):
    """A model file is truncated, corrupt or of a kind this library cannot run."""


class UnsupportedArchitectureError(SpnlError, ValueError):
    """The model's architecture is not one of the supported ones (the message lists them)."""


class RequestError(SpnlError, ValueError):
    """A generate/chat request has an invalid parameter or prompt."""


class ContextLengthError(RequestError):
    """The prompt does not fit the context (with room for at least one generated token)."""


class AdapterInUseError(RequestError):
    """A LoRA adapter cannot be unloaded or evicted now: requests running with it (the
    message says how many) finish first. The server answers 409."""


class EngineError(SpnlError, RuntimeError):
    """A request could not be completed because a step of the engine failed (the message
    names the cause); the backend stays usable and the other requests go on."""


class DistributedError(EngineError):
    """A rank of a tensor-parallel group stopped, or stopped answering within the
    collective timeout (the message names what is known of it): the group cannot go on,
    and its backend refuses further work; load a new one."""


class RequestAbortedError(SpnlError):
    """A request ended before it finished: its backend was closed, or its stream was left
    unread too long (see the README's rule for streams)."""
