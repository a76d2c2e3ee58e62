// K-quants in tiles of 16 rows: the same bytes as the file's rows, reordered once at load
// so that the products read 16 weight rows side by side (included by quant_matmul.c). Q4_K
// and Q6_K, the formats of nearly every weight of a Q4_K_M file.
//
// A matrix's first n_rows / 16 * 16 rows are tiles; a last group of fewer rows stays as
// rows. Tile t, block b is 16 blocks' bytes, contiguous: the block's 32-bit words of rows
// 0..15 side by side, so that word w is one 64-byte vector with row r in lane r,
//
//     words[slot(w)][r][0..3] = rows[16 t + r][b][4 w .. 4 w + 3],
//
// and the bytes past its last whole word (Q6_K's float16 d: 2 a row) of the 16 rows, one
// after another. Q4_K's 144 bytes are 36 words, in their order; Q6_K's 210 are 52 words and
// 2 bytes, its words in the order its kernel reads them (tile_slot): read out of order, its
// three parts' words interleaved, the hardware prefetchers of a Zen 4 stopped following,
// and a product from memory read 8 GB/s instead of 25. Its tile blocks are 3,360 bytes,
// half a cache line past a whole number: the 32 bytes of d's end an even block and begin an
// odd one, which keeps every block's words on whole cache lines (from a tile on a whole
// line).
//
// A product then takes 4 values of 16 rows per VNNI dot product, one broadcast of 4
// activations against all of them, and weighs a sub-block's sums for 16 rows by their
// scales at once: on a Zen 4 about 11 cycles a Q4_K block where the one-row kernel on rows
// takes 19 (its scales spread, and its sums folded, block by block). The integers per
// block and row are k_dot's, and each row's float sums are taken in block order as k_dot
// takes them: the same bits as the rows, for every number of activation rows. The torch
// twin of the reordering is `quant.tiles`.

#define TILE16 16
#define TILE_MAX_K 65536  // values a tiled row may have: the fallbacks hold one on the stack
#define Q4K_TILE_BLOCK_BYTES (TILE16 * 144)
#define Q6K_TILE_BLOCK_BYTES (TILE16 * 210)

// Rows a matrix of n_rows keeps as tiles.
static inline int64_t tiled_rows(int64_t n_rows) { return n_rows / TILE16 * TILE16; }

// Where word w of a block of `bytes` bytes goes among its tile block's words: Q6_K's (32 of
// ql, 16 of qh, 4 of scales) as q6_k_t16_block reads them, its scales, then for each half h
// and j < 8 the ql words 16h + j and 16h + 8 + j and the qh word 32 + 8h + j; others' stay.
static inline int tile_slot(int bytes, int w) {
    if (bytes != 210) return w;
    if (w >= 48) return w - 48;
    if (w >= 32) return 4 + 24 * ((w - 32) / 8) + 3 * ((w - 32) % 8) + 2;
    return 4 + 24 * (w / 16) + 3 * (w % 8) + (w % 16) / 8;
}

// Where, in tile block b of a format of `bytes` a block, its words begin and its tail.
static inline int64_t tile_words_at(int bytes, int64_t b) { return b & 1 ? TILE16 * (bytes % 4) : 0; }
static inline int64_t tile_tail_at(int bytes, int64_t b) { return b & 1 ? 0 : 64 * (bytes / 4); }

// Block b of row r of the tile at `tile` into the `bytes` bytes at out.
static inline void untile_block(const uint8_t *tile, int bytes, int r, int64_t b, uint8_t *out) {
    const uint8_t *block = tile + b * TILE16 * bytes;
    const uint8_t *words = block + tile_words_at(bytes, b) + 4 * r;
    const int n_words = bytes / 4, tail = bytes % 4;
    for (int w = 0; w < n_words; w++) memcpy(out + 4 * w, words + 64 * tile_slot(bytes, w), 4);
    if (tail) memcpy(out + 4 * n_words, block + tile_tail_at(bytes, b) + tail * r, (size_t)tail);
}

// Task t of spnl_tile: tile t reordered (the last task: the rows past the tiles copied).
// In place (src == dst), each worker first copies its tile's 16 rows to its own scratch of
// one tile: a tile's bytes are its own 16 rows', so tiles never reach into each other.
typedef struct {
    const uint8_t *src;
    uint8_t *dst, *scratch;
    int64_t n_rows, blocks;
    int bytes;
} tile_call;

static void tile_task(void *ctx, int64_t t, int worker) {
    const tile_call *c = ctx;
    const int bytes = c->bytes, n_words = bytes / 4, tail = bytes % 4;
    const int64_t row_bytes = c->blocks * bytes, tiles = c->n_rows / TILE16;
    if (t == tiles) {
        const int64_t first = tiles * TILE16;
        if (c->src != c->dst)
            memcpy(c->dst + first * row_bytes, c->src + first * row_bytes,
                   (size_t)((c->n_rows - first) * row_bytes));
        return;
    }
    const uint8_t *src = c->src + t * TILE16 * row_bytes;
    uint8_t *dst = c->dst + t * TILE16 * row_bytes;
    if (c->scratch) {
        uint8_t *own = c->scratch + (int64_t)worker * TILE16 * row_bytes;
        memcpy(own, src, (size_t)(TILE16 * row_bytes));
        src = own;
    }
    for (int64_t b = 0; b < c->blocks; b++) {
        const uint8_t *from = src + b * bytes;
        uint8_t *block = dst + b * TILE16 * bytes, *words = block + tile_words_at(bytes, b);
#if defined(INT8_PATH) && defined(K_DIRECT_FILL)
        // the tile fill's transpositions (quant_int8.h): 16 words of 16 rows, then 4
        __m512i columns[16];
        int w = 0;
        for (; w + 16 <= n_words; w += 16) {
            columns16(from + 4 * w, row_bytes, columns);
            for (int i = 0; i < 16; i++)
                _mm512_storeu_si512((void *)(words + 64 * tile_slot(bytes, w + i)), columns[i]);
        }
        for (; w < n_words; w += 4) {  // both formats' words: 16 k + 4
            columns4(from + 4 * w, row_bytes, columns);
            for (int i = 0; i < 4; i++)
                _mm512_storeu_si512((void *)(words + 64 * tile_slot(bytes, w + i)), columns[i]);
        }
#else
        for (int w = 0; w < n_words; w++)
            for (int r = 0; r < TILE16; r++)
                memcpy(words + 64 * tile_slot(bytes, w) + 4 * r, from + r * row_bytes + 4 * w, 4);
#endif
        for (int r = 0; tail && r < TILE16; r++)
            memcpy(block + tile_tail_at(bytes, b) + tail * r, from + r * row_bytes + 4 * n_words,
                   (size_t)tail);
    }
}

// Bytes of a block of the formats that have tiles (GGML's numbers), else 0.
static inline int tile_format_bytes(int qtype) {
    return qtype == Q4_K ? 144 : qtype == Q6_K ? 210 : 0;
}

// dst = the matrix src [n_rows][k_in] of GGML type qtype (Q4_K or Q6_K) in tiles (the
// same number of bytes): a buffer of its own, or src itself (in place, with one tile of
// scratch a worker); never one that overlaps src otherwise.
int spnl_tile(int qtype, const uint8_t *src, int64_t src_bytes, int64_t n_rows, int64_t k_in,
              uint8_t *dst, int threads) {
    const int bytes = tile_format_bytes(qtype);
    if (!bytes || n_rows < 0 || k_in < 1 || k_in % QK_K || k_in > TILE_MAX_K) return BAD_ARGUMENT;
    const int64_t blocks = k_in / QK_K;
    if (n_rows > src_bytes / (blocks * bytes)) return OUT_OF_BOUNDS;
    const int64_t matrix = n_rows * blocks * bytes;
    const int in_place = dst == src;
    if (!in_place && dst < src + matrix && src < dst + matrix) return BAD_ARGUMENT;
    const int workers = threads < 1 ? 1 : threads;  // spnl_parallel's workers are 0 .. threads - 1
    uint8_t *scratch = NULL;
    if (in_place && n_rows >= TILE16) {
        scratch = malloc((size_t)workers * TILE16 * blocks * bytes);
        if (!scratch) return NO_MEMORY;
    }
    tile_call call = {src, dst, scratch, n_rows, blocks, bytes};
    spnl_parallel(n_rows / TILE16 + 1, tile_task, &call, threads);
    free(scratch);
    return 0;
}

// ---- the formats' kernels on tiles ----------------------------------------------------------

// Row r of the tile at `tile`, as a row at out.
static void untile_row(const uint8_t *tile, int bytes, int64_t blocks, int r, uint8_t *out) {
    for (int64_t b = 0; b < blocks; b++) untile_block(tile, bytes, r, b, out + b * bytes);
}

// A tile's rows one at a time, each as a row on the stack, through the rows' kernel `fn`
// (the rows past the tiles as they are). Rows of at most TILE_MAX_K values (spnl_tile).
#define TILE_AS_ROWS(fn, bytes, acts, rows, k_in, w, count, y, stride)                          \
    do {                                                                                       \
        if ((count) < TILE16) {                                                                \
            fn(acts, rows, k_in, w, count, y, stride);                                         \
            break;                                                                             \
        }                                                                                      \
        uint8_t row_[(k_in) / QK_K * (bytes)];                                                 \
        for (int r_ = 0; r_ < TILE16; r_++) {                                                  \
            untile_row(w, bytes, (k_in) / QK_K, r_, row_);                                     \
            fn(acts, rows, k_in, row_, 1, (y) + r_, stride);                                   \
        }                                                                                      \
    } while (0)

// Each tiled format's float kernel (exact, rare: batch invariance's float32 mode) and its
// dequantized rows, each block gathered from its tile (or read as a row past the tiles).
#define TILE_KERNELS(NAME, BYTES)                                                              \
    static void NAME##_t16_f32(const void *acts, int64_t rows, int64_t k_in, const uint8_t *w, \
                               int64_t count, float *y, int64_t stride) {                      \
        TILE_AS_ROWS(NAME##_f32, BYTES, acts, rows, k_in, w, count, y, stride);                \
    }                                                                                          \
    static void NAME##_t16_row(void *ctx, int64_t i, int worker) {                             \
        (void)worker;                                                                          \
        const rows_call *c = ctx;                                                              \
        const int64_t blocks = c->k_in / QK_K, row_bytes = blocks * (BYTES);                   \
        const int64_t id = c->ids ? c->ids[i] : i;                                             \
        const bool tiled = id < tiled_rows(c->n_rows);                                         \
        const uint8_t *tile = c->w + id / TILE16 * TILE16 * row_bytes;                         \
        v16f values[QK_K / 16];                                                                \
        uint8_t block[BYTES];                                                                  \
        for (int64_t b = 0; b < blocks; b++) {                                                 \
            if (tiled) untile_block(tile, BYTES, (int)(id % TILE16), b, block);                \
            else memcpy(block, c->w + id * row_bytes + b * (BYTES), BYTES);                    \
            dq_##NAME(block, values);                                                          \
            memcpy(c->out + i * c->k_in + b * QK_K, values, sizeof values);                    \
        }                                                                                      \
    }                                                                                          \
    static void NAME##_t16_rows(const uint8_t *w, const int64_t *ids, int64_t count,           \
                                int64_t k_in, int64_t n_rows, float *out, int threads) {       \
        rows_call call = {w, ids, k_in, n_rows, out};                                          \
        spnl_parallel(count, NAME##_t16_row, &call, threads);                                  \
    }
TILE_KERNELS(q4_k, 144)
TILE_KERNELS(q6_k, 210)

#ifdef INT8_PATH
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TILES_NATIVE 1

// Where each block's lines are asked for, in bytes from the block (-1: not at all): its own
// lines, just before its loads. On a Zen 4 the one-row product from memory read 23.7-25.1
// GB/s so at 1 thread against 22.9-23.1 without, and 34.8 against 32.9 at 2; half a block
// or more ahead, slower (17.9-20.8: it overruns the hardware prefetchers), as for the rows'
// one-row kernels there (build.py's _TUNING).
#ifndef T16_PREFETCH
#define T16_PREFETCH 0
#endif

// Byte i of each 32-bit word, in both of its int16 halves.
static inline __m512i byte_in_halves(__m512i v, int i) {
    const __m128i at = _mm_setr_epi8(i, -1, i, -1, 4 + i, -1, 4 + i, -1, 8 + i, -1, 8 + i, -1,
                                     12 + i, -1, 12 + i, -1);
    return _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(at));
}

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// One block of the tile (tb: its 2,304 bytes) against activation rows a[0..mr): each row's
// S and M for the 16 weight rows, as k_tile_rows finds them, onto its float sums.
static inline __attribute__((always_inline)) void q4_k_t16_block(int mr, const uint8_t *tb,
                                                            const act_block *a, __m512 *ss,
                                                            __m512 *ms) {
    const __m512i *v = (const __m512i *)tb;
    __m512i head[4], sc[2], mn[2];
    for (int q = 0; q < 4; q++) head[q] = _mm512_loadu_si512(v + q);
    q4_k_scale_bytes(head, sc, mn);
    const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8((char)0xF0);
    __m512i sums[KT_MR];
    for (int i = 0; i < mr; i++) sums[i] = _mm512_setzero_si512();
    // Words 8c..8c+7 of the values: values 64c + 4k of each row in their low nibbles
    // (sub-block 2c), 64c + 32 + 4k in their high ones (2c + 1). Each half sub-block one
    // chain of 4 dot products (within int16: 16 x 15 x 127); the high nibbles are taken in
    // place (16 times the value), their sums shifted back, exactly.
    // unrolled whole: the masks, shifts and shuffles below then take constants
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        const __m512i *p = v + 4 + 8 * c;
#pragma GCC unroll 2
        for (int high = 0; high < 2; high++) {
            const __m512i mask = high ? high4 : low4;
            const int g = 16 * c + 8 * high;  // the first group of 4 values
            __m512i lo[KT_MR], hi[KT_MR];
            for (int i = 0; i < mr; i++) lo[i] = hi[i] = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) {
                const __m512i u0 = _mm512_and_si512(_mm512_loadu_si512(p + k), mask);
                const __m512i u1 = _mm512_and_si512(_mm512_loadu_si512(p + k + 4), mask);
                for (int i = 0; i < mr; i++) {
                    lo[i] = _mm512_dpbusd_epi32(lo[i], u0, bcast4(a[i].q + 4 * (g + k)));
                    hi[i] = _mm512_dpbusd_epi32(hi[i], u1, bcast4(a[i].q + 4 * (g + k + 4)));
                }
            }
            const int s = 2 * c + high;
            const __m512i pair = byte_in_halves(sc[s / 4], s % 4);
            for (int i = 0; i < mr; i++) {
                const __m512i halves =
                    high ? _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srai_epi32(lo[i], 4),
                                                   _mm512_slli_epi32(hi[i], 12))
                         : _mm512_mask_blend_epi16(0xAAAAAAAA, lo[i], _mm512_slli_epi32(hi[i], 16));
                sums[i] = _mm512_dpwssd_epi32(sums[i], halves, pair);
            }
        }
    }
    __m512 d, dmin;
    halves_to_float(head[0], &d, &dmin);
    dmin = _mm512_xor_ps(dmin, _mm512_set1_ps(-0.0f));  // k_dot takes -dmin
    for (int i = 0; i < mr; i++) {
        __m512i offsets = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)  // sub-block j's minimum against its two sums of 16
            offsets = _mm512_dpwssd_epi32(offsets, byte_in_halves(mn[j / 4], j % 4),
                                          bcast4((const int8_t *)(a[i].bsums + 2 * j)));
        const __m512 by = _mm512_set1_ps(a[i].d);
        ss[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i]), _mm512_mul_ps(d, by), ss[i]);
        ms[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(offsets), _mm512_mul_ps(dmin, by), ms[i]);
    }
}

// Activation rows m..m+mr-1 against every block of one tile: 16 results each, at
// y + i * stride.
static inline __attribute__((always_inline)) void q4_k_t16_tile(int mr, const act_rows *x, int64_t m,
                                                           int64_t blocks, const uint8_t *tile,
                                                           float *y, int64_t stride) {
    __m512 ss[KT_MR], ms[KT_MR];
    for (int i = 0; i < mr; i++) ss[i] = ms[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        act_block a[KT_MR];
        for (int i = 0; i < mr; i++) a[i] = acts_256(x, (m + i) * blocks + b);
#if T16_PREFETCH >= 0
        prefetch_lines(tile + b * Q4K_TILE_BLOCK_BYTES + T16_PREFETCH, Q4K_TILE_BLOCK_BYTES);
#endif
        q4_k_t16_block(mr, tile + b * Q4K_TILE_BLOCK_BYTES, a, ss, ms);
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(y + i * stride, _mm512_add_ps(ss[i], ms[i]));
}


// Q6_K: per block, 32 words of low nibbles (ql), 16 of two-bit crumbs (qh), 4 of int8
// scales (one per 16 values), then d. Word 16h + j of ql holds, in its low nibbles, values
// 128h + 4j + [0, 4) and in its high ones those 64 later; word 16h + 8 + j those 32 later
// again; word 32 + 8h + j of qh their top two bits: value group 128h + 32k + 4j (k < 4) in
// its crumbs k (bits 2k, 2k + 1). That group belongs to sub-block 8h + 2k + j / 4.

// Scale s of 16 rows (sc: their 4 words of scales) sign-extended to 32 bits.
static inline __m512i q6_k_scale(const __m512i *sc, int s) {
    return _mm512_srai_epi32(_mm512_slli_epi32(_mm512_loadu_si512(sc + s / 4), 24 - 8 * (s % 4)), 24);
}

// Scales 2p and 2p + 1 of 16 rows sign-extended to the two int16 halves of each word.
static inline __m512i q6_k_scale_pair(const __m512i *sc, int p) {
    const int i = 2 * (p % 2);
    const __m128i at = _mm_setr_epi8(-1, i, -1, i + 1, -1, 4 + i, -1, 5 + i, -1, 8 + i, -1, 9 + i,
                                     -1, 12 + i, -1, 13 + i);
    return _mm512_srai_epi16(
        _mm512_shuffle_epi8(_mm512_loadu_si512(sc + p / 2), _mm512_broadcast_i32x4(at)), 8);
}

// A Q6_K block's 4 value vectors of 16 rows from its words at `at` (tile_slot's ql word
// 16h + j, ql word 16h + 8 + j, qh word 32 + 8h + j): values 128h + 32k + 4j + [0, 4) of
// each row in u[k], k = 3's 4 times over (their nibble shifted down 2 beside their crumb in
// place: two operations fewer; their sums shifted back, exactly).
static inline __attribute__((always_inline)) void q6_k_values(const __m512i *at, __m512i u[4]) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8((char)0xF0);
    const __m512i crumb = _mm512_set1_epi8(0x30), top = _mm512_set1_epi8((char)0xC0);
    const __m512i q0 = _mm512_loadu_si512(at), q1 = _mm512_loadu_si512(at + 1);
    const __m512i qh = _mm512_loadu_si512(at + 2);
    u[0] = _mm512_ternarylogic_epi32(_mm512_and_si512(q0, low4), _mm512_slli_epi16(qh, 4), crumb,
                                     0xF8);
    u[1] = _mm512_ternarylogic_epi32(_mm512_and_si512(q1, low4), _mm512_slli_epi16(qh, 2), crumb,
                                     0xF8);
    u[2] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(q0, 4), low4), qh, crumb,
                                     0xF8);
    u[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(_mm512_and_si512(q1, high4), 2), qh, top,
                                     0xF8);
}

// One Q6_K block of the tile (its 52 words at `words`, in tile_slot's order; its 16 d's at
// `ds`) against activation rows a[0..mr): each row's S and M for the 16 weight rows, as
// k_dot finds them, onto its float sums. Value group 128h + 32k + 4j (k < 4) belongs to
// sub-block 8h + 2k + j / 4: each k's sums one chain, through j < 4, then 4 <= j < 8, the
// words read in order. (Each k's chain whole, one after another, holds fewer registers and
// measured 1.1x faster at 4 to 16 rows in cache, but reads the words out of order: from
// memory 17-20 GB/s at one row against 27-28.)
static inline __attribute__((always_inline)) void q6_k_t16_block(int mr, const uint8_t *words,
                                                                 const uint8_t *ds,
                                                                 const act_block *a, __m512 *ss,
                                                                 __m512 *ms) {
    const __m512i *v = (const __m512i *)words;
    __m512i sums[KT_MR];
    for (int i = 0; i < mr; i++) sums[i] = _mm512_setzero_si512();
    // unrolled whole: the shifts and offsets below then take constants
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {
            __m512i acc[KT_MR][4];
            for (int i = 0; i < mr; i++)
                for (int k = 0; k < 4; k++) acc[i][k] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int jj = 0; jj < 4; jj++) {
                const int j = 4 * half + jj;
                __m512i u[4];
                q6_k_values(v + 4 + 24 * h + 3 * j, u);
                for (int k = 0; k < 4; k++)
                    for (int i = 0; i < mr; i++)
                        acc[i][k] = _mm512_dpbusd_epi32(acc[i][k], u[k],
                                                        bcast4(a[i].q + 128 * h + 32 * k + 4 * j));
            }
            for (int k = 0; k < 4; k++) {
                const int s = 8 * h + 2 * k + half;
                const __m512i scale = q6_k_scale(v, s);
                for (int i = 0; i < mr; i++) {
                    const __m512i sum = k == 3 ? _mm512_srai_epi32(acc[i][k], 2) : acc[i][k];
                    sums[i] = _mm512_add_epi32(sums[i], _mm512_mullo_epi32(sum, scale));
                }
            }
        }
    }
    __m512i pairs[8];
    for (int p = 0; p < 8; p++) pairs[p] = q6_k_scale_pair(v, p);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)ds));
    const __m512 dmin = _mm512_mul_ps(d, _mm512_set1_ps(-32.0f));  // k_dot's for Q6_K
    for (int i = 0; i < mr; i++) {
        __m512i offsets = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int p = 0; p < 8; p++)  // scales 2p, 2p + 1 against their sums of 16
            offsets = _mm512_dpwssd_epi32(offsets, pairs[p],
                                          bcast4((const int8_t *)(a[i].bsums + 2 * p)));
        const __m512 by = _mm512_set1_ps(a[i].d);
        ss[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i]), _mm512_mul_ps(d, by), ss[i]);
        ms[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(offsets), _mm512_mul_ps(dmin, by), ms[i]);
    }
}

// Activation rows m..m+mr-1 against every Q6_K block of one tile: 16 results each, at
// y + i * stride.
static inline __attribute__((always_inline)) void q6_k_t16_tile(int mr, const act_rows *x,
                                                                int64_t m, int64_t blocks,
                                                                const uint8_t *tile, float *y,
                                                                int64_t stride) {
    __m512 ss[KT_MR], ms[KT_MR];
    for (int i = 0; i < mr; i++) ss[i] = ms[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        act_block a[KT_MR];
        for (int i = 0; i < mr; i++) a[i] = acts_256(x, (m + i) * blocks + b);
        // no lines asked for: its words read in order, the hardware prefetchers follow them
        // (on a Zen 4 from memory, 26.4 GB/s against 19.3 asking for each block's own lines)
        const uint8_t *block = tile + b * Q6K_TILE_BLOCK_BYTES;
        q6_k_t16_block(mr, block + tile_words_at(210, b), block + tile_tail_at(210, b), a, ss, ms);
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(y + i * stride, _mm512_add_ps(ss[i], ms[i]));
}

#endif

// The int8 kernels: a whole tile against every activation row (without AVX-512's VNNI, as
// rows on the stack through the rows' kernel); the rows past the tiles through the rows'.
// Each pass of 4 activation rows unpacks the tile's values again (from L1 or L2): fewer
// instructions than unpacking them once into a k_tile that the rows then read (as the
// rows' tiles are met), 1.1-1.4x faster at 8 to 64 rows for Q4_K.
#ifdef TILES_NATIVE
#define TILE_I8(NAME, BYTES)                                                                   \
    static void NAME##_t16_i8(const void *acts, int64_t rows, int64_t k_in, const uint8_t *w,  \
                              int64_t count, float *y, int64_t stride) {                       \
        if (count < TILE16) {                                                                  \
            NAME##_i8(acts, rows, k_in, w, count, y, stride);                                  \
            return;                                                                            \
        }                                                                                      \
        const act_rows *x = acts;                                                              \
        for (int64_t m = 0; m < rows; m += KT_MR)                                              \
            FOUR_ROWS(NAME##_t16_tile, rows - m, x, m, k_in / QK_K, w, y + m * stride, stride) \
    }
#else
#define TILE_I8(NAME, BYTES)                                                                   \
    static void NAME##_t16_i8(const void *acts, int64_t rows, int64_t k_in, const uint8_t *w,  \
                              int64_t count, float *y, int64_t stride) {                       \
        TILE_AS_ROWS(NAME##_i8, BYTES, acts, rows, k_in, w, count, y, stride);                 \
    }
#endif
TILE_I8(q4_k, 144)
TILE_I8(q6_k, 210)
#endif

// Whether the products on tiles of GGML type qtype have their own kernel here (else they
// run, exactly, a row at a time through the rows' kernel: tiles are worth making only where
// this is 1).
int spnl_tiles_native(int qtype) {
#ifdef TILES_NATIVE
    return tile_format_bytes(qtype) != 0;
#else
    (void)qtype;
    return 0;
#endif
}
