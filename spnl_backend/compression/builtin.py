"""The compression methods that ship with the package.

``tqB`` is PolarQuant at B bits for keys and values; ``tqB-qjl`` spends one of the key's
B bits on the QJL residual correction (B-1 bits of codes + 1 sign bit per coordinate)
and keeps B bits for values, which are summed, not dotted, and gain nothing from QJL.
"""

from .attention import CodecPair
from .cache import CodecKVCache
from .codecs import Fp8Codec, Int8Codec
from .polar import PolarCodec
from .protocol import KVGeometry
from .registry import Compressor, register_compressor


def _fp8(g: KVGeometry) -> CodecPair:
    return CodecPair(Fp8Codec(g.num_layers, g.head_dim), Fp8Codec(g.num_layers, g.head_dim))


def _int8(g: KVGeometry) -> CodecPair:
    return CodecPair(Int8Codec(g.head_dim), Int8Codec(g.head_dim))


def _polar(key_bits: int, value_bits: int, qjl: bool):
    def make(g: KVGeometry) -> CodecPair:
        return CodecPair(
            PolarCodec(g.head_dim, key_bits, g.device, qjl=qjl),
            PolarCodec(g.head_dim, value_bits, g.device),
        )

    return make


def _codec_method(name: str, summary: str, make_codecs) -> Compressor:
    return Compressor(
        name,
        summary,
        make_cache=lambda g: CodecKVCache(make_codecs(g), g),
        make_codecs=make_codecs,
    )


BUILT_IN = (
    _codec_method("fp8", "float8_e4m3fn, one scale per layer and tensor", _fp8),
    _codec_method("int8", "int8, one scale per token and head", _int8),
    _codec_method("tq4", "PolarQuant, 4-bit codes after a random rotation", _polar(4, 4, False)),
    _codec_method("tq3", "PolarQuant, 3-bit codes after a random rotation", _polar(3, 3, False)),
    _codec_method(
        "tq4-qjl", "TurboQuant, keys 3-bit + 1-bit QJL, values 4-bit", _polar(3, 4, True)
    ),
    _codec_method(
        "tq3-qjl", "TurboQuant, keys 2-bit + 1-bit QJL, values 3-bit", _polar(2, 3, True)
    ),
)

for _compressor in BUILT_IN:
    register_compressor(_compressor)
