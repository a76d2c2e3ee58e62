import logging
import os
import signal

# No network at test time; set before huggingface_hub reads it on import.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter. Triton decides this
# when its own library is imported, so it is set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
    """Tests see only the MISTRALRS_* variables they set themselves, plus one: the suite
    runs the native kernels with every index checked (MISTRALRS_NATIVE_CHECKS), so a
    kernel that strays fails its test instead of corrupting memory. The unchecked build is
    what tests/test_cpu_kernels.py and tests/test_cpu_paths.py also run."""
    for name in list(os.environ):
        if name.upper().startswith("MISTRALRS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("MISTRALRS_NATIVE_CHECKS", "true")


@pytest.fixture(autouse=True)
def _fixed_template_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chat templates that print today's date (gpt-oss's Harmony) see one fixed day, so a
    tiny model's greedy tokens, and the verdicts on them, do not change at midnight."""
    from datetime import datetime

    from spnl_backend.loader import chat_template

    monkeypatch.setattr(chat_template, "_now", lambda: datetime(2026, 11, 29, 12, 0))


@pytest.fixture(autouse=True)
def _restore_library_logger():
    """The CLI configures the library's logger for the console; undo that after each test."""
    from spnl_backend.log import LOGGER_NAME, set_verbose

    logger = logging.getLogger(LOGGER_NAME)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    set_verbose(False)
    logger.handlers, logger.level, logger.propagate = saved


@pytest.fixture
def foreground():
    """Children started in the test take Ctrl-C (SIGINT) as a shell's foreground command
    does. A shell starts a background job (``pytest ... &``) with SIGINT ignored, which its
    children inherit: Python then installs no handler for it, and a test's SIGINT would
    do nothing. A handler set here resets to the default action in every child."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def picks(monkeypatch):
    """Every pick the PIC recomputation probes make (`engine.pic_probe`), as ``(group end,
    indices)``."""
    from spnl_backend.engine.pic_blocks import PicProgress

    found: list[tuple[int, list[int]]] = []
    original = PicProgress.choose

    def choose(self, end, indices):
        found.append((end, list(indices)))
        original(self, end, indices)

    monkeypatch.setattr(PicProgress, "choose", choose)
    return found


@pytest.fixture(scope="session", autouse=True)
def _private_caches(tmp_path_factory: pytest.TempPathFactory):
    """Converted tokenizers and hub lookups go to a throwaway place, not the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="session")
def native_kernels():
    """The compiled CPU kernels, as shipped; a machine without a C compiler fails here."""
    import spnl_backend.kernels.cpu as cpu

    native = cpu.cpu_kernels()
    if native is None:
        pytest.fail("the CPU kernels did not build: is there a C compiler?")
    return native


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    from helpers import TinyModels

    return TinyModels(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def live(backend):
    """The server over the test module's own ``backend`` fixture."""
    from live_server import LiveServer

    server = LiveServer(backend)
    yield server
    server.stop()


@pytest.fixture
def block_runs(monkeypatch):
    """How many steps the native layer blocks ran."""
    from spnl_backend.models import native_blocks

    runs = [0]
    run = native_blocks.LayerBlocks.run

    def counted(self, *args):
        runs[0] += 1
        return run(self, *args)

    monkeypatch.setattr(native_blocks.LayerBlocks, "run", counted)
    return runs
