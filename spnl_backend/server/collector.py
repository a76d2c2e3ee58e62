"""The server's use of Python's cyclic garbage collector. The server's process is its own,
so it may set the collector (a library embedded in a host never does).

A full collection walks every object the collector tracks, holding the GIL throughout:
with a model loaded, about 250 ms, and for as long as it runs every stream and `/health`
wait. Two settings keep such pauses short:

- What a model load leaves lives as long as the model, so it is frozen (`gc.freeze`) out
  of the collector's passes, after a pass that collects what was already garbage. A
  closed model's memory is released by reference counts; what of it is in reference
  cycles (a few dozen small objects per load: ctypes' function types, a step's metadata)
  stayed frozen for good, so unloading a model ends with one full pass
  (`collect_unloaded`).
- A request's parsing (a large grammar's conversion builds up to a million short-lived,
  acyclic objects, which reference counts free) runs with automatic collection paused; a
  full collection in the middle of it walked all of them, about 100 ms for a 956 KB
  grammar. Under parses that overlap without a break, the young objects are still
  collected once every `MAX_PAUSED_S` (a generation-1 pass, by the parse that begins then),
  so that cyclic garbage cannot pile up while the collector is off.
"""

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

MAX_PAUSED_S = 10.0

_lock = threading.Lock()
_pausing = 0  # parses in progress
_was_enabled = False  # the collector's state when the first of them began
_collected_at = 0.0  # when the collector last ran, as far as pauses know


def freeze_loaded() -> None:
    """Everything alive now kept out of later collections (call after a model loads); the
    garbage collected first, which frozen would never be."""
    gc.collect()
    gc.freeze()


def collect_unloaded() -> None:
    """A closed model's cyclic garbage collected (call after unloading one): frozen with
    its load, no automatic pass reaches it. One full pass, holding the GIL (about 250 ms
    with a model loaded), then what is left frozen again."""
    if gc.get_freeze_count() == 0:
        return  # nothing frozen: the automatic passes reach everything
    gc.unfreeze()
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Automatic collection off while any caller is inside; back as it was after the last
    one leaves."""
    global _pausing, _was_enabled, _collected_at
    with _lock:
        now = time.monotonic()
        if _pausing == 0:
            _was_enabled = gc.isenabled()
            _collected_at = now
            gc.disable()
        elif _was_enabled and now - _collected_at > MAX_PAUSED_S:
            gc.collect(1)  # paused too long: what the pause let pile up
            _collected_at = now
        _pausing += 1
    try:
        yield
    finally:
        with _lock:
            _pausing -= 1
            if _pausing == 0 and _was_enabled:
                gc.enable()


def without_pauses(function: Callable[P, T]) -> Callable[P, T]:
    """``function`` run with automatic collection `paused`."""

    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        with paused():
            return function(*args, **kwargs)

    return run
