"""Compressed KV caches: the CompressedKVCache protocol, the cache factory, the methods.

``MISTRALRS_KV_CACHE_COMPRESSION`` names a method (`compressor_names()`); `none` keeps
the plain cache. See `registry` for adding a method from another package.
"""

import torch

from . import builtin  # noqa: F401  (registers the built-in methods)
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
    register_compressor,
)


def kv_bytes_per_token(name: str, config, dtype: torch.dtype = torch.float16) -> int | None:
    """K and V bytes per token of a model (``num_layers``, ``num_kv_heads``, ``head_dim``)
    with method ``name``; ``none`` gives the plain cache in ``dtype`` (16-bit by default)."""
    geometry = KVGeometry(
        config.num_layers, config.num_kv_heads, config.head_dim, dtype, torch.device("cpu")
    )
    compressor = get_compressor(name)
    if compressor is None:
        from ..engine.budget import kv_bytes_per_token as plain_bytes_per_token

        return plain_bytes_per_token(config, dtype)
    return compressor.bytes_per_token(geometry)


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
    "kv_bytes_per_token",
    "plugin_failures",
    "refresh_plugins",
    "register_compressor",
]
