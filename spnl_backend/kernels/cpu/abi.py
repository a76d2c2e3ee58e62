"""The ctypes mirror of ``common.h``: the kernels' argument structs, field for field, and
every entry point's signature. The loader (`kernels.cpu.build`) checks each struct's size
against the library's own answer, so a mirror out of step is refused, not called."""

import ctypes

MAX_HEAD_DIM = 4096  # SPNL_MAX_HEAD_DIM in common.h
PTR, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


# The argument structs of common.h, field for field (the loader checks their sizes).
class ProductsArgs(ctypes.Structure):
    _fields_ = (
        ("count", I32),
        ("qtypes", ctypes.POINTER(I32)),
        ("weights", ctypes.POINTER(PTR)),
        ("w_bytes", ctypes.POINTER(I64)),
        ("n_outs", ctypes.POINTER(I64)),
    )


class Group(ctypes.Structure):
    """Which rows one product of a grouped call takes (``spnl_group``)."""

    _fields_ = (("x_row", I64), ("y_row", I64), ("rows", I64), ("col", I64))


class MoeArgs(ctypes.Structure):
    """A mixture-of-experts layer (``spnl_moe_args``, moe.c)."""

    _fields_ = (
        ("router", PTR),
        ("gate_up", ctypes.POINTER(ProductsArgs)),
        ("down", ctypes.POINTER(ProductsArgs)),
        ("experts", I64),
        ("top_k", I64),
        ("hidden", I64),
        ("inner", I64),
        ("renormalize", I32),
        ("router_bias", PTR),
        ("gate_up_bias", PTR),
        ("down_bias", PTR),
        ("clamped", I32),
        ("alpha", F32),
        ("limit", F32),
    )


class LoraSegment(ctypes.Structure):
    """One adapter's rows of a LoRA product (``spnl_lora_segment``, lora.c)."""

    _fields_ = (
        ("rows", PTR),
        ("count", I64),
        ("a", PTR),
        ("bt", PTR),
        ("rank", I64),
        ("scale", F32),
    )


class LoraGroup(ctypes.Structure):
    """A step's rows of one adapter slot and scale factor (``spnl_lora_group``)."""

    _fields_ = (("slot", I64), ("factor", ctypes.c_double), ("rows", PTR), ("count", I64))


class LoraTable(ctypes.Structure):
    """A projection's adapters by slot, for the layer blocks (``spnl_lora_table``)."""

    _fields_ = (
        ("slots", I64),
        ("a", ctypes.POINTER(PTR)),
        ("bt", ctypes.POINTER(PTR)),
        ("rank", ctypes.POINTER(I64)),
        ("scale", ctypes.POINTER(ctypes.c_double)),
    )


LORA_PROJECTIONS = 7  # q, k, v, o, gate, up, down (common.h's enum)
GATED_ACTS = {"silu": 0, "gelu_tanh": 1}  # common.h's SPNL_ACT_*: a gated MLP's activation


class ScoringArgs(ctypes.Structure):
    _fields_ = (
        ("scale", F32),
        ("softcap", F32),
        ("window", I64),
        ("sinks", PTR),
        ("chunk", I64),
    )


class AttentionArgs(ctypes.Structure):
    _fields_ = (
        ("slots", PTR),
        ("slot_stride", I64),
        ("slot_width", I64),
        ("lens", PTR),
        ("num_slots", I64),
        ("seqs", I64),
        ("heads", I64),
        ("kv_heads", I64),
        ("dim", I64),
        ("scoring", ScoringArgs),
        ("out", PTR),
        ("threads", I32),
        ("firsts", PTR),
    )


class PagedDecodeArgs(ctypes.Structure):
    _fields_ = (
        ("at", AttentionArgs),
        ("q", PTR),
        ("k_cache", PTR),
        ("v_cache", PTR),
        ("half", I32),
    )


class CodedDecodeArgs(ctypes.Structure):
    _fields_ = (
        ("at", AttentionArgs),
        ("q_rot", PTR),
        ("q", PTR),
        ("k_shift", PTR),
        ("k_anchor", PTR),
        ("v_anchor", PTR),
        ("k_pool", PTR),
        ("v_pool", PTR),
        ("k_bytes", I64),
        ("v_bytes", I64),
        ("k_outliers", I64),
        ("k_lut", PTR),
        ("v_lut", PTR),
        ("k_bits", I32),
        ("v_bits", I32),
    )


class QkArgs(ctypes.Structure):
    _fields_ = (
        ("q", PTR),
        ("k", PTR),
        ("q_row", I64),
        ("k_row", I64),
        ("tokens", I64),
        ("heads", I64),
        ("kv_heads", I64),
        ("head_dim", I64),
        ("rotary_dim", I64),
        ("q_scale", PTR),
        ("k_scale", PTR),
        ("eps", F32),
        ("cos", PTR),
        ("sin", PTR),
    )


class StepArgs(ctypes.Structure):
    """What every layer of one step shares (``spnl_step_args``, layer_blocks.c)."""

    _fields_ = (
        ("tokens", I64),
        ("x", PTR),
        ("h", PTR),
        ("qkv", PTR),
        ("q", PTR),
        ("kv", PTR),
        ("attn", PTR),
        ("out", PTR),
        ("gate_up", PTR),
        ("act", PTR),
        ("slot_mapping", PTR),
        ("num_slots", I64),
        ("at", AttentionArgs),
        ("cos", PTR * 2),
        ("sin", PTR * 2),
        ("rotary_dim", I64 * 2),
        ("threads", I32),
        ("exact", I32),
        ("at_windowed", AttentionArgs),
        ("windowed", I32),
        ("scratch", PTR),
        ("scratch_bytes", I64),
        ("lora_groups", ctypes.POINTER(LoraGroup)),
        ("lora_count", I64),
        ("window_slot_mapping", PTR),
        ("window_num_slots", I64),
    )


class LayerArgs(ctypes.Structure):
    """One layer's fixed part (``spnl_layer_args``, layer_blocks.c)."""

    _fields_ = (
        ("qkv", ctypes.POINTER(ProductsArgs)),
        ("o", ctypes.POINTER(ProductsArgs)),
        ("gate_up", ctypes.POINTER(ProductsArgs)),
        ("down", ctypes.POINTER(ProductsArgs)),
        ("hidden", I64),
        ("inner", I64),
        ("heads", I64),
        ("kv_heads", I64),
        ("head_dim", I64),
        ("q_norm", PTR),
        ("k_norm", PTR),
        ("attn_delta_norm", PTR),
        ("attn_out_norm", PTR),
        ("mlp_delta_norm", PTR),
        ("mlp_out_norm", PTR),
        ("eps", F32),
        ("k_cache", PTR),
        ("v_cache", PTR),
        ("half", I32),
        ("local", I32),
        ("scoring", ScoringArgs),
        ("qk_full", I32),
        ("has_clip", I32),
        ("clip", F32),
        ("act", I32),
        ("moe", ctypes.POINTER(MoeArgs)),
        ("lora", ctypes.POINTER(LoraTable) * LORA_PROJECTIONS),
    )


STRUCTS = {  # the C function that answers each struct's size
    "spnl_sizeof_products": ProductsArgs,
    "spnl_sizeof_paged_decode": PagedDecodeArgs,
    "spnl_sizeof_coded_decode": CodedDecodeArgs,
    "spnl_sizeof_qk": QkArgs,
    "spnl_sizeof_step": StepArgs,
    "spnl_sizeof_layer": LayerArgs,
    "spnl_sizeof_group": Group,
    "spnl_sizeof_moe": MoeArgs,
    "spnl_sizeof_lora_segment": LoraSegment,
    "spnl_sizeof_lora_group": LoraGroup,
    "spnl_sizeof_lora_table": LoraTable,
}
# The format numbers of Q4_K's and Q6_K's bytes in tiles of 16 rows (tiles.h, `quant.tiles`):
# the kernels' own, beside GGML's type numbers (1000 past them).
Q4K_TILES = 1012
Q6K_TILES = 1014
TILED_FORMATS = {12: Q4K_TILES, 14: Q6K_TILES}  # by GGML's number of the rows' type

SIGNATURES = {  # name: (argument types, result type)
    "spnl_has_int8": ([], I32),
    "spnl_full_checks": ([], I32),
    **{name: ([], I64) for name in STRUCTS},
    "spnl_row_bytes": ([I32, I64], I64),
    "spnl_qmatmul": ([ctypes.POINTER(ProductsArgs), PTR, I64, I64, PTR, I64, I32, I32], I32),
    "spnl_qmatmul_groups": (
        [ctypes.POINTER(ProductsArgs), PTR, PTR, I64, I64, PTR, I64, I64, I32, I32],
        I32,
    ),
    "spnl_moe_scratch_bytes": ([ctypes.POINTER(MoeArgs), I64], I64),
    "spnl_moe": ([ctypes.POINTER(MoeArgs), PTR, I64, PTR, PTR, I64, I32, I32], I32),
    "spnl_lora_add": (
        [ctypes.POINTER(LoraSegment), I64, PTR, I64, I64, I64, PTR, I64, I64, I32],
        I32,
    ),
    "spnl_dequantize": ([I32, PTR, I64, I64, I64, PTR, I32], I32),
    "spnl_gather_rows": ([I32, PTR, I64, PTR, I64, I64, PTR], I32),
    "spnl_tile": ([I32, PTR, I64, I64, I64, PTR, I32], I32),
    "spnl_tiles_native": ([I32], I32),
    "spnl_rms_norm": ([PTR, PTR, PTR, I64, I64, F32], I32),
    "spnl_add_rms_norm": ([PTR, PTR, PTR, F32, PTR, F32, PTR, I64, I64, I32], I32),
    "spnl_qk_norm_rope": ([ctypes.POINTER(QkArgs), I32], I32),
    "spnl_gated_act": ([I32, PTR, PTR, I64, I64, I64, I64, PTR, I32], I32),
    "spnl_attention_block": ([ctypes.POINTER(StepArgs), ctypes.POINTER(LayerArgs)], I32),
    "spnl_mlp_block": ([ctypes.POINTER(StepArgs), ctypes.POINTER(LayerArgs)], I32),
    "spnl_moe_block": ([ctypes.POINTER(StepArgs), ctypes.POINTER(LayerArgs)], I32),
    "spnl_layers": (
        [ctypes.POINTER(StepArgs), ctypes.POINTER(LayerArgs), I64, ctypes.POINTER(I64)],
        I32,
    ),
    "spnl_store_kv": ([PTR, PTR, PTR, PTR, PTR, I64, I64, I64, I32], I32),
    "spnl_paged_decode": ([ctypes.POINTER(PagedDecodeArgs)], I32),
    "spnl_coded_decode": ([ctypes.POINTER(CodedDecodeArgs)], I32),
    "spnl_delta_rule": ([PTR] * 7 + [I64] * 4 + [I32], I32),
    "spnl_ssd_scan": ([PTR] * 7 + [I64] * 4 + [I32], I32),
    "spnl_selective_scan": ([PTR] * 7 + [I64] * 3 + [I32], I32),
    "spnl_pool_check": ([I64, I32, I32, PTR], I32),
}
STATUS = {
    -1: "rejected its arguments",
    -2: "ran out of memory",
    -3: "found an index out of bounds",
}
