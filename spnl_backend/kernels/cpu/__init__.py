"""The CPU's native kernels: C compiled for this machine at first use, called through ctypes.

One C file per kernel family, each kernel the twin of a torch reference elsewhere in the
package: ``quant_matmul.c`` (the quantized matrix products, dequantization),
``layer_ops.c`` (RMSNorm, alone or with the residual add; q/k norms with RoPE),
``paged_attention.c`` (KV store, paged decode attention), ``coded_decode.c`` (decode
attention over compressed KV), ``moe.c`` (a mixture-of-experts layer: routing, the experts'
grouped products, their weighted sum; bound in `kernels.cpu.moe`) and ``layer_blocks.c`` (a
decoder layer as two calls of the kernels above, whose twin is the per-op path of
`models.layers`); ``common.h`` declares
their entry points and argument structs, which the `ctypes.Structure` classes below mirror. They
are compiled with the system's C compiler (``-O3 -march=native``, OpenMP where the compiler
has it) into one library in a per-user cache keyed by the sources, compiler and flags, so
later processes load it in milliseconds. Without a compiler everything falls back to the
torch twins, with a warning that says why; ``MISTRALRS_CPU_KERNELS=torch`` asks for that
fallback on purpose.

Every wrapper checks what the C code relies on (dtypes, contiguity, shapes, extents)
before calling it, and the C code checks the extents it is given: a violation is a
`KernelArgumentError`. The indices the attention kernels follow (block tables, slots,
outlier positions) are data, not extents: the engine checks each step's once before any
kernel runs (`kernels.sets.check_step_slots`), and ``MISTRALRS_NATIVE_CHECKS`` builds a
second library that checks every one itself. A caller of these methods outside the
engine, with the plain build, must pass indices inside the pool. A prepared `Products`
keeps its weights' addresses: the weights must not be replaced while it is in use.
"""

import ctypes
import hashlib
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from ...errors import EngineError
from ...log import get_logger
from ...settings.paths import cache_dir
from ...settings.platform import find_c_compiler

log = get_logger()

HERE = Path(__file__).parent
# The translation units, linked into one library; the cache key also covers every header.
SOURCES = tuple(
    HERE / name
    for name in (
        "quant_matmul.c",
        "layer_ops.c",
        "paged_attention.c",
        "coded_decode.c",
        "moe.c",
        "layer_blocks.c",
        "pool.c",
        "build_info.c",
    )
)
HEADERS = tuple(sorted(HERE.glob("*.h")))
# No fused multiply-add contraction: the element-wise kernels then round exactly as torch.
_BASE_FLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=256",
    "-fPIC",
    "-shared",
    "-std=gnu11",
    "-ffp-contract=off",
]
_CHECK_FLAGS = ["-DSPNL_CHECKS"]
MAX_HEAD_DIM = 4096  # SPNL_MAX_HEAD_DIM in common.h
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


# The argument structs of common.h, field for field (the loader checks their sizes).
class _Products(ctypes.Structure):
    _fields_ = (
        ("count", _I32),
        ("qtypes", ctypes.POINTER(_I32)),
        ("weights", ctypes.POINTER(_P)),
        ("w_bytes", ctypes.POINTER(_I64)),
        ("n_outs", ctypes.POINTER(_I64)),
    )


class Group(ctypes.Structure):
    """Which rows one product of a grouped call takes (``spnl_group``)."""

    _fields_ = (("x_row", _I64), ("y_row", _I64), ("rows", _I64), ("col", _I64))


class MoeArgs(ctypes.Structure):
    """A mixture-of-experts layer (``spnl_moe_args``, moe.c)."""

    _fields_ = (
        ("router", _P),
        ("gate_up", ctypes.POINTER(_Products)),
        ("down", ctypes.POINTER(_Products)),
        ("experts", _I64),
        ("top_k", _I64),
        ("hidden", _I64),
        ("inner", _I64),
        ("renormalize", _I32),
    )


class _Attention(ctypes.Structure):
    _fields_ = (
        ("slots", _P),
        ("slot_stride", _I64),
        ("slot_width", _I64),
        ("lens", _P),
        ("num_slots", _I64),
        ("seqs", _I64),
        ("heads", _I64),
        ("kv_heads", _I64),
        ("dim", _I64),
        ("scale", _F32),
        ("softcap", _F32),
        ("window", _I64),
        ("out", _P),
        ("threads", _I32),
        ("firsts", _P),
    )


class _PagedDecode(ctypes.Structure):
    _fields_ = (("at", _Attention), ("q", _P), ("k_cache", _P), ("v_cache", _P), ("half", _I32))


class _CodedDecode(ctypes.Structure):
    _fields_ = (
        ("at", _Attention),
        ("q_rot", _P),
        ("q", _P),
        ("k_shift", _P),
        ("k_anchor", _P),
        ("v_anchor", _P),
        ("k_pool", _P),
        ("v_pool", _P),
        ("k_bytes", _I64),
        ("v_bytes", _I64),
        ("k_outliers", _I64),
        ("k_lut", _P),
        ("v_lut", _P),
        ("k_bits", _I32),
        ("v_bits", _I32),
    )


class _QK(ctypes.Structure):
    _fields_ = (
        ("q", _P),
        ("k", _P),
        ("q_row", _I64),
        ("k_row", _I64),
        ("tokens", _I64),
        ("heads", _I64),
        ("kv_heads", _I64),
        ("head_dim", _I64),
        ("rotary_dim", _I64),
        ("q_scale", _P),
        ("k_scale", _P),
        ("eps", _F32),
        ("cos", _P),
        ("sin", _P),
    )


class StepArgs(ctypes.Structure):
    """What every layer of one step shares (``spnl_step_args``, layer_blocks.c)."""

    _fields_ = (
        ("tokens", _I64),
        ("x", _P),
        ("h", _P),
        ("qkv", _P),
        ("q", _P),
        ("kv", _P),
        ("attn", _P),
        ("out", _P),
        ("gate_up", _P),
        ("act", _P),
        ("slot_mapping", _P),
        ("num_slots", _I64),
        ("at", _Attention),
        ("cos", _P * 2),
        ("sin", _P * 2),
        ("rotary_dim", _I64 * 2),
        ("threads", _I32),
        ("exact", _I32),
        ("at_windowed", _Attention),
        ("windowed", _I32),
        ("scratch", _P),
        ("scratch_bytes", _I64),
    )


class LayerArgs(ctypes.Structure):
    """One layer's fixed part (``spnl_layer_args``, layer_blocks.c)."""

    _fields_ = (
        ("qkv", ctypes.POINTER(_Products)),
        ("o", ctypes.POINTER(_Products)),
        ("gate_up", ctypes.POINTER(_Products)),
        ("down", ctypes.POINTER(_Products)),
        ("hidden", _I64),
        ("inner", _I64),
        ("heads", _I64),
        ("kv_heads", _I64),
        ("head_dim", _I64),
        ("q_norm", _P),
        ("k_norm", _P),
        ("attn_delta_norm", _P),
        ("attn_out_norm", _P),
        ("mlp_delta_norm", _P),
        ("mlp_out_norm", _P),
        ("eps", _F32),
        ("k_cache", _P),
        ("v_cache", _P),
        ("half", _I32),
        ("local", _I32),
        ("scale", _F32),
        ("softcap", _F32),
        ("window", _I64),
        ("qk_full", _I32),
        ("has_clip", _I32),
        ("clip", _F32),
        ("moe", ctypes.POINTER(MoeArgs)),
    )


_STRUCTS = {  # the C function that answers each struct's size
    "spnl_sizeof_products": _Products,
    "spnl_sizeof_paged_decode": _PagedDecode,
    "spnl_sizeof_coded_decode": _CodedDecode,
    "spnl_sizeof_qk": _QK,
    "spnl_sizeof_step": StepArgs,
    "spnl_sizeof_layer": LayerArgs,
    "spnl_sizeof_group": Group,
    "spnl_sizeof_moe": MoeArgs,
}
_SIGNATURES = {  # name: (argument types, result type)
    "spnl_has_int8": ([], _I32),
    "spnl_full_checks": ([], _I32),
    **{name: ([], _I64) for name in _STRUCTS},
    "spnl_row_bytes": ([_I32, _I64], _I64),
    "spnl_qmatmul": ([ctypes.POINTER(_Products), _P, _I64, _I64, _P, _I64, _I32, _I32], _I32),
    "spnl_qmatmul_groups": (
        [ctypes.POINTER(_Products), _P, _P, _I64, _I64, _P, _I64, _I64, _I32, _I32],
        _I32,
    ),
    "spnl_moe_scratch_bytes": ([ctypes.POINTER(MoeArgs), _I64], _I64),
    "spnl_moe": ([ctypes.POINTER(MoeArgs), _P, _I64, _P, _P, _I64, _I32, _I32], _I32),
    "spnl_dequantize": ([_I32, _P, _I64, _I64, _I64, _P, _I32], _I32),
    "spnl_gather_rows": ([_I32, _P, _I64, _P, _I64, _I64, _P], _I32),
    "spnl_rms_norm": ([_P, _P, _P, _I64, _I64, _F32], _I32),
    "spnl_add_rms_norm": ([_P, _P, _P, _F32, _P, _F32, _P, _I64, _I64], _I32),
    "spnl_qk_norm_rope": ([ctypes.POINTER(_QK)], _I32),
    "spnl_attention_block": ([ctypes.POINTER(StepArgs), ctypes.POINTER(LayerArgs)], _I32),
    "spnl_mlp_block": ([ctypes.POINTER(StepArgs), ctypes.POINTER(LayerArgs)], _I32),
    "spnl_moe_block": ([ctypes.POINTER(StepArgs), ctypes.POINTER(LayerArgs)], _I32),
    "spnl_store_kv": ([_P, _P, _P, _P, _P, _I64, _I64, _I64, _I32], _I32),
    "spnl_paged_decode": ([ctypes.POINTER(_PagedDecode)], _I32),
    "spnl_coded_decode": ([ctypes.POINTER(_CodedDecode)], _I32),
    "spnl_pool_check": ([_I64, _I32, _I32, _P], _I32),
}
_STATUS = {
    -1: "rejected its arguments",
    -2: "ran out of memory",
    -3: "found an index out of bounds",
}


class KernelArgumentError(EngineError):
    """A native kernel was about to be called with arguments that break its invariants
    (shapes, dtypes, strides, indices): the call is refused instead of reading or writing
    memory it does not own."""


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

    def products(self, weights: list[tuple[int, torch.Tensor, int]]) -> "Products":
        """A prepared call for ``x @ W.T`` of each ``(qtype, W [n_out, row_bytes], n_out)``."""
        return Products(self, weights)

    def dequantize(self, qtype: int, weight: torch.Tensor, n_rows: int, k_in: int) -> torch.Tensor:
        require(weight, torch.uint8, "dequantize: weight")
        out = torch.empty((n_rows, k_in), dtype=torch.float32)
        _check(
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
        _check(
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
                f"{_qtype_name(qtype)}"
            )

    def rms_norm(self, x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        require(x, torch.float32, "rms_norm: x")
        if x.dim() == 0 or x.shape[-1] == 0:
            raise KernelArgumentError(f"rms_norm: x of shape {tuple(x.shape)} has no rows to norm")
        require(scale, torch.float32, "rms_norm: scale", numel=x.shape[-1])
        out = torch.empty_like(x)
        _check(
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
        _check(
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
        args = _QK(
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
        _check(self.library.spnl_qk_norm_rope(args), "qk_norm_rope")

    def attention_block(self, step: "StepArgs", layer: "LayerArgs") -> None:
        """A layer's attention block (layer_blocks.c) over arguments the caller checked."""
        _check(self.library.spnl_attention_block(step, layer), "attention_block")

    def mlp_block(self, step: "StepArgs", layer: "LayerArgs") -> None:
        """A layer's MLP block (layer_blocks.c) over arguments the caller checked."""
        _check(self.library.spnl_mlp_block(step, layer), "mlp_block")

    def moe_block(self, step: "StepArgs", layer: "LayerArgs") -> None:
        """A layer's experts as its MLP block (layer_blocks.c) over checked arguments."""
        _check(self.library.spnl_moe_block(step, layer), "moe_block")

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
        _check(
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
        scale: float,
        window: int | None,
        softcap: float | None,
        firsts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each query ``q[s]`` over the keys at ``slots[s, j]`` for ``j < lens[s]``: from
        ``firsts[s]`` on where given, else the last ``window`` of them."""
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
        args = _PagedDecode(
            at=_attention(
                out,
                kv_heads,
                slots,
                lens,
                key_cache.numel() // row,
                scale,
                window,
                softcap,
                self.threads,
                firsts,
            ),
            q=q.data_ptr(),
            k_cache=key_cache.data_ptr(),
            v_cache=value_cache.data_ptr(),
            half=key_cache.dtype is torch.float16,
        )
        _check(self.library.spnl_paged_decode(args), "paged_decode")
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
        scale: float,
        window: int | None,
        softcap: float | None,
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
        args = _CodedDecode(
            at=_attention(
                out,
                kv_heads,
                slots,
                lens,
                key_pool.shape[0],
                scale,
                window,
                softcap,
                self.threads,
            ),
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
        _check(self.library.spnl_coded_decode(args), "coded_decode")
        return out


def require(
    tensor: torch.Tensor,
    dtype: torch.dtype,
    what: str,
    *,
    dims: int | None = None,
    numel: int | None = None,
) -> None:
    """A tensor the C code may read as a flat array of ``dtype``: on the CPU, contiguous,
    of the expected dimensions and size (checked on every call, so kept cheap)."""
    if (
        tensor.dtype is dtype
        and tensor.is_cpu
        and tensor.is_contiguous()
        and (dims is None or tensor.dim() == dims)
        and (numel is None or tensor.numel() == numel)
    ):
        return
    raise KernelArgumentError(f"{what} is {_problem(tensor, dtype, dims, numel)}")


def _problem(tensor: torch.Tensor, dtype: torch.dtype, dims: int | None, numel: int | None) -> str:
    if not tensor.is_cpu:
        problem = f"on {tensor.device}"
    elif tensor.dtype is not dtype:
        problem = f"of {tensor.dtype}, not {dtype}"
    elif not tensor.is_contiguous():
        problem = "not contiguous"
    elif dims is not None and tensor.dim() != dims:
        problem = f"{tensor.dim()}-D, not {dims}-D"
    else:
        problem = f"of {tensor.numel()} elements, not {numel}"
    return f"{problem} (shape {tuple(tensor.shape)})"


def _qtype_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"number {qtype} (unknown)"


# The dtypes a float pool may hold: read back exactly, computed in float32.
POOL_DTYPES = (torch.float32, torch.float16)


def pool_row(key_cache: torch.Tensor, value_cache: torch.Tensor, what: str) -> int:
    """Elements per slot of a ``[blocks, block_size, kv_heads, head_dim]`` pool pair of
    float32 or float16."""
    dtype = key_cache.dtype if key_cache.dtype in POOL_DTYPES else torch.float32
    for tensor, name in ((key_cache, "key"), (value_cache, "value")):
        require(tensor, dtype, f"{what}: {name} cache", dims=4)
    if key_cache.shape != value_cache.shape:
        raise KernelArgumentError(f"{what}: key and value caches differ in shape")
    if key_cache.shape[-2] == 0 or key_cache.shape[-1] == 0:
        raise KernelArgumentError(f"{what}: caches of shape {tuple(key_cache.shape)} hold no key")
    return key_cache.shape[-2] * key_cache.shape[-1]


def _attention(
    out: torch.Tensor,
    kv_heads: int,
    slots: torch.Tensor,
    lens: torch.Tensor,
    num_slots: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    threads: int,
    firsts: torch.Tensor | None = None,
) -> _Attention:
    """The part both decode attentions share, for queries shaped as ``out [seqs, heads, dim]``
    over a pool of ``num_slots`` (the tensors checked by the caller, and kept alive by it
    until the call returns)."""
    seqs, heads, dim = out.shape
    return _Attention(
        slots=slots.data_ptr(),
        slot_stride=slots.stride(0),
        slot_width=slots.shape[1],
        lens=lens.data_ptr(),
        num_slots=num_slots,
        seqs=seqs,
        heads=heads,
        kv_heads=kv_heads,
        dim=dim,
        scale=scale,
        softcap=softcap or 0.0,
        window=window or 0,
        out=out.data_ptr(),
        threads=threads,
        firsts=None if firsts is None else firsts.data_ptr(),
    )


def check_keys(
    slots: torch.Tensor,
    lens: torch.Tensor,
    seqs: int,
    what: str,
    firsts: torch.Tensor | None = None,
) -> None:
    """The slot table ``[seqs, width]`` (rows contiguous), the lengths ``[seqs]`` and, where
    given, the first keys ``[seqs]`` (each checked against its length in C)."""
    if slots.dtype != torch.int64 or slots.dim() != 2 or slots.shape[0] != seqs:
        raise KernelArgumentError(f"{what}: slots of {slots.dtype} {tuple(slots.shape)}")
    if slots.device.type != "cpu" or slots.stride(1) != 1:
        raise KernelArgumentError(f"{what}: slots must be CPU rows of consecutive int64")
    require(lens, torch.int64, f"{what}: lengths", numel=seqs)
    if firsts is not None:
        require(firsts, torch.int64, f"{what}: first keys", numel=seqs)


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
        self.args = _Products(  # the ctypes arrays are kept alive by the struct
            count,
            (_I32 * count)(*(qtype for qtype, _, _ in weights)),
            (_P * count)(*(w.data_ptr() for _, w, _ in weights)),
            (_I64 * count)(*(w.numel() for _, w, _ in weights)),
            (_I64 * count)(*(n for _, _, n in weights)),
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
        _check(
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
        _check(
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


def _check(status: int, name: str) -> None:
    if status != 0:
        what = _STATUS.get(status, f"failed with status {status}")
        raise KernelArgumentError(f"the CPU kernel {name} {what}")


def cpu_kernels(checks: bool = False) -> CpuKernels | None:
    """The compiled kernels built by the compiler found on this machine (as `info` shows),
    or None (logged) where there is none or the build fails."""
    compiler = find_c_compiler()
    if compiler is None:
        log.warning(
            "native.unavailable",
            reason="no C compiler (cc, gcc or clang) found; the CPU runs the slower torch kernels",
        )
        return None
    return load_cpu_kernels(compiler, checks)


@cache
def load_cpu_kernels(compiler: str, checks: bool = False) -> CpuKernels | None:
    """The kernels compiled by ``compiler`` (with every index checked where ``checks``),
    or None, with a warning that says why, where the build fails."""
    try:
        path = _build(compiler, checks)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning(
            "native.unavailable",
            reason=f"compiling {', '.join(path.name for path in SOURCES)} failed",
            detail=str(detail)[-2000:],
        )
        return None
    try:
        return _load(path)
    except _MismatchedBuildError as exc:
        log.warning("native.unavailable", reason=str(exc))
        return None


class _MismatchedBuildError(Exception):
    """The library's argument structs are not the ones this module mirrors."""


def _load(path: Path) -> CpuKernels:
    library = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    for name, struct in _STRUCTS.items():  # a mirror out of step would pass garbage
        if getattr(library, name)() != ctypes.sizeof(struct):
            raise _MismatchedBuildError(
                f"{struct.__name__} does not match its C struct in common.h ({path})"
            )
    has_int8 = bool(library.spnl_has_int8())
    return CpuKernels(
        library,
        path,
        exact=not has_int8,
        checks=bool(library.spnl_full_checks()),
        has_int8=has_int8,
    )


def built_before(compiler: str, checks: bool = False) -> bool:
    """Whether this machine's cache holds a build of these sources by ``compiler`` (so
    loading them compiles nothing)."""
    return any(target.exists() for _, target in _targets(compiler, checks))


def _targets(compiler: str, checks: bool) -> list[tuple[list[str], Path]]:
    """Each way to build, best first: its flags and where its build is cached."""
    source = _source_digest()
    base = [*_BASE_FLAGS, *(_CHECK_FLAGS if checks else [])]
    # Link-time optimisation and OpenMP's simd pragmas where the compiler has them (the
    # threads are pool.c's, not OpenMP's runtime). Link-time optimisation changes no
    # result (no fast-math, no contraction) but the speed: GCC 12 runs the one-row k-quant
    # products 40% faster with it (bench/cpu_products.py).
    candidates = [[*base, "-flto", "-fopenmp-simd"], [*base, "-fopenmp-simd"], base]
    return [(flags, _target(source, compiler, flags)) for flags in candidates]


def _build(compiler: str, checks: bool) -> Path:
    targets = _targets(compiler, checks)
    base = targets[-1][0]
    for _, target in targets:  # a build made before, the first that the compiler took
        if target.exists():
            return target
    for flags, target in targets:
        try:
            _compile(compiler, flags, target)
            log.info(
                "native.compiled",
                path=str(target),
                openmp_simd="-fopenmp-simd" in flags,
                lto="-flto" in flags,
            )
            return target
        except subprocess.CalledProcessError:
            if flags is base:
                raise
    raise AssertionError("unreachable")


def _target(source: bytes, compiler: str, flags: list[str]) -> Path:
    key = hashlib.sha256(source + " ".join([compiler, *flags, _cpu_identity()]).encode())
    return cache_dir("native") / key.hexdigest()[:24] / "libspnlcpu.so"


def _source_digest() -> bytes:
    """Every source and header, each by name and content: a change to any one rebuilds."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        text = path.read_bytes()
        digest.update(f"{path.name} {len(text)}\n".encode() + text)
    return digest.digest()


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: a cache shared by machines with different CPUs
    (a network home) must not hand one's instructions to another."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags.strip()}"


def _compile(compiler: str, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", str(built), "-lm", "-pthread"],
            check=True,
            capture_output=True,
            text=True,
        )
        built.rename(target)
