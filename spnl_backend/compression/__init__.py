"""Compressed KV caches: the CompressedKVCache protocol, the cache factory, the methods.

``MISTRALRS_KV_CACHE_COMPRESSION`` names a method (`compressor_names()`); `none` keeps
the plain cache. See `registry` for adding a method from another package.

The names below load on first use: settings check a method's name against `registry`,
which sits below them, and importing this package must not pull the codecs and kernels
(which themselves read settings) into that check.
"""

import importlib

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

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
