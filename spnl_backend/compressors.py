"""The cache factory: compression methods by name, built in or added by other packages.

A package adds a method without touching this one by declaring an entry point in the
``spnl_backend.kv_cache_compressors`` group, named as users will spell it in
``MISTRALRS_KV_CACHE_COMPRESSION``; it points at a `Compressor`, or at a callable that
takes a `KVGeometry` and returns a `CompressedKVCache`::

    [project.entry-points."spnl_backend.kv_cache_compressors"]
    mymethod = "my_package.kv:make_cache"

A method with ``make_codecs`` also gets the paged block pool (its records are stored in
the blocks, so prefix caching and batching keep working); one without runs one protocol
cache per sequence, in non-paged mode.
"""

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from .log import get_logger

if TYPE_CHECKING:
    from .compression.attention import CodecPair
    from .compression.protocol import CompressedKVCache, KVGeometry

log = get_logger()

ENTRY_POINT_GROUP = "spnl_backend.kv_cache_compressors"
NONE = "none"
# The methods that ship with the package, defined in `BUILT_IN_MODULE` and loaded on first
# use like a plugin's: the registry lives outside the `compression` package and imports
# nothing above it, so settings can check a name against it without importing torch, the
# kernels or the codecs (which read settings themselves: no cycle).
BUILT_IN_NAMES = ("fp8", "int8", "tq4", "tq3", "tq4-qjl", "tq3-qjl")
BUILT_IN_MODULE = "spnl_backend.compression.builtin"


@dataclass(frozen=True)
class Compressor:
    name: str
    summary: str
    make_cache: Callable[["KVGeometry"], "CompressedKVCache"]
    make_codecs: Callable[["KVGeometry"], "CodecPair"] | None = None
    # The engine measures `KVGeometry.kv_means` for it (one forward pass at load).
    calibrated: bool = False

    def bytes_per_token(self, geometry: "KVGeometry") -> int | None:
        """K and V of every layer for one token, where the record size is known."""
        if self.make_codecs is None:
            return None
        pair = self.make_codecs(geometry)
        return pair.bytes_per_token(geometry.num_layers, geometry.num_kv_heads)


@cache
def _built_in() -> dict[str, Compressor]:
    methods = {c.name: c for c in importlib.import_module(BUILT_IN_MODULE).BUILT_IN}
    if tuple(methods) != BUILT_IN_NAMES:
        raise RuntimeError(f"{BUILT_IN_MODULE} defines {tuple(methods)}, not {BUILT_IN_NAMES}")
    return methods


@cache
def _plugins() -> tuple[dict[str, Compressor], dict[str, str]]:
    """The entry points' compressors, and why each one that failed to load failed."""
    found: dict[str, Compressor] = {}
    failed: dict[str, str] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        name = point.name.lower()
        try:
            found[name] = _as_compressor(name, point.value, point.load())
        except (Exception, SystemExit) as exc:  # a broken plugin must not break the others
            failed[name] = f"{point.value}: {type(exc).__name__}: {exc}"
            log.warning("kv_compression.plugin_failed", name=name, reason=failed[name])
    return found, failed


def _as_compressor(name: str, target: str, loaded: object) -> Compressor:
    if name == NONE or name in BUILT_IN_NAMES:
        raise ValueError(f"{name!r} is the name of a built-in method")
    if isinstance(loaded, Compressor):
        return dataclasses.replace(loaded, name=name)
    if callable(loaded):
        return Compressor(name, f"plugin {target}", make_cache=loaded)  # type: ignore[arg-type]
    raise TypeError(
        "the entry point must name a Compressor or a callable taking a KVGeometry and "
        f"returning a CompressedKVCache, not a {type(loaded).__name__}"
    )


def refresh_plugins() -> None:
    """Look for entry points again (after installing a plugin in a running process)."""
    _plugins.cache_clear()


def compressor_names() -> tuple[str, ...]:
    """Every usable method's name: none, the built-in ones, then the plugins that loaded."""
    return (NONE, *BUILT_IN_NAMES, *_plugins()[0])


def plugin_failures() -> dict[str, str]:
    return dict(_plugins()[1])


def get_compressor(name: str) -> Compressor | None:
    """The method registered as ``name``; None for ``none``."""
    if name == NONE:
        return None
    try:
        return _built_in()[name] if name in BUILT_IN_NAMES else _plugins()[0][name]
    except KeyError:
        raise KeyError(
            f"no KV-cache compressor named {name!r}; registered: " + ", ".join(compressor_names())
        ) from None
