"""spnl-backend: run LLMs locally, configured by the MISTRALRS_* environment variables."""

from .backend import Backend, GenerateResult, Usage, load_backend
from .errors import (
    EngineError,
    ModelFileError,
    ModelNotFoundError,
    PlatformError,
    RequestAbortedError,
    RequestError,
    SettingsError,
    SpnlError,
    UnsupportedArchitectureError,
)
from .settings import BackendSettings, PlatformDecisions, detect_platform, load_settings

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendSettings",
    "EngineError",
    "GenerateResult",
    "ModelFileError",
    "ModelNotFoundError",
    "PlatformDecisions",
    "PlatformError",
    "RequestAbortedError",
    "RequestError",
    "SettingsError",
    "SpnlError",
    "UnsupportedArchitectureError",
    "Usage",
    "detect_platform",
    "load_backend",
    "load_settings",
]
