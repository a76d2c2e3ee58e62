// Quantized matrix products: y[m][n] = sum_k x[m][k] * W[n][k], with W kept in its GGML
// blocks (twin: spnl_backend/quant/ggml.py, then a float product). Each block is dequantized
// in vector registers with exactly the arithmetic of the torch twin and multiplied with
// float32 activations, so results differ from the twin only in the order of the sums; or,
// where AVX2 compiles it, multiplied with int8 activations in integers. Tiles of rows of W
// are the pool's tasks (pool.c); the rows of x (a decode batch) reuse each block. Also the exact
// dequantization of whole matrices (prefill) and of single rows (embeddings).

#include "common.h"

#define QK_K 256
#define MAX_ROWS 64  // activation rows the float kernels meet at once

// GGML's type ids (gguf.GGMLQuantizationType).
enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
       Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30, MXFP4 = 39 };
// Not GGML's: Q4_K's and Q6_K's bytes reordered in tiles of 16 rows (tiles.h, quant/tiles.py).
enum { Q4_K_T16 = 1012, Q6_K_T16 = 1014 };

// Every block format once: type id, name, values and bytes per block. The float kernels,
// the int8 kernels (quant_int8.h) and the FORMATS table are each stamped out from it.
#define BLOCK_FORMATS(X)                                                                       \
    X(Q4_0, q4_0, 32, 18) X(Q4_1, q4_1, 32, 20) X(Q5_0, q5_0, 32, 22)                         \
    X(Q5_1, q5_1, 32, 24) X(Q8_0, q8_0, 32, 34) X(Q8_1, q8_1, 32, 36)                         \
    X(Q2_K, q2_k, 256, 84) X(Q3_K, q3_k, 256, 110) X(Q4_K, q4_k, 256, 144)                    \
    X(Q5_K, q5_k, 256, 176) X(Q6_K, q6_k, 256, 210) X(MXFP4, mxfp4, 32, 17)

// ---- one block → its values (as the torch twin computes them), 16 lanes at a time ---------
//
// With AVX-512BW the packed bits are taken apart 16 or 32 bytes at a time before widening;
// elsewhere the same arithmetic runs on 32-bit lanes.

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define BYTE_UNPACK 1
static inline v16f widen_u8(__m128i bytes) {
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
}
static inline v16f widen_i8(__m128i bytes) {
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
#endif

static inline void dq_q4_0(const uint8_t *b, v16f *out) {
    const v16f d = splat(half_to_float(b));
    const v16i q = load_u8(b + 2);
    out[0] = (to_f32(q & 0xF) - 8.0f) * d;
    out[1] = (to_f32(q >> 4) - 8.0f) * d;
}

static inline void dq_q4_1(const uint8_t *b, v16f *out) {
    const v16f d = splat(half_to_float(b)), m = splat(half_to_float(b + 2));
    const v16i q = load_u8(b + 4);
    out[0] = to_f32(q & 0xF) * d + m;
    out[1] = to_f32(q >> 4) * d + m;
}

#ifdef BYTE_UNPACK
static inline void dq_q5_0(const uint8_t *b, v16f *out) {
    const v16f d = splat(half_to_float(b));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const __m128i qs = _mm_loadu_si128((const __m128i *)(b + 6)), low = _mm_set1_epi8(0x0F);
    const __m128i sixteen = _mm_set1_epi8(16);
    const __m128i lo = _mm_or_si128(_mm_and_si128(qs, low),
                                    _mm_maskz_mov_epi8((__mmask16)qh, sixteen));
    const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(qs, 4), low),
                                    _mm_maskz_mov_epi8((__mmask16)(qh >> 16), sixteen));
    out[0] = (widen_u8(lo) - 16.0f) * d;
    out[1] = (widen_u8(hi) - 16.0f) * d;
}
#else
static inline void dq_q5_0(const uint8_t *b, v16f *out) {
    const v16f d = splat(half_to_float(b));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const v16i q = load_u8(b + 6);
    out[0] = (to_f32((q & 0xF) | (bits_of(qh, 0) << 4)) - 16.0f) * d;
    out[1] = (to_f32((q >> 4) | (bits_of(qh, 16) << 4)) - 16.0f) * d;
}

#endif

static inline void dq_q5_1(const uint8_t *b, v16f *out) {
    const v16f d = splat(half_to_float(b)), m = splat(half_to_float(b + 2));
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const v16i q = load_u8(b + 8);
    out[0] = to_f32((q & 0xF) | (bits_of(qh, 0) << 4)) * d + m;
    out[1] = to_f32((q >> 4) | (bits_of(qh, 16) << 4)) * d + m;
}

// MXFP4: an E8M0 exponent byte, then 32 E2M1 values as nibbles (value j low in byte j,
// j + 16 high), ggml's way: the values doubled, as int8, under the scale 2^(e - 128).
static const float E2M1_DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

#ifdef BYTE_UNPACK
static inline void dq_mxfp4(const uint8_t *b, v16f *out) {  // the nibbles index the table
    const v16f d = splat(e8m0_half(b[0]));
    const __m512 table = _mm512_loadu_ps(E2M1_DOUBLED);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 1)), low = _mm_set1_epi8(0x0F);
    const __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(q, low));
    const __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low));
    out[0] = (v16f)_mm512_permutexvar_ps(lo, table) * d;
    out[1] = (v16f)_mm512_permutexvar_ps(hi, table) * d;
}
#else
static inline void dq_mxfp4(const uint8_t *b, v16f *out) {
    const float d = e8m0_half(b[0]);
    float low[16], high[16];
    for (int i = 0; i < 16; i++) {
        low[i] = E2M1_DOUBLED[b[1 + i] & 0xF] * d;
        high[i] = E2M1_DOUBLED[b[1 + i] >> 4] * d;
    }
    out[0] = load_f32(low);
    out[1] = load_f32(high);
}
#endif

static inline void dq_q8_0(const uint8_t *b, v16f *out) {
    const v16f d = splat(half_to_float(b));
    out[0] = to_f32(load_i8(b + 2)) * d;
    out[1] = to_f32(load_i8(b + 18)) * d;
}

static inline void dq_q8_1(const uint8_t *b, v16f *out) {
    const v16f d = splat(half_to_float(b));
    out[0] = to_f32(load_i8(b + 4)) * d;
    out[1] = to_f32(load_i8(b + 20)) * d;
}

static inline void dq_q2_k(const uint8_t *b, v16f *out) {
    const uint8_t *scales = b, *qs = b + 16;
    const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
    for (int h = 0; h < 2; h++)
        for (int part = 0; part < 2; part++) {
            const v16i q = load_u8(qs + h * 32 + part * 16);
            for (int j = 0; j < 4; j++) {
                const int s = h * 8 + j * 2 + part;
                const v16f dl = splat(d * (float)(scales[s] & 0xF));
                const v16f ml = splat(dmin * (float)(scales[s] >> 4));
                out[h * 8 + j * 2 + part] = dl * to_f32((q >> (2 * j)) & 3) - ml;
            }
        }
}

static inline void dq_q3_k(const uint8_t *b, v16f *out) {
    const uint8_t *hmask = b, *qs = b + 32, *packed = b + 96;
    const float d = half_to_float(b + 108);
    for (int h = 0; h < 2; h++)
        for (int part = 0; part < 2; part++) {
            const v16i q = load_u8(qs + h * 32 + part * 16);
            const v16i hm = load_u8(hmask + part * 16);
            for (int j = 0; j < 4; j++) {
                const int s = h * 8 + j * 2 + part;
                const int low = s < 8 ? packed[s] & 0xF : packed[s - 8] >> 4;
                const int high = (packed[8 + s % 4] >> (2 * (s / 4))) & 3;
                const v16f dl = splat(d * ((float)(low | (high << 4)) - 32.0f));
                const v16i bit = (hm >> (h * 4 + j)) & 1;
                out[s] = dl * to_f32(((q >> (2 * j)) & 3) - ((1 - bit) << 2));
            }
        }
}

static inline void k4_scale_min(const uint8_t *p, float d, float dmin, float *sc, float *mn) {
    for (int j = 0; j < 8; j++) {
        const int s = j < 4 ? p[j] & 63 : (p[j + 4] & 0xF) | ((p[j - 4] >> 6) << 4);
        const int m = j < 4 ? p[j + 4] & 63 : (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
        sc[j] = d * (float)s;
        mn[j] = dmin * (float)m;
    }
}

#ifdef BYTE_UNPACK
static inline void dq_q4_k(const uint8_t *b, v16f *out) {
    float sc[8], mn[8];
    k4_scale_min(b + 4, half_to_float(b), half_to_float(b + 2), sc, mn);
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++)
        for (int part = 0; part < 2; part++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 16 + c * 32 + part * 16));
            out[c * 4 + part] = splat(sc[2 * c]) * widen_u8(_mm_and_si128(q, low))
                                - splat(mn[2 * c]);
            out[c * 4 + 2 + part] = splat(sc[2 * c + 1])
                                    * widen_u8(_mm_and_si128(_mm_srli_epi16(q, 4), low))
                                    - splat(mn[2 * c + 1]);
        }
}
#else
static inline void dq_q4_k(const uint8_t *b, v16f *out) {
    float sc[8], mn[8];
    k4_scale_min(b + 4, half_to_float(b), half_to_float(b + 2), sc, mn);
    for (int c = 0; c < 4; c++)
        for (int part = 0; part < 2; part++) {
            const v16i q = load_u8(b + 16 + c * 32 + part * 16);
            out[c * 4 + part] = splat(sc[2 * c]) * to_f32(q & 0xF) - splat(mn[2 * c]);
            out[c * 4 + 2 + part] = splat(sc[2 * c + 1]) * to_f32(q >> 4) - splat(mn[2 * c + 1]);
        }
}

#endif

static inline void dq_q5_k(const uint8_t *b, v16f *out) {
    float sc[8], mn[8];
    k4_scale_min(b + 4, half_to_float(b), half_to_float(b + 2), sc, mn);
    for (int c = 0; c < 4; c++)
        for (int part = 0; part < 2; part++) {
            const v16i q = load_u8(b + 48 + c * 32 + part * 16);
            const v16i qh = load_u8(b + 16 + part * 16);
            const v16i lo = (q & 0xF) | (((qh >> (2 * c)) & 1) << 4);
            const v16i hi = (q >> 4) | (((qh >> (2 * c + 1)) & 1) << 4);
            out[c * 4 + part] = splat(sc[2 * c]) * to_f32(lo) - splat(mn[2 * c]);
            out[c * 4 + 2 + part] = splat(sc[2 * c + 1]) * to_f32(hi) - splat(mn[2 * c + 1]);
        }
}

#ifdef BYTE_UNPACK
static inline void dq_q6_k(const uint8_t *b, v16f *out) {
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = half_to_float(b + 208);
    const __m128i low = _mm_set1_epi8(0x0F), two = _mm_set1_epi8(3), bias = _mm_set1_epi8(32);
    for (int h = 0; h < 2; h++)
        for (int part = 0; part < 2; part++) {
            const __m128i a = _mm_loadu_si128((const __m128i *)(b + h * 64 + part * 16));
            const __m128i c = _mm_loadu_si128((const __m128i *)(b + h * 64 + 32 + part * 16));
            const __m128i hb = _mm_loadu_si128((const __m128i *)(b + 128 + h * 32 + part * 16));
            const __m128i q[4] = {
                _mm_or_si128(_mm_and_si128(a, low), _mm_slli_epi16(_mm_and_si128(hb, two), 4)),
                _mm_or_si128(_mm_and_si128(c, low),
                             _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 2), two), 4)),
                _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), low),
                             _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 4), two), 4)),
                _mm_or_si128(_mm_and_si128(_mm_srli_epi16(c, 4), low),
                             _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 6), two), 4))};
            for (int g = 0; g < 4; g++) {
                const v16f ds = splat(d * (float)scales[h * 8 + 2 * g + part]);
                out[h * 8 + g * 2 + part] = ds * widen_i8(_mm_sub_epi8(q[g], bias));
            }
        }
}
#else
static inline void dq_q6_k(const uint8_t *b, v16f *out) {
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = half_to_float(b + 208);
    for (int h = 0; h < 2; h++)
        for (int part = 0; part < 2; part++) {
            const v16i a = load_u8(b + h * 64 + part * 16);
            const v16i c = load_u8(b + h * 64 + 32 + part * 16);
            const v16i hb = load_u8(b + 128 + h * 32 + part * 16);
            const v16i q[4] = {(a & 0xF) | ((hb & 3) << 4), (c & 0xF) | (((hb >> 2) & 3) << 4),
                               (a >> 4) | (((hb >> 4) & 3) << 4), (c >> 4) | (((hb >> 6) & 3) << 4)};
            for (int g = 0; g < 4; g++) {
                const v16f ds = splat(d * (float)scales[h * 8 + 2 * g + part]);
                out[h * 8 + g * 2 + part] = ds * to_f32(q[g] - 32);
            }
        }
}

#endif

// ---- products with float activations: one weight row against every activation row ---------

// y[m * stride + n] = sum_k x[m][k] * W[n][k]  for m < rows, n < count (consecutive weight
// rows starting at w)
typedef void (*row_fn)(const void *acts, int64_t rows, int64_t k_in, const uint8_t *w,
                       int64_t count, float *y, int64_t stride);
typedef void (*rows_fn)(const uint8_t *, const int64_t *, int64_t, int64_t, int64_t, float *,
                        int);

// Dequantized rows, each a task of the pool: which (ids, or all in order) and where.
typedef struct {
    const uint8_t *w;
    const int64_t *ids;
    int64_t k_in, n_rows;  // n_rows: the matrix's (where its layout depends on them)
    float *out;
} rows_call;

#define DEFINE_FLOAT_KERNELS(NAME, BLOCK, BYTES, DEQUANT)                                      \
    static void NAME##_f32(const void *acts, int64_t rows, int64_t k_in, const uint8_t *w,     \
                           int64_t count, float *y, int64_t stride) {                          \
        const float *x = (const float *)acts;                                                  \
        const int64_t blocks = k_in / BLOCK, row_bytes = blocks * BYTES;                       \
        v16f values[BLOCK / 16];                                                               \
        for (int64_t n = 0; n < count; n++, w += row_bytes) {                                  \
            if (rows == 1) { /* two chains: consecutive FMAs need not wait on each other */    \
                v16f even = {0}, odd = {0};                                                    \
                for (int64_t b = 0; b < blocks; b++) {                                         \
                    DEQUANT(w + b * BYTES, values);                                            \
                    for (int i = 0; i < BLOCK / 16; i += 2) {                                  \
                        even = fma16(values[i], load_f32(x + b * BLOCK + 16 * i), even);       \
                        odd = fma16(values[i + 1], load_f32(x + b * BLOCK + 16 * i + 16), odd); \
                    }                                                                          \
                }                                                                              \
                y[n] = hsum(even + odd);                                                       \
                continue;                                                                      \
            }                                                                                  \
            /* the one-row path's two chains per row: each row sums as it would alone */       \
            v16f even[MAX_ROWS], odd[MAX_ROWS];                                                \
            for (int64_t m = 0; m < rows; m++) even[m] = odd[m] = (v16f){0};                   \
            for (int64_t b = 0; b < blocks; b++) {                                             \
                DEQUANT(w + b * BYTES, values);                                                \
                for (int64_t m = 0; m < rows; m++) {                                           \
                    const float *xm = x + m * k_in + b * BLOCK;                                \
                    v16f e = even[m], o = odd[m];                                              \
                    for (int i = 0; i < BLOCK / 16; i += 2) {                                  \
                        e = fma16(values[i], load_f32(xm + 16 * i), e);                        \
                        o = fma16(values[i + 1], load_f32(xm + 16 * i + 16), o);               \
                    }                                                                          \
                    even[m] = e, odd[m] = o;                                                   \
                }                                                                              \
            }                                                                                  \
            for (int64_t m = 0; m < rows; m++) y[m * stride + n] = hsum(even[m] + odd[m]);     \
        }                                                                                      \
    }                                                                                          \
    /* out[i] = W[ids[i]] (all rows when ids is NULL), dequantized exactly */                  \
    static void NAME##_row(void *ctx, int64_t i, int worker) {                                 \
        (void)worker;                                                                          \
        const rows_call *c = ctx;                                                              \
        const int64_t blocks = c->k_in / BLOCK, row_bytes = blocks * BYTES;                    \
        const uint8_t *row = c->w + (c->ids ? c->ids[i] : i) * row_bytes;                      \
        v16f values[BLOCK / 16];                                                               \
        for (int64_t b = 0; b < blocks; b++) {                                                 \
            DEQUANT(row + b * BYTES, values);                                                  \
            memcpy(c->out + i * c->k_in + b * BLOCK, values, sizeof values);                   \
        }                                                                                      \
    }                                                                                          \
    static void NAME##_rows(const uint8_t *w, const int64_t *ids, int64_t count, int64_t k_in, \
                            int64_t n_rows, float *out, int threads) {                         \
        rows_call call = {w, ids, k_in, n_rows, out};                                          \
        spnl_parallel(count, NAME##_row, &call, threads);                                      \
    }

#define FLOAT_KERNELS(T, NAME, BLOCK, BYTES) DEFINE_FLOAT_KERNELS(NAME, BLOCK, BYTES, dq_##NAME)
BLOCK_FORMATS(FLOAT_KERNELS)

// float16 matrices (Gemma 4's per-layer projection): 32 values as a "block" of 64 bytes,
// widened exactly to float32; no int8 path (rounding the activations would change them).
static inline void dq_f16(const uint8_t *b, v16f *out) {
    out[0] = load_f16((const uint16_t *)b);
    out[1] = load_f16((const uint16_t *)b + 16);
}
DEFINE_FLOAT_KERNELS(f16, 32, 64, dq_f16)

// ---- integer products on 8-bit activations (x86 with AVX2): quant_int8.h ------------------

#if defined(__AVX2__)
#define INT8_PATH 1
#include "quant_int8.h"
#endif
#include "tiles.h"

// ---- the formats and the entry points ------------------------------------------------------

typedef struct {
    int qtype, block, bytes;
    row_fn exact, fast;  // fast: int8 activations (NULL where not compiled)
    rows_fn rows;
} format;

#ifdef INT8_PATH
#define FORMAT(T, NAME, BLOCK, BYTES) {T, BLOCK, BYTES, NAME##_f32, NAME##_i8, NAME##_rows},
#else
#define FORMAT(T, NAME, BLOCK, BYTES) {T, BLOCK, BYTES, NAME##_f32, NULL, NAME##_rows},
#endif

#ifdef INT8_PATH
#define T16_FAST(NAME) NAME##_t16_i8
#else
#define T16_FAST(NAME) NULL
#endif
static const format FORMATS[] = {
    BLOCK_FORMATS(FORMAT){F16, 32, 64, f16_f32, NULL, f16_rows},
    {Q4_K_T16, 256, 144, q4_k_t16_f32, T16_FAST(q4_k), q4_k_t16_rows},
    {Q6_K_T16, 256, 210, q6_k_t16_f32, T16_FAST(q6_k), q6_k_t16_rows}};

static const format *format_of(int qtype, int64_t k_in) {
    if ((qtype == Q4_K_T16 || qtype == Q6_K_T16) && k_in > TILE_MAX_K)
        return NULL;  // no such tiles are made
    for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; i++)
        if (FORMATS[i].qtype == qtype) return k_in % FORMATS[i].block ? NULL : &FORMATS[i];
    return NULL;
}

// Bytes of one row of k_in weights of type qtype (-1: not a type, or not whole blocks).
int64_t spnl_row_bytes(int qtype, int64_t k_in) {
    const format *f = format_of(qtype, k_in);
    return f && k_in > 0 ? k_in / f->block * f->bytes : -1;
}

int spnl_has_int8(void) {
#ifdef INT8_PATH
    return 1;
#else
    return 0;
#endif
}

#define MAX_PRODUCTS 512  // a mixture of experts: gate and up of each of up to 256 experts
#define TILE_ROWS 16  // weight rows per task: spreads the per-row overhead
// A task of a tiled matrix is one tile, or the rows past the last (tiles.h).
_Static_assert(TILE_ROWS == TILE16, "the tiles' kernels take one tile a task");

#ifdef INT8_PATH
typedef struct {
    const float *x;
    int64_t k_in;
    bool b32, b256;
    act_rows *out;
} quantize_call;

// Row m of x as int8 activations, in the blocks the products ask for.
static void quantize_row(void *ctx, int64_t m, int worker) {
    (void)worker;
    const quantize_call *c = ctx;
    const int64_t k_in = c->k_in;
    const float *xm = c->x + m * k_in;
    act_rows *out = c->out;
    if (c->b32)
        quantize_row_32(xm, k_in, out->q32 + m * k_in, out->d32 + m * k_in / 32,
                        out->s32 + m * k_in / 32, out->sums32 + m * k_in / 32);
    if (c->b256)
        quantize_row_256(xm, k_in, out->q256 + m * k_in, out->d256 + m * k_in / 256,
                         out->bsums + m * k_in / 16);
}

// Every row of x [rows][k_in] as int8 activations, in the blocks of 32 and/or of 256 that the
// products ask for, and (k4, one row only) the blocks of 256 also in Q4_K's order for its
// one-row kernel (false: out of memory).
static bool quantize_rows(const float *x, int64_t rows, int64_t k_in, bool b32, bool b256,
                          bool k4, int threads, act_rows *out) {
    const size_t n = (size_t)rows * (size_t)k_in;
    *out = (act_rows){.k = k_in};
    if (b32) {
        out->q32 = malloc(n);
        out->d32 = malloc(n / 32 * sizeof(float));
        out->s32 = malloc(n / 32 * sizeof(float));
        out->sums32 = malloc(n / 32 * sizeof(int16_t));
    }
    if (b256) {
        out->q256 = malloc(n);
        out->d256 = malloc(n / 256 * sizeof(float));
        out->bsums = malloc(n / 16 * sizeof(int16_t));
    }
    if (k4 && b256 && rows == 1) out->q256_k4 = malloc(n);
    if ((b32 && (!out->q32 || !out->d32 || !out->s32 || !out->sums32))
        || (b256 && (!out->q256 || !out->d256 || !out->bsums))
        || (k4 && b256 && rows == 1 && !out->q256_k4))
        return false;
    quantize_call call = {x, k_in, b32, b256, out};
    spnl_parallel(rows, quantize_row, &call, threads);
    if (out->q256_k4) k4_order(out->q256, k_in / 256, out->q256_k4);
    return true;
}

static void free_rows(act_rows *a) {
    free(a->q32); free(a->d32); free(a->s32); free(a->sums32);
    free(a->q256); free(a->d256); free(a->bsums); free(a->q256_k4);
}
#endif

// What a set of products needs: every format's fast (int8) path, and which activation
// blocks (32, 256, Q4_K's order).
typedef struct { int fast; bool b32, b256, k4; } needs;

// The products' formats, their columns in the output (first) and their tiles of
// consecutive weight rows, shared out among the threads (tile_start); 0 or the error.
static int plan_products(const spnl_products *p, int64_t k_in, const format **formats,
                         int64_t *first, int64_t *tile_start, needs *need) {
    const int count = p->count;
    if (count < 1 || count > MAX_PRODUCTS || k_in < 1) return BAD_ARGUMENT;
    for (int i = 0; i < count; i++) {
        formats[i] = format_of(p->qtypes[i], k_in);
        if (!formats[i] || p->n_outs[i] < 0) return BAD_ARGUMENT;
        if (p->n_outs[i] > p->w_bytes[i] / (k_in / formats[i]->block * formats[i]->bytes))
            return OUT_OF_BOUNDS;  // the matrix is smaller than n_out rows of k_in
        need->fast = need->fast && formats[i]->fast;
        need->b32 = need->b32 || formats[i]->block == 32;
        need->b256 = need->b256 || formats[i]->block == QK_K;
        // Q4_K's one-row order: its rows, and the rows past a tiled matrix's tiles
        need->k4 = need->k4 || formats[i]->qtype == Q4_K || formats[i]->qtype == Q4_K_T16;
        first[i + 1] = first[i] + p->n_outs[i];
        tile_start[i + 1] = tile_start[i] + (p->n_outs[i] + TILE_ROWS - 1) / TILE_ROWS;
    }
    return 0;
}

// Tile t: its product, its first weight row and row count, and where its rows start.
typedef struct { int product; int64_t first_row, rows; const uint8_t *w; } tile;

static inline tile tile_of(int64_t t, const int64_t *tile_start, const format **formats,
                           const int64_t *n_outs, const uint8_t *const *weights, int64_t k_in) {
    int i = 0;
    while (t >= tile_start[i + 1]) i++;
    const int64_t n = (t - tile_start[i]) * TILE_ROWS;
    const int64_t rows = n_outs[i] - n < TILE_ROWS ? n_outs[i] - n : TILE_ROWS;
    return (tile){i, n, rows, weights[i] + n * (k_in / formats[i]->block * formats[i]->bytes)};
}

// One spnl_qmatmul call, as each of its tiles needs it.
typedef struct {
    const spnl_products *p;
    const format **formats;
    const int64_t *first, *tile_start;
    const float *x;
    int64_t rows, k_in;
    float *y;
    int64_t y_stride;
#ifdef INT8_PATH
    const act_rows *fast;  // the quantized activations (NULL: the exact products)
#endif
} product_call;

// Tile t: its weight rows against every row of x.
static void product_tile(void *ctx, int64_t t, int worker) {
    (void)worker;
    const product_call *c = ctx;
    const tile at = tile_of(t, c->tile_start, c->formats, c->p->n_outs, c->p->weights, c->k_in);
    const format *f = c->formats[at.product];
    const int64_t rows = c->rows, k_in = c->k_in, stride = c->y_stride;
    float *out = c->y + c->first[at.product] + at.first_row;
#ifdef INT8_PATH
    if (c->fast) {
        f->fast(c->fast, rows, k_in, at.w, at.rows, out, stride);
        return;
    }
#endif
    for (int64_t m0 = 0; m0 < rows; m0 += MAX_ROWS)
        f->exact(c->x + m0 * k_in, rows - m0 < MAX_ROWS ? rows - m0 : MAX_ROWS, k_in, at.w,
                 at.rows, out + m0 * stride, stride);
}

// The products of p with the same activations x [rows][k_in], side by side in y
// [rows][y_stride]: product i fills columns [offset_i, offset_i + n_out_i) with
// sum_k x[m][k] * W_i[n][k]. `exact` keeps float activations; otherwise (where compiled)
// they are quantized to int8 once for all (quant_int8.h). Tiles of weight rows are shared out
// among the threads in one parallel region; every row of x meets every weight block in the
// same arithmetic and order, whatever the number of rows.
int spnl_qmatmul(const spnl_products *p, const float *x, int64_t rows, int64_t k_in, float *y,
                 int64_t y_stride, int threads, int exact) {
    const int count = p->count;
    const format *formats[MAX_PRODUCTS];
    int64_t first[MAX_PRODUCTS + 1] = {0}, tile_start[MAX_PRODUCTS + 1] = {0};
    if (rows < 1) return BAD_ARGUMENT;
    needs need = {.fast = !exact};
    int status = plan_products(p, k_in, formats, first, tile_start, &need);
    if (status) return status;
    if (first[count] > y_stride) return BAD_ARGUMENT;
#ifdef INT8_PATH
    act_rows quantized = {0};
    const int fast = need.fast;
    if (fast && !quantize_rows(x, rows, k_in, need.b32, need.b256, need.k4, threads, &quantized)) {
        free_rows(&quantized);
        return NO_MEMORY;
    }
#endif
    product_call call = {.p = p, .formats = formats, .first = first, .tile_start = tile_start,
                         .x = x, .rows = rows, .k_in = k_in, .y = y, .y_stride = y_stride};
#ifdef INT8_PATH
    call.fast = fast ? &quantized : NULL;
#endif
    spnl_parallel(tile_start[count], product_tile, &call, threads);
#ifdef INT8_PATH
    if (fast) free_rows(&quantized);
#endif
    return 0;
}

#ifdef INT8_PATH
// Rows first.. of the quantized activations a, and of k4 (Q4_K's one-row order, or NULL).
static act_rows rows_from(const act_rows *a, int64_t first, const int8_t *k4) {
    const int64_t k = a->k;
    return (act_rows){
        .q32 = a->q32 ? a->q32 + first * k : NULL,
        .q256 = a->q256 ? a->q256 + first * k : NULL,
        .d32 = a->d32 ? a->d32 + first * k / 32 : NULL,
        .s32 = a->s32 ? a->s32 + first * k / 32 : NULL,
        .d256 = a->d256 ? a->d256 + first * k / QK_K : NULL,
        .sums32 = a->sums32 ? a->sums32 + first * k / 32 : NULL,
        .bsums = a->bsums ? a->bsums + first * k / 16 : NULL,
        .q256_k4 = k4 ? (int8_t *)k4 + first * k : NULL,
        .k = k,
    };
}
#endif

// Whether the groups stay inside x [x_rows] and y [y_rows][y_stride] (compared by
// subtraction: a sum of two huge extents would wrap and pass).
static bool groups_in_bounds(const spnl_products *p, const spnl_group *g, int64_t x_rows,
                             int64_t y_rows, int64_t y_stride) {
    for (int i = 0; i < p->count; i++)
        if (g[i].rows < 0 || g[i].x_row < 0 || g[i].y_row < 0 || g[i].col < 0
            || g[i].x_row > x_rows || g[i].rows > x_rows - g[i].x_row
            || g[i].y_row > y_rows || g[i].rows > y_rows - g[i].y_row
            || g[i].col > y_stride || p->n_outs[i] > y_stride - g[i].col)
            return false;
    return true;
}

// One grouped call, as each of its tiles needs it.
typedef struct {
    const spnl_products *p;
    const spnl_group *g;
    const format **formats;
    const int64_t *tile_start;
    const float *x;
    int64_t k_in, y_stride;
    float *y;
#ifdef INT8_PATH
    int fast;
    const act_rows *quantized;
    const int8_t *ordered;  // every row in Q4_K's one-row order (NULL: none needed)
#endif
} group_call;

// Tile t: its weight rows against its product's rows of x.
static void group_tile(void *ctx, int64_t t, int worker) {
    (void)worker;
    const group_call *c = ctx;
    const tile at = tile_of(t, c->tile_start, c->formats, c->p->n_outs, c->p->weights, c->k_in);
    const spnl_group *group = &c->g[at.product];
    const format *f = c->formats[at.product];
    const int64_t stride = c->y_stride;
    float *out = c->y + group->y_row * stride + group->col + at.first_row;
    if (!group->rows) return;
#ifdef INT8_PATH
    if (c->fast) {
        const act_rows rows =
            rows_from(c->quantized, group->x_row, group->rows == 1 ? c->ordered : NULL);
        f->fast(&rows, group->rows, c->k_in, at.w, at.rows, out, stride);
        return;
    }
#endif
    const float *xg = c->x + group->x_row * c->k_in;
    for (int64_t m0 = 0; m0 < group->rows; m0 += MAX_ROWS)
        f->exact(xg + m0 * c->k_in, group->rows - m0 < MAX_ROWS ? group->rows - m0 : MAX_ROWS,
                 c->k_in, at.w, at.rows, out + m0 * stride, stride);
}

// Product i with its own rows of x [x_rows][k_in] (an expert with the tokens routed to it):
// rows g[i].x_row .. + g[i].rows, into rows g[i].y_row .. of y [y_rows][y_stride] from
// column g[i].col. The activations are read, and on the int8 path quantized, once for all;
// each row is computed exactly as a one-row spnl_qmatmul computes it (a group of one row
// takes the one-row kernel, Q4_K's order included), in one parallel region for all.
int spnl_qmatmul_groups(const spnl_products *p, const spnl_group *g, const float *x,
                        int64_t x_rows, int64_t k_in, float *y, int64_t y_rows, int64_t y_stride,
                        int threads, int exact) {
    const int count = p->count;
    const format *formats[MAX_PRODUCTS];
    int64_t first[MAX_PRODUCTS + 1] = {0}, tile_start[MAX_PRODUCTS + 1] = {0};
    needs need = {.fast = !exact};
    int status = plan_products(p, k_in, formats, first, tile_start, &need);
    if (status) return status;
    if (x_rows < 1 || !groups_in_bounds(p, g, x_rows, y_rows, y_stride)) return BAD_ARGUMENT;
    group_call call = {.p = p, .g = g, .formats = formats, .tile_start = tile_start, .x = x,
                       .k_in = k_in, .y_stride = y_stride, .y = y};
#ifdef INT8_PATH
    act_rows quantized = {0};
    int8_t *ordered = NULL;
    call.fast = need.fast;
    call.quantized = &quantized;
    if (call.fast) {
        bool ok = quantize_rows(x, x_rows, k_in, need.b32, need.b256, false, threads, &quantized);
        if (ok && need.k4 && need.b256) {
            ordered = malloc((size_t)x_rows * (size_t)k_in);
            ok = ordered != NULL;
            if (ok) k4_order(quantized.q256, x_rows * k_in / QK_K, ordered);
        }
        if (!ok) {
            free(ordered);
            free_rows(&quantized);
            return NO_MEMORY;
        }
        call.ordered = ordered;
    }
#endif
    spnl_parallel(tile_start[count], group_tile, &call, threads);
#ifdef INT8_PATH
    if (call.fast) {
        free(ordered);
        free_rows(&quantized);
    }
#endif
    return 0;
}

// out[r] = W[r] in float32 for every row (prefill dequantizes a matrix, then multiplies).
int spnl_dequantize(int qtype, const uint8_t *w, int64_t w_bytes, int64_t n_rows, int64_t k_in,
                    float *out, int threads) {
    const format *f = format_of(qtype, k_in);
    if (!f || n_rows < 0 || k_in < 1) return BAD_ARGUMENT;
    if (n_rows > w_bytes / (k_in / f->block * f->bytes)) return OUT_OF_BOUNDS;
    f->rows(w, NULL, n_rows, k_in, n_rows, out, threads);
    return 0;
}

// out[i] = W[ids[i]]: embedding rows.
int spnl_gather_rows(int qtype, const uint8_t *w, int64_t n_rows, const int64_t *ids,
                     int64_t count, int64_t k_in, float *out) {
    const format *f = format_of(qtype, k_in);
    if (!f || count < 0) return BAD_ARGUMENT;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n_rows) return OUT_OF_BOUNDS;
    f->rows(w, ids, count, k_in, n_rows, out, 1);
    return 0;
}

