"""spnl-backend: run LLMs locally, configured by the MISTRALRS_* environment variables.

The names below are imported on first use, so ``import spnl_backend`` (and the command
line, which must answer Ctrl-C even while torch loads) costs nothing until they are.
"""

from importlib import import_module
from typing import TYPE_CHECKING

from .errors import (
    AdapterInUseError,
    DistributedError,
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

if TYPE_CHECKING:
    from .backend import Backend
    from .engine.cache import CacheInfo, PoolUsage
    from .engine.engine import EngineStats
    from .load import load_backend
    from .results import GenerateResult, Usage
    from .settings import BackendSettings, PlatformDecisions, detect_platform, load_settings

__version__ = "0.1.0"

_LAZY = {
    "Backend": ".backend",
    "GenerateResult": ".results",
    "Usage": ".results",
    "load_backend": ".load",
    "CacheInfo": ".engine.cache",
    "PoolUsage": ".engine.cache",
    "EngineStats": ".engine.engine",
    "BackendSettings": ".settings",
    "PlatformDecisions": ".settings",
    "detect_platform": ".settings",
    "load_settings": ".settings",
}

__all__ = [
    "AdapterInUseError",
    "Backend",
    "BackendSettings",
    "CacheInfo",
    "DistributedError",
    "EngineError",
    "EngineStats",
    "GenerateResult",
    "ModelFileError",
    "ModelNotFoundError",
    "PlatformDecisions",
    "PlatformError",
    "PoolUsage",
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


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
