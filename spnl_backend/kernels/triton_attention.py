"""Triton paged attention: one kernel for prefill, chunked prefill, prefix hits and decode.

Twin: `paged_ref.paged_attention_ref`. Each program takes a tile of up to ``BLOCK_Q``
query tokens of one sequence together with all the query heads of one KV head (GQA and
MQA share every K/V tile load), and walks the sequence's keys in tiles of ``TILE``
positions, looked up through the block table, with an online softmax. Sliding windows,
chunks (Llama 4's chunked attention), softcapping, ALiBi, attention sinks and an FP8 cache
are compile-time switches. Long decode contexts are split across ``num_splits`` programs
per tile, and a second kernel merges their partial softmax states (split-KV), so a single
sequence still fills the GPU.

PIC sequences (`kernels.pic`, another compile-time switch) walk their keys in prompt order
instead of through the block table: each key's pool slot, block id and position, and each
query's prompt index, block id and position, come in flat arrays, and the mask is the rule
itself (a key at or before the query, cross on either side or the same element; a window
by position). No mask is materialised.
"""

import math

import torch
import triton
import triton.language as tl

from .metadata import PagedMetadata
from .scoring import Scoring
from .triton_fp8 import fp8_e4m3_decode


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _attention_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_starts_ptr,
    tile_seq_ptr,
    tile_first_ptr,
    alibi_ptr,
    sinks_ptr,
    pic_start_ptr,
    pic_slots_ptr,
    pic_blocks_ptr,
    pic_places_ptr,
    pic_q_ptr,
    scale,
    softcap,
    window,
    chunk,
    k_scale,
    v_scale,
    num_kv_heads,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_table,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    IS_FP8: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
    USE_PIC: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    q_tile, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = tl.load(tile_seq_ptr + q_tile)
    first = tl.load(tile_first_ptr + q_tile)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_begin = tl.load(query_starts_ptr + seq)
    query_len = tl.load(query_starts_ptr + seq + 1) - q_begin
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < query_len)
    q_pos = context_len + token
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr
        + (q_begin + token)[:, None].to(tl.int64) * stride_q_token
        + head[:, None] * stride_q_head
        + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # Keys this tile can see, cut into TILE-sized steps shared out among the splits.
    last = tl.minimum(context_len + first + BLOCK_Q - 1, seq_len - 1)
    start = 0
    if USE_WINDOW:
        start = tl.maximum(context_len + first - window + 1, 0)
    if USE_CHUNK:  # the tile's first query's chunk: its later queries' start no earlier
        start = tl.maximum(start, (context_len + first) // chunk * chunk)
    if USE_PIC:
        # A PIC sequence: seq_len counts its keys in prompt order, and queries carry their
        # prompt index, block id and position (three int32 per token).
        key_start = tl.load(pic_start_ptr + seq)
        is_pic = key_start >= 0
        pic_row = (q_begin + token).to(tl.int64) * 3
        q_index = tl.load(pic_q_ptr + pic_row, mask=row_ok, other=0)
        q_block = tl.load(pic_q_ptr + pic_row + 1, mask=row_ok, other=0)
        q_place = tl.load(pic_q_ptr + pic_row + 2, mask=row_ok, other=0)
        # A PIC tile's keys end at its last query's prompt index (its queries come in
        # prompt order, each seeing keys at or before it).
        last = tl.where(is_pic, tl.max(tl.where(row_ok, q_index, 0), 0), last)
        start = tl.where(is_pic, 0, start)
    first_step = start // TILE
    steps = last // TILE + 1 - first_step
    per_split = tl.cdiv(steps, NUM_SPLITS)
    step_lo = first_step + split * per_split
    step_hi = tl.minimum(step_lo + per_split, first_step + steps)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0)
    for step in range(step_lo, step_hi):
        k_pos = step * TILE + tl.arange(0, TILE)
        k_ok = k_pos < seq_len
        paged = k_ok
        if USE_PIC:
            pic_ok = k_ok & (k_pos * 0 + key_start >= 0)
            paged = k_ok & (k_pos * 0 + key_start < 0)
        page = tl.load(block_tables_ptr + seq * stride_table + k_pos // PAGE, mask=paged, other=0)
        slot = page.to(tl.int64) * PAGE + k_pos % PAGE
        if USE_PIC:
            pic_slot = tl.load(pic_slots_ptr + key_start + k_pos, mask=pic_ok, other=0)
            slot = tl.where(is_pic, pic_slot, slot)
        offsets = (slot[:, None] * num_kv_heads + kv_head) * HEAD_DIM + dims[None, :]
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0)
        v = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0)
        if IS_FP8:
            k = (fp8_e4m3_decode(k) * k_scale).to(q.dtype)
            v = (fp8_e4m3_decode(v) * v_scale).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        if USE_ALIBI:
            s += slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        if USE_CHUNK:
            visible = visible & (k_pos[None, :] >= q_pos[:, None] // chunk * chunk)
        if USE_PIC:
            k_block = tl.load(pic_blocks_ptr + key_start + k_pos, mask=pic_ok, other=0)
            k_place = tl.load(pic_places_ptr + key_start + k_pos, mask=pic_ok, other=0)
            same = k_block[None, :] == q_block[:, None]
            cross = (k_block[None, :] == 0) | (q_block[:, None] == 0)
            seen = (k_pos[None, :] <= q_index[:, None]) & (same | cross)
            seen = seen & k_ok[None, :] & row_ok[:, None]
            if USE_WINDOW:
                seen = seen & (q_place[:, None] - k_place[None, :] < window)
            visible = tl.where(is_pic, seen, visible)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS == 1:
        if USE_SINKS:  # the sink joins the softmax's peak and denominator, with no value
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0)
            m_all = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_all)
            l_i = l_i * alpha + tl.exp(sink - m_all)
            acc = acc * alpha[:, None]
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # 0 only in masked rows
        tl.store(
            out_ptr
            + (q_begin + token)[:, None].to(tl.int64) * stride_o_token
            + head[:, None] * stride_o_head
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        state = (q_tile * num_kv_heads + kv_head) * NUM_SPLITS + split
        tl.store(m_ptr + state * BLOCK_M + rows, m_i)
        tl.store(l_ptr + state * BLOCK_M + rows, l_i)
        tl.store(acc_ptr + (state * BLOCK_M + rows)[:, None] * HEAD_DIM_PAD + dims[None, :], acc)


@triton.jit
def _merge_splits_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    tile_seq_ptr,
    tile_first_ptr,
    query_starts_ptr,
    sinks_ptr,
    num_kv_heads,
    stride_o_token,
    stride_o_head,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    q_tile, kv_head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(tile_seq_ptr + q_tile)
    first = tl.load(tile_first_ptr + q_tile)
    q_begin = tl.load(query_starts_ptr + seq)
    query_len = tl.load(query_starts_ptr + seq + 1) - q_begin
    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < query_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    base = (q_tile * num_kv_heads + kv_head) * NUM_SPLITS
    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0)
        m_max = sink
    for split in range(NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(m_ptr + (base + split) * BLOCK_M + rows))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:
        l_sum = tl.exp(sink - m_safe)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for split in range(NUM_SPLITS):
        state = (base + split) * BLOCK_M + rows
        weight = tl.exp(tl.load(m_ptr + state) - m_safe)
        l_sum += tl.load(l_ptr + state) * weight
        acc += tl.load(acc_ptr + state[:, None] * HEAD_DIM_PAD + dims[None, :]) * weight[:, None]
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    tl.store(
        out_ptr
        + (q_begin + token)[:, None].to(tl.int64) * stride_o_token
        + head[:, None] * stride_o_head
        + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :],
    )


def paged_attention_triton(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedMetadata,
    scoring: Scoring,
    *,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention for the packed queries ``q [T, heads, head_dim]`` of several sequences over
    the paged cache; the same contract as `paged_attention_ref`."""
    _, heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group = heads // num_kv_heads
    plan = meta.memo(("triton_plan", group), lambda: _Plan(group, meta.query_lens, q.device))
    splits = num_splits or plan.splits(num_kv_heads, max(meta.seq_lens), q.device)
    out = torch.empty_like(q)
    is_fp8 = key_cache.dtype == torch.float8_e4m3fn
    if is_fp8:
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    pad = max(triton.next_power_of_2(head_dim), 16)
    programs = len(plan.tile_seq)
    shape = (programs * num_kv_heads * splits, plan.block_m)
    m = torch.empty(shape if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    l_state = torch.empty_like(m)
    acc = torch.empty((*shape, pad) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    query_starts = meta.query_starts
    lens = meta.memo(
        "seq_lens_i32", lambda: torch.tensor(meta.seq_lens, dtype=torch.int32, device=q.device)
    )
    tables = meta.memo("tables_i32", lambda: meta.block_tables.to(dtype=torch.int32))
    alibi = alibi_slopes if alibi_slopes is not None else q.new_zeros(1)
    pic = None
    if meta.pic is not None:
        if alibi_slopes is not None or scoring.chunk is not None:
            raise ValueError(
                "PIC sequences take neither ALiBi nor chunked attention: their positions overlap"
            )
        pic = meta.memo("triton_pic", lambda: _PicArrays(meta, q.device))
        lens = pic.lens
    none = lens[:1]
    sinks, window, softcap = scoring.sinks, scoring.window, scoring.softcap
    sink_logits = (sinks if sinks is not None else q.new_zeros(1)).float().contiguous()
    _attention_kernel[(programs, num_kv_heads, splits)](
        q,
        key_cache,
        value_cache,
        out,
        m,
        l_state,
        acc,
        tables,
        lens,
        query_starts,
        plan.tile_seq,
        plan.tile_first,
        alibi.float().contiguous(),
        sink_logits,
        *(none,) * 5
        if pic is None
        else (pic.start, pic.slots, pic.blocks, pic.places, pic.queries),
        float(scoring.scale),
        float(softcap or 1.0),
        int(window or 0),
        int(scoring.chunk or 1),
        float(k_scale),
        float(v_scale),
        num_kv_heads,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        tables.stride(0),
        PAGE=key_cache.shape[1],
        GROUP=group,
        BLOCK_M=plan.block_m,
        BLOCK_Q=plan.block_q,
        TILE=plan.tile,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=pad,
        USE_WINDOW=window is not None,
        USE_CHUNK=scoring.chunk is not None,
        USE_SOFTCAP=softcap is not None,
        USE_ALIBI=alibi_slopes is not None,
        IS_FP8=is_fp8,
        NUM_SPLITS=splits,
        IEEE=q.dtype == torch.float32,
        USE_PIC=pic is not None,
        USE_SINKS=sinks is not None,
    )
    if splits > 1:
        _merge_splits_kernel[(programs, num_kv_heads)](
            m,
            l_state,
            acc,
            out,
            plan.tile_seq,
            plan.tile_first,
            query_starts,
            sink_logits,
            num_kv_heads,
            out.stride(0),
            out.stride(1),
            GROUP=group,
            BLOCK_M=plan.block_m,
            BLOCK_Q=plan.block_q,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=pad,
            NUM_SPLITS=splits,
            USE_SINKS=sinks is not None,
        )
    return out


class _Plan:
    """How the queries are cut into program tiles."""

    def __init__(self, group: int, query_lens: list[int], device: torch.device) -> None:
        prefill = max(query_lens) > 1
        self.block_m = max(triton.next_power_of_2(group), 64 if prefill else 16)
        self.block_q = self.block_m // group
        self.tile = 64 if prefill else 32
        firsts = [
            (seq, first) for seq, n in enumerate(query_lens) for first in range(0, n, self.block_q)
        ]
        self.tile_seq = torch.tensor([s for s, _ in firsts], dtype=torch.int32, device=device)
        self.tile_first = torch.tensor([f for _, f in firsts], dtype=torch.int32, device=device)

    def splits(self, num_kv_heads: int, longest: int, device: torch.device) -> int:
        """Split the keys when there are fewer programs than the GPU has room for."""
        if device.type != "cuda":
            return 1
        programs = len(self.tile_seq) * num_kv_heads
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
        by_work = math.ceil(longest / (4 * self.tile))
        return max(1, min(math.ceil(target / programs), by_work, 32))


class _PicArrays:
    """A step's PIC sequences as the kernel reads them: per sequence the offset of its keys
    in the flat arrays (-1: a plain sequence) and its key count in place of its length;
    per key its pool slot (int64), block id and position; per query token its prompt index,
    block id and position (zeros for a plain sequence's tokens). Built where the step's
    `PicKeys` are (the device), without a round trip to the host."""

    def __init__(self, meta: PagedMetadata, device: torch.device) -> None:
        starts, lens, slots, blocks, places, queries = [], [], [], [], [], []
        offset = 0
        for index, (seq_len, count) in enumerate(zip(meta.seq_lens, meta.query_lens, strict=True)):
            keys = meta.pic_of(index)
            if keys is None:
                starts.append(-1)
                lens.append(seq_len)
                queries.append(torch.zeros((count, 3), dtype=torch.int64, device=device))
                continue
            keys = keys.to(device)
            starts.append(offset)
            lens.append(keys.key_slots.numel())
            offset += keys.key_slots.numel()
            slots.append(keys.key_slots)
            blocks.append(keys.key_blocks)
            places.append(keys.key_positions)
            q = keys.q_index
            queries.append(torch.stack([q, keys.query_blocks(), keys.key_positions[q]], dim=1))
        self.start = torch.tensor(starts, dtype=torch.int32, device=device)
        self.lens = torch.tensor(lens, dtype=torch.int32, device=device)
        self.slots = torch.cat(slots).to(torch.int64)
        self.blocks = torch.cat(blocks).to(torch.int32)
        self.places = torch.cat(places).to(torch.int32)
        self.queries = torch.cat(queries).to(torch.int32).contiguous()
