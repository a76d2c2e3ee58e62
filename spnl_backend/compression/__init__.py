"""Compressed KV caches: the CompressedKVCache protocol, the cache factory, the methods.

``MISTRALRS_KV_CACHE_COMPRESSION`` names a method (`compressor_names()`); `none` keeps
the plain cache. The registry of methods is `spnl_backend.compressors` (outside this
package, below settings, which check a method's name against it); see it for adding a
method from another package. Its names are handed out here too.

The names below load on first use: importing this package must not pull the codecs and
kernels into a caller that only wants a name.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what `__getattr__` hands out, for type checkers
    from ..compressors import (
        ENTRY_POINT_GROUP,
        Compressor,
        compressor_names,
        get_compressor,
        plugin_failures,
        refresh_plugins,
    )
    from .attention import CodecPair
    from .cache import CodecKVCache
    from .codecs import Fp8Codec, Int8Codec, VectorCodec
    from .polar import PolarCodec
    from .protocol import (
        AttendConfig,
        CompressedKVCache,
        DecodeOutput,
        Dequantized,
        DequantResult,
        Fused,
        KVGeometry,
        ResizableKVCache,
    )
    from .sizes import method_bytes_per_token

_SUBMODULES = ("attention", "builtin", "cache", "codecs", "polar", "protocol", "sizes")
# Each name's module, relative to this package.
_EXPORTS = {
    "CodecPair": ".attention",
    "CodecKVCache": ".cache",
    "Fp8Codec": ".codecs",
    "Int8Codec": ".codecs",
    "VectorCodec": ".codecs",
    "PolarCodec": ".polar",
    "AttendConfig": ".protocol",
    "CompressedKVCache": ".protocol",
    "DecodeOutput": ".protocol",
    "Dequantized": ".protocol",
    "DequantResult": ".protocol",
    "Fused": ".protocol",
    "KVGeometry": ".protocol",
    "ResizableKVCache": ".protocol",
    "ENTRY_POINT_GROUP": "..compressors",
    "Compressor": "..compressors",
    "compressor_names": "..compressors",
    "get_compressor": "..compressors",
    "plugin_failures": "..compressors",
    "refresh_plugins": "..compressors",
    "method_bytes_per_token": ".sizes",
}

__all__ = [
    "ENTRY_POINT_GROUP",
    "AttendConfig",
    "CodecKVCache",
    "CodecPair",
    "CompressedKVCache",
    "Compressor",
    "DecodeOutput",
    "DequantResult",
    "Dequantized",
    "Fp8Codec",
    "Fused",
    "Int8Codec",
    "KVGeometry",
    "PolarCodec",
    "ResizableKVCache",
    "VectorCodec",
    "compressor_names",
    "get_compressor",
    "method_bytes_per_token",
    "plugin_failures",
    "refresh_plugins",
]


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})
