import logging
import os

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    skips = {
        "cuda": (torch.cuda.is_available(), "needs a CUDA GPU"),
        "metal": (has_mps, "needs Apple Metal (MPS)"),
    }
    for item in items:
        for marker, (present, reason) in skips.items():
            if marker in item.keywords and not present:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _clean_mistralrs_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see only the MISTRALRS_* variables they set themselves."""
    for name in list(os.environ):
        if name.upper().startswith("MISTRALRS_"):
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _restore_library_logger():
    """The CLI configures the library's logger for the console; undo that after each test."""
    from spnl_backend.log import LOGGER_NAME, set_verbose

    logger = logging.getLogger(LOGGER_NAME)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    set_verbose(False)
    logger.handlers, logger.level, logger.propagate = saved
