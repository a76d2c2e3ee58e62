"""Where the package keeps what it builds once per machine (compiled kernels, converted
tokenizers): the one place that reads ``XDG_CACHE_HOME``."""

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """``$XDG_CACHE_HOME/spnl_backend/<kind>`` (``~/.cache`` where the variable is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "spnl_backend" / kind
