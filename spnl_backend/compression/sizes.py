"""What a token's K and V take under a compression method."""

import torch

from ..compressors import get_compressor
from ..memory import KVShape, kv_bytes_per_token
from .protocol import KVGeometry


def method_bytes_per_token(
    name: str, config: KVShape, dtype: torch.dtype = torch.float16
) -> int | None:
    """K and V bytes per token of a model with method ``name`` (None where the method's
    record size is not known); ``none`` gives the plain cache in ``dtype`` (16-bit by
    default), by `memory.kv_bytes_per_token`."""
    compressor = get_compressor(name)
    if compressor is None:
        return kv_bytes_per_token(config, dtype)
    geometry = KVGeometry(
        config.num_kv_layers, config.num_kv_heads, config.head_dim, dtype, torch.device("cpu")
    )
    return compressor.bytes_per_token(geometry)
