"""spnl-backend: run LLMs locally, configured by the MISTRALRS_* environment variables."""

from .errors import PlatformError, SettingsError, SpnlError
from .settings import BackendSettings, PlatformDecisions, detect_platform, load_settings

__version__ = "0.1.0"

__all__ = [
    "BackendSettings",
    "PlatformDecisions",
    "PlatformError",
    "SettingsError",
    "SpnlError",
    "detect_platform",
    "load_settings",
]
