"""The server's collector settings (`server/collector.py`): paused while requests are
parsed, back as it was after the last one, and never paused for long without a pass."""

import gc
import threading
import weakref

import pytest

from spnl_backend.server import collector


@pytest.fixture(autouse=True)
def enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_inside_and_enabled_after():
    with collector.paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_overlapping_pauses_end_with_the_last():
    inside, leave = threading.Event(), threading.Event()

    def parse() -> None:
        with collector.paused():
            inside.set()
            leave.wait(30)

    other = threading.Thread(target=parse)
    other.start()
    assert inside.wait(30)
    with collector.paused():
        assert not gc.isenabled()
    assert not gc.isenabled(), "the other parse is still in progress"
    leave.set()
    other.join(30)
    assert gc.isenabled()


def test_a_collector_the_host_disabled_stays_disabled():
    gc.disable()
    with collector.paused():
        pass
    assert not gc.isenabled()


def test_an_exception_still_ends_the_pause():
    with pytest.raises(ValueError, match="parse failed"), collector.paused():
        raise ValueError("parse failed")
    assert gc.isenabled()


def test_a_pause_without_a_break_still_collects(monkeypatch):
    """Parses that overlap without end must not let cyclic garbage pile up: a parse that
    begins after `MAX_PAUSED_S` runs a young-generation pass."""
    gc.collect()
    monkeypatch.setattr(collector, "MAX_PAUSED_S", 0.0)
    collected = threading.Event()
    with collector.paused():

        class Cycle:
            pass

        cycle = Cycle()
        cycle.me = cycle
        weakref.finalize(cycle, collected.set)
        del cycle
        assert not collected.is_set()
        with collector.paused():
            assert collected.is_set()


def test_without_pauses_runs_the_function_paused():
    seen = collector.without_pauses(lambda x: (x, gc.isenabled()))(7)
    assert seen == (7, False)
    assert gc.isenabled()
