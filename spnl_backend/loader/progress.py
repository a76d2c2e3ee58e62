"""Progress of long loads: log events by default, a progress bar where the caller wants one
(the CLI, or `load_backend` on a terminal).

A stage of counted work (tensors read) reports ``(stage, done, total)`` as it goes; a
first-run step that has nothing to count (converting a tokenizer, compiling the CPU
kernels: tens of seconds, once per machine) reports ``(stage, 0, 1)`` when it starts and
``(stage, 1, 1)`` when it ends (`step`), and a bar shows its time running meanwhile.
"""

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Protocol

from ..log import get_logger
from ..signals import leave_interrupts_to_the_main_thread

log = get_logger()

TICK_S = 0.5  # how often a bar of a step that counts nothing shows its time


class Progress(Protocol):
    def __call__(self, stage: str, done: int, total: int) -> None: ...


@contextlib.contextmanager
def step(progress: Progress, stage: str, happens: bool = True) -> Iterator[None]:
    """A step with nothing to count, reported to ``progress`` where it ``happens`` (a
    cache would make it instant): started, and ended once it has succeeded."""
    if not happens:
        yield
        return
    progress(stage, 0, 1)
    yield
    progress(stage, 1, 1)


class LogProgress:
    """Emits ``load.progress`` events at each quarter of every stage."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        quarter = 4 * done // max(total, 1)
        if done == 0 or quarter > self._last.get(stage, -1):
            self._last[stage] = quarter
            log.info("load.progress", stage=stage, done=done, total=total)

    def close(self) -> None:
        pass


class TqdmProgress:
    """A tqdm bar per stage, on stderr (what the CLI shows). A finished stage's bar is
    drawn at 100% and kept on its own line, so what follows starts on a fresh one; a step
    that counts nothing shows its time running; `close` ends every bar's line (an
    interruption's message then starts on a fresh one)."""

    def __init__(self) -> None:
        self._bars: dict = {}
        self._open: set[str] = set()
        self._ticking: dict[str, threading.Event] = {}
        self._closed = False

    def __call__(self, stage: str, done: int, total: int) -> None:
        from tqdm import tqdm

        if self._closed:  # a load given up on that goes on in its thread: nothing more drawn
            return
        bar = self._bars.get(stage)
        if bar is None:
            # A step that counts nothing shows its time alone: "compiling ...: 00:12".
            shape = {"bar_format": "{desc}: {elapsed}"} if total == 1 else {"unit": "tensor"}
            self._open.add(stage)  # first: a Ctrl-C while tqdm draws the bar still ends it
            bar = self._bars[stage] = tqdm(total=total, desc=stage, disable=None, **shape)
            if bar.disable:
                self._open.discard(stage)
                return
            if total == 1 and done == 0:
                self._tick(stage, bar)
        if stage not in self._open:
            return
        bar.update(done - bar.n)
        if done >= total:
            self._finish(stage)

    def _tick(self, stage: str, bar) -> None:
        stop = self._ticking[stage] = threading.Event()

        def run() -> None:
            leave_interrupts_to_the_main_thread()
            while not stop.wait(TICK_S):
                bar.refresh()

        threading.Thread(target=run, name="spnl-progress", daemon=True).start()

    def _finish(self, stage: str) -> None:
        self._open.discard(stage)
        ticking = self._ticking.pop(stage, None)
        if ticking is not None:
            ticking.set()
        bar = self._bars.get(stage)
        if bar is None:  # interrupted while tqdm drew it: its line ended here
            sys.stderr.write("\n")
            return
        bar.refresh()  # updates within tqdm's refresh interval are not drawn
        bar.close()

    def close(self) -> None:
        """End every bar still open (a load that failed or was interrupted), and draw no
        more."""
        self._closed = True
        for stage in list(self._open):
            self._finish(stage)
