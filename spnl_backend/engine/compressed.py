"""Compressed KV caches in the engine: per-sequence protocol caches and the coded block pool.

Non-paged mode wraps each sequence's `CompressedKVCache` as a store of the contiguous
cache manager (`ProtocolKV`). Paged mode keeps the methods' records in the block pool
(`CodedPagedKVCache`): a block holds ``block_size`` tokens' K and V records, written
through the slot mapping like the plain pool, so block tables, prefix caching,
preemption and batching are the same as without compression.
"""

import hashlib

import torch

from ..compression import (
    AttendConfig,
    CodecPair,
    CompressedKVCache,
    DequantResult,
    Fused,
    ResizableKVCache,
)
from ..compression.attention import attend_records, decode_records, first_visible
from ..kernels import AttentionKernels, check_step_slots
from ..kernels.attention_ref import attention_ref
from ..kernels.cpu import CpuKernels
from ..kernels.metadata import PagedMetadata
from ..models.config import ModelConfig
from ..models.step_attention import AttentionSpec, WithoutLayerBlocks


class ProtocolKV:
    """A sequence's store of the contiguous cache manager, over a protocol cache."""

    def __init__(self, cache: CompressedKVCache, method: str) -> None:
        self.cache, self.method = cache, method

    def reserve(self, num_tokens: int, used: int) -> None:
        """The method grows its own storage."""

    def copy_prefix(self, source: "ProtocolKV", length: int) -> None:
        self._resizable("reuse a cached prefix").copy_prefix(source.cache, length)  # type: ignore[arg-type]

    def truncate(self, length: int) -> None:
        if self.cache.seq_len(0) > length:
            self._resizable("drop rejected draft tokens").truncate(length)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        context_len: int,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        layer = spec.layer
        stored = self.cache.seq_len(layer)
        if stored != context_len:
            raise RuntimeError(
                f"the {self.method!r} KV cache holds {stored} tokens of layer {layer}, "
                f"but this step continues after {context_len}"
            )
        if q.shape[0] == 1 and context_len > 0:
            config = AttendConfig.of(spec.scoring, spec.num_kv_groups)
            output = self.cache.decode(layer, k, v, q, config)
            if isinstance(output, Fused):
                return self._checked(output.output, q.shape, "decode output")
            result = output.result
        else:
            result = self.cache.prefill(layer, k, v, q)
        return self._attend_dequantized(q, result, context_len, spec)

    def _attend_dequantized(
        self, q: torch.Tensor, result: DequantResult, context_len: int, spec: AttentionSpec
    ) -> torch.Tensor:
        total = context_len + q.shape[0]
        keys_shape = (total, *result.k.shape[1:])
        bias = result.logit_bias
        return attention_ref(
            q,
            self._checked(result.k, keys_shape, "dequantized K").to(q.dtype),
            self._checked(result.v, keys_shape, "dequantized V").to(q.dtype),
            spec.scoring,
            context_len=context_len,
            logit_bias=None if bias is None else bias * spec.scoring.scale,
        )

    def _checked(self, tensor: torch.Tensor, shape: tuple, what: str) -> torch.Tensor:
        if tuple(tensor.shape[: len(shape)]) != tuple(shape):
            raise RuntimeError(
                f"the {self.method!r} KV cache returned {what} of shape {tuple(tensor.shape)}; "
                f"expected {tuple(shape)}"
            )
        return tensor

    def _resizable(self, purpose: str) -> ResizableKVCache:
        if not isinstance(self.cache, ResizableKVCache):
            raise RuntimeError(
                f"the {self.method!r} KV cache cannot {purpose}: it has no truncate/copy_prefix"
            )
        return self.cache


class CodedPagedKVCache:
    """The block pool holding a method's records: K ``[layers, blocks, block_size,
    kv_heads, key_bytes]`` and V likewise, uint8."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        pair: CodecPair,
        device: torch.device,
    ) -> None:
        shape = (config.num_kv_layers, num_blocks, block_size, config.num_kv_heads)
        self.pair = pair
        self.keys = torch.zeros((*shape, pair.key.record_bytes), dtype=torch.uint8, device=device)
        self.values = torch.zeros(
            (*shape, pair.value.record_bytes), dtype=torch.uint8, device=device
        )

    @property
    def bytes_per_token(self) -> int:
        layers, _, _, heads = self.keys.shape[:4]
        return self.pair.bytes_per_token(layers, heads)

    def step(self, kernels: AttentionKernels, meta: PagedMetadata) -> "CodedPagedStep":
        return CodedPagedStep(self, meta, kernels.native)

    def tier_layout(self) -> dict[str, object]:
        """What a block's bytes are (`block_bytes`), for the KV tier's fingerprint: the
        records' shapes and each codec's whole state (a `ValueError` where a codec's state
        is not fixed yet: set by the first vectors this process stores, its records would
        mean something else to another process)."""
        shapes = [list(self.keys[:, 0].shape), list(self.values[:, 0].shape)]
        return {
            "records": shapes,
            "codecs": [_state_digest(self.pair.key), _state_digest(self.pair.value)],
        }

    def block_bytes(self, block_id: int) -> torch.Tensor:
        """A copy of block ``block_id``'s K and V records, every layer's."""
        keys, values = self.keys[:, block_id], self.values[:, block_id]
        return torch.cat([keys.reshape(-1), values.reshape(-1)]).cpu()

    def load_block(self, block_id: int, data: torch.Tensor) -> None:
        """Block ``block_id`` set from `block_bytes`'s bytes."""
        keys, values = self.keys[:, block_id], self.values[:, block_id]
        split = keys.numel()
        keys.copy_(data[:split].reshape(keys.shape).to(keys.device))
        values.copy_(data[split:].reshape(values.shape).to(values.device))


class CodedPagedStep(WithoutLayerBlocks):
    """Encode this step's K/V into their slots, then attend each sequence over its blocks."""

    def __init__(
        self, cache: CodedPagedKVCache, meta: PagedMetadata, native: CpuKernels | None
    ) -> None:
        self.cache, self.meta, self.native = cache, meta, native

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        layer, pair, meta = spec.layer, self.cache.pair, self.meta
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        keep, slots = meta.written_slots
        if keep is not None:
            k, v = k[keep], v[keep]
        keys.flatten(0, 1)[slots] = pair.key.encode(layer, k)
        values.flatten(0, 1)[slots] = pair.value.encode(layer, v)
        if meta.is_decode and self.native is not None:
            check_step_slots(meta, keys)
            lens = meta.memo("seq_lens_i64", lambda: torch.tensor(meta.seq_lens))
            out = decode_records(
                self.native,
                pair,
                layer,
                q,
                keys.flatten(0, 1),
                values.flatten(0, 1),
                meta.decode_slots,
                lens,
                spec.scoring,
            )
            if out is not None:
                return out
        out = torch.empty_like(q)
        start = 0
        for index, (seq_len, query_len) in enumerate(
            zip(meta.seq_lens, meta.query_lens, strict=True)
        ):
            end = start + query_len
            context_len = seq_len - query_len
            skip = first_visible(context_len, spec.scoring.window) // meta.block_size
            table = meta.block_tables[index, skip : -(-seq_len // meta.block_size)]
            held = seq_len - skip * meta.block_size
            out[start:end] = attend_records(
                pair,
                layer,
                q[start:end],
                keys[table].flatten(0, 1)[:held],
                values[table].flatten(0, 1)[:held],
                spec.scoring,
                context_len=held - query_len,
            )
            start = end
        return out


def _state_digest(codec: object) -> str:
    """SHA-256 of a codec's type and every attribute (tensors by their bytes)."""
    digest = hashlib.sha256(type(codec).__qualname__.encode())
    for name, value in sorted(vars(codec).items()):
        items = value if isinstance(value, list | tuple) else [value]
        if any(item is None for item in items) and isinstance(value, list):
            raise ValueError(f"{type(codec).__name__}.{name} is set by the first stored vectors")
        digest.update(name.encode())
        for item in items:
            if isinstance(item, torch.Tensor):
                digest.update(str(item.dtype).encode() + str(tuple(item.shape)).encode())
                digest.update(
                    item.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                )
            else:
                digest.update(repr(item).encode())
    return digest.hexdigest()
