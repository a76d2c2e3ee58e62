"""The server's collector settings (`server/collector.py`): paused while requests are
parsed, back as it was after the last one, and never paused for long without a pass."""

import gc
import threading
import weakref
from types import SimpleNamespace

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


# ---- load/close cycles leave nothing of the closed model ------------------------------


class _Cyclic:
    """A backend whose objects form a reference cycle, as a real one's few dozen do."""

    closed = False

    def __init__(self, source: str) -> None:
        self.me = self

    def close(self) -> None:
        self.closed = True

    def cache_info(self) -> SimpleNamespace:
        return SimpleNamespace(state_bytes=None)  # no state layers


def test_an_unloaded_models_cyclic_garbage_is_collected_though_frozen():
    """Frozen with its load, a closed model's reference cycles were never collected: a
    server's RSS crept up with every load and unload."""
    from spnl_backend.server.models import ModelSet

    loaded: list[weakref.ref] = []

    def load(source: str) -> _Cyclic:
        backend = _Cyclic(source)
        loaded.append(weakref.ref(backend))
        collector.freeze_loaded()  # as the server's loader does
        return backend

    models = ModelSet({"a": "a"}, load)  # type: ignore[arg-type]
    try:
        for _ in range(3):
            models.acquire("a")
            models.release("a")
            assert models.unload("a")
        assert [ref() for ref in loaded] == [None, None, None]
    finally:
        gc.unfreeze()


def test_garbage_is_collected_before_a_load_is_frozen():
    garbage = _Cyclic("x")
    probe = weakref.ref(garbage)
    del garbage
    try:
        collector.freeze_loaded()
        assert probe() is None
    finally:
        gc.unfreeze()


def test_load_close_cycles_leave_no_backend_object_alive(tiny):
    """Freed by reference counts alone (the collector off, as for a frozen load): the
    backend, its engine, model, grammar compiler and tokenizer, and the compiled grammars
    emptied by close."""
    from helpers import CPU

    from spnl_backend import load_backend

    path = str(tiny.hf("llama").path)
    gc.disable()
    try:
        for _ in range(3):
            backend = load_backend(path, settings=CPU)
            backend.generate("x", max_tokens=2, regex="[a-z]+")
            engine = backend._loop.engine
            compiler = backend._grammars
            owned = [backend, engine, engine.runner.model, compiler, backend.tokenizer]
            probes = [weakref.ref(thing) for thing in owned]
            backend.close()
            assert compiler.kept() == (0, 0)
            del backend, engine, compiler, owned
            assert [probe() for probe in probes] == [None] * len(probes)
    finally:
        gc.enable()
