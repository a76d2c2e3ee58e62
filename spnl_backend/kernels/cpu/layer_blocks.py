"""The native layer blocks' step (``layer_blocks.c``): a decoder's layers as two calls each,
the attention block and the MLP block (which starts with the gated activation).

`models.native_blocks` reads the model into each layer's fixed arguments (`LayerArgs`);
this module checks a step's tensors and pools, lays out its buffers and runs every layer,
all in one native call (``spnl_layers``).
"""

import ctypes
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..sets import NativeKeys
from .abi import LayerArgs, StepArgs
from .checks import KernelArgumentError, check_keys, pool_row, require
from .moe import NativeMoe, scratch
from .wrappers import CpuKernels

# The most tokens of a step whose working buffers are kept for the next: a decode batch's
# (at 8B sizes 64 tokens' are 16 MB).
KEEP_TOKENS = 64


class RotaryTables(Protocol):
    """One step's rotary tables (`models.rope.RotaryTables`): ``[T, 1, rotary_dim]``."""

    cos: torch.Tensor
    sin: torch.Tensor


@dataclass
class LayerStack:
    """Every layer's fixed arguments, over one model's shapes: what a step runs (`run`).
    ``moe``: one of its MoE layers (every one has the same shapes), whose scratch all of
    them take."""

    native: CpuKernels
    hidden: int
    inner: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: list[LayerArgs]
    moe: NativeMoe | None = None
    pools_key: tuple | None = field(default=None, init=False)  # the pools' addresses, dtype, shape
    # The pools last set (slot counts, weak references): the same live tensors again need
    # no new check.
    pools_seen: tuple | None = field(default=None, init=False, repr=False)
    # A decode step's working buffers, kept for the next step of as many tokens: a step
    # finds its code and data out of the caches (the products stream the weights through
    # them), so every allocation it skips is a few microseconds saved.
    kept: tuple[int, dict[str, int], list[torch.Tensor]] | None = field(
        default=None, init=False, repr=False
    )

    def __post_init__(self) -> None:
        # One array of the layers' arguments, which a step hands to C whole; ``layers``
        # become its elements (a change to one is the array's), the structs they were
        # copied from kept with what they point into.
        self.array = (LayerArgs * len(self.layers))(*self.layers)
        self.copied_from = self.layers
        self.layers = [self.array[i] for i in range(len(self.array))]
        self._failed = ctypes.c_int64(-1)

    def run(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        tables: Sequence[RotaryTables],
        keys: NativeKeys,
        pools: list[tuple[torch.Tensor, torch.Tensor]],
        lora_groups: ctypes.Array | None = None,
    ) -> torch.Tensor:
        """Every layer over ``x`` (the residual stream, updated in place) and ``h`` (its norm
        by the first layer's input norm) → the final norm's output; ``lora_groups``: the
        step's rows of LoRA adapters (`kernels.cpu.lora.lora_groups`), each layer's tables
        set in its arguments by the caller."""
        tokens = x.shape[0]
        self._check_step(x, h, tables, keys)
        window_slots = None if keys.window_pool is None else keys.window_pool[1]
        self._set_pools(pools, keys.num_slots, window_slots)
        addresses, _held = self._buffers(tokens)  # held through the layers' calls
        step = StepArgs(
            tokens=tokens,
            x=x.data_ptr(),
            h=h.data_ptr(),
            **addresses,
            slot_mapping=keys.slot_mapping.data_ptr(),
            num_slots=keys.num_slots,
            threads=self.native.threads,
            exact=int(self.native.exact),
        )
        if lora_groups is not None and len(lora_groups):
            step.lora_groups, step.lora_count = lora_groups, len(lora_groups)
        if self.moe is not None:  # every MoE layer has the same shapes (checked at build)
            step.scratch, step.scratch_bytes = scratch(self.moe.scratch_bytes(tokens))
        at = step.at
        at.slots, at.slot_stride, at.slot_width = (
            keys.slots.data_ptr(),
            keys.slots.stride(0),
            keys.slots.shape[1],
        )
        at.lens, at.seqs = keys.lens.data_ptr(), tokens
        if keys.windowed is not None:
            slots, lens, firsts = keys.windowed
            windowed = step.at_windowed
            windowed.slots, windowed.slot_stride, windowed.slot_width = (
                slots.data_ptr(),
                slots.stride(0),
                slots.shape[1],
            )
            windowed.lens, windowed.seqs = lens.data_ptr(), tokens
            windowed.firsts = firsts.data_ptr()
            step.windowed = 1
        if keys.window_pool is not None:
            step.window_slot_mapping = keys.window_pool[0].data_ptr()
            step.window_num_slots = keys.window_pool[1]
        for i, table in enumerate(tables):
            step.cos[i], step.sin[i] = table.cos.data_ptr(), table.sin.data_ptr()
            step.rotary_dim[i] = table.cos.shape[-1]
        self.native.layers(step, self.array, self._failed)
        return h

    def _buffers(self, tokens: int) -> tuple[dict[str, int], list[torch.Tensor]]:
        """The step's working buffers (float32, written before they are read) and their
        addresses: those of the last step where it had as many tokens, up to `KEEP_TOKENS`
        (a prefill chunk's, tens of MB, are not kept)."""
        if self.kept is not None and self.kept[0] == tokens:
            return self.kept[1], self.kept[2]
        empty = lambda *shape: torch.empty(shape, dtype=torch.float32)  # noqa: E731
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        buffers = {
            "qkv": empty(tokens, q_size + 2 * kv_size),
            "q": empty(tokens, q_size),
            "kv": empty(2, tokens, kv_size),
            "attn": empty(tokens, q_size),
            "out": empty(tokens, self.hidden),
            "gate_up": empty(tokens, 2 * self.inner),
            "act": empty(tokens, self.inner),
        }
        addresses = {name: t.data_ptr() for name, t in buffers.items()}
        held = list(buffers.values())
        self.kept = (tokens, addresses, held) if tokens <= KEEP_TOKENS else None
        return addresses, held

    def _check_step(self, x, h, tables, keys: NativeKeys) -> None:
        """What the C code relies on, with the checks the single kernels make."""
        tokens = x.shape[0]
        for tensor, name in ((x, "x"), (h, "h")):
            require(
                tensor, torch.float32, f"layer blocks: {name}", dims=2, numel=tokens * self.hidden
            )
        for table in tables:
            for t in (table.cos, table.sin):
                require(t, torch.float32, "layer blocks: rotary table")
                if not (
                    t.shape == table.cos.shape
                    and t.shape[0] == tokens
                    and t.shape[-1] <= self.head_dim
                ):
                    raise KernelArgumentError(f"layer blocks: rotary table {tuple(t.shape)}")
        check_keys(keys.slots, keys.lens, tokens, "layer blocks")
        if keys.windowed is not None:
            check_keys(*keys.windowed[:2], tokens, "layer blocks", keys.windowed[2])
        require(keys.slot_mapping, torch.int64, "layer blocks: slot mapping", numel=tokens)
        if keys.window_pool is not None:
            if keys.windowed is None:
                raise KernelArgumentError("layer blocks: a windowed pool without its keys")
            mapping = keys.window_pool[0]
            require(mapping, torch.int64, "layer blocks: windowed slot mapping", numel=tokens)

    def _set_pools(
        self,
        pools: list[tuple[torch.Tensor, torch.Tensor]],
        num_slots: int,
        window_slots: int | None = None,
    ) -> None:
        """Each layer's pool pair, set again only when the pools are others; every pool is
        checked before any layer's pointers change. ``window_slots``: the slots of the
        windowed layers' own pool, where they keep one."""
        if len(pools) != len(self.layers):
            raise KernelArgumentError(
                f"layer blocks: {len(pools)} pools for {len(self.layers)} layers"
            )
        if self._same_pools(pools, num_slots, window_slots):
            return
        first = pools[0][0]
        slots = [
            window_slots if window_slots is not None and args.scoring.window > 0 else num_slots
            for args in self.layers
        ]
        shapes = tuple(k.shape for k, _ in pools)
        key = tuple((k.data_ptr(), v.data_ptr()) for k, v in pools), first.dtype, shapes
        if key == self.pools_key:
            self._seen(pools, num_slots, window_slots)
            return
        for pair, count in zip(pools, slots, strict=True):
            for pool in pair:  # every layer's pools alike but for its slot count
                if not (
                    pool.dtype is first.dtype
                    and pool.shape[0] * pool.shape[1] == count
                    and pool.shape[1:] == first.shape[1:]
                    and pool.shape[2:] == (self.kv_heads, self.head_dim)
                ):
                    raise KernelArgumentError(
                        f"layer blocks: a pool of {pool.dtype} {tuple(pool.shape)}"
                    )
            pool_row(*pair, "layer blocks")  # each a float pool the kernels read
        for args, (k_cache, v_cache) in zip(self.layers, pools, strict=True):
            args.k_cache, args.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            args.half = int(first.dtype is torch.float16)
        self.pools_key = key
        self._seen(pools, num_slots, window_slots)

    def _same_pools(self, pools: list, num_slots: int, window_slots: int | None) -> bool:
        """Whether ``pools`` are the very tensors set last, alive (weak references: a pool
        let go is not held here), for as many slots; a pool is never reallocated in place."""
        seen = self.pools_seen
        if seen is None or seen[0] != num_slots or seen[1] != window_slots:
            return False
        return all(a is c() and b is d() for (a, b), (c, d) in zip(pools, seen[2], strict=True))

    def _seen(self, pools: list, num_slots: int, window_slots: int | None) -> None:
        refs = tuple((weakref.ref(k), weakref.ref(v)) for k, v in pools)
        self.pools_seen = (num_slots, window_slots, refs)
