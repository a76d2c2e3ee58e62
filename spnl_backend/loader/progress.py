"""Progress of long loads: log events by default, a progress bar where the caller wants one."""

from typing import Protocol

from ..log import get_logger

log = get_logger()


class Progress(Protocol):
    def __call__(self, stage: str, done: int, total: int) -> None: ...


class LogProgress:
    """Emits ``load.progress`` events at each quarter of every stage."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        quarter = 4 * done // max(total, 1)
        if done == 0 or quarter > self._last.get(stage, -1):
            self._last[stage] = quarter
            log.info("load.progress", stage=stage, done=done, total=total)


class TqdmProgress:
    """A tqdm bar per stage, on stderr (what the CLI shows). A finished stage's bar is
    drawn at 100% and kept on its own line, so what follows starts on a fresh one."""

    def __init__(self) -> None:
        self._bars: dict = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        from tqdm import tqdm

        bar = self._bars.get(stage)
        if bar is None:
            bar = self._bars[stage] = tqdm(total=total, desc=stage, unit="tensor", disable=None)
        if bar.disable:
            return
        bar.update(done - bar.n)
        if done >= total:
            bar.refresh()  # updates within tqdm's refresh interval are not drawn
            bar.close()
