"""The compression methods that ship with the package.

Keys reach every attention score, values are only averaged, so the PolarQuant methods
give keys one more bit: ``tqB`` stores values in B bits and keys in B + 1, with a few of
each key's largest coordinates kept exactly; ``tqB-qjl`` spends the key's extra bit on
the QJL residual correction instead (B bits of codes + 1 sign bit per coordinate). They
centre on the model's K/V means over a reference text (`Compressor.calibrated`).
Measured on the default model (perplexity over 4,096 tokens of bench/data/english.txt,
K/V passed through the codecs): 5-bit keys + 2 outliers with 4-bit values cost +2.2% with
centres from the text itself; the calibrated centres, the anchor and 5 outliers bring
that to +1.5% (+1.7% to +2.0% with other rotation seeds), at 30.0% of a 16-bit cache.
bench/kv_compression.py measures them through the engine.
"""

from ..compressors import Compressor
from .attention import CodecPair
from .cache import CodecKVCache
from .codecs import Fp8Codec, Int8Codec
from .polar import PolarCodec
from .protocol import KVGeometry


def _fp8(g: KVGeometry) -> CodecPair:
    absmax = [None, None] if g.kv_absmax is None else g.kv_absmax.T.tolist()
    return CodecPair(
        Fp8Codec(g.num_layers, g.head_dim, absmax[0]),
        Fp8Codec(g.num_layers, g.head_dim, absmax[1]),
    )


def _int8(g: KVGeometry) -> CodecPair:
    return CodecPair(Int8Codec(g.head_dim), Int8Codec(g.head_dim))


def _polar(value_bits: int, qjl: bool, key_outliers: int):
    key_bits = value_bits if qjl else value_bits + 1

    def make(g: KVGeometry) -> CodecPair:
        means = (None, None) if g.kv_means is None else (g.kv_means[:, 0], g.kv_means[:, 1])
        key = PolarCodec(
            g.num_layers,
            g.head_dim,
            key_bits,
            g.device,
            qjl=qjl,
            outliers=key_outliers,
            centers=means[0],
        )
        value = PolarCodec(g.num_layers, g.head_dim, value_bits, g.device, centers=means[1])
        return CodecPair(key, value)

    return make


def _codec_method(name: str, summary: str, make_codecs, calibrated: bool = False) -> Compressor:
    return Compressor(
        name,
        summary,
        make_cache=lambda g: CodecKVCache(make_codecs(g), g),
        make_codecs=make_codecs,
        calibrated=calibrated,
    )


BUILT_IN = (
    _codec_method("fp8", "float8_e4m3fn, one scale per layer and tensor", _fp8, calibrated=True),
    _codec_method("int8", "int8, one scale per token and head", _int8),
    _codec_method(
        "tq4",
        "PolarQuant, values 4-bit, keys 5-bit + 5 outliers",
        _polar(4, False, 5),
        calibrated=True,
    ),
    _codec_method(
        "tq3",
        "PolarQuant, values 3-bit, keys 4-bit + 12 outliers",
        _polar(3, False, 12),
        calibrated=True,
    ),
    _codec_method(
        "tq4-qjl",
        "TurboQuant, values 4-bit, keys 4-bit + 1-bit QJL + 2 outliers",
        _polar(4, True, 2),
        calibrated=True,
    ),
    _codec_method(
        "tq3-qjl",
        "TurboQuant, values 3-bit, keys 3-bit + 1-bit QJL + 12 outliers",
        _polar(3, True, 12),
        calibrated=True,
    ),
)
