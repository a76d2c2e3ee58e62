"""`CodecKVCache`: the protocol's per-sequence cache for the built-in compression methods.

Each layer keeps its K and V records in growing buffers under its own lock, so layers
can be stored and read from several threads at once.
"""

import threading

import torch

from ..memory import grown
from .attention import CodecPair, attend_records, decode_records
from .protocol import AttendConfig, DequantResult, Fused, KVGeometry


class LayerRecords:
    """One layer's K and V records ``[capacity, kv_heads, bytes]`` and how many are used."""

    def __init__(self, geometry: KVGeometry, pair: CodecPair) -> None:
        heads, device = geometry.num_kv_heads, geometry.device
        self.keys = torch.empty((0, heads, pair.key.record_bytes), dtype=torch.uint8, device=device)
        self.values = torch.empty(
            (0, heads, pair.value.record_bytes), dtype=torch.uint8, device=device
        )
        self.length = 0
        self.lock = threading.Lock()

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        end = self.length + keys.shape[0]
        self._reserve(end)
        self.keys[self.length : end] = keys
        self.values[self.length : end] = values
        self.length = end

    def copy_from(self, source: "LayerRecords", length: int) -> None:
        self._reserve(length)
        self.keys[:length] = source.keys[:length]
        self.values[:length] = source.values[:length]
        self.length = length

    def used(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[: self.length], self.values[: self.length]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def _reserve(self, tokens: int) -> None:
        self.keys = grown(self.keys, tokens, self.length)
        self.values = grown(self.values, tokens, self.length)


class CodecKVCache:
    """`CompressedKVCache` (and `ResizableKVCache`) over a pair of vector codecs."""

    def __init__(self, pair: CodecPair, geometry: KVGeometry) -> None:
        self.pair, self.geometry = pair, geometry
        self.layers = [LayerRecords(geometry, pair) for _ in range(geometry.num_layers)]

    def prefill(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor
    ) -> DequantResult:
        records = self.layers[layer]
        with records.lock:
            self._store(layer, records, k, v)
            keys, values = records.used()
            k_all = self.pair.key.dequantize(layer, keys)
            v_all = self.pair.value.dequantize(layer, values)
            bias = self.pair.key.logit_bias(layer, q, keys)
        return DequantResult(k_all.to(k.dtype), v_all.to(v.dtype), bias)

    def decode(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, config: AttendConfig
    ) -> Fused:
        records = self.layers[layer]
        with records.lock:
            self._store(layer, records, k, v)
            keys, values = records.used()
            out = decode_records(
                self.geometry.native,
                self.pair,
                layer,
                q,
                records.keys,
                records.values,
                torch.arange(records.length, device=q.device).unsqueeze(0),
                torch.tensor([records.length]),
                config.scoring,
            )
            if out is not None:
                return Fused(out)
            out = attend_records(
                self.pair,
                layer,
                q,
                keys,
                values,
                config.scoring,
                context_len=records.length - q.shape[0],
            )
        return Fused(out)

    def seq_len(self, layer: int) -> int:
        return self.layers[layer].length

    def reset(self) -> None:
        for records in self.layers:
            with records.lock:
                records.length = 0

    def memory_usage(self) -> int:
        return sum(records.nbytes for records in self.layers)

    def truncate(self, length: int) -> None:
        for records in self.layers:
            with records.lock:
                records.length = min(records.length, length)

    def copy_prefix(self, source: "CodecKVCache", length: int) -> None:
        self.pair = source.pair.fork()  # read the copied records as they were written
        for mine, theirs in zip(self.layers, source.layers, strict=True):
            with mine.lock, theirs.lock:
                mine.copy_from(theirs, length)

    def _store(self, layer: int, records: LayerRecords, k: torch.Tensor, v: torch.Tensor) -> None:
        records.append(self.pair.key.encode(layer, k), self.pair.value.encode(layer, v))
