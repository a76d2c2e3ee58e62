"""Several models behind one server: each loaded on its first request and let go once idle
for its keep-alive, all within one memory budget.

A model's footprint is its file's size until it has loaded once, then what its load
added to the process's resident memory (weights, KV pool, compiled state) and, for a
model with state layers, the most its state slots and snapshots take (allocated as
sequences run, not at load: `CacheInfo.state_bytes`). A load that
would pass the budget first unloads the least recently used models no request holds; a
request whose model cannot fit even then gets a 503 saying so. A load that fails fails
the requests waiting for it with its error (a 500 naming the model); the next request
tries again. ``keep_alive`` is Ollama's: seconds after a model's last request ends (0:
unload at once; negative: keep).

A model may carry LoRA adapters, each belonging to that one model: a request naming an
adapter holds its base model, whose footprint counts the adapters it holds
(`AdapterUsage.nbytes`); adapters loaded or unloaded at run time are remembered, so an
unloaded model comes back with the adapters it had.

Every method is safe from any thread; the server calls `acquire` off its event loop,
since a load takes seconds.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..backend import Backend
from ..log import get_logger
from ..memory import release_freed_memory, resident_bytes
from . import collector
from .protocol import ApiError

log = get_logger()

DEFAULT_KEEP_ALIVE_S = 300.0
RETRY_AFTER_S = 5


@dataclass
class ServedModel:
    name: str
    source: str  # what load_backend takes
    backend: Backend | None = None
    loading: threading.Event | None = None  # set when a load in progress ends
    error: str | None = None  # the last load's failure, for the requests that waited
    users: int = 0  # requests holding it
    last_used: float = field(default_factory=time.monotonic)
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    footprint: int = 0  # bytes, measured at its last load (0: never loaded)
    adapters: dict[str, str] = field(default_factory=dict)  # its LoRA adapters: name -> path
    adapter_bytes: int = 0  # of those, the bytes held in memory as counted in `footprint`

    def estimate(self) -> int:
        if self.footprint:
            return self.footprint
        return _size(self.source) + sum(_size(path) for path in self.adapters.values())

    def base_estimate(self) -> int:
        """`estimate` less its adapters'."""
        return self.footprint - self.adapter_bytes if self.footprint else _size(self.source)


def _size(source: str) -> int:
    """A file's size, or a PEFT directory's weights' (0 where there is none)."""
    path = Path(source)
    if path.is_dir():
        path = path / "adapter_model.safetensors"
    try:
        return path.stat().st_size if path.is_file() else 0
    except OSError:
        return 0


class ModelSet:
    def __init__(
        self,
        sources: dict[str, str],
        load: Callable[[str], Backend],
        keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
        budget_bytes: int | None = None,
        named_loads: dict[str, Callable[[str], Backend]] | None = None,
        adapters: dict[str, dict[str, str]] | None = None,
    ) -> None:
        """``load``: a model's source to its backend; ``named_loads``: the loaders of
        the models whose settings differ from the rest (their own chat template, their
        adapters); ``adapters``: each model's LoRA adapters (name -> path) its loader
        loads with it."""
        self._named_loads = named_loads or {}
        self._load, self.budget_bytes = load, budget_bytes
        self._lock = threading.Lock()
        self.models = {
            name: ServedModel(name, source, keep_alive_s=keep_alive_s)
            for name, source in sources.items()
        }
        for model, given in (adapters or {}).items():
            for adapter, path in given.items():
                self.check_adapter_name(adapter)
                self.served(model).adapters[adapter] = path

    @property
    def names(self) -> list[str]:
        return list(self.models)

    def loaded(self) -> list[ServedModel]:
        with self._lock:
            return [m for m in self.models.values() if m.backend is not None]

    def base_of(self, name: str) -> str | None:
        """The model whose LoRA adapter ``name`` is (None where no model has one)."""
        with self._lock:
            return next((m.name for m in self.models.values() if name in m.adapters), None)

    def adapter_list(self) -> list[tuple[str, str, str]]:
        """Every model's adapters, ``(adapter, model, path)``, in the models' order."""
        with self._lock:
            return [(a, m.name, p) for m in self.models.values() for a, p in m.adapters.items()]

    def add_adapter(self, model: str, name: str, path: str) -> None:
        """Remember ``model``'s adapter ``name`` (loaded on its backend by the caller), to
        load again whenever the model does; its bytes join the model's footprint."""
        self.check_adapter_name(name)
        with self._lock:
            self.served(model).adapters[name] = path
        self.count_adapters(model)

    def remove_adapter(self, name: str) -> None:
        """Forget an adapter (unloaded from its loaded backend by the caller)."""
        base = self.base_of(name)
        if base is not None:
            with self._lock:
                self.models[base].adapters.pop(name, None)
            self.count_adapters(base)

    def count_adapters(self, name: str) -> None:
        """The model's footprint, if loaded, with its adapters' bytes held now."""
        model = self.served(name)
        backend = model.backend
        if backend is None or backend.closed:
            return
        held = _adapter_bytes(backend)
        with self._lock:
            model.footprint += held - model.adapter_bytes
            model.adapter_bytes = held

    def check_adapter_name(self, name: str) -> None:
        """An adapter's name chooses it in ``model``: neither a model's nor another's."""
        base = self.base_of(name)
        if name in self.models or base is not None:
            taken = "a served model's" if base is None else f"an adapter of {base!r}'s"
            raise ValueError(
                f"the LoRA adapter name {name!r} is {taken} name already; each adapter "
                "needs a name unlike every served model's and every other adapter's"
            )

    def memory(self) -> dict[str, object]:
        """The budget and each model's footprint in bytes (measured, or estimated before
        its first load), of which its held adapters' bytes, and its adapters."""
        with self._lock:
            return {
                "budget_bytes": self.budget_bytes,
                "models": [
                    {
                        "name": m.name,
                        "loaded": m.backend is not None,
                        "footprint_bytes": m.estimate(),
                        "adapter_bytes": m.adapter_bytes,
                        "adapters": list(m.adapters),
                    }
                    for m in self.models.values()
                ],
            }

    def served(self, name: str) -> ServedModel:
        """The model of that name, or the base model of the adapter of that name; a 404
        naming the served ones where there is none."""
        model = self.models.get(name)
        if model is None:
            model = next((m for m in self.models.values() if name in m.adapters), None)
        if model is None:
            raise ApiError(
                404,
                f"the model {name!r} does not exist here; this server serves "
                + ", ".join(repr(n) for n in self.models),
                param="model",
                code="model_not_found",
            )
        return model

    def acquire(self, name: str, keep_alive_s: float | None = None) -> Backend:
        """The model's backend, loaded if it is not, held until `release`."""
        model = self.served(name)
        while True:
            with self._lock:
                if model.backend is not None and not model.backend.closed:
                    model.users += 1
                    model.last_used = time.monotonic()
                    if keep_alive_s is not None:
                        model.keep_alive_s = keep_alive_s
                    return model.backend
                waiting = model.loading
                if waiting is None:
                    evicted = self._make_room(model)
                    model.loading, model.error = threading.Event(), None
            if waiting is not None:
                waiting.wait()
                if model.error is not None and model.backend is None:
                    raise _load_failed(model)
                continue
            self._close(evicted)
            self._load_now(model)

    def release(self, name: str, keep_alive_s: float | None = None) -> None:
        """A request is done with the model; unloaded at once if its keep-alive is 0."""
        model = self.served(name)
        with self._lock:
            model.users -= 1
            model.last_used = time.monotonic()
            if keep_alive_s is not None:
                model.keep_alive_s = keep_alive_s
            expired = self._take_if_expired(model, time.monotonic())
        self._close(expired)

    def reap(self) -> None:
        """Unload every model idle past its keep-alive."""
        now = time.monotonic()
        with self._lock:
            expired = [b for m in self.models.values() for b in self._take_if_expired(m, now)]
        self._close(expired)

    def unload(self, name: str) -> bool:
        """Unload a model no request holds (Ollama's keep_alive 0 with no prompt)."""
        model = self.served(name)
        with self._lock:
            if model.backend is None or model.users:
                return False
            taken = [model.backend]
            model.backend = None
        self._close(taken)
        return True

    def close(self) -> None:
        with self._lock:
            taken = [m.backend for m in self.models.values() if m.backend is not None]
            for model in self.models.values():
                model.backend = None
        self._close(taken)

    # ---- internals --------------------------------------------------------------------

    def _load_now(self, model: ServedModel) -> None:
        before = resident_bytes()
        try:
            backend = self._named_loads.get(model.name, self._load)(model.source)
        except Exception as exc:
            log.error("models.load_failed", model=model.name, error=f"{type(exc).__name__}: {exc}")
            with self._lock:
                model.error = f"{type(exc).__name__}: {exc}"
                done, model.loading = model.loading, None
            done.set()  # type: ignore[union-attr]
            raise _load_failed(model) from None
        try:
            self._sync_adapters(model, backend)
        except Exception as exc:
            backend.close()
            with self._lock:
                model.error = f"{type(exc).__name__}: {exc}"
                done, model.loading = model.loading, None
            done.set()  # type: ignore[union-attr]
            raise _load_failed(model) from None
        grown = resident_bytes() - before
        states = backend.cache_info().state_bytes or 0
        held = _adapter_bytes(backend) if model.adapters else 0
        with self._lock:
            # The resident growth holds the adapters loaded with it, if it was measured.
            footprint = max(grown, model.base_estimate() + held)
            model.backend, model.footprint = backend, footprint + states
            model.adapter_bytes = held
            done, model.loading = model.loading, None
        done.set()  # type: ignore[union-attr]
        log.info("models.loaded", model=model.name, footprint_mb=model.footprint >> 20)

    @staticmethod
    def _sync_adapters(model: ServedModel, backend: Backend) -> None:
        """The reloaded backend with the adapters the model had when let go: those loaded
        since it was first loaded, less those unloaded (its loader loads the given ones)."""
        if not model.adapters and not hasattr(backend, "adapters"):
            return
        have = {a.name for a in backend.adapters()}
        for name, path in model.adapters.items():
            if name not in have:
                backend.load_adapter(name, path)
        for name in have - set(model.adapters):
            backend.unload_adapter(name)

    def _make_room(self, model: ServedModel) -> list[Backend]:
        """Under the lock: take the least recently used idle models out until ``model``
        fits the budget (their backends, to close outside the lock); a 503 where it
        cannot fit even then."""
        if self.budget_bytes is None:
            return []
        need = model.estimate()
        held = [m for m in self.models.values() if m.backend is not None or m.loading]
        used = sum(m.estimate() for m in held)
        idle = sorted(
            (m for m in held if m.backend is not None and not m.users), key=lambda m: m.last_used
        )
        taken: list[Backend] = []
        while used + need > self.budget_bytes and idle:
            victim = idle.pop(0)
            taken.append(victim.backend)  # type: ignore[arg-type]
            victim.backend = None
            used -= victim.estimate()
            log.info("models.evicted", model=victim.name, for_model=model.name)
        if used + need > self.budget_bytes:
            busy = [m.name for m in held if m.backend is not None and m.backend not in taken]
            raise ApiError(
                503,
                f"the model {model.name!r} needs about {need >> 20} MB and the memory budget "
                f"({self.budget_bytes >> 20} MB) is held by models in use ({', '.join(busy)}); "
                "retry when they finish",
                kind="server_error",
                code="model_does_not_fit",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return taken

    def _take_if_expired(self, model: ServedModel, now: float) -> list[Backend]:
        idle_for = now - model.last_used
        if model.backend is None or model.users or model.keep_alive_s < 0:
            return []
        if idle_for < model.keep_alive_s:
            return []
        taken, model.backend = [model.backend], None
        log.info("models.unloaded", model=model.name, idle_s=round(idle_for, 1))
        return taken

    @staticmethod
    def _close(backends: list[Backend]) -> None:
        """Close each of ``backends``, taken out of the list: its references are their
        last, gone before the collector's pass."""
        if not backends:
            return
        while backends:
            backends.pop(0).close()
        collector.collect_unloaded()
        release_freed_memory()


def _adapter_bytes(backend: Backend) -> int:
    """The bytes of the LoRA adapters the backend holds in memory."""
    usage = backend.stats().adapters
    return 0 if usage is None else usage.nbytes


def _load_failed(model: ServedModel) -> ApiError:
    return ApiError(
        500,
        f"the model {model.name!r} failed to load: {model.error}",
        kind="server_error",
        code="model_load_failed",
    )
