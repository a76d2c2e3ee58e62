"""The LoRA adapters a backend knows, and the ones it holds in memory.

An adapter is known by name once loaded (at start, or at run time through
`Backend.load_adapter`) until it is unloaded. At most ``max_loaded`` of them
(``MISTRALRS_LORA_MAX_LOADED``; 0: no bound) are held on the model at once: holding
another first evicts the least recently used one that no unfinished request runs with, and
an evicted adapter is read again from its path when a request asks for it. Every change
happens on the engine loop's thread, between steps; ``listed`` is a snapshot other threads
may read at any time.
"""

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass

from ..errors import AdapterInUseError, RequestError
from ..log import get_logger
from ..models.lora import AdapterInfo, LoraAdapter, LoraAdapters
from ..models.transformer import CausalLM

log = get_logger()

Reader = Callable[[str, str, CausalLM], LoraAdapter]  # (name, path, model): read, checked


@dataclass(frozen=True)
class AdapterUsage:
    """Adapters known, held in memory (and their bytes), and the bound on those held."""

    known: int
    loaded: int
    nbytes: int
    max_loaded: int  # 0: no bound


class AdapterRegistry:
    """An engine's adapters: ``known`` by name (what each was when last read, and whether
    it is held now), the held ones on the model (`models.lora.LoraAdapters`)."""

    def __init__(self, model: CausalLM, read: Reader, max_loaded: int = 0) -> None:
        self.model, self.read, self.max_loaded = model, read, max_loaded
        self.known: dict[str, AdapterInfo] = {}  # in load order (llama-server's ids)
        self.listed: tuple[AdapterInfo, ...] = ()

    @property
    def held(self) -> LoraAdapters:
        """The adapters on the model. The native layer blocks add the adapters' products
        at each projection with the kernel the per-op path calls (`models.native_blocks`),
        so a row's arithmetic is the same on either path, whatever shares its step."""
        if self.model.adapters is None:
            self.model.adapters = LoraAdapters()
        return self.model.adapters

    def add(self, adapter: LoraAdapter, in_use: Collection[str]) -> AdapterInfo:
        """Know ``adapter`` by its name and hold it, if room can be made (else it is read
        again when a request asks for it)."""
        if adapter.name in self.known:
            raise RequestError(
                f"a LoRA adapter named {adapter.name!r} is loaded already; unload it first"
            )
        held = self._make_room(in_use)
        if held:
            self.held.attach(self.model, adapter)
        self.known[adapter.name] = AdapterInfo.of(adapter, held)
        self._list()
        return self.known[adapter.name]

    def remove(self, name: str, in_use: Collection[str]) -> None:
        """Forget ``name``: an `AdapterInUseError` while unfinished requests run with it."""
        self.check_known(name)
        running = sum(1 for used in in_use if used == name)
        if running:
            raise AdapterInUseError(
                f"the LoRA adapter {name!r} is in use by {running} unfinished request(s); "
                "unload it once they finish"
            )
        if self.model.adapters is not None and self.model.adapters.find(name):
            self.model.adapters.detach(self.model, name)
        del self.known[name]
        self._list()
        log.info("lora.unloaded", adapter=name)

    def acquire(self, name: str, in_use: Collection[str]) -> tuple[int, int]:
        """The slot and hash root of adapter ``name``, held (read again if it was
        evicted), marked as used last."""
        self.check_known(name)
        held = self.held
        found = held.find(name)
        if found is None:
            if not self._make_room(in_use):
                raise RequestError(
                    f"adapter={name!r}: the {self.max_loaded} adapters held in memory "
                    "(MISTRALRS_LORA_MAX_LOADED) are all in use by unfinished requests; "
                    "retry when one finishes, or raise the bound"
                )
            adapter = self.read(name, self.known[name].path, self.model)
            held.attach(self.model, adapter)
            self.known[name] = AdapterInfo.of(adapter)
            self._list()
            log.info("lora.reloaded", adapter=name)
            found = held.find(name)
            assert found is not None
        held.touch(name)
        slot, adapter = found
        return slot, adapter.root

    def check_known(self, name: str) -> None:
        if name not in self.known:
            loaded = ", ".join(self.known) or "none"
            raise RequestError(
                f"adapter={name!r}: no LoRA adapter of that name is loaded (loaded: {loaded}; "
                "MISTRALRS_LORA_ADAPTERS names them, or load one at run time)"
            )

    def usage(self) -> AdapterUsage:
        held = self.model.adapters
        loaded, nbytes = (0, 0) if held is None else (len(held), held.nbytes)
        return AdapterUsage(len(self.known), loaded, nbytes, self.max_loaded)

    def _make_room(self, in_use: Collection[str]) -> bool:
        """Evict least recently used idle adapters until one more fits the bound; False
        where every held one is in use."""
        if not self.max_loaded:
            return True
        held = self.held
        busy = set(in_use)
        for name in held.names():  # least recently used first
            if len(held) < self.max_loaded:
                break
            if name not in busy:
                held.detach(self.model, name)
                self.known[name] = dataclasses.replace(self.known[name], loaded=False)
                log.info("lora.evicted", adapter=name)
        self._list()
        return len(held) < self.max_loaded

    def _list(self) -> None:
        self.listed = tuple(self.known.values())
