"""The library logs structured events and never configures the host's logging."""

import logging
import subprocess
import sys

import pytest
import structlog

from spnl_backend import load_settings
from spnl_backend.log import LOGGER_NAME, get_logger, set_verbose


@pytest.fixture
def quiet_library():
    """The library's logger as a host that configured nothing finds it."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers = [logging.NullHandler()]
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    return logger


def test_host_logging_and_structlog_are_left_alone(quiet_library):
    root_handlers = list(logging.getLogger().handlers)
    our_handlers = list(quiet_library.handlers)
    load_settings()
    assert logging.getLogger().handlers == root_handlers
    assert quiet_library.handlers == our_handlers
    assert not structlog.is_configured()


def test_events_reach_the_stdlib_logger_with_their_fields(caplog, quiet_library):
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        get_logger().info("prefix_cache.hit", blocks=12)
    record = caplog.records[-1]
    assert record.getMessage() == "prefix_cache.hit blocks=12"
    assert record.spnl_event == "prefix_cache.hit"
    assert record.spnl_fields == {"blocks": 12}


def test_an_exception_is_a_plain_traceback_without_local_variables(caplog, quiet_library):
    from spnl_backend.cli import _ConsoleFormatter

    def fails(prompt):
        raise ValueError("boom")

    with caplog.at_level(logging.ERROR, logger=LOGGER_NAME):
        try:
            fails("".join(["a secret", " prompt"]))  # the source line shows no prompt
        except ValueError as exc:
            get_logger().error("server.internal_error", exc_info=exc)
    record = caplog.records[-1]
    assert record.getMessage() == "server.internal_error"
    assert record.exc_info[0] is ValueError
    console = _ConsoleFormatter().format(record)
    assert "ValueError: boom" in console
    assert "in fails" in console
    assert "secret prompt" not in console
    assert "secret prompt" not in caplog.text


def test_debug_events_need_verbose(caplog, quiet_library):
    with caplog.at_level(logging.DEBUG, logger=LOGGER_NAME):
        get_logger().debug("engine.step", tokens=1)
        assert not caplog.records
        set_verbose(True)
        get_logger().debug("engine.step", tokens=2)
    assert [r.getMessage() for r in caplog.records] == ["engine.step tokens=2"]


def test_verbose_env_shows_events_when_the_host_configured_nothing(monkeypatch, quiet_library):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setenv("MISTRALRS_VERBOSE", "1")
    load_settings()
    assert any(
        isinstance(h, logging.StreamHandler) and not isinstance(h, logging.NullHandler)
        for h in quiet_library.handlers
    )
    assert quiet_library.level == logging.DEBUG


def test_a_host_that_logs_nothing_never_imports_structlog():
    """Events no handler would see are dropped before structlog is imported (its import,
    rich's with it, costs half a second of a cold start); the first seen event imports it."""
    script = (
        "import logging, sys\n"
        "from spnl_backend.log import LOGGER_NAME, get_logger\n"
        "log = get_logger()\n"
        "log.info('model.default', path='x')\n"
        "log.debug('engine.step', tokens=1)\n"
        "print('structlog' in sys.modules)\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "log.bind(request=7).info('model.default', path='y')\n"
        "print('structlog' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n") == [
        "False",
        "model.default request=7 path='y'",
        "True",
        "",
    ]
