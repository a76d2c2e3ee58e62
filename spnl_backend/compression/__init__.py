"""Compressed KV caches: the CompressedKVCache protocol, the cache factory, the methods.

``MISTRALRS_KV_CACHE_COMPRESSION`` names a method (`compressor_names()`); `none` keeps
the plain cache. See `registry` for adding a method from another package.

The names below load on first use: settings check a method's name against `registry`,
which sits below them, and importing this package must not pull the codecs and kernels
(which themselves read settings) into that check.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what `__getattr__` hands out, for type checkers
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
    from .registry import (
        ENTRY_POINT_GROUP,
        Compressor,
        compressor_names,
        get_compressor,
        plugin_failures,
        refresh_plugins,
    )
    from .sizes import method_bytes_per_token

_SUBMODULES = ("attention", "builtin", "cache", "codecs", "polar", "protocol", "registry", "sizes")
_EXPORTS = {
    "CodecPair": "attention",
    "CodecKVCache": "cache",
    "Fp8Codec": "codecs",
    "Int8Codec": "codecs",
    "VectorCodec": "codecs",
    "PolarCodec": "polar",
    "AttendConfig": "protocol",
    "CompressedKVCache": "protocol",
    "DecodeOutput": "protocol",
    "Dequantized": "protocol",
    "DequantResult": "protocol",
    "Fused": "protocol",
    "KVGeometry": "protocol",
    "ResizableKVCache": "protocol",
    "ENTRY_POINT_GROUP": "registry",
    "Compressor": "registry",
    "compressor_names": "registry",
    "get_compressor": "registry",
    "plugin_failures": "registry",
    "refresh_plugins": "registry",
    "method_bytes_per_token": "sizes",
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
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})
