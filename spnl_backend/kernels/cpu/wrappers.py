"""The compiled kernels as Python calls (`CpuKernels`, `Products`): each checks its
arguments (`kernels.cpu.checks`), fills the mirror's structs (`kernels.cpu.abi`) and calls
the library."""

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from ...memory import host_tensor
from ..scoring import Scoring
from .abi import (
    GATED_ACTS,
    I32,
    I64,
    MAX_HEAD_DIM,
    PTR,
    TILED_FORMATS,
    AttentionArgs,
    CodedDecodeArgs,
    Group,
    LayerArgs,
    PagedDecodeArgs,
    ProductsArgs,
    QkArgs,
    ScoringArgs,
    StepArgs,
)
from .checks import KernelArgumentError, check_keys, check_status, pool_row, qtype_name, require


@dataclass(frozen=True)
class CpuKernels:
    library: ctypes.CDLL
    path: Path
    # Float activations in the quantized products (slower, and exact).
    exact: bool = False
    # Built with -DSPNL_CHECKS: every index checked in C too.
    checks: bool = False
    has_int8: bool = True
    # The threads a call computes on (pool.c's pool, shared by the process's calls): the
    # platform's decision (`PlatformDecisions.threads`).
    threads: int = 1

    def tiles_native(self, qtype: GGMLQuantizationType) -> bool:
        """Whether ``qtype``'s tiles of 16 rows (`quant.tiles`) have their own kernel here."""
        return bool(self.library.spnl_tiles_native(qtype.value))

    def tile(
        self,
        qtype: GGMLQuantizationType,
        weight: torch.Tensor,
        k_in: int,
        *,
        in_place: bool = False,
    ) -> torch.Tensor:
        """The ``qtype`` (Q4_K or Q6_K) rows ``weight`` ``[rows, row_bytes]`` in tiles of 16
        rows (`quant.tiles`): in a host buffer of their own, or ``in_place``, in ``weight``'s
        own bytes, returned; the caller then holds rows no more."""
        require(weight, torch.uint8, "tile: weight", dims=2)
        if qtype.value not in TILED_FORMATS:
            raise KernelArgumentError(
                f"tile: {qtype.name} has no tiles; "
                f"accepted: {', '.join(qtype_name(q) for q in TILED_FORMATS)}"
            )
        self.check_row_bytes(qtype.value, k_in, weight.shape[1], "tile")
        out = weight if in_place else host_tensor(tuple(weight.shape), torch.uint8, zeroed=False)
        check_status(
            self.library.spnl_tile(
                qtype.value,
                weight.data_ptr(),
                weight.numel(),
                weight.shape[0],
                k_in,
                out.data_ptr(),
                self.threads,
            ),
            "tile",
        )
        return out

    def products(self, weights: list[tuple[int, torch.Tensor, int]]) -> "Products":
        """A prepared call for ``x @ W.T`` of each ``(qtype, W [n_out, row_bytes], n_out)``."""
        return Products(self, weights)

    def dequantize(self, qtype: int, weight: torch.Tensor, n_rows: int, k_in: int) -> torch.Tensor:
        require(weight, torch.uint8, "dequantize: weight")
        out = torch.empty((n_rows, k_in), dtype=torch.float32)
        check_status(
            self.library.spnl_dequantize(
                qtype,
                weight.data_ptr(),
                weight.numel(),
                n_rows,
                k_in,
                out.data_ptr(),
                self.threads,
            ),
            "dequantize",
        )
        return out

    def gather_rows(
        self, qtype: int, weight: torch.Tensor, ids: torch.Tensor, k_in: int
    ) -> torch.Tensor:
        require(weight, torch.uint8, "gather_rows: weight", dims=2)
        self.check_row_bytes(qtype, k_in, weight.shape[1], "gather_rows")
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty((ids.numel(), k_in), dtype=torch.float32)
        check_status(
            self.library.spnl_gather_rows(
                qtype,
                weight.data_ptr(),
                weight.shape[0],
                ids.data_ptr(),
                ids.numel(),
                k_in,
                out.data_ptr(),
            ),
            "gather_rows",
        )
        return out

    def check_row_bytes(self, qtype: int, k_in: int, row_bytes: int, what: str) -> None:
        """That rows of ``row_bytes`` bytes hold ``k_in`` weights of ``qtype``."""
        if self.library.spnl_row_bytes(qtype, k_in) != row_bytes:
            raise KernelArgumentError(
                f"{what}: rows of {row_bytes} bytes do not hold {k_in} weights of type "
                f"{qtype_name(qtype)}"
            )

    def rms_norm(self, x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        require(x, torch.float32, "rms_norm: x")
        if x.dim() == 0 or x.shape[-1] == 0:
            raise KernelArgumentError(f"rms_norm: x of shape {tuple(x.shape)} has no rows to norm")
        require(scale, torch.float32, "rms_norm: scale", numel=x.shape[-1])
        out = torch.empty_like(x)
        check_status(
            self.library.spnl_rms_norm(
                x.data_ptr(),
                scale.data_ptr(),
                out.data_ptr(),
                x.numel() // x.shape[-1],
                x.shape[-1],
                eps,
            ),
            "rms_norm",
        )
        return out

    def gated_act(self, kind: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` for ``kind`` (silu or gelu_tanh: `GATED_ACTS`) over ``[rows,
        inner]`` float32 views whose rows may lie apart (a product's halves), their values
        consecutive within a row."""
        if kind not in GATED_ACTS:
            raise KernelArgumentError(
                f"gated_act: activation {kind!r}; the kernel has {', '.join(GATED_ACTS)}"
            )
        for t, name in ((gate, "gate"), (up, "up")):
            if not (
                t.dtype is torch.float32
                and t.is_cpu
                and t.dim() == 2
                and t.shape == gate.shape
                and t.shape[1] > 0
                and t.stride(1) == 1
                and (t.shape[0] < 2 or t.stride(0) >= t.shape[1])
            ):
                raise KernelArgumentError(
                    f"gated_act: {name} of {t.dtype} on {t.device}, shape {tuple(t.shape)}, "
                    f"strides {t.stride()}; wanted float32 on the CPU, gate's 2-D shape "
                    f"{tuple(gate.shape)}, each row's values consecutive, rows apart"
                )
        rows, inner = gate.shape
        out = torch.empty(rows, inner, dtype=torch.float32)
        check_status(
            self.library.spnl_gated_act(
                GATED_ACTS[kind],
                gate.data_ptr(),
                up.data_ptr(),
                rows,
                inner,
                gate.stride(0) if rows > 1 else inner,
                up.stride(0) if rows > 1 else inner,
                out.data_ptr(),
                self.threads,
            ),
            "gated_act",
        )
        return out

    def add_rms_norm(
        self,
        x: torch.Tensor,
        delta: torch.Tensor,
        delta_norm: tuple[torch.Tensor, float] | None,
        scale: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """``x += delta`` (``delta`` normed first by ``delta_norm = (scale, eps)`` where
        given), in place, then the RMSNorm of the new ``x``; ``x`` must be contiguous."""
        require(x, torch.float32, "add_rms_norm: x")
        dim = x.shape[-1] if x.dim() else 0
        if dim == 0:
            raise KernelArgumentError(f"add_rms_norm: x of shape {tuple(x.shape)} has no rows")
        delta = delta.contiguous()
        require(delta, torch.float32, "add_rms_norm: delta", numel=x.numel())
        require(scale, torch.float32, "add_rms_norm: scale", numel=dim)
        delta_scale, delta_eps = (None, 0.0) if delta_norm is None else delta_norm
        if delta_scale is not None:
            require(delta_scale, torch.float32, "add_rms_norm: delta scale", numel=dim)
        out = torch.empty_like(x)
        check_status(
            self.library.spnl_add_rms_norm(
                x.data_ptr(),
                delta.data_ptr(),
                None if delta_scale is None else delta_scale.data_ptr(),
                delta_eps,
                scale.data_ptr(),
                eps,
                out.data_ptr(),
                x.numel() // dim,
                dim,
                self.threads,
            ),
            "add_rms_norm",
        )
        return out

    def qk_norm_rope_(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        norms: tuple[torch.Tensor, torch.Tensor, float] | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Norm each head of ``q [T, heads, dim]`` and ``k [T, kv_heads, dim]`` by ``norms =
        (q scale, k scale, eps)`` where given, then rotate both, in place. Each token's
        heads must be consecutive (rows may be parts of one wider row: a q/k/v product)."""
        for t, name in ((q, "q"), (k, "k")):
            if not (
                t.dtype is torch.float32
                and t.is_cpu
                and t.dim() == 3
                and t.stride(2) == 1
                and t.stride(1) == t.shape[2]
                and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1] * t.shape[2])
            ):
                raise KernelArgumentError(
                    f"qk_norm_rope: {name} of {t.dtype}, shape {tuple(t.shape)} and strides "
                    f"{t.stride()} is not [tokens, heads, dim] float32 with each token's "
                    "heads consecutive"
                )
        tokens, heads, dim = q.shape
        if k.shape[0] != tokens or k.shape[2] != dim:
            raise KernelArgumentError(
                f"qk_norm_rope: q of shape {tuple(q.shape)} and k of shape {tuple(k.shape)}"
            )
        for table, name in ((cos, "cos"), (sin, "sin")):
            require(table, torch.float32, f"qk_norm_rope: {name}", dims=2)
            if table.shape != cos.shape or table.shape[0] != tokens:
                raise KernelArgumentError(
                    f"qk_norm_rope: tables of shape {tuple(table.shape)} for {tokens} tokens"
                )
        q_scale = k_scale = None
        eps = 0.0
        if norms is not None:
            q_scale, k_scale, eps = norms
            for scale, name in ((q_scale, "q scale"), (k_scale, "k scale")):
                require(scale, torch.float32, f"qk_norm_rope: {name}", numel=dim)
        args = QkArgs(
            q=q.data_ptr(),
            k=k.data_ptr(),
            q_row=q.stride(0) if tokens > 1 else heads * dim,
            k_row=k.stride(0) if tokens > 1 else k.shape[1] * dim,
            tokens=tokens,
            heads=heads,
            kv_heads=k.shape[1],
            head_dim=dim,
            rotary_dim=cos.shape[-1],
            q_scale=None if q_scale is None else q_scale.data_ptr(),
            k_scale=None if k_scale is None else k_scale.data_ptr(),
            eps=eps,
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
        )
        check_status(self.library.spnl_qk_norm_rope(args, self.threads), "qk_norm_rope")

    def delta_rule_(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
    ) -> torch.Tensor:
        """The gated delta rule token by token (twin: `kernels.delta_rule.recurrent`): ``q``,
        ``k [T, H, dk]``, ``v [T, H, dv]``, ``g``, ``beta [T, H]`` (float32), ``state [H, dk,
        dv]`` (float32, contiguous, updated in place) → ``[T, H, dv]``."""
        require(state, torch.float32, "delta_rule: state", dims=3)
        heads, dk, dv = state.shape
        tokens = q.shape[0] if q.dim() else 0
        q, k = (_rows(t, (tokens, heads, dk), f"delta_rule: {n}") for t, n in ((q, "q"), (k, "k")))
        v = _rows(v, (tokens, heads, dv), "delta_rule: v")
        g, beta = (
            _rows(t, (tokens, heads), f"delta_rule: {n}") for t, n in ((g, "g"), (beta, "beta"))
        )
        out = torch.empty_like(v)
        check_status(
            self.library.spnl_delta_rule(
                *(t.data_ptr() for t in (q, k, v, g, beta, state, out)),
                tokens,
                heads,
                dk,
                dv,
                self.threads,
            ),
            "delta_rule",
        )
        return out

    def ssd_scan_(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        state: torch.Tensor,
    ) -> torch.Tensor:
        """Mamba-2's scan token by token (twin: `kernels.ssd.recurrent`): ``x [T, H, P]``,
        ``dt [T, H]``, ``a [H]``, ``b``, ``c [T, H, N]`` (float32), ``state [H, P, N]``
        (float32, contiguous, updated in place) → ``[T, H, P]``."""
        require(state, torch.float32, "ssd_scan: state", dims=3)
        heads, p, n = state.shape
        tokens = x.shape[0] if x.dim() else 0
        x = _rows(x, (tokens, heads, p), "ssd_scan: x")
        dt = _rows(dt, (tokens, heads), "ssd_scan: dt")
        a = _rows(a, (heads,), "ssd_scan: a")
        b, c = (_rows(t, (tokens, heads, n), f"ssd_scan: {m}") for t, m in ((b, "b"), (c, "c")))
        out = torch.empty_like(x)
        check_status(
            self.library.spnl_ssd_scan(
                *(t.data_ptr() for t in (x, dt, a, b, c, state, out)),
                tokens,
                heads,
                p,
                n,
                self.threads,
            ),
            "ssd_scan",
        )
        return out

    def selective_scan_(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        state: torch.Tensor,
    ) -> torch.Tensor:
        """Mamba-1's scan token by token (twin: `kernels.selective_scan.recurrent`): ``x``,
        ``dt [T, D]``, ``a [D, N]``, ``b``, ``c [T, N]`` (float32), ``state [D, N]``
        (float32, contiguous, updated in place) → ``[T, D]``."""
        require(state, torch.float32, "selective_scan: state", dims=2)
        channels, n = state.shape
        tokens = x.shape[0] if x.dim() else 0
        x, dt = (
            _rows(t, (tokens, channels), f"selective_scan: {m}") for t, m in ((x, "x"), (dt, "dt"))
        )
        a = _rows(a, (channels, n), "selective_scan: a")
        b, c = (_rows(t, (tokens, n), f"selective_scan: {m}") for t, m in ((b, "b"), (c, "c")))
        out = torch.empty_like(x)
        check_status(
            self.library.spnl_selective_scan(
                *(t.data_ptr() for t in (x, dt, a, b, c, state, out)),
                tokens,
                channels,
                n,
                self.threads,
            ),
            "selective_scan",
        )
        return out

    def attention_block(self, step: "StepArgs", layer: "LayerArgs") -> None:
        """A layer's attention block (layer_blocks.c) over arguments the caller checked."""
        check_status(self.library.spnl_attention_block(step, layer), "attention_block")

    def mlp_block(self, step: "StepArgs", layer: "LayerArgs") -> None:
        """A layer's MLP block (layer_blocks.c) over arguments the caller checked."""
        check_status(self.library.spnl_mlp_block(step, layer), "mlp_block")

    def moe_block(self, step: "StepArgs", layer: "LayerArgs") -> None:
        """A layer's experts as its MLP block (layer_blocks.c) over checked arguments."""
        check_status(self.library.spnl_moe_block(step, layer), "moe_block")

    def layers(self, step: "StepArgs", layers: ctypes.Array, failed: ctypes.c_int64) -> None:
        """Every layer of ``layers`` (an array of `LayerArgs`) over checked arguments: each
        its attention block, then its MoE or MLP block (layer_blocks.c), in one call;
        ``failed``: where the failing call's index is written."""
        status = self.library.spnl_layers(step, layers, len(layers), ctypes.byref(failed))
        if status:
            layer, second = divmod(failed.value, 2)
            block = (
                ("moe_block" if layers[layer].moe else "mlp_block") if second else "attention_block"
            )
            check_status(status, f"{block} (layer {layer})")

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        key, value = key.contiguous(), value.contiguous()
        row = pool_row(key_cache, value_cache, "store_kv")
        for tensor, name in ((key, "key"), (value, "value")):
            require(tensor, torch.float32, f"store_kv: {name}", numel=slots.numel() * row)
        require(slots, torch.int64, "store_kv: slots", dims=1)
        check_status(
            self.library.spnl_store_kv(
                key.data_ptr(),
                value.data_ptr(),
                key_cache.data_ptr(),
                value_cache.data_ptr(),
                slots.data_ptr(),
                slots.numel(),
                row,
                key_cache.numel() // row,
                key_cache.dtype is torch.float16,
            ),
            "store_kv",
        )

    def paged_decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
        scoring: Scoring,
        firsts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each query ``q[s]`` over the keys at ``slots[s, j]`` for ``j < lens[s]``: from
        ``firsts[s]`` on where given, else from the start of the window or the chunk
        ``scoring`` gives."""
        q = q.contiguous()
        require(q, torch.float32, "paged_decode: q", dims=3)
        seqs, _, dim = q.shape
        row = pool_row(key_cache, value_cache, "paged_decode")
        kv_heads = key_cache.shape[-2]
        if key_cache.shape[-1] != dim:
            raise KernelArgumentError(
                f"paged_decode: q has {dim} dims, the cache {row // kv_heads}"
            )
        check_keys(slots, lens, seqs, "paged_decode", firsts)
        out = torch.empty_like(q)
        args = PagedDecodeArgs(
            at=attention_args(
                out, kv_heads, slots, lens, key_cache.numel() // row, scoring, self.threads, firsts
            ),
            q=q.data_ptr(),
            k_cache=key_cache.data_ptr(),
            v_cache=value_cache.data_ptr(),
            half=key_cache.dtype is torch.float16,
        )
        check_status(self.library.spnl_paged_decode(args), "paged_decode")
        return out

    def coded_decode(
        self,
        q_rot: torch.Tensor,
        q: torch.Tensor,
        anchors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        key_pool: torch.Tensor,
        value_pool: torch.Tensor,
        key_format: tuple[torch.Tensor, int, int],
        value_format: tuple[torch.Tensor, int],
        slots: torch.Tensor,
        lens: torch.Tensor,
        scoring: Scoring,
    ) -> torch.Tensor:
        """One query per sequence over PolarQuant records ``[slots, kv_heads, bytes]``;
        ``key_format`` is (codebook, bits, outliers), ``value_format`` (codebook, bits);
        ``anchors`` is (q . key centre and q . key anchor ``[seqs, heads]``, the value
        anchor less the value centre, rotated, ``[kv_heads, dim]``). Returns the rotated
        value sum without the values' centre."""
        q_rot, q = q_rot.contiguous(), q.contiguous()
        k_shift, k_anchor, v_anchor = (t.float().contiguous() for t in anchors)
        require(q, torch.float32, "coded_decode: q", dims=3)
        seqs, heads, dim = q.shape
        (k_lut, k_bits, outliers), (v_lut, v_bits) = key_format, value_format
        if not (1 <= k_bits <= 8 and 1 <= v_bits <= 8 and 0 <= outliers <= dim <= MAX_HEAD_DIM):
            raise KernelArgumentError(
                f"coded_decode: {k_bits}-bit keys with {outliers} outliers and {v_bits}-bit "
                f"values of {dim} dims; bits are 1 to 8, outliers at most the head's "
                f"{dim} dims, and a head at most {MAX_HEAD_DIM}"
            )
        kv_heads = key_pool.shape[-2]
        require(q_rot, torch.float32, "coded_decode: q_rot", numel=q.numel())
        require(k_shift, torch.float32, "coded_decode: key centre terms", numel=seqs * heads)
        require(k_anchor, torch.float32, "coded_decode: key anchor terms", numel=seqs * heads)
        require(v_anchor, torch.float32, "coded_decode: value anchor", numel=kv_heads * dim)
        require(k_lut, torch.float32, "coded_decode: key codebook", numel=1 << k_bits)
        require(v_lut, torch.float32, "coded_decode: value codebook", numel=1 << v_bits)
        for pool, name in ((key_pool, "key"), (value_pool, "value")):
            require(pool, torch.uint8, f"coded_decode: {name} records", dims=3)
        if value_pool.shape[:2] != key_pool.shape[:2]:
            raise KernelArgumentError("coded_decode: key and value pools differ in shape")
        check_keys(slots, lens, seqs, "coded_decode")
        out = torch.empty_like(q)
        args = CodedDecodeArgs(
            at=attention_args(out, kv_heads, slots, lens, key_pool.shape[0], scoring, self.threads),
            q_rot=q_rot.data_ptr(),
            q=q.data_ptr(),
            k_shift=k_shift.data_ptr(),
            k_anchor=k_anchor.data_ptr(),
            v_anchor=v_anchor.data_ptr(),
            k_pool=key_pool.data_ptr(),
            v_pool=value_pool.data_ptr(),
            k_bytes=key_pool.shape[-1],
            v_bytes=value_pool.shape[-1],
            k_outliers=outliers,
            k_lut=k_lut.data_ptr(),
            v_lut=v_lut.data_ptr(),
            k_bits=k_bits,
            v_bits=v_bits,
        )
        check_status(self.library.spnl_coded_decode(args), "coded_decode")
        return out


def _rows(tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """``tensor`` as the C code reads it: float32, contiguous (copied where it is a view
    with gaps, as a layer's split of one projection is), of exactly ``shape``."""
    tensor = tensor.contiguous()
    require(tensor, torch.float32, what)
    if tuple(tensor.shape) != shape:
        raise KernelArgumentError(f"{what} of shape {tuple(tensor.shape)}, not {shape}")
    return tensor


def attention_args(
    out: torch.Tensor,
    kv_heads: int,
    slots: torch.Tensor,
    lens: torch.Tensor,
    num_slots: int,
    scoring: Scoring,
    threads: int,
    firsts: torch.Tensor | None = None,
) -> AttentionArgs:
    """The part both decode attentions share, for queries shaped as ``out [seqs, heads, dim]``
    over a pool of ``num_slots`` (the tensors checked by the caller, and kept alive by it
    until the call returns)."""
    seqs, heads, dim = out.shape
    return AttentionArgs(
        slots=slots.data_ptr(),
        slot_stride=slots.stride(0),
        slot_width=slots.shape[1],
        lens=lens.data_ptr(),
        num_slots=num_slots,
        seqs=seqs,
        heads=heads,
        kv_heads=kv_heads,
        dim=dim,
        scoring=scoring_args(scoring, heads),
        out=out.data_ptr(),
        threads=threads,
        firsts=None if firsts is None else firsts.data_ptr(),
    )


def scoring_args(scoring: Scoring, heads: int) -> ScoringArgs:
    """``scoring`` as the C structs hold it (its sinks checked: float32, one per head, kept
    alive by the `Scoring` while the call runs)."""
    if scoring.sinks is not None:
        require(scoring.sinks, torch.float32, "attention sinks", numel=heads)
    return ScoringArgs(
        scale=scoring.scale,
        softcap=scoring.softcap or 0.0,
        window=scoring.window or 0,
        sinks=None if scoring.sinks is None else scoring.sinks.data_ptr(),
        chunk=scoring.chunk or 0,
    )


class Products:
    """Several quantized products of one input, prepared once (the ctypes arrays), called
    every step: the activations are read, and on the int8 path quantized, once for all, and
    the results land side by side in one tensor."""

    def __init__(self, kernels: CpuKernels, weights: list[tuple[int, torch.Tensor, int]]) -> None:
        count = len(weights)
        for _, w, n_out in weights:
            require(w, torch.uint8, "matmul: weight", dims=2)
            if w.shape[0] != n_out:
                raise KernelArgumentError(f"matmul: a weight of {w.shape[0]} rows, not {n_out}")
        self.kernels = kernels
        self.args = ProductsArgs(  # the ctypes arrays are kept alive by the struct
            count,
            (I32 * count)(*(qtype for qtype, _, _ in weights)),
            (PTR * count)(*(w.data_ptr() for _, w, _ in weights)),
            (I64 * count)(*(w.numel() for _, w, _ in weights)),
            (I64 * count)(*(n for _, _, n in weights)),
        )
        self.widths = [n for _, _, n in weights]
        self.total = sum(self.widths)
        self.weights = [w for _, w, _ in weights]  # kept alive for the pointers
        self.row_bytes = [(qtype, w.shape[1]) for qtype, w, _ in weights]
        self.k_in = -1  # none checked yet

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [rows, k]`` (float32, contiguous) → ``[rows, total]``."""
        require(x, torch.float32, "matmul: x", dims=2)
        rows, k_in = x.shape
        kernels = self.kernels
        if rows == 0:
            return torch.empty((0, self.total), dtype=torch.float32)
        self._check_width(k_in)
        out = torch.empty((rows, self.total), dtype=torch.float32)
        check_status(
            kernels.library.spnl_qmatmul(
                self.args,
                x.data_ptr(),
                rows,
                k_in,
                out.data_ptr(),
                self.total,
                kernels.threads,
                kernels.exact,
            ),
            "matmul",
        )
        return out

    def groups(self, x: torch.Tensor, groups: list[tuple[int, int, int, int]], y_rows: int):
        """Product ``i`` on its own rows of ``x [rows, k]``: ``groups[i] = (x_row, y_row,
        rows, col)`` takes that many rows from ``x_row`` into rows from ``y_row`` of the
        result ``[y_rows, width]`` (width: the widest group's ``col`` plus its product's
        rows), each row computed as a one-row call computes it; rows no group writes are 0."""
        require(x, torch.float32, "matmul: x", dims=2)
        if len(groups) != len(self.widths):
            raise KernelArgumentError(
                f"matmul: {len(groups)} groups for {len(self.widths)} products"
            )
        self._check_width(x.shape[1])
        width = max(g[3] + n for g, n in zip(groups, self.widths, strict=True))
        out = torch.zeros((y_rows, width), dtype=torch.float32)
        array = (Group * len(groups))(*(Group(*g) for g in groups))
        check_status(
            self.kernels.library.spnl_qmatmul_groups(
                self.args,
                array,
                x.data_ptr(),
                x.shape[0],
                x.shape[1],
                out.data_ptr(),
                y_rows,
                width,
                self.kernels.threads,
                self.kernels.exact,
            ),
            "matmul",
        )
        return out

    def _check_width(self, k_in: int) -> None:
        if k_in != self.k_in:  # the one width these weights take, found on first use
            for qtype, row_bytes in self.row_bytes:
                self.kernels.check_row_bytes(qtype, k_in, row_bytes, "matmul")
            self.k_in = k_in
