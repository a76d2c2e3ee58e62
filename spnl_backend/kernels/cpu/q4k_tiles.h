// Q4_K in tiles of 16 rows: the same bytes as the file's rows, reordered once at load so
// that the products read 16 weight rows side by side (included by quant_matmul.c).
//
// A matrix's first n_rows / 16 * 16 rows are tiles; a last group of fewer rows stays as
// rows. Tile t, block b is 2,304 contiguous bytes (16 blocks of 144): the block's 36
// 32-bit words (4 of header: d, dmin, the 12 scale bytes; 32 of values), word w of rows
// 0..15 side by side, so that word w is one 64-byte vector with row r in lane r:
//
//     tiled[t][b][w][r][0..3] = rows[16 t + r][b][4 w .. 4 w + 3]
//
// A product then takes 4 values of 16 rows per VNNI dot product, one broadcast of 4
// activations against all of them, and weighs a sub-block's sums for 16 rows by their
// scales in one int16 dot product: about 11 cycles a block on a Zen 4, where the one-row
// kernel on rows takes 19 (its scales spread, and its sums folded, block by block). The
// integers per block and row are k_dot's, and each row's float sums are taken in block
// order as k_dot takes them: the same bits as the rows, for every number of activation
// rows. The torch twin of the reordering is `quant.tiles`.

#define Q4K_TILE_ROWS 16
#define Q4K_TILE_WORDS 36  // 144 bytes
#define Q4K_TILE_BLOCK (Q4K_TILE_ROWS * 144)
#define Q4K_TILE_MAX_K 65536  // values a tiled row may have: the fallbacks hold one on the stack

// Rows a matrix of n_rows keeps as tiles.
static inline int64_t q4k_tiled_rows(int64_t n_rows) { return n_rows / Q4K_TILE_ROWS * Q4K_TILE_ROWS; }

// Block b of row r of the tile at `tile` (blocks per row: `blocks`) into the 144 bytes at out.
static inline void q4k_untile_block(const uint8_t *tile, int64_t blocks, int r, int64_t b,
                                    uint8_t *out) {
    const uint8_t *at = tile + b * Q4K_TILE_BLOCK + 4 * r;
    for (int w = 0; w < Q4K_TILE_WORDS; w++) memcpy(out + 4 * w, at + 64 * w, 4);
}

// Task t of spnl_q4k_tile: tile t reordered (the last task: the rows past the tiles copied).
typedef struct { const uint8_t *src; uint8_t *dst; int64_t n_rows, blocks; } tile_call;

static void tile_task(void *ctx, int64_t t, int worker) {
    (void)worker;
    const tile_call *c = ctx;
    const int64_t row_bytes = c->blocks * 144, tiles = c->n_rows / Q4K_TILE_ROWS;
    if (t == tiles) {
        const int64_t first = tiles * Q4K_TILE_ROWS;
        memcpy(c->dst + first * row_bytes, c->src + first * row_bytes,
               (size_t)((c->n_rows - first) * row_bytes));
        return;
    }
    const uint8_t *src = c->src + t * Q4K_TILE_ROWS * row_bytes;
    uint8_t *dst = c->dst + t * Q4K_TILE_ROWS * row_bytes;
    for (int64_t b = 0; b < c->blocks; b++) {
#if defined(INT8_PATH) && defined(K_DIRECT_FILL)
        // the tile fill's transpositions (quant_int8.h): 4 then 2 x 16 words of 16 rows
        __m512i words[Q4K_TILE_WORDS];
        columns4(src + b * 144, row_bytes, words);
        for (int h = 0; h < 2; h++) columns16(src + b * 144 + 16 + 64 * h, row_bytes, words + 4 + 16 * h);
        for (int w = 0; w < Q4K_TILE_WORDS; w++)
            _mm512_storeu_si512((void *)(dst + b * Q4K_TILE_BLOCK + 64 * w), words[w]);
#else
        for (int w = 0; w < Q4K_TILE_WORDS; w++)
            for (int r = 0; r < Q4K_TILE_ROWS; r++)
                memcpy(dst + b * Q4K_TILE_BLOCK + 64 * w + 4 * r,
                       src + r * row_bytes + b * 144 + 4 * w, 4);
#endif
    }
}

// dst = the Q4_K matrix src [n_rows][k_in] in tiles (the same number of bytes).
int spnl_q4k_tile(const uint8_t *src, int64_t src_bytes, int64_t n_rows, int64_t k_in,
                  uint8_t *dst, int threads) {
    if (n_rows < 0 || k_in < 1 || k_in % QK_K || k_in > Q4K_TILE_MAX_K) return BAD_ARGUMENT;
    const int64_t blocks = k_in / QK_K;
    if (n_rows > src_bytes / (blocks * 144)) return OUT_OF_BOUNDS;
    tile_call call = {src, dst, n_rows, blocks};
    spnl_parallel(n_rows / Q4K_TILE_ROWS + 1, tile_task, &call, threads);
    return 0;
}

// ---- the formats' kernels on tiles ----------------------------------------------------------

// Row r of the tile at `tile`, as a row at out.
static void q4k_untile_row(const uint8_t *tile, int64_t blocks, int r, uint8_t *out) {
    for (int64_t b = 0; b < blocks; b++) q4k_untile_block(tile, blocks, r, b, out + b * 144);
}

// A tile's rows one at a time, each as a row on the stack, through Q4_K's kernel `fn` (the
// rows past the tiles as they are). Rows of at most Q4K_TILE_MAX_K values (spnl_q4k_tile).
#define Q4K_AS_ROWS(fn, acts, rows, k_in, w, count, y, stride)                                 \
    do {                                                                                       \
        if ((count) < Q4K_TILE_ROWS) {                                                         \
            fn(acts, rows, k_in, w, count, y, stride);                                         \
            break;                                                                             \
        }                                                                                      \
        uint8_t row_[(k_in) / QK_K * 144];                                                     \
        for (int r_ = 0; r_ < Q4K_TILE_ROWS; r_++) {                                           \
            q4k_untile_row(w, (k_in) / QK_K, r_, row_);                                        \
            fn(acts, rows, k_in, row_, 1, (y) + r_, stride);                                   \
        }                                                                                      \
    } while (0)

// The float kernel (exact, rare: batch invariance's float32 mode).
static void q4_k_t16_f32(const void *acts, int64_t rows, int64_t k_in, const uint8_t *w,
                         int64_t count, float *y, int64_t stride) {
    Q4K_AS_ROWS(q4_k_f32, acts, rows, k_in, w, count, y, stride);
}

// Dequantized rows: each block gathered from its tile (or read as a row past the tiles).
static void q4_k_t16_row(void *ctx, int64_t i, int worker) {
    (void)worker;
    const rows_call *c = ctx;
    const int64_t blocks = c->k_in / QK_K, row_bytes = blocks * 144;
    const int64_t id = c->ids ? c->ids[i] : i;
    const bool tiled = id < q4k_tiled_rows(c->n_rows);
    const uint8_t *tile = c->w + id / Q4K_TILE_ROWS * Q4K_TILE_ROWS * row_bytes;
    v16f values[QK_K / 16];
    uint8_t block[144];
    for (int64_t b = 0; b < blocks; b++) {
        if (tiled) q4k_untile_block(tile, blocks, (int)(id % Q4K_TILE_ROWS), b, block);
        else memcpy(block, c->w + id * row_bytes + b * 144, 144);
        dq_q4_k(block, values);
        memcpy(c->out + i * c->k_in + b * QK_K, values, sizeof values);
    }
}

static void q4_k_t16_rows(const uint8_t *w, const int64_t *ids, int64_t count, int64_t k_in,
                          int64_t n_rows, float *out, int threads) {
    rows_call call = {w, ids, k_in, n_rows, out};
    spnl_parallel(count, q4_k_t16_row, &call, threads);
}

#ifdef INT8_PATH
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q4K_TILES_NATIVE 1

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
static inline __attribute__((always_inline)) void t16_block(int mr, const uint8_t *tb,
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
static inline __attribute__((always_inline)) void t16_rows(int mr, const act_rows *x, int64_t m,
                                                           int64_t blocks, const uint8_t *tile,
                                                           float *y, int64_t stride) {
    __m512 ss[KT_MR], ms[KT_MR];
    for (int i = 0; i < mr; i++) ss[i] = ms[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        act_block a[KT_MR];
        for (int i = 0; i < mr; i++) a[i] = acts_256(x, (m + i) * blocks + b);
#if T16_PREFETCH >= 0
        prefetch_lines(tile + b * Q4K_TILE_BLOCK + T16_PREFETCH, Q4K_TILE_BLOCK);
#endif
        t16_block(mr, tile + b * Q4K_TILE_BLOCK, a, ss, ms);
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(y + i * stride, _mm512_add_ps(ss[i], ms[i]));
}

#endif

// The int8 kernel: a whole tile against every activation row (without AVX-512's VNNI, as
// rows on the stack through Q4_K's kernel); the rows past the tiles through Q4_K's.
static void q4_k_t16_i8(const void *acts, int64_t rows, int64_t k_in, const uint8_t *w,
                        int64_t count, float *y, int64_t stride) {
#ifdef Q4K_TILES_NATIVE
    // Each pass of 4 activation rows unpacks the tile's values again (from L1 or L2): fewer
    // instructions than unpacking them once into a k_tile that the rows then read (as the
    // rows' tiles are met), 1.1-1.4x faster at 8 to 64 rows.
    if (count == Q4K_TILE_ROWS) {
        const act_rows *x = acts;
        for (int64_t m = 0; m < rows; m += KT_MR)
            FOUR_ROWS(t16_rows, rows - m, x, m, k_in / QK_K, w, y + m * stride, stride)
        return;
    }
#endif
    Q4K_AS_ROWS(q4_k_i8, acts, rows, k_in, w, count, y, stride);
}
#endif

// Whether the products on tiles have their own kernel here (else they run, exactly, a row
// at a time through Q4_K's: tiles are worth making only where this is 1).
int spnl_q4k_tiles_native(void) {
#ifdef Q4K_TILES_NATIVE
    return 1;
#else
    return 0;
#endif
}
