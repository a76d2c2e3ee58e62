"""What the server reads from the environment besides the MISTRALRS_* variables."""

import os

API_KEY_ENV = "SPNL_BACKEND_API_KEY"


def api_key_from_env() -> str | None:
    """The bearer key clients must send, from ``SPNL_BACKEND_API_KEY`` (unset or empty:
    none is required)."""
    return os.environ.get(API_KEY_ENV) or None
