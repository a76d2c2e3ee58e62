// Integer products of GGML weight blocks with 8-bit activations (x86 with AVX2), included by
// quant_matmul.c.
//
// Each activation row is quantized as the reference engine (llama.cpp) quantizes it for the
// weight type at hand, so the integer sums are the ones it computes:
//  - for the 32-value formats (MXFP4 among them: its E2M1 values, doubled, are integers
//    under a power-of-two scale), blocks of 32 with a scale rounded to float16 (and, for the
//    formats with a minimum, the scaled sum of the block, kept exact where llama.cpp rounds
//    it to float16: the product is then exactly the dequantized twin's);
//  - for the k-quants, blocks of 256 with a float scale and the sum of every 16 values.
// Within a weight block the products are summed in integers, sub-block scales included (and,
// apart, the minimums or offsets times the activations' sums).
//  - The 32-value formats sum each block to one integer and add it, times (weight scale x
//    activation scale), to one of 4 float chains, block b to chain b mod 4 (Q4_1/Q5_1 add
//    their minimum terms to 4 chains of their own); the chains are summed at the end.
//  - The k-quants sum each block to two integers and add them to two floats, in block order
//    (k_dot).
// Many activation rows meet tiles of 16 weight rows side by side (k_tile, t32_tile). The
// integers are exact, so the tiles give the same bits as one row at a time, and the same on
// AVX2 as on AVX-512.
// A row's result therefore depends on that row alone: every row count, one row or a prompt,
// gets exactly the same bits.

#ifndef SPNL_QUANT_INT8_H
#define SPNL_QUANT_INT8_H

#include "common.h"

// ---- the activations ---------------------------------------------------------------------------

// Row m of rows activation rows of k values: q32/d32/s32 for the 32-value formats, q256/d256/
// bsums for the k-quants (either set NULL where no product of the call needs it).
typedef struct {
    int8_t *q32, *q256;
    float *d32, *s32, *d256;  // s32: the block's scale times the sum of its values
    int16_t *sums32, *bsums;  // sums32: the sum of a block of 32; bsums: of every 16 of 256
    int8_t *q256_k4;          // q256 in Q4_K's value order (k4_order), for one-row products
    int64_t k;
} act_rows;

// Q4_K (and Q5_K) keep a block's values as 4 chunks of 32 bytes, each byte two values: the
// low nibbles are values 64c..64c+31, the high ones 64c+32..64c+63. Two chunks loaded as
// one 64-byte vector give, as low nibbles, values [0, 32) and [64, 96), so the one-row
// product reads the activations in that order: the 32-value runs of a block as
// K4_ORDER lists them.
static const int K4_ORDER[8] = {0, 2, 1, 3, 4, 6, 5, 7};

static void k4_order(const int8_t *q, int64_t blocks, int8_t *out) {
    for (int64_t b = 0; b < blocks; b++)
        for (int i = 0; i < 8; i++)
            memcpy(out + b * 256 + i * 32, q + b * 256 + K4_ORDER[i] * 32, 32);
}

// One k-quant block's activations.
typedef struct { const int8_t *q; float d; const int16_t *bsums; } act_block;

// Block `at` of the activations, counting from row 0's first.
static inline act_block acts_256(const act_rows *x, int64_t at) {
    return (act_block){x->q256 + at * 256, x->d256[at], x->bsums + at * 16};
}

static inline float round_to_half(float v) {
#if defined(__F16C__)
    return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
#else
    return (float)(_Float16)v;
#endif
}

static inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// 8 floats times `by`, rounded to the nearest integer (ties to even), as int32.
static inline __m256i rounded(const float *x, __m256 by) {
    return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), by));
}

// 32 int32 lanes (4 vectors of 8, in order) packed to 32 int8.
static inline __m256i pack_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    const __m256i packed = _mm256_packs_epi16(ab, cd);
    // packs interleave the 128-bit lanes: put the 4-byte groups back in order
    return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline int32_t sum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

// Blocks of 32: scale = max |x| / 127 (kept as float16), q = round(x * 127 / max |x|),
// s = scale * sum(q), sums = sum(q).
static void quantize_row_32(const float *x, int64_t k, int8_t *q, float *d, float *s,
                            int16_t *sums) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + b * 32;
        __m256 most = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb));
        for (int i = 8; i < 32; i += 8)
            most = _mm256_max_ps(most, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
        const float amax = hmax256(most), scale = amax / 127.0f;
        const __m256 by = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
        const __m256i v0 = rounded(xb, by), v1 = rounded(xb + 8, by);
        const __m256i v2 = rounded(xb + 16, by), v3 = rounded(xb + 24, by);
        _mm256_storeu_si256((__m256i *)(q + b * 32), pack_i8(v0, v1, v2, v3));
        const int32_t sum = sum_i32(_mm256_add_epi32(_mm256_add_epi32(v0, v1),
                                                     _mm256_add_epi32(v2, v3)));
        d[b] = round_to_half(scale);
        s[b] = d[b] * (float)sum;  // exact: 12 bits of sum times 11 of a float16
        sums[b] = (int16_t)sum;
    }
}

// Blocks of 256: the value of largest magnitude (the first, on ties) maps to -127 or 127,
// q = round(x * 127 / max), scale = 1 / (127 / max); bsums: the sum of every 16 q.
// The value of largest magnitude of xb[0, 256): the first on ties, NaNs passed over, 0.0f
// where every magnitude is 0. The largest magnitude found 4 x 8 lanes at a time (a
// maximum, whatever the order), then the first value of that magnitude: what one pass in
// order, keeping each larger magnitude, finds, in a tenth of the time.
static inline float largest_256(const float *xb) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 most[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                      _mm256_setzero_ps()};
    for (int i = 0; i < 256; i += 32)
        for (int j = 0; j < 4; j++)  // NaN first: max_ps then keeps the second operand
            most[j] = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i + 8 * j)),
                                    most[j]);
    const float amax =
        hmax256(_mm256_max_ps(_mm256_max_ps(most[0], most[1]), _mm256_max_ps(most[2], most[3])));
    if (amax == 0.0f) return 0.0f;
    const __m256 target = _mm256_set1_ps(amax);
    for (int i = 0; i < 256; i += 8) {
        const __m256 magnitudes = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i));
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(magnitudes, target, _CMP_EQ_OQ));
        if (hits) return xb[i + __builtin_ctz((unsigned)hits)];
    }
    return 0.0f;  // not reached: amax is one of the magnitudes
}

static void quantize_row_256(const float *x, int64_t k, int8_t *q, float *d, int16_t *bsums) {
    for (int64_t b = 0; b < k / 256; b++) {
        const float *xb = x + b * 256;
        const float max = largest_256(xb);
        if (max == 0.0f) {
            d[b] = 0.0f;
            memset(q + b * 256, 0, 256);
            memset(bsums + b * 16, 0, 16 * sizeof(int16_t));
            continue;
        }
        const float iscale = 127.0f / max;
        const __m256 by = _mm256_set1_ps(iscale);
        for (int i = 0; i < 256; i += 32) {
            const __m256i v0 = rounded(xb + i, by), v1 = rounded(xb + i + 8, by);
            const __m256i v2 = rounded(xb + i + 16, by), v3 = rounded(xb + i + 24, by);
            _mm256_storeu_si256((__m256i *)(q + b * 256 + i), pack_i8(v0, v1, v2, v3));
            bsums[b * 16 + i / 16] = (int16_t)sum_i32(_mm256_add_epi32(v0, v1));
            bsums[b * 16 + i / 16 + 1] = (int16_t)sum_i32(_mm256_add_epi32(v2, v3));
        }
        d[b] = 1.0f / iscale;
    }
}

// ---- integer building blocks --------------------------------------------------------------------

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

// 8 lanes, each the sum of 4 products of unsigned and signed bytes (u <= 128 and |s| <= 127,
// so the pairs of maddubs cannot saturate).
static inline __m256i dot_u8s8_add(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return dot_u8s8_add(_mm256_setzero_si256(), u, s);
}

// Signed weights times signed activations: the weights' magnitudes as the unsigned operand,
// their signs moved onto the activations.
static inline __m256i dot_s8s8(__m256i w, __m256i x) {
    return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

// 8 lanes: products of unsigned and signed bytes summed in pairs (16 int16), then each pair
// of those times its int16 scale and summed (the k-quants' sub-block scales).
static inline __m256i scaled_dot(__m256i u, __m256i s, __m256i scales16) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scales16);
}

static inline __m256i low_nibbles(__m256i q) { return _mm256_and_si256(q, _mm256_set1_epi8(0x0F)); }
static inline __m256i high_nibbles(__m256i q) {
    return _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(0x0F));
}
static inline __m256i crumbs(__m256i q, int shift) {  // the 2-bit field at `shift`, per byte
    return _mm256_and_si256(_mm256_srli_epi16(q, shift), _mm256_set1_epi8(3));
}
static inline __m256i bit_at(__m256i q, int shift, int to) {  // bit `shift` of each byte, at `to`
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(q, shift), _mm256_set1_epi8(1)),
                             to);
}
static inline __m256i nibbles_of_16(const uint8_t *p) {  // 16 bytes → low 16, then high 16
    const __m128i q = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}
static inline __m256i bits_to_16s(uint32_t bits) {  // bit i of `bits` → byte i: 16 or 0
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(16));
#else
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
#endif
}

// Sub-block scales as the int16 operand of scaled_dot. `words` holds 8 int16 scales in both
// 128-bit lanes; pick(words, i, j) puts scale i in the low lane and scale j in the high one.
static inline __m256i pick(__m256i words, int i, int j) {
    const __m256i at = _mm256_setr_epi8(
        2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1,
        2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1,
        2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1,
        2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1);
    return _mm256_shuffle_epi8(words, at);
}
static inline __m256i words_u8(uint64_t eight) {  // 8 unsigned bytes → int16, in both lanes
    return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)eight)));
}
static inline __m256i words_i8(const int8_t *eight) {
    int64_t v;
    memcpy(&v, eight, 8);
    return _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_cvtsi64_si128(v)));
}
// ---- one weight block against its activations -----------------------------------------------
//
// Each format has a struct of its block unpacked into registers (NAME_w) and NAME_unpack to
// fill it. The 32-value formats' NAME_ints give a block's products with one row of
// activations as 8 int32 lanes (and NAME_min its minimum, 0 where it has none); the
// k-quants' k_dot adds a block to a row's sums (below). Several rows unpack a block once
// and meet it in turn; one row does both at once. The arithmetic is the same.

// What the 32-value tiles add to each value to make it an unsigned byte, as log2 (-1: the
// formats with a minimum, whose values are unsigned already and whose minimum is a term
// of its own).
enum { q4_0_bias = 3, q5_0_bias = 4, q8_0_bias = 7, q8_1_bias = 7, q4_1_bias = -1,
       q5_1_bias = -1, mxfp4_bias = 4 };

// Each 32-value format's block scale: a float16 first, or MXFP4's exponent byte.
#define q4_0_scale half_to_float
#define q4_1_scale half_to_float
#define q5_0_scale half_to_float
#define q5_1_scale half_to_float
#define q8_0_scale half_to_float
#define q8_1_scale half_to_float
static inline float mxfp4_scale(const uint8_t *b) { return e8m0_half(b[0]); }

// The scales of a row's next n <= 4 blocks from w, as one vector: d, where each block's
// unpacking left its scale, or (MXFP4, 4 blocks) straight from the exponent bytes, the same
// bits as e8m0_half. Through d the compiler packs MXFP4's integer-made scales into 64-bit
// stores, and the vector loaded from them waits on store forwarding: half the product's time.
static inline __m128 stored_scales(const uint8_t *w, int n, const float *d) {
    (void)w, (void)n;
    return _mm_loadu_ps(d);
}
#define q4_0_scales stored_scales
#define q4_1_scales stored_scales
#define q5_0_scales stored_scales
#define q5_1_scales stored_scales
#define q8_0_scales stored_scales
#define q8_1_scales stored_scales
static inline __m128 mxfp4_scales(const uint8_t *w, int n, const float *d) {
    if (n < 4) return _mm_loadu_ps(d);
    const __m128i e = _mm_setr_epi32(w[0], w[17], w[34], w[51]);
    const __m128i normal = _mm_slli_epi32(_mm_sub_epi32(e, _mm_set1_epi32(1)), 23);
    const __m128i tiny = _mm_sllv_epi32(_mm_set1_epi32(0x00200000), e);  // e < 2: subnormal
    const __m128i is_tiny = _mm_cmplt_epi32(e, _mm_set1_epi32(2));
    return _mm_castsi128_ps(_mm_blendv_epi8(normal, tiny, is_tiny));
}

// The float chains of a 32-value format's row: block b goes to chain b mod CHAINS.
#define CHAINS 4

// Each 32-value format's values as unsigned bytes (the value plus 2^bias): what the
// tiles hold, and what the one-row unpacking starts from.
static inline __m256i q4_0_values(const uint8_t *b) { return nibbles_of_16(b + 2); }
static inline __m256i q4_1_values(const uint8_t *b) { return nibbles_of_16(b + 4); }
static inline __m256i q5_0_values(const uint8_t *b) {
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    return _mm256_or_si256(nibbles_of_16(b + 6), bits_to_16s(qh));
}
static inline __m256i q5_1_values(const uint8_t *b) {
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    return _mm256_or_si256(nibbles_of_16(b + 8), bits_to_16s(qh));
}
static inline __m256i q8_0_values(const uint8_t *b) {
    return _mm256_xor_si256(load32(b + 2), _mm256_set1_epi8((char)0x80));
}
static inline __m256i q8_1_values(const uint8_t *b) {
    return _mm256_xor_si256(load32(b + 4), _mm256_set1_epi8((char)0x80));
}
// MXFP4's E2M1 nibbles through E2M1_DOUBLED as int8 (its values, doubled, are integers in
// [-12, 12]), looked up 16 at a time in each 128-bit lane.
static inline __m256i mxfp4_signed(const uint8_t *b) {
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
    return _mm256_shuffle_epi8(table, nibbles_of_16(b + 1));
}
static inline __m256i mxfp4_values(const uint8_t *b) {
    return _mm256_add_epi8(mxfp4_signed(b), _mm256_set1_epi8(16));
}

// The 32-value formats with signed values: |w| as the unsigned operand, w for the signs.
typedef struct { __m256i u, w; float d; } signed_w;
static inline __m256i signed_ints(const signed_w *w, const int8_t *q) {
    return dot_u8s8(w->u, _mm256_sign_epi8(load32(q), w->w));
}
static inline float signed_min(const signed_w *w) { (void)w; return 0.0f; }
static inline void signed_from(__m256i w, float d, signed_w *out) {
    *out = (signed_w){_mm256_sign_epi8(w, w), w, d};
}
typedef signed_w q8_0_w, q8_1_w, q4_0_w, q5_0_w, mxfp4_w;
#define mxfp4_ints signed_ints
#define mxfp4_wmin signed_min
#define q8_0_ints signed_ints
#define q8_1_ints signed_ints
#define q4_0_ints signed_ints
#define q5_0_ints signed_ints
#define q8_0_wmin signed_min
#define q8_1_wmin signed_min
#define q4_0_wmin signed_min
#define q5_0_wmin signed_min
static inline void q8_0_unpack(const uint8_t *b, signed_w *w) {
    signed_from(load32(b + 2), half_to_float(b), w);
}
static inline void q8_1_unpack(const uint8_t *b, signed_w *w) {
    signed_from(load32(b + 4), half_to_float(b), w);
}
static inline void q4_0_unpack(const uint8_t *b, signed_w *w) {
    signed_from(_mm256_sub_epi8(q4_0_values(b), _mm256_set1_epi8(8)), half_to_float(b), w);
}
static inline void q5_0_unpack(const uint8_t *b, signed_w *w) {
    signed_from(_mm256_sub_epi8(q5_0_values(b), _mm256_set1_epi8(16)), half_to_float(b), w);
}
static inline void mxfp4_unpack(const uint8_t *b, signed_w *w) {
    signed_from(mxfp4_signed(b), e8m0_half(b[0]), w);
}

// The 32-value formats with a minimum: value = d * u + m.
typedef struct { __m256i u; float d, m; } offset_w;
typedef offset_w q4_1_w, q5_1_w;
static inline __m256i offset_ints(const offset_w *w, const int8_t *q) {
    return dot_u8s8(w->u, load32(q));
}
static inline float offset_min(const offset_w *w) { return w->m; }
#define q4_1_ints offset_ints
#define q5_1_ints offset_ints
#define q4_1_wmin offset_min
#define q5_1_wmin offset_min
static inline void q4_1_unpack(const uint8_t *b, offset_w *w) {
    *w = (offset_w){q4_1_values(b), half_to_float(b), half_to_float(b + 2)};
}
static inline void q5_1_unpack(const uint8_t *b, offset_w *w) {
    *w = (offset_w){q5_1_values(b), half_to_float(b), half_to_float(b + 2)};
}

// The k-quants: 8 vectors of 32 unsigned values, each with the int16 scales of its sub-blocks
// (one for 32 values, or one per 16 in the low and high lanes), and the weights of the
// activations' sums of 16 (the minimums, or the values' offset times the scales).
typedef struct {
    __m256i u[8], scales[8];
    __m256i offsets;  // int16 weights of the 16 sums of 16
    float d, dmin;    // dmin: the scale of the offsets
} k_parts;

#if defined(__AVX512BW__)
// With AVX-512 the vectors go in pairs, 64 values per instruction.
typedef struct { __m512i u[4], scales[4]; __m256i offsets; float d, dmin; } k_w;

static inline __m512i pair(__m256i low, __m256i high) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

static inline void k_finish(const k_parts *p, k_w *w) {
    for (int i = 0; i < 4; i++) {
        w->u[i] = pair(p->u[2 * i], p->u[2 * i + 1]);
        w->scales[i] = pair(p->scales[2 * i], p->scales[2 * i + 1]);
    }
    w->offsets = p->offsets, w->d = p->d, w->dmin = p->dmin;
}

static inline __m256i k_scaled_sum(const k_w *w, const int8_t *q) {
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) {
        const __m512i x = _mm512_loadu_si512((const void *)(q + 64 * i));
        sum = _mm512_add_epi32(sum, _mm512_madd_epi16(_mm512_maddubs_epi16(w->u[i], x),
                                                       w->scales[i]));
    }
    return _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
}
#else
typedef k_parts k_w;

static inline void k_finish(const k_parts *p, k_w *w) { *w = *p; }

static inline __m256i k_scaled_sum(const k_w *w, const int8_t *q) {
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++)
        sum = _mm256_add_epi32(sum, scaled_dot(w->u[j], load32(q + 32 * j), w->scales[j]));
    return sum;
}
#endif

// A k-quant block meets a row of activations in two exact integers: S, the products
// weighed by their sub-block scales, and M, the offsets times the activations' sums of 16.
// The row's result is then two float sums taken in block order and added at the end,
//     y = sum_b S_b * (d_b * a.d_b)  +  sum_b M_b * (dmin_b * a.d_b)     (each term an FMA)
// so any kernel that finds the same integers (one row at a time here, or a tile of weight
// rows side by side, k_tile below) gives the same bits. One row keeps both sums in the
// first two lanes of `acc`.
// The sums of the 8 lanes of s and of m, in lanes 0 and 1.
static inline __m128i two_sums(__m256i s, __m256i m) {
    const __m256i mixed = _mm256_add_epi32(_mm256_unpacklo_epi32(s, m),
                                           _mm256_unpackhi_epi32(s, m));
    const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(mixed),
                                       _mm256_extracti128_si256(mixed, 1));
    return _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
}

static inline __m128 k_dot(const k_w *w, act_block a, __m128 acc) {
    const __m128i both = two_sums(k_scaled_sum(w, a.q),
                                  _mm256_madd_epi16(w->offsets, load32(a.bsums)));
    double d_dmin;  // d and dmin, side by side in k_w
    memcpy(&d_dmin, &w->d, sizeof d_dmin);
    const __m128 scales = _mm_castpd_ps(_mm_set_sd(d_dmin));
    return _mm_fmadd_ps(_mm_cvtepi32_ps(both), _mm_mul_ps(scales, _mm_set1_ps(a.d)), acc);
}

static inline float k_result(__m128 acc) {
    return _mm_cvtss_f32(acc) + _mm_cvtss_f32(_mm_movehdup_ps(acc));
}

// The 6-bit scales and minimums of Q4_K and Q5_K (12 bytes at p): 8 bytes each.
static inline void k4_scales(const uint8_t *p, uint64_t *sc, uint64_t *mn) {
    uint32_t u[3];
    memcpy(u, p, 12);
    const uint32_t six = 0x3F3F3F3F, four = 0x0F0F0F0F, two = 0x03030303;
    const uint32_t s_lo = u[0] & six, s_hi = (u[2] & four) | (((u[0] >> 6) & two) << 4);
    const uint32_t m_lo = u[1] & six, m_hi = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);
    *sc = (uint64_t)s_lo | (uint64_t)s_hi << 32;
    *mn = (uint64_t)m_lo | (uint64_t)m_hi << 32;
}

// Q4_K and Q5_K: a 6-bit scale and minimum per 32 values; the minimums weigh pairs of sums.
static inline void k4_common(const uint8_t *b, k_parts *w) {
    uint64_t sc, mn;
    k4_scales(b + 4, &sc, &mn);
    const __m256i scales = words_u8(sc);
    for (int j = 0; j < 8; j++) w->scales[j] = pick(scales, j, j);
    const __m128i m = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)mn));
    w->offsets = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
    w->d = half_to_float(b);
    w->dmin = -half_to_float(b + 2);
}

static inline void q4_k_parts(const uint8_t *b, k_parts *w) {
    k4_common(b, w);
    for (int c = 0; c < 4; c++) {
        const __m256i q = load32(b + 16 + c * 32);
        w->u[2 * c] = low_nibbles(q);
        w->u[2 * c + 1] = high_nibbles(q);
    }
}

static inline void q5_k_parts(const uint8_t *b, k_parts *w) {
    k4_common(b, w);
    const __m256i qh = load32(b + 16);
    for (int c = 0; c < 4; c++) {
        const __m256i q = load32(b + 48 + c * 32);
        w->u[2 * c] = _mm256_or_si256(low_nibbles(q), bit_at(qh, 2 * c, 4));
        w->u[2 * c + 1] = _mm256_or_si256(high_nibbles(q), bit_at(qh, 2 * c + 1, 4));
    }
}

// Signed scales per 16 (Q3_K, Q6_K): the scales of vector j are 2j and 2j + 1; values carry
// an offset `bias`, taken off through the sums of 16.
static inline void k16_scales(const int8_t *scales, int bias, k_parts *w) {
    for (int h = 0; h < 2; h++) {
        const __m256i words = words_i8(scales + 8 * h);
        for (int g = 0; g < 4; g++) w->scales[4 * h + g] = pick(words, 2 * g, 2 * g + 1);
    }
    w->offsets = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scales));
    w->dmin = -(float)bias * w->d;
}

// Q6_K: values 0..63 less 32, an int8 scale per 16.
static inline void q6_k_parts(const uint8_t *b, k_parts *w) {
    for (int h = 0; h < 2; h++) {
        const __m256i ql0 = load32(b + h * 64), ql1 = load32(b + h * 64 + 32);
        const __m256i qh = load32(b + 128 + h * 32);
        w->u[4 * h] = _mm256_or_si256(low_nibbles(ql0), _mm256_slli_epi16(crumbs(qh, 0), 4));
        w->u[4 * h + 1] = _mm256_or_si256(low_nibbles(ql1), _mm256_slli_epi16(crumbs(qh, 2), 4));
        w->u[4 * h + 2] = _mm256_or_si256(high_nibbles(ql0), _mm256_slli_epi16(crumbs(qh, 4), 4));
        w->u[4 * h + 3] = _mm256_or_si256(high_nibbles(ql1), _mm256_slli_epi16(crumbs(qh, 6), 4));
    }
    w->d = half_to_float(b + 208);
    k16_scales((const int8_t *)(b + 192), 32, w);
}

// Q3_K: values 0..7 less 4 (two low bits, a high bit in hmask), a 6-bit scale less 32 per 16.
static inline void q3_k_parts(const uint8_t *b, k_parts *w) {
    const uint8_t *packed = b + 96;
    int8_t scales[16];
    for (int s = 0; s < 16; s++) {
        const int low = s < 8 ? packed[s] & 0xF : packed[s - 8] >> 4;
        const int high = (packed[8 + s % 4] >> (2 * (s / 4))) & 3;
        scales[s] = (int8_t)((low | (high << 4)) - 32);
    }
    const __m256i hm = load32(b);
    for (int h = 0; h < 2; h++) {
        const __m256i q = load32(b + 32 + h * 32);
        for (int j = 0; j < 4; j++)
            w->u[4 * h + j] = _mm256_or_si256(crumbs(q, 2 * j), bit_at(hm, 4 * h + j, 2));
    }
    w->d = half_to_float(b + 108);
    k16_scales(scales, 4, w);
}

// Q2_K: values 0..3, a 4-bit scale and a 4-bit minimum per 16.
static inline void q2_k_parts(const uint8_t *b, k_parts *w) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)b), four = _mm_set1_epi8(0x0F);
    const __m128i scales = _mm_and_si128(packed, four);
    for (int h = 0; h < 2; h++) {
        const __m256i words = _mm256_broadcastsi128_si256(
            _mm_cvtepu8_epi16(h ? _mm_srli_si128(scales, 8) : scales));
        const __m256i q = load32(b + 16 + h * 32);
        for (int j = 0; j < 4; j++) {
            w->u[4 * h + j] = crumbs(q, 2 * j);
            w->scales[4 * h + j] = pick(words, 2 * j, 2 * j + 1);
        }
    }
    w->offsets = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), four));
    w->d = half_to_float(b + 80);
    w->dmin = -half_to_float(b + 82);
}

// The values that share a scale in each k-quant.
enum { q2_k_sub = 16, q3_k_sub = 16, q4_k_sub = 32, q5_k_sub = 32, q6_k_sub = 16 };
// How the tiles weigh a sub-block's sum by its scale without an int32 multiplication, by
// what always fits an int16 (the activations within +-127): 1, half a sub-block's products
// (Q2_K 8 x 3 x 127, Q3_K 8 x 7 x 127, Q4_K 16 x 15 x 127), the two halves side by side in
// one int16 dot product with the scale; 2, one group of 4 (Q6_K: 4 x 63 x 127), pairs of
// groups so; 0, the multiplication (Q5_K: pairs of its groups measured no faster).
enum { q2_k_narrow = 1, q3_k_narrow = 1, q4_k_narrow = 1, q5_k_narrow = 0, q6_k_narrow = 2 };

// Each k-quant's unpack: its parts, then (with AVX-512) paired.
#define K_UNPACK(NAME)                                               \
    static inline void NAME##_unpack(const uint8_t *b, k_w *w) {     \
        k_parts p;                                                   \
        NAME##_parts(b, &p);                                         \
        k_finish(&p, w);                                             \
    }
K_UNPACK(q2_k)
K_UNPACK(q3_k)
K_UNPACK(q4_k)
K_UNPACK(q5_k)
K_UNPACK(q6_k)

// ---- k-quant tiles: the blocks of KT_ROWS weight rows side by side ----------------------------
//
// For many activation rows a block is unpacked once into a tile whose every int32 holds 4
// values of one row, 16 rows to a vector (lanes16: two with AVX2): one broadcast of 4
// activations then meets 16 weight rows at once, and S and M come out for 16 rows in the
// lanes of one vector each.

#define KT_ROWS 16
#define KT_MR 4        // activation rows that meet each tile vector while it is in a register

typedef struct {
    int32_t u[64][KT_ROWS];       // u[g][r]: values 4g..4g+3 of row r
    int32_t scales[16][KT_ROWS];  // the scale of values 16s..16s+15
    int32_t offsets[8][KT_ROWS];  // two int16: the weights of the sums of 16 number 2i, 2i+1
    float d[KT_ROWS], dmin[KT_ROWS];
} k_tile;

// The tile from the parts of its KT_ROWS rows' blocks (p[r]: row r's).
#if defined(__AVX512F__)
// Columns of 8 int32 words from 16 rows at once: word g of every row, for g < 8, into
// out[g] (row r in lane r). rows[r] holds row r in its low half and row r + 8 in its high
// half; each half goes through the same 8 x 8 transposition.
static inline void transpose_words(const __m512i rows[8], __m512i out[8]) {
    __m512i pairs[8], quads[8];
    for (int k = 0; k < 4; k++) {  // words 0, 1 | 4, 5 of two rows, and 2, 3 | 6, 7
        pairs[2 * k] = _mm512_unpacklo_epi32(rows[2 * k], rows[2 * k + 1]);
        pairs[2 * k + 1] = _mm512_unpackhi_epi32(rows[2 * k], rows[2 * k + 1]);
    }
    for (int k = 0; k < 2; k++)  // per group of 4 rows: words g | g + 4 for g < 4
        for (int h = 0; h < 2; h++) {
            const __m512i x = pairs[4 * k + h], y = pairs[4 * k + 2 + h];
            quads[4 * k + 2 * h] = _mm512_unpacklo_epi64(x, y);
            quads[4 * k + 2 * h + 1] = _mm512_unpackhi_epi64(x, y);
        }
    const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int g = 0; g < 4; g++) {  // rows 0-3 beside rows 4-7, in each half
        out[g] = _mm512_permutex2var_epi64(quads[g], low, quads[4 + g]);
        out[g + 4] = _mm512_permutex2var_epi64(quads[g], high, quads[4 + g]);
    }
}

static inline void words_of(const k_parts *p, size_t field, __m512i rows[8]) {
    for (int r = 0; r < 8; r++) {
        const __m256i lo = load32((const char *)&p[r] + field);
        const __m256i hi = load32((const char *)&p[r + 8] + field);
        rows[r] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
}

static inline void k_tile_fill(const k_parts *p, k_tile *t) {
    __m512i rows[8], cols[8];
    for (int j = 0; j < 8; j++) {
        words_of(p, offsetof(k_parts, u) + j * sizeof(__m256i), rows);
        transpose_words(rows, cols);
        for (int g = 0; g < 8; g++) _mm512_storeu_si512((void *)t->u[8 * j + g], cols[g]);
        // the scales fill each 128-bit lane: words 0 and 4 hold two copies of each
        words_of(p, offsetof(k_parts, scales) + j * sizeof(__m256i), rows);
        transpose_words(rows, cols);
        _mm512_storeu_si512((void *)t->scales[2 * j], _mm512_srai_epi32(cols[0], 16));
        _mm512_storeu_si512((void *)t->scales[2 * j + 1], _mm512_srai_epi32(cols[4], 16));
    }
    words_of(p, offsetof(k_parts, offsets), rows);  // word i: the pair of weights 2i, 2i + 1
    transpose_words(rows, cols);
    for (int i = 0; i < 8; i++) _mm512_storeu_si512((void *)t->offsets[i], cols[i]);
    for (int r = 0; r < KT_ROWS; r++) t->d[r] = p[r].d, t->dmin[r] = p[r].dmin;
}
#else
static inline void k_tile_fill(const k_parts *p, k_tile *t) {
    for (int r = 0; r < KT_ROWS; r++) {
        int32_t words[8][8], scales[8][8], offsets[8];
        for (int j = 0; j < 8; j++) {
            _mm256_storeu_si256((__m256i *)words[j], p[r].u[j]);
            _mm256_storeu_si256((__m256i *)scales[j], p[r].scales[j]);
        }
        _mm256_storeu_si256((__m256i *)offsets, p[r].offsets);
        for (int j = 0; j < 8; j++) {
            for (int g = 0; g < 8; g++) t->u[8 * j + g][r] = words[j][g];
            t->scales[2 * j][r] = scales[j][0] >> 16;  // two copies of each scale in a word
            t->scales[2 * j + 1][r] = scales[j][4] >> 16;
        }
        for (int i = 0; i < 8; i++) t->offsets[i][r] = offsets[i];
        t->d[r] = p[r].d, t->dmin[r] = p[r].dmin;
    }
}
#endif

// Sixteen int32 lanes, one per weight row of a tile: one AVX-512 vector, or two AVX2 ones.
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
typedef __m512i lanes16;
static inline lanes16 l16_zero(void) { return _mm512_setzero_si512(); }
static inline lanes16 l16_load(const int32_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline lanes16 l16_set1(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
static inline lanes16 l16_add(lanes16 a, lanes16 b) { return _mm512_add_epi32(a, b); }
static inline lanes16 l16_mullo(lanes16 a, lanes16 b) { return _mm512_mullo_epi32(a, b); }
// lane r: a[r] in its low int16 and b[r] in its high one (both within int16's range)
static inline lanes16 l16_halves(lanes16 a, lanes16 b) {
    return _mm512_mask_blend_epi16(0xAAAAAAAA, a, _mm512_slli_epi32(b, 16));
}
// acc + the 4 products of unsigned bytes u and signed bytes x in each lane
static inline lanes16 l16_dot_u8(lanes16 acc, lanes16 u, lanes16 x) {
    return _mm512_dpbusd_epi32(acc, u, x);
}
// acc + the 2 products of int16 pairs in each lane
static inline lanes16 l16_dot_i16(lanes16 acc, lanes16 a, lanes16 b) {
    return _mm512_dpwssd_epi32(acc, a, b);
}
// Sixteen float lanes, one per weight row: a row's two float sums, kept in registers.
typedef __m512 flanes16;
static inline flanes16 f16_zero(void) { return _mm512_setzero_ps(); }
// fma(float(ints[r]), scale[r] * by, acc[r]) in every lane r
static inline flanes16 l16_fma(flanes16 acc, lanes16 ints, const float *scale, float by) {
    const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(scale), _mm512_set1_ps(by));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), s, acc);
}
// y[r] = a[r] + b[r]
static inline void f16_store_sum(float *y, flanes16 a, flanes16 b) {
    _mm512_storeu_ps(y, _mm512_add_ps(a, b));
}
#else
typedef struct { __m256i lo, hi; } lanes16;
static inline lanes16 l16_zero(void) {
    return (lanes16){_mm256_setzero_si256(), _mm256_setzero_si256()};
}
static inline lanes16 l16_load(const int32_t *p) { return (lanes16){load32(p), load32(p + 8)}; }
static inline lanes16 l16_set1(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    const __m256i b = _mm256_set1_epi32(v);
    return (lanes16){b, b};
}
static inline lanes16 l16_add(lanes16 a, lanes16 b) {
    return (lanes16){_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}
static inline lanes16 l16_mullo(lanes16 a, lanes16 b) {
    return (lanes16){_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)};
}
static inline lanes16 l16_halves(lanes16 a, lanes16 b) {
    return (lanes16){_mm256_blend_epi16(a.lo, _mm256_slli_epi32(b.lo, 16), 0xAA),
                     _mm256_blend_epi16(a.hi, _mm256_slli_epi32(b.hi, 16), 0xAA)};
}
static inline lanes16 l16_dot_u8(lanes16 acc, lanes16 u, lanes16 x) {
    return (lanes16){dot_u8s8_add(acc.lo, u.lo, x.lo), dot_u8s8_add(acc.hi, u.hi, x.hi)};
}
static inline lanes16 l16_dot_i16(lanes16 acc, lanes16 a, lanes16 b) {
    return (lanes16){_mm256_add_epi32(acc.lo, _mm256_madd_epi16(a.lo, b.lo)),
                     _mm256_add_epi32(acc.hi, _mm256_madd_epi16(a.hi, b.hi))};
}
typedef struct { __m256 lo, hi; } flanes16;
static inline flanes16 f16_zero(void) { return (flanes16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline flanes16 l16_fma(flanes16 acc, lanes16 ints, const float *scale, float by) {
    const __m256 b = _mm256_set1_ps(by);
    const __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(scale), b);
    const __m256 hi = _mm256_mul_ps(_mm256_loadu_ps(scale + 8), b);
    return (flanes16){_mm256_fmadd_ps(_mm256_cvtepi32_ps(ints.lo), lo, acc.lo),
                      _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints.hi), hi, acc.hi)};
}
static inline void f16_store_sum(float *y, flanes16 a, flanes16 b) {
    _mm256_storeu_ps(y, _mm256_add_ps(a.lo, b.lo));
    _mm256_storeu_ps(y + 8, _mm256_add_ps(a.hi, b.hi));
}
#endif

// Block b of activation rows m..m+mr-1 against the tile's rows: ss[i] takes S, ms[i] takes
// M, as k_dot. `sub`: the values that share a scale (16, or 32 where the format's scales go
// by 32); `narrow`: the format's half sub-blocks sum within int16 (NAME_narrow).
static inline __attribute__((always_inline)) void k_tile_rows(const k_tile *t, const act_rows *x,
                                                              int64_t m, int mr, int sub,
                                                              int narrow, int64_t b,
                                                              flanes16 *ss, flanes16 *ms) {
    const int8_t *q[KT_MR];
    for (int i = 0; i < mr; i++) q[i] = x->q256 + ((m + i) * (x->k / 256) + b) * 256;
    lanes16 sums[KT_MR];
    for (int i = 0; i < mr; i++) sums[i] = l16_zero();
    // Narrow: each half of a sub-block a chain; the two halves side by side as int16 meet
    // the scale, twice over in each lane, in one dot product. The integers are exact, so
    // the same S comes out either way.
    for (int s = 0; narrow == 1 && s < 256 / sub; s++) {
        lanes16 low[KT_MR], high[KT_MR];
        for (int i = 0; i < mr; i++) low[i] = high[i] = l16_zero();
        for (int g = s * sub / 4; g < s * sub / 4 + sub / 8; g++) {
            const lanes16 w0 = l16_load(t->u[g]), w1 = l16_load(t->u[g + sub / 8]);
            for (int i = 0; i < mr; i++) {
                low[i] = l16_dot_u8(low[i], w0, l16_set1(q[i] + 4 * g));
                high[i] = l16_dot_u8(high[i], w1, l16_set1(q[i] + 4 * g + sub / 2));
            }
        }
        const lanes16 scale = l16_load(t->scales[s * sub / 16]);
        const lanes16 pair = l16_halves(scale, scale);
        for (int i = 0; i < mr; i++) sums[i] = l16_dot_i16(sums[i], l16_halves(low[i], high[i]), pair);
    }
    // Narrow 2: one group of 4 products fits an int16 (Q6_K: 4 x 63 x 127); each pair of
    // groups side by side meets the scale in one dot product.
    for (int s = 0; narrow == 2 && s < 256 / sub; s++) {
        const lanes16 scale = l16_load(t->scales[s * sub / 16]);
        const lanes16 pair = l16_halves(scale, scale);
        for (int g = s * sub / 4; g < (s + 1) * sub / 4; g += 2) {
            const lanes16 w0 = l16_load(t->u[g]), w1 = l16_load(t->u[g + 1]);
            for (int i = 0; i < mr; i++) {
                const lanes16 a = l16_dot_u8(l16_zero(), w0, l16_set1(q[i] + 4 * g));
                const lanes16 c = l16_dot_u8(l16_zero(), w1, l16_set1(q[i] + 4 * g + 4));
                sums[i] = l16_dot_i16(sums[i], l16_halves(a, c), pair);
            }
        }
    }
    for (int s = 0; !narrow && s < 256 / sub; s++) {
        lanes16 even[KT_MR], odd[KT_MR];  // two chains: consecutive dot products need not wait
        for (int i = 0; i < mr; i++) even[i] = odd[i] = l16_zero();
        for (int g = s * sub / 4; g < (s + 1) * sub / 4; g += 2) {
            const lanes16 w0 = l16_load(t->u[g]), w1 = l16_load(t->u[g + 1]);
            for (int i = 0; i < mr; i++) {
                even[i] = l16_dot_u8(even[i], w0, l16_set1(q[i] + 4 * g));
                odd[i] = l16_dot_u8(odd[i], w1, l16_set1(q[i] + 4 * g + 4));
            }
        }
        const lanes16 scale = l16_load(t->scales[s * sub / 16]);
        for (int i = 0; i < mr; i++) {
            sums[i] = l16_add(sums[i], l16_mullo(l16_add(even[i], odd[i]), scale));
        }
    }
    for (int i = 0; i < mr; i++) {
        const int64_t at = (m + i) * (x->k / 256) + b;
        const int16_t *bsums = x->bsums + at * 16;
        lanes16 offsets = l16_zero();
        for (int p = 0; p < 8; p++)
            offsets = l16_dot_i16(offsets, l16_load(t->offsets[p]), l16_set1(bsums + 2 * p));
        ss[i] = l16_fma(ss[i], sums[i], t->d, x->d256[at]);
        ms[i] = l16_fma(ms[i], offsets, t->dmin, x->d256[at]);
    }
}

// Activation rows m..m+mr-1 (mr <= KT_MR, a constant where inlined) against the tiles of
// every block (tiles[b]: block b of KT_ROWS weight rows): row i's KT_ROWS results at
// y + i * stride. Each row's two float sums stay in registers through the blocks, taken in
// block order as k_dot takes them, and are added at the end: the same bits as one row alone.
static inline __attribute__((always_inline)) void k_tile_all(int mr, const k_tile *tiles,
                                                             const act_rows *x, int64_t m,
                                                             int sub, int narrow, int64_t blocks,
                                                             float *y, int64_t stride) {
    flanes16 ss[KT_MR], ms[KT_MR];
    for (int i = 0; i < mr; i++) ss[i] = ms[i] = f16_zero();
    for (int64_t b = 0; b < blocks; b++) k_tile_rows(&tiles[b], x, m, mr, sub, narrow, b, ss, ms);
    for (int i = 0; i < mr; i++) f16_store_sum(y + i * stride, ss[i], ms[i]);
}

// ---- 32-value tiles (AVX-512 with VNNI): KT_ROWS weight rows, all their blocks side by side
//
// Each int32 of the tile holds 4 values of one row as unsigned bytes (the value plus the
// format's bias, taken off again through the activations' sum), so one broadcast of 4
// activations meets 16 rows in one dpbusd and a block's integer comes out for 16 rows in
// one vector. Each row's 4 float chains (block b in chain b mod 4, as NAME_by_rows keeps
// them) are 4 vectors, summed at the end in sum_chains' order: the same bits as one row at
// a time.

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define T32_TILES 1

static inline float q4_1_min(const uint8_t *b) { return half_to_float(b + 2); }
static inline float q5_1_min(const uint8_t *b) { return half_to_float(b + 2); }
#define q4_0_min(b) 0.0f
#define q5_0_min(b) 0.0f
#define q8_0_min(b) 0.0f
#define q8_1_min(b) 0.0f
#define mxfp4_min(b) 0.0f

typedef struct {
    int32_t (*u)[8][KT_ROWS];  // [block][group g][row]: values 4g..4g+3, biased
    float (*d)[KT_ROWS], (*m)[KT_ROWS];
} t32_tile;

static inline bool t32_alloc(int64_t blocks, t32_tile *t) {
    t->u = malloc((size_t)blocks * sizeof *t->u);
    t->d = malloc((size_t)blocks * sizeof *t->d);
    t->m = malloc((size_t)blocks * sizeof *t->m);
    return t->u && t->d && t->m;
}
static inline void t32_free(t32_tile *t) { free(t->u); free(t->d); free(t->m); }

// The 4 chains of 16 rows summed as sum_chains sums the lanes of one row's chains.
static inline __m512 hsum_chains(const __m512 c[CHAINS]) {
    return _mm512_add_ps(_mm512_add_ps(c[0], c[2]), _mm512_add_ps(c[1], c[3]));
}

// Block b of the tile against activation rows m..m+mr-1, into their chain acc[r] (and
// extra[r], for the formats with a minimum). Each row's integers are summed in two halves
// (exact: the same integer), so that 2 * mr chains of dpbusd run side by side rather than
// one chain of 8 dependent ones; each tile vector, loaded once, meets every row.
static inline __attribute__((always_inline)) void t32_block(int mr, const t32_tile *t,
                                                            const act_rows *x, int64_t m,
                                                            int64_t b, int bias, __m512 *acc,
                                                            __m512 *extra) {
    const int64_t per_row = x->k / 32;
    __m512i even[4], odd[4];
    for (int r = 0; r < mr; r++) {
        const int64_t at = (m + r) * per_row + b;
        even[r] = _mm512_set1_epi32(bias < 0 ? 0 : -(int32_t)x->sums32[at] * (1 << bias));
        odd[r] = _mm512_setzero_si512();
    }
    for (int l = 0; l < 8; l += 2) {
        const __m512i u0 = _mm512_loadu_si512((const void *)t->u[b][l]);
        const __m512i u1 = _mm512_loadu_si512((const void *)t->u[b][l + 1]);
        for (int r = 0; r < mr; r++) {
            const int8_t *q = x->q32 + ((m + r) * per_row + b) * 32 + 4 * l;
            int32_t x0, x1;
            memcpy(&x0, q, 4);
            memcpy(&x1, q + 4, 4);
            even[r] = _mm512_dpbusd_epi32(even[r], u0, _mm512_set1_epi32(x0));
            odd[r] = _mm512_dpbusd_epi32(odd[r], u1, _mm512_set1_epi32(x1));
        }
    }
    const __m512 d = _mm512_loadu_ps(t->d[b]);
    for (int r = 0; r < mr; r++) {
        const int64_t at = (m + r) * per_row + b;
        const __m512i sum = _mm512_add_epi32(even[r], odd[r]);
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x->d32[at]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r]);
        if (bias < 0)
            extra[r] = _mm512_fmadd_ps(_mm512_loadu_ps(t->m[b]), _mm512_set1_ps(x->s32[at]),
                                       extra[r]);
    }
}

// Activation rows m..m+mr-1 (mr <= 4, a constant where inlined) against the tile: y[r] for
// its KT_ROWS rows, row i's at y + i * stride. Blocks go to chain b mod CHAINS in groups of
// CHAINS, so that each chain is a register. A row's float sums are those of one row alone,
// in the same order: the same bits.
static inline __attribute__((always_inline)) void t32_rows(int mr, const t32_tile *t,
                                                           const act_rows *x, int64_t m,
                                                           int64_t blocks, int bias, float *y,
                                                           int64_t stride) {
    __m512 acc[CHAINS][4], extra[CHAINS][4];
    for (int c = 0; c < CHAINS; c++)
        for (int r = 0; r < mr; r++) acc[c][r] = extra[c][r] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + CHAINS <= blocks; b += CHAINS)
        for (int c = 0; c < CHAINS; c++) t32_block(mr, t, x, m, b + c, bias, acc[c], extra[c]);
    for (int c = 0; b < blocks; b++, c++) t32_block(mr, t, x, m, b, bias, acc[c], extra[c]);
    for (int r = 0; r < mr; r++) {
        const __m512 chains[CHAINS] = {acc[0][r], acc[1][r], acc[2][r], acc[3][r]};
        __m512 sum = hsum_chains(chains);
        if (bias < 0) {
            const __m512 mins[CHAINS] = {extra[0][r], extra[1][r], extra[2][r], extra[3][r]};
            sum = _mm512_add_ps(sum, hsum_chains(mins));
        }
        _mm512_storeu_ps(y + r * stride, sum);
    }
}

// The blocks of KT_ROWS rows (row_bytes apart) into the tile.
#define DEFINE_T32_FILL(NAME, BYTES)                                                          \
    static void NAME##_t32_fill(const uint8_t *w, int64_t row_bytes, int64_t blocks,         \
                                t32_tile *t) {                                               \
        for (int64_t b = 0; b < blocks; b++) {                                               \
            __m512i rows[8], cols[8];                                                        \
            for (int r = 0; r < 8; r++) {                                                    \
                const uint8_t *lo = w + r * row_bytes + b * BYTES;                           \
                const uint8_t *hi = lo + 8 * row_bytes;                                      \
                prefetch_ahead(lo, KT_ROWS * row_bytes, BYTES);                              \
                prefetch_ahead(hi, KT_ROWS * row_bytes, BYTES);                              \
                rows[r] = _mm512_inserti64x4(_mm512_castsi256_si512(NAME##_values(lo)),      \
                                             NAME##_values(hi), 1);                          \
            }                                                                                \
            transpose_words(rows, cols);                                                     \
            for (int g = 0; g < 8; g++) _mm512_storeu_si512((void *)t->u[b][g], cols[g]);    \
            for (int r = 0; r < KT_ROWS; r++) {                                              \
                t->d[b][r] = NAME##_scale(w + r * row_bytes + b * BYTES);                    \
                t->m[b][r] = NAME##_min(w + r * row_bytes + b * BYTES);                      \
            }                                                                                \
        }                                                                                    \
    }
#endif

// ---- the kernel: weight rows against activation rows ----------------------------------------

// Activation rows that meet a tile of weight rows before the next rows come: they stay in the
// cache while the tile's rows pass.
#define INT8_ROW_BLOCK 32
// How far ahead of the weight block being read the weights are prefetched, a block's worth
// of cache lines per block, as the rows stream past. The hardware prefetchers alone leave
// a row's decode at 60% of what a plain sum reads. Addresses past the matrix are harmless:
// a prefetch never faults.
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

// The cache lines of [at, at + bytes): a tile's fill asks for the next tile's rows (the
// same thread's next task, most often) while it unpacks its own.
// The address is formed as an integer: past the matrix, it is harmless. The builtin by
// name: GCC 12 drops _mm_prefetch inside the always-inline row loops below, and keeps it.
static inline void prefetch_ahead(const uint8_t *base, int64_t offset, int bytes) {
    const uintptr_t at = (uintptr_t)base + (uintptr_t)offset;
    for (int o = 0; o < bytes; o += 64) __builtin_prefetch((const void *)(at + (uintptr_t)o), 0, 3);
}

static inline void prefetch_block(const uint8_t *block, int bytes) {
    prefetch_ahead(block, PREFETCH_BYTES, bytes);
}

// Rows [0, returned) of count weight rows done in whole tiles of KT_ROWS (none with fewer
// than T32_MIN_ROWS activation rows, where each weight row alone is faster, or where the
// tiles are not built or their memory is not to be had: the other kernel gives the same bits).
#define T32_MIN_ROWS 6
#ifdef T32_TILES
#define T32_TILES_OF(NAME, BYTES)                                                             \
    DEFINE_T32_FILL(NAME, BYTES)                                                              \
    static int64_t NAME##_tiles(const act_rows *x, int64_t rows, int64_t blocks,             \
                                const uint8_t *w, int64_t count, float *y, int64_t stride) {  \
        t32_tile tile = {0};                                                                  \
        if (rows < T32_MIN_ROWS || count < KT_ROWS || !t32_alloc(blocks, &tile)) {           \
            t32_free(&tile);                                                                  \
            return 0;                                                                         \
        }                                                                                     \
        int64_t n = 0;                                                                        \
        for (; n + KT_ROWS <= count; n += KT_ROWS) {                                          \
            NAME##_t32_fill(w + n * blocks * BYTES, blocks * BYTES, blocks, &tile);           \
            for (int64_t m = 0; m < rows; m += 4)                                             \
                FOUR_ROWS(t32_rows, rows - m, &tile, x, m, blocks, NAME##_bias,                \
                          y + m * stride + n, stride)                                         \
        }                                                                                     \
        t32_free(&tile);                                                                      \
        return n;                                                                             \
    }
#else
#define T32_TILES_OF(NAME, BYTES)                                                             \
    static int64_t NAME##_tiles(const act_rows *x, int64_t rows, int64_t blocks,             \
                                const uint8_t *w, int64_t count, float *y, int64_t stride) {  \
        (void)x, (void)rows, (void)blocks, (void)w, (void)count, (void)y, (void)stride;       \
        return 0;                                                                             \
    }
#endif

// FN(mr, ...) for the next min(left, 4) activation rows, mr a constant in each call: the
// rows' sums then stay in registers.
#define FOUR_ROWS(FN, left, ...)                                                              \
    switch (left) {                                                                           \
    case 1: FN(1, __VA_ARGS__); break;                                                        \
    case 2: FN(2, __VA_ARGS__); break;                                                        \
    case 3: FN(3, __VA_ARGS__); break;                                                        \
    default: FN(4, __VA_ARGS__);                                                              \
    }

// The 32-value formats: a row's blocks give one integer each (their 8 lanes summed, exact),
// and block b adds integer x (weight scale x activation scale) to float chain b mod 4 (and
// its minimum x the activations' scaled sum to a chain of minimums, for the formats that
// have one); the chains are summed at the end, (0 + 2) + (1 + 3). Four blocks at a time:
// their lanes are summed together, and their scales multiply in one vector.
// Lane i: the sum of the 8 lanes of s[i].
static inline __m128i sum_lanes4(const __m256i s[4]) {
    const __m256i ab = _mm256_hadd_epi32(s[0], s[1]), cd = _mm256_hadd_epi32(s[2], s[3]);
    const __m256i all = _mm256_hadd_epi32(ab, cd);
    return _mm_add_epi32(_mm256_castsi256_si128(all), _mm256_extracti128_si256(all, 1));
}

// n <= 4 floats, the rest 0.
static inline __m128 load_floats(const float *p, int n) {
    if (n == CHAINS) return _mm_loadu_ps(p);
    float v[CHAINS] = {0};
    memcpy(v, p, (size_t)n * sizeof(float));
    return _mm_loadu_ps(v);
}

// The chains' sum: (0 + 2) + (1 + 3).
static inline float sum_chains(__m128 v) {
    const __m128 half = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

// One activation row against one MXFP4 weight row, whole groups of 4 blocks only (the
// chains of mxfp4_group, which adds the rest): 4 blocks per 512-bit vector, block i's 16
// nibble bytes in 128-bit lane i, the low nibbles (values 0..15) and the high ones
// (16..31) looked up plus 16 (unsigned, for dpbusd), the activations' halves gathered to
// match by lane shuffles and the 16s taken off through the blocks' sums. The same integer
// per block as mxfp4_group, added to the same chains in the same order: the same bits, in
// half the instructions. Q5_0 and Q8_0 have their own below; the other formats none
// (ROW1_NAME 0).
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define ROW1_mxfp4 1
static inline __m128 mxfp4_row1(const act_rows *x, int64_t groups, const uint8_t *w) {
    const __m512i table = _mm512_broadcast_i32x4(
        _mm_setr_epi8(16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4));
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    __m128 acc = _mm_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *block = w + g * CHAINS * 17;
        prefetch_ahead(block, PREFETCH_BYTES, CHAINS * 17);
        __m512i q = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(block + 1)));
        for (int i = 1; i < CHAINS; i++)  // a constant lane once unrolled
            q = _mm512_mask_broadcast_i32x4(q, (__mmask16)(0xF << (4 * i)),
                                            _mm_loadu_si128((const __m128i *)(block + 17 * i + 1)));
        const __m512i ulo = _mm512_shuffle_epi8(table, _mm512_and_si512(q, low));
        const __m512i uhi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(q, 4), low));
        const int8_t *a = x->q32 + g * CHAINS * 32;
        const __m512i a0 = _mm512_loadu_si512((const void *)a);
        const __m512i a1 = _mm512_loadu_si512((const void *)(a + 64));
        const __m512i alo = _mm512_shuffle_i64x2(a0, a1, _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i ahi = _mm512_shuffle_i64x2(a0, a1, _MM_SHUFFLE(3, 1, 3, 1));
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ulo, alo);
        s = _mm512_dpbusd_epi32(s, uhi, ahi);
        s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, (_MM_PERM_ENUM)0x4E));
        s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, (_MM_PERM_ENUM)0xB1));
        const __m128i sums = _mm512_castsi512_si128(_mm512_permutexvar_epi32(firsts, s));
        int64_t four;
        memcpy(&four, x->sums32 + g * CHAINS, sizeof four);
        const __m128i bias = _mm_slli_epi32(_mm_cvtepi16_epi32(_mm_cvtsi64_si128(four)), 4);
        const __m128 scale = _mm_mul_ps(mxfp4_scales(block, CHAINS, NULL),
                                        _mm_loadu_ps(x->d32 + g * CHAINS));
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_sub_epi32(sums, bias)), scale, acc);
    }
    return acc;
}
#else
#define ROW1_mxfp4 0
#define mxfp4_row1(x, groups, w) _mm_setzero_ps()
#endif

// Q5_0's and Q8_0's one-row products need VBMI's byte permutes and BITALG's bit shuffle
// (Ice Lake, Zen 4 and later); elsewhere the group path gives the same bits.
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && \
    defined(__AVX512BITALG__)
// The 4 integers of a group of 4 blocks from s, block i's products in 128-bit lane i,
// less the activations' sums of 32 times 2^bias (the bias added to the weights).
static inline __m128i lane_sums(__m512i s, const int16_t *sums32, int bias) {
    const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, (_MM_PERM_ENUM)0x4E));
    s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, (_MM_PERM_ENUM)0xB1));
    int64_t four;
    memcpy(&four, sums32, sizeof four);
    const __m128i offsets = _mm_slli_epi32(_mm_cvtepi16_epi32(_mm_cvtsi64_si128(four)), bias);
    return _mm_sub_epi32(_mm512_castsi512_si128(_mm512_permutexvar_epi32(firsts, s)), offsets);
}

// acc plus group g's 4 blocks: lane_sums' integers of s, each weighed by its block's float16
// scale (the first 4 halves of d) times its activations' scale, as the group path weighs it.
static inline __m128 group_fma(__m128 acc, __m512i s, __m512i d, const act_rows *x, int64_t g,
                               int bias) {
    const __m128i sums = lane_sums(s, x->sums32 + g * CHAINS, bias);
    const __m128 scale = _mm_mul_ps(_mm_cvtph_ps(_mm512_castsi512_si128(d)),
                                    _mm_loadu_ps(x->d32 + g * CHAINS));
    return _mm_fmadd_ps(_mm_cvtepi32_ps(sums), scale, acc);
}

// The activations of 4 blocks from a: their first 16 values (lo) and last 16 (hi), block i
// in 128-bit lane i.
static inline void lane_acts(const int8_t *a, __m512i *lo, __m512i *hi) {
    const __m512i a0 = _mm512_loadu_si512((const void *)a);
    const __m512i a1 = _mm512_loadu_si512((const void *)(a + 64));
    *lo = _mm512_shuffle_i64x2(a0, a1, _MM_SHUFFLE(2, 0, 2, 0));
    *hi = _mm512_shuffle_i64x2(a0, a1, _MM_SHUFFLE(3, 1, 3, 1));
}

// One activation row against one Q5_0 weight row, whole groups of 4 blocks (88 bytes) only,
// as mxfp4_row1: the group read as bytes [0, 64) and [24, 88), from which vpermt2b picks
// block i's 16 nibble bytes into lane i, its 32 high bits (qh) into both 64-bit halves of
// lane i, and the 4 float16 scales. The high bits become byte masks (vpshufbitqmb) that
// add 16 to the nibbles: the values plus 16, taken off through the activations' sums. The
// same integer per block as q5_0_group, the same float steps: the same bits.
#define ROW1_q5_0 1
// Group byte o is index o below 64, 64 + (o - 24) past it (the second load).
static const uint8_t Q5_0_NIBBLES[64] = {
    6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
    28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43,
    50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 104, 105,
    112, 113, 114, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 126, 127};
static const uint8_t Q5_0_HIGH[64] = {
    2, 3, 4, 5, 2, 3, 4, 5, 2, 3, 4, 5, 2, 3, 4, 5,
    24, 25, 26, 27, 24, 25, 26, 27, 24, 25, 26, 27, 24, 25, 26, 27,
    46, 47, 48, 49, 46, 47, 48, 49, 46, 47, 48, 49, 46, 47, 48, 49,
    108, 109, 110, 111, 108, 109, 110, 111, 108, 109, 110, 111, 108, 109, 110, 111};
static const uint8_t Q5_0_SCALES[64] = {0, 1, 22, 23, 44, 45, 106, 107};
// vpshufbitqmb's bit of each byte: value j of a lane is qh bit j (low nibbles) or 16 + j.
static const uint8_t Q5_0_BITS[2][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31}};
// As Q8_0's below, twice PREFETCH_BYTES ahead (gate + up of gemma3-1b from memory
// 1.02-1.06x; 4x: 0.93x).
#ifndef Q5_0_PREFETCH_BYTES
#define Q5_0_PREFETCH_BYTES (2 * PREFETCH_BYTES)
#endif
typedef struct {
    __m512i nibbles, high, scale_bytes, bits_lo, bits_hi, low, sixteen;
} q5_0_tables;

// Group g's dot products s (block i's in 128-bit lane i, before lane_sums) and its scales'
// bytes d (the first 4 halves).
static inline __attribute__((always_inline)) void q5_0_group_sums(
    const q5_0_tables *t, const act_rows *x, const uint8_t *w, int64_t g, __m512i *s,
    __m512i *d) {
    const uint8_t *group = w + g * CHAINS * 22;
    // two groups' lines (176 bytes) asked for every other group: 3 prefetches where 2 a
    // group ask for most lines twice (q + k + v from memory: 1.04-1.11x)
    if (!(g & 1)) prefetch_ahead(group, Q5_0_PREFETCH_BYTES, 2 * CHAINS * 22);
    __m512i first = _mm512_loadu_si512((const void *)group);
    __m512i second = _mm512_loadu_si512((const void *)(group + 24));
    // held in registers: else GCC folds a load into each of the 3 vpermt2b below (which
    // overwrite a source), 6 loads of the group where 2 do (gemma3-1b gate + up from
    // memory 1.04-1.05x, q + k + v 1.10x)
    __asm__("" : "+v"(first), "+v"(second));
    const __m512i q = _mm512_permutex2var_epi8(first, t->nibbles, second);
    const __m512i qh = _mm512_permutex2var_epi8(first, t->high, second);
    *d = _mm512_permutex2var_epi8(first, t->scale_bytes, second);
    __m512i ulo = _mm512_and_si512(q, t->low);
    __m512i uhi = _mm512_and_si512(_mm512_srli_epi16(q, 4), t->low);
    ulo = _mm512_mask_add_epi8(ulo, _mm512_bitshuffle_epi64_mask(qh, t->bits_lo), ulo, t->sixteen);
    uhi = _mm512_mask_add_epi8(uhi, _mm512_bitshuffle_epi64_mask(qh, t->bits_hi), uhi, t->sixteen);
    __m512i alo, ahi;
    lane_acts(x->q32 + g * CHAINS * 32, &alo, &ahi);
    *s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ulo, alo), uhi, ahi);
}

// group_fma for groups g..g+3 in turn: their 16 lane sums found in one tree of shuffles,
// their offsets, conversions and scales in one vector each, about half the instructions
// of 4 group_fma (from memory: gemma3-1b gate + up 1.04-1.06x, q + k + v 1.07-1.10x). The
// same integers, the same float steps in the same order: the same bits.
static inline __m128 four_groups_fma(__m128 acc, const __m512i s[4], const __m512i d[4],
                                     const act_rows *x, int64_t g, int bias) {
    // 128-bit lane L of t01: [s0 0+2, s1 0+2, s0 1+3, s1 1+3] of that lane's ints
    const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[0], s[1]),
                                         _mm512_unpackhi_epi32(s[0], s[1]));
    const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2], s[3]),
                                         _mm512_unpackhi_epi32(s[2], s[3]));
    // int 4L + k: group k's block L
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23),
                                       _mm512_unpackhi_epi64(t01, t23));
    const __m512i by_group = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), u);
    const __m512i offsets = _mm512_slli_epi32(
        _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(x->sums32 + g * CHAINS))),
        bias);
    const __m512 ints = _mm512_cvtepi32_ps(_mm512_sub_epi32(by_group, offsets));
    const __m256i halves = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_unpacklo_epi64(_mm512_castsi512_si128(d[0]),
                                                  _mm512_castsi512_si128(d[1]))),
        _mm_unpacklo_epi64(_mm512_castsi512_si128(d[2]), _mm512_castsi512_si128(d[3])), 1);
    const __m512 scale =
        _mm512_mul_ps(_mm512_cvtph_ps(halves), _mm512_loadu_ps(x->d32 + g * CHAINS));
    acc = _mm_fmadd_ps(_mm512_castps512_ps128(ints), _mm512_castps512_ps128(scale), acc);
    acc = _mm_fmadd_ps(_mm512_extractf32x4_ps(ints, 1), _mm512_extractf32x4_ps(scale, 1), acc);
    acc = _mm_fmadd_ps(_mm512_extractf32x4_ps(ints, 2), _mm512_extractf32x4_ps(scale, 2), acc);
    return _mm_fmadd_ps(_mm512_extractf32x4_ps(ints, 3), _mm512_extractf32x4_ps(scale, 3), acc);
}

static inline __m128 q5_0_row1(const act_rows *x, int64_t groups, const uint8_t *w) {
    const q5_0_tables t = {
        _mm512_loadu_si512((const void *)Q5_0_NIBBLES),
        _mm512_loadu_si512((const void *)Q5_0_HIGH),
        _mm512_loadu_si512((const void *)Q5_0_SCALES),
        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)Q5_0_BITS[0])),
        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)Q5_0_BITS[1])),
        _mm512_set1_epi8(0x0F),
        _mm512_set1_epi8(16)};
    __m128 acc = _mm_setzero_ps();
    int64_t g = 0;
    for (; g + 4 <= groups; g += 4) {
        __m512i s[4], d[4];
        for (int i = 0; i < 4; i++) q5_0_group_sums(&t, x, w, g + i, &s[i], &d[i]);
        acc = four_groups_fma(acc, s, d, x, g, 4);
    }
    for (; g < groups; g++) {
        __m512i s, d;
        q5_0_group_sums(&t, x, w, g, &s, &d);
        acc = group_fma(acc, s, d, x, g, 4);
    }
    return acc;
}

// One activation row against one Q8_0 weight row, whole groups of 4 blocks (136 bytes)
// only: the group read as bytes [0, 64), [64, 128) and [72, 136), vpermt2b picks blocks 0
// and 1's values into one vector, 2 and 3's into another (the activations' own order) and
// the 4 float16 scales; the values plus 128 (unsigned, for dpbusd), taken off through the
// activations' sums. The same integer per block as q8_0_group, the same float steps: the
// same bits.
#define ROW1_q8_0 1
// Block values 0..31 of blocks 0 and 1 (group bytes 2.., 36..), from the first two loads
// (index = byte); of blocks 2 and 3 (bytes 70.., 104..), from the last two (the byte less
// 64 below 128, 64 + (byte - 72) past it); the scales' bytes (0, 34, 68, 102: index = byte).
static const uint8_t Q8_0_FIRST[64] = {
    2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17,
    18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33,
    36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51,
    52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67};
static const uint8_t Q8_0_SECOND[64] = {
    6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
    22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37,
    40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55,
    56, 57, 58, 59, 60, 61, 62, 63, 120, 121, 122, 123, 124, 125, 126, 127};
static const uint8_t Q8_0_SCALES[64] = {0, 1, 34, 35, 68, 69, 102, 103};
// Q8_0's one row reads its bytes faster than the others: twice PREFETCH_BYTES ahead keeps
// the memory busy (the output layer from memory: 34 -> 36-39 GB/s; 4x gains nothing more).
#ifndef Q8_0_PREFETCH_BYTES
#define Q8_0_PREFETCH_BYTES (2 * PREFETCH_BYTES)
#endif
static inline __m128 q8_0_row1(const act_rows *x, int64_t groups, const uint8_t *w) {
    const __m512i first = _mm512_loadu_si512((const void *)Q8_0_FIRST);
    const __m512i second = _mm512_loadu_si512((const void *)Q8_0_SECOND);
    const __m512i scale_bytes = _mm512_loadu_si512((const void *)Q8_0_SCALES);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m128 acc = _mm_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = w + g * CHAINS * 34;
        prefetch_ahead(group, Q8_0_PREFETCH_BYTES, CHAINS * 34);
        __m512i l0 = _mm512_loadu_si512((const void *)group);
        __m512i l1 = _mm512_loadu_si512((const void *)(group + 64));
        __m512i l2 = _mm512_loadu_si512((const void *)(group + 72));
        // held in registers: else GCC loads l0 again for the scales and folds l1 and l2
        // into the permutes (which overwrite a source), 6 loads of the group where 3 do
        // (bench/read_gap.py --formats Q8_0, weights in L2: 47 -> 58-60 GB/s)
        __asm__("" : "+v"(l0), "+v"(l1), "+v"(l2));
        const __m512i u01 = _mm512_xor_si512(_mm512_permutex2var_epi8(l0, first, l1), flip);
        const __m512i u23 = _mm512_xor_si512(_mm512_permutex2var_epi8(l1, second, l2), flip);
        const __m512i d = _mm512_permutex2var_epi8(l0, scale_bytes, l1);
        const int8_t *a = x->q32 + g * CHAINS * 32;
        const __m512i s01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u01,
                                                _mm512_loadu_si512((const void *)a));
        const __m512i s23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u23,
                                                _mm512_loadu_si512((const void *)(a + 64)));
        // block i's lanes into 128-bit lane i
        const __m512i s = _mm512_add_epi32(_mm512_shuffle_i64x2(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                                           _mm512_shuffle_i64x2(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
        acc = group_fma(acc, s, d, x, g, 7);
    }
    return acc;
}
#else
#define ROW1_q5_0 0
#define ROW1_q8_0 0
#define q5_0_row1(x, groups, w) _mm_setzero_ps()
#define q8_0_row1(x, groups, w) _mm_setzero_ps()
#endif
#define ROW1_q4_0 0
#define ROW1_q4_1 0
#define ROW1_q5_1 0
#define ROW1_q8_1 0
#define q4_0_row1(x, groups, w) _mm_setzero_ps()
#define q4_1_row1(x, groups, w) _mm_setzero_ps()
#define q5_1_row1(x, groups, w) _mm_setzero_ps()
#define q8_1_row1(x, groups, w) _mm_setzero_ps()

// y[r * stride] for activation rows m..m+mr-1 (mr <= 4) against one weight row, each
// unpacked block meeting the rows in turn.
#define DEFINE_INT8_KERNEL(NAME, BLOCK, BYTES)                                          \
    T32_TILES_OF(NAME, BYTES)                                                                 \
    /* blocks b0..b0+n-1 (n <= CHAINS) into the chains of rows m..m+mr-1 */                  \
    static inline __attribute__((always_inline)) void NAME##_group(                           \
        const act_rows *x, int64_t m, int mr, int64_t b0, int n, const uint8_t *w,            \
        __m128 *acc, __m128 *extra) {                                                         \
        const int64_t per_row = x->k / 32;                                                    \
        __m256i ints[4][CHAINS];                                                              \
        float d[CHAINS] = {0}, mins[CHAINS] = {0};                                            \
        prefetch_ahead(w, b0 * BYTES + PREFETCH_BYTES, CHAINS * BYTES);                       \
        for (int i = 0; i < CHAINS; i++) {                                                    \
            if (i >= n) {                                                                     \
                for (int r = 0; r < mr; r++) ints[r][i] = _mm256_setzero_si256();             \
                continue;                                                                     \
            }                                                                                 \
            const uint8_t *block = w + (b0 + i) * BYTES;                                      \
            NAME##_w wb;                                                                      \
            NAME##_unpack(block, &wb);                                                        \
            d[i] = wb.d, mins[i] = NAME##_wmin(&wb);                                          \
            for (int r = 0; r < mr; r++)                                                      \
                ints[r][i] = NAME##_ints(&wb, x->q32 + ((m + r) * per_row + b0 + i) * 32);    \
        }                                                                                     \
        const __m128 dv = NAME##_scales(w + b0 * BYTES, n, d), mv = _mm_loadu_ps(mins);       \
        for (int r = 0; r < mr; r++) {                                                        \
            const int64_t at = (m + r) * per_row + b0;                                        \
            const __m128 scale = _mm_mul_ps(dv, load_floats(x->d32 + at, n));                 \
            acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(sum_lanes4(ints[r])), scale, acc[r]);       \
            if (NAME##_bias < 0)                                                              \
                extra[r] = _mm_fmadd_ps(mv, load_floats(x->s32 + at, n), extra[r]);           \
        }                                                                                     \
    }                                                                                         \
    /* y[r * stride] for activation rows m..m+mr-1 (mr <= 4) against one weight row */       \
    static inline __attribute__((always_inline)) void NAME##_by_rows(                         \
        int mr, const act_rows *x, int64_t m, int64_t blocks, const uint8_t *w, float *y,    \
        int64_t stride) {                                                                     \
        __m128 acc[4], extra[4];                                                              \
        for (int r = 0; r < mr; r++) acc[r] = extra[r] = _mm_setzero_ps();                   \
        int64_t b0 = 0;                                                                       \
        for (; b0 + CHAINS <= blocks; b0 += CHAINS)                                           \
            NAME##_group(x, m, mr, b0, CHAINS, w, acc, extra);                                \
        if (b0 < blocks) NAME##_group(x, m, mr, b0, (int)(blocks - b0), w, acc, extra);      \
        for (int r = 0; r < mr; r++)                                                          \
            y[r * stride] = NAME##_bias < 0 ? sum_chains(acc[r]) + sum_chains(extra[r])       \
                                            : sum_chains(acc[r]);                             \
    }                                                                                         \
    static void NAME##_i8(const void *acts, int64_t rows, int64_t k_in, const uint8_t *w,     \
                          int64_t count, float *y, int64_t stride) {                          \
        const act_rows *x = (const act_rows *)acts;                                           \
        const int64_t blocks = k_in / BLOCK, row_bytes = blocks * BYTES;                      \
        const int64_t tiled = NAME##_tiles(x, rows, blocks, w, count, y, stride);             \
        w += tiled * row_bytes, y += tiled, count -= tiled;                                   \
        if (rows == 1 && ROW1_##NAME) { /* by_rows' bits, in fewer instructions */            \
            const int64_t whole = blocks / CHAINS * CHAINS;                                   \
            for (int64_t n = 0; n < count; n++) {                                             \
                __m128 acc = NAME##_row1(x, whole / CHAINS, w + n * row_bytes);                \
                __m128 extra = _mm_setzero_ps(); /* no minimum: the formats with ROW1 */      \
                if (whole < blocks)                                                           \
                    NAME##_group(x, 0, 1, whole, (int)(blocks - whole), w + n * row_bytes,    \
                                 &acc, &extra);                                               \
                y[n] = sum_chains(acc);                                                       \
            }                                                                                 \
            return;                                                                           \
        }                                                                                     \
        for (int64_t m0 = 0; m0 < rows; m0 += INT8_ROW_BLOCK) {                               \
            const int64_t end = rows - m0 < INT8_ROW_BLOCK ? rows : m0 + INT8_ROW_BLOCK;      \
            for (int64_t n = 0; n < count; n++)                                               \
                for (int64_t m = m0; m < end; m += 4)                                         \
                    FOUR_ROWS(NAME##_by_rows, end - m, x, m, blocks, w + n * row_bytes,       \
                              y + m * stride + n, stride)                                     \
        }                                                                                     \
    }

// ---- one activation row against one weight row: a decode's products -------------------------
//
// The same integers S and M per block as k_dot, found with fewer instructions for the two
// formats of Q4_K_M files, 8 blocks at a time:
//  - 64 values per vector in the order the block stores them (the activations reordered
//    to match, for Q4_K); each vector's products summed by 4 (exact in int32, and within
//    an int16: 4 x 63 x 127), two vectors' sums packed to int16 and weighed by their
//    sub-block scales in one dot product (the scales spread by a permutation);
//  - a block's 16 lanes of S folded to 8 beside its 8 lanes of M, and the 8 blocks' lanes
//    summed in one tree of shuffles (not a tree per block);
//  - the 16 integers converted, and their float scales (d, dmin) x the activations' scale
//    found, in one vector each.
// The float sums are then k_dot's, in its order: each block's two FMAs in turn on the
// same two running sums (its pair of integers and of scales moved to their lanes, apart
// from the chain of FMAs). The same bits as every other path.
#if defined(__AVX512BW__)
#define R4(a) a, a, a, a
// How far ahead the one-row kernels ask for their weights: further than the other kernels
// (PREFETCH_BYTES), as these spend less time per byte; 8 KiB, not 16: the 1B files'
// Q4_K and Q6_K products from memory 1.00-1.21x, none slower (bench/products_ab.py
// --shapes 1b, 5 runs), the loads alone 8 KiB ahead the fastest (bench/read_gap.py), on
// a Zen 5. CPUs measured otherwise get their own from build.py (`_TUNING`: Zen 4, 0).
#ifndef ROW1_PREFETCH
#define ROW1_PREFETCH 8192
#endif

// The cache lines of [p, p + bytes), each once.
static inline void prefetch_lines(const uint8_t *p, int bytes) {
    const uintptr_t end = (uintptr_t)p + (uintptr_t)bytes;
    for (uintptr_t at = (uintptr_t)p & ~(uintptr_t)63; at < end; at += 64)
        __builtin_prefetch((const void *)at, 0, 3);
}

// 16 sums of 4 products of unsigned bytes u and signed bytes x.
static inline __m512i sums_of_4(__m512i u, __m512i x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1));
#endif
}

// acc plus the products of int16 pairs a, b.
static inline __m512i dot_i16_add(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// Block i of a group's V: its S (16 lanes) folded to 8 beside its M, taken from m_pair (the
// M of blocks i and i ^ 1, the even one in the low 8 lanes): [M | S] for even i, [S | M]
// for odd.
static inline __m512i k8_lanes(__m512i s, __m512i m_pair, int i) {
    const __m512i swapped = _mm512_shuffle_i64x2(s, s, _MM_SHUFFLE(1, 0, 3, 2));
    return _mm512_mask_add_epi32(m_pair, (i & 1) ? 0x00FF : 0xFF00, s, swapped);
}

// The 8 blocks' S and M (each the sum of 8 lanes of its V) as [S0, M0, S1, M1, ...].
static inline __m512i k8_sums(const __m512i v[8]) {
    __m512i t[4];
    for (int i = 0; i < 4; i++)  // 128-bit lane L: lanes 4L..4L+3 of v[2i], v[2i+1], half-summed
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    // 128-bit lane L, int k: the sum of lanes 4L..4L+3 of v[k] (u0) and v[4 + k] (u1)
    const __m512i u0 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[0], t[1]),
                                        _mm512_unpackhi_epi64(t[0], t[1]));
    const __m512i u1 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2], t[3]),
                                        _mm512_unpackhi_epi64(t[2], t[3]));
    // int 4L + k: the low 8 lanes of v[k] (L = 0), its high 8 (1), of v[4 + k] (2, 3)
    const __m512i all = _mm512_add_epi32(_mm512_shuffle_i64x2(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_i64x2(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(4, 0, 1, 5, 6, 2, 3, 7, 12, 8, 9, 13, 14, 10, 11, 15);
    return _mm512_permutexvar_epi32(order, all);
}

// Up to 8 blocks' integers [S0, M0, S1, M1, ...] as floats, and the scales they take in
// k_dot's FMAs: [d0, dmin0, d1, ...] (dmin negated) x the activations' scales.
typedef struct { __m512 ints, by; } k8_terms;

static inline k8_terms k8_terms_of(__m512i sums, __m512 scales, const float *ad, int n) {
    const __m512 a = _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
        _mm512_castps256_ps512(_mm256_maskz_loadu_ps((__mmask8)((1u << n) - 1), ad)));
    return (k8_terms){_mm512_cvtepi32_ps(sums), _mm512_mul_ps(scales, a)};
}

// k_dot's FMAs for n <= 8 blocks, in block order, onto the two running sums in lanes 0
// and 1 of acc (each block's pair moved to those lanes apart from the chain of FMAs).
static inline __m128 k8_fma(k8_terms t, int n, __m128 acc) {
    const __m128 p[4] = {_mm512_castps512_ps128(t.ints), _mm512_extractf32x4_ps(t.ints, 1),
                         _mm512_extractf32x4_ps(t.ints, 2), _mm512_extractf32x4_ps(t.ints, 3)};
    const __m128 q[4] = {_mm512_castps512_ps128(t.by), _mm512_extractf32x4_ps(t.by, 1),
                         _mm512_extractf32x4_ps(t.by, 2), _mm512_extractf32x4_ps(t.by, 3)};
    for (int i = 0; i < n; i++)
        acc = i & 1 ? _mm_fmadd_ps(_mm_movehl_ps(p[i / 2], p[i / 2]), _mm_movehl_ps(q[i / 2], q[i / 2]), acc)
                    : _mm_fmadd_ps(p[i / 2], q[i / 2], acc);
    return acc;
}

// The 6-bit scales and minimums of 4 Q4_K blocks' headers (block i's 16 bytes in 128-bit
// lane i: d, dmin, the 12 packed bytes) as bytes: sc 0-3, mn 0-3, sc 4-7, mn 4-7 (k4_scales).
static inline __m512i k4_scale_bytes(__m512i h) {
    const __m512i lows = _mm512_shuffle_epi8(
        h, _mm512_broadcast_i32x4(_mm_setr_epi8(4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 12, 13, 14, 15)));
    const __m512i masked = _mm512_and_si512(lows, _mm512_broadcast_i32x4(_mm_setr_epi8(
        63, 63, 63, 63, 63, 63, 63, 63, 15, 15, 15, 15, -16, -16, -16, -16)));
    const __m512i low_bits = _mm512_srlv_epi32(masked, _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0, 0, 4)));
    // the top 2 bits of packed bytes 0-7, at bits 4 and 5 of bytes 8-15
    const __m512i tops = _mm512_srli_epi16(_mm512_bslli_epi128(h, 4), 2);
    const __m512i at = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0,
                                                            48, 48, 48, 48, 48, 48, 48, 48));
    return _mm512_ternarylogic_epi32(low_bits, tops, at, 0xF8);  // low_bits | (tops & at)
}

// Q4_K block's S from its 128 value bytes q and activations a (K4_ORDER); scale words of
// blocks i & ~1 and i | 1 (16 each, k4_scale_bytes' order), this one's by i & 1.
static inline __m512i q4_k_s(const uint8_t *q, const int8_t *a, __m512i words, int odd) {
#define SP(e, a, b, c, d) R4(16 * e + a), R4(16 * e + b), R4(16 * e + a), R4(16 * e + b), \
                          R4(16 * e + c), R4(16 * e + d), R4(16 * e + c), R4(16 * e + d)
    // packs(sums of v, sums of v + 1) in 128-bit lane L: 4 of v's (its sub-block by L),
    // then 4 of v + 1's
    static const int16_t at[2][2][32] = {{{SP(0, 0, 1, 2, 3)}, {SP(0, 8, 9, 10, 11)}},
                                         {{SP(1, 0, 1, 2, 3)}, {SP(1, 8, 9, 10, 11)}}};
#undef SP
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512i s = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const __m512i v = _mm512_loadu_si512((const void *)(q + 64 * h));
        const __m512i lo = _mm512_and_si512(v, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        const __m512i x0 = _mm512_loadu_si512((const void *)(a + 128 * h));
        const __m512i x1 = _mm512_loadu_si512((const void *)(a + 128 * h + 64));
        const __m512i packed = _mm512_packs_epi32(sums_of_4(lo, x0), sums_of_4(hi, x1));
        const __m512i scales = _mm512_permutexvar_epi16(
            _mm512_loadu_si512((const void *)at[odd][h]), words);
        s = dot_i16_add(s, packed, scales);
    }
    return s;
}

// The terms of n <= 8 Q4_K blocks from block b (w, a, bsums, ad at block b).
static inline __attribute__((always_inline)) k8_terms q4_k_eight(
    const uint8_t *w, const int8_t *a, const int16_t *bsums, const float *ad, int n) {
    // the minimums of blocks 2p, 2p + 1 for their pairs of sums of 16
    static const int16_t mins_at[32] = {4, 4, 5, 5, 6, 6, 7, 7, 12, 12, 13, 13, 14, 14, 15, 15,
                                        20, 20, 21, 21, 22, 22, 23, 23, 28, 28, 29, 29, 30, 30, 31, 31};
    __m512i v[8], heads[2];
    prefetch_lines(w + ROW1_PREFETCH, n * 144);
    for (int f = 0; f < 2; f++) {  // blocks 4f..4f+3
        __m512i h = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++)
            if (4 * f + i < n)
                h = _mm512_inserti32x4(h, _mm_loadu_si128((const __m128i *)(w + (4 * f + i) * 144)), i);
        heads[f] = h;
        const __m512i bytes = k4_scale_bytes(h);
        for (int p = 0; p < 2; p++) {
            const int j = 4 * f + 2 * p;  // blocks j, j + 1
            if (j >= n) {
                v[j] = v[j + 1] = _mm512_setzero_si512();
                continue;
            }
            const __m512i words = _mm512_cvtepu8_epi16(
                p ? _mm512_extracti64x4_epi64(bytes, 1) : _mm512_castsi512_si256(bytes));
            const __m512i sums16 = _mm512_maskz_loadu_epi16(j + 1 < n ? 0xFFFFFFFF : 0xFFFF,
                                                            bsums + 16 * j);
            const __m512i m_pair = _mm512_madd_epi16(
                _mm512_permutexvar_epi16(_mm512_loadu_si512((const void *)mins_at), words), sums16);
            for (int e = 0; e < 2; e++)
                v[j + e] = j + e < n ? k8_lanes(q4_k_s(w + (j + e) * 144 + 16, a + (j + e) * 256,
                                                        words, e), m_pair, e)
                                     : _mm512_setzero_si512();
        }
    }
    // d and dmin of each block, its first 4 bytes: dmin negated, as k_dot takes it
    const __m256i halves = _mm256_xor_si256(
        _mm512_castsi512_si256(_mm512_permutex2var_epi32(
            heads[0], _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0), heads[1])),
        _mm256_set1_epi32((int)0x80000000u));
    return k8_terms_of(k8_sums(v), _mm512_cvtph_ps(halves), ad, n);
}

// `count` weight rows (row_bytes apart) of `blocks` k-quant blocks of BYTES bytes, each
// against the activations x->ACTS, 8 blocks at a time through EIGHT, into y[0, count).
// Each group's FMAs come after the next group's integers, the next row's first group
// included: the chain of FMAs (and a row's last sums) runs while those are found, instead
// of holding them back. A row's rest takes EIGHT with its count a constant in each case
// (the work of absent blocks left out). Each row's FMAs are its own, in block order.
#define K8_REST(EIGHT, N) \
    case N: t = EIGHT(rw, ra, rs, x->d256 + b, N), t_n = N; break;
#define DEFINE_K8_ROW(NAME, EIGHT, BYTES, ACTS)                                                \
    static inline void NAME(const act_rows *x, int64_t blocks, const uint8_t *w, int64_t count, \
                            int64_t row_bytes, float *y) {                                     \
        if (blocks == 0) {                                                                     \
            for (int64_t n = 0; n < count; n++) y[n] = 0.0f;                                   \
            return;                                                                            \
        }                                                                                      \
        __m128 acc = _mm_setzero_ps(); /* the sums of the row of `last` */                     \
        k8_terms last = {_mm512_setzero_ps(), _mm512_setzero_ps()};                            \
        int last_n = 0;                                                                        \
        bool last_ends = false; /* whether `last` is its row's last group */                   \
        for (int64_t n = 0; n < count; n++) {                                                  \
            const uint8_t *wn = w + n * row_bytes;                                             \
            for (int64_t b = 0; b < blocks; b += 8) {                                          \
                k8_terms t;                                                                    \
                int t_n = 8;                                                                   \
                if (b + 8 <= blocks) {                                                         \
                    t = EIGHT(wn + b * BYTES, x->ACTS + b * 256, x->bsums + b * 16,            \
                              x->d256 + b, 8);                                                 \
                } else {                                                                       \
                    const uint8_t *rw = wn + b * BYTES;                                        \
                    const int8_t *ra = x->ACTS + b * 256;                                      \
                    const int16_t *rs = x->bsums + b * 16;                                     \
                    switch (blocks - b) {                                                      \
                        K8_REST(EIGHT, 1) K8_REST(EIGHT, 2) K8_REST(EIGHT, 3)                  \
                        K8_REST(EIGHT, 4) K8_REST(EIGHT, 5) K8_REST(EIGHT, 6)                  \
                        default: t = EIGHT(rw, ra, rs, x->d256 + b, 7), t_n = 7; break;        \
                    }                                                                          \
                }                                                                              \
                if (last_n) {                                                                  \
                    acc = last_n == 8 ? k8_fma(last, 8, acc) : k8_fma(last, last_n, acc);      \
                    if (last_ends) y[n - 1] = k_result(acc), acc = _mm_setzero_ps();           \
                }                                                                              \
                last = t, last_n = t_n, last_ends = b + 8 >= blocks;                           \
            }                                                                                  \
        }                                                                                      \
        if (last_n) {                                                                          \
            acc = last_n == 8 ? k8_fma(last, 8, acc) : k8_fma(last, last_n, acc);              \
            y[count - 1] = k_result(acc);                                                      \
        }                                                                                      \
    }

// Q4_K against activations in K4_ORDER.
DEFINE_K8_ROW(q4_k_reordered, q4_k_eight, 144, q256_k4)

// Q6_K block's S: 128 values a half, its low nibbles of 64 bytes 64 consecutive values
// (the activations as they are), the high ones the next 64; two bits each from qh. Scale
// words of blocks i & ~1 and i | 1 (16 each), this one's by i & 1.
static inline __m512i q6_k_s(const uint8_t *b, const int8_t *a, __m512i words, int odd) {
#define SP(e, h) R4(16 * e + 8 * h), R4(16 * e + 8 * h + 4), R4(16 * e + 8 * h + 1), \
                 R4(16 * e + 8 * h + 5), R4(16 * e + 8 * h + 2), R4(16 * e + 8 * h + 6), \
                 R4(16 * e + 8 * h + 3), R4(16 * e + 8 * h + 7)
    static const int16_t at[2][2][32] = {{{SP(0, 0)}, {SP(0, 1)}}, {{SP(1, 0)}, {SP(1, 1)}}};
#undef SP
    // qh's bits 0-1 to 4-5 for values [0, 32) of a half, 2-3 for [32, 64); then 4-5, 6-7
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
    __m512i s = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {  // values [128h, 128h + 128)
        const __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * h));
        const __m512i qh = _mm512_broadcast_i64x4(load32(b + 128 + 32 * h));
        const __m512i ua = _mm512_ternarylogic_epi32(_mm512_and_si512(ql, low),
                                                     _mm512_sllv_epi16(qh, up), two, 0xF8);
        const __m512i ub = _mm512_ternarylogic_epi32(
            _mm512_and_si512(_mm512_srli_epi16(ql, 4), low), _mm512_srlv_epi16(qh, down), two, 0xF8);
        const __m512i x0 = _mm512_loadu_si512((const void *)(a + 128 * h));
        const __m512i x1 = _mm512_loadu_si512((const void *)(a + 128 * h + 64));
        const __m512i packed = _mm512_packs_epi32(sums_of_4(ua, x0), sums_of_4(ub, x1));
        const __m512i scales = _mm512_permutexvar_epi16(
            _mm512_loadu_si512((const void *)at[odd][h]), words);
        s = dot_i16_add(s, packed, scales);
    }
    return s;
}

// The terms of n <= 8 Q6_K blocks from block b (w, a, bsums, ad at block b).
static inline __attribute__((always_inline)) k8_terms q6_k_eight(
    const uint8_t *w, const int8_t *a, const int16_t *bsums, const float *ad, int n) {
    __m512i v[8];
    int32_t d[8] = {0};  // the 4 bytes that end each block: its last 2 scales, d
    prefetch_lines(w + ROW1_PREFETCH, n * 210);
    for (int j = 0; j < 8; j += 2) {  // blocks j, j + 1
        if (j >= n) {
            v[j] = v[j + 1] = _mm512_setzero_si512();
            continue;
        }
        const uint8_t *b = w + j * 210;
        const __m128i first = _mm_loadu_si128((const __m128i *)(b + 192));
        __m128i second = _mm_setzero_si128();
        memcpy(&d[j], b + 206, 4);
        if (j + 1 < n) {
            second = _mm_loadu_si128((const __m128i *)(b + 210 + 192));
            memcpy(&d[j + 1], b + 210 + 206, 4);
        }
        const __m512i words = _mm512_cvtepi8_epi16(_mm256_set_m128i(second, first));
        const __m512i sums16 = _mm512_maskz_loadu_epi16(j + 1 < n ? 0xFFFFFFFF : 0xFFFF,
                                                        bsums + 16 * j);
        const __m512i m_pair = _mm512_madd_epi16(words, sums16);
        for (int e = 0; e < 2; e++)
            v[j + e] = j + e < n ? k8_lanes(q6_k_s(b + e * 210, a + (j + e) * 256, words, e),
                                            m_pair, e)
                                 : _mm512_setzero_si512();
    }
    // [d, d] per block, then [d, -32 d]: k_dot's dmin for Q6_K
    const __m512 dd = _mm512_movehdup_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d)));
    const __m512 by = _mm512_setr_ps(1, -32, 1, -32, 1, -32, 1, -32, 1, -32, 1, -32, 1, -32, 1, -32);
    return k8_terms_of(k8_sums(v), _mm512_mul_ps(dd, by), ad, n);
}

// Q6_K: its activations as they are.
DEFINE_K8_ROW(q6_k_wide, q6_k_eight, 210, q256)
#define Q6_K_GROUPED_MIN 8

// 16-bit scales for 64 values: scale index[i] for the pair of values 2i, 2i + 1.
static inline __m512i spread(__m512i words, const int16_t index[32]) {
    return _mm512_permutexvar_epi16(_mm512_loadu_si512((const void *)index), words);
}

// s plus 128 values (u0 then u1, 64 each) times the activations at a, each pair of products
// weighed by its sub-block's scale (spread by index0, index1).
static inline __m512i scaled_128(__m512i s, __m512i u0, __m512i u1, const int8_t *a,
                                 __m512i wide, const int16_t index0[32],
                                 const int16_t index1[32]) {
    const __m512i x0 = _mm512_loadu_si512((const void *)a);
    const __m512i x1 = _mm512_loadu_si512((const void *)(a + 64));
    s = _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(u0, x0), spread(wide, index0)));
    return _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(u1, x1), spread(wide, index1)));
}

// A block's sums S (16 lanes) and M (8) into k_dot's two float sums, as k_dot adds them.
static inline __m128 k_add(__m512i s, __m256i m, float d, float dmin, float ad, __m128 acc) {
    const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
    const __m128 scales = _mm_setr_ps(d, dmin, 0.0f, 0.0f);
    return _mm_fmadd_ps(_mm_cvtepi32_ps(two_sums(s8, m)), _mm_mul_ps(scales, _mm_set1_ps(ad)), acc);
}

// Q6_K a block at a time (each block's sums reduced and added on their own): faster than
// q6_k_wide for rows of fewer than Q6_K_GROUPED_MIN blocks, where a group's fixed cost
// weighs (4 blocks a row, from L3: 1.35x); from 8 blocks q6_k_wide's run of rows is the
// faster (8 blocks from memory 1.06-1.14x, from L3 1.11x). Its low nibbles of 64 bytes are
// 64 consecutive values, so the activations go as they are.
static inline float q6_k_per_block(const act_rows *x, int64_t blocks, const uint8_t *w) {
    static const int16_t at[4][32] = {
        {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
        {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
        {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9,
         10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
        {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13,
         14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};
    // qh's 2-bit fields: shifts 0 and 2 for values [0, 32) and [32, 64) of a half, 4 and 6
    // for [64, 96) and [96, 128)
    static const int16_t shifts[2][32] = {
        {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2},
        {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6}};
    const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(3);
    const __m512i shift_a = _mm512_loadu_si512((const void *)shifts[0]);
    const __m512i shift_b = _mm512_loadu_si512((const void *)shifts[1]);
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = w + b * 210;
        prefetch_block(block, 210);
        const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 192)));
        const __m512i wide = _mm512_castsi256_si512(scales);
        const int8_t *a = x->q256 + b * 256;
        __m512i s = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {  // values [128h, 128h + 128)
            const __m512i ql = _mm512_loadu_si512((const void *)(block + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(load32(block + 128 + 32 * h));
            const __m512i ha = _mm512_and_si512(_mm512_srlv_epi16(qh, shift_a), two);
            const __m512i hb = _mm512_and_si512(_mm512_srlv_epi16(qh, shift_b), two);
            const __m512i ua = _mm512_or_si512(_mm512_and_si512(ql, low), _mm512_slli_epi16(ha, 4));
            const __m512i ub = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low),
                                               _mm512_slli_epi16(hb, 4));
            s = scaled_128(s, ua, ub, a + 128 * h, wide, at[2 * h], at[2 * h + 1]);
        }
        const __m256i m = _mm256_madd_epi16(scales, load32(x->bsums + b * 16));
        const float d = half_to_float(block + 208);
        acc = k_add(s, m, d, -32.0f * d, x->d256[b], acc);
    }
    return k_result(acc);
}
#undef R4
#endif

// The one-row kernel each k-quant takes: `count` weight rows (row_bytes apart) against one
// activation row, into y[0, count). Q4_K (activations reordered) and Q6_K (from
// Q6_K_GROUPED_MIN blocks) take their run of rows; the others, and Q4_K where its
// activations were not reordered, `by_dot` (one row through k_dot) a row at a time
// (EACH_ROW).
#define EACH_ROW(ONE, x, blocks, w, count, row_bytes, y)                                       \
    do {                                                                                       \
        for (int64_t n_ = 0; n_ < (count); n_++) (y)[n_] = ONE(x, blocks, (w) + n_ * (row_bytes)); \
    } while (0)
#if defined(__AVX512BW__)
#define ONE_ROW_q4_k(x, blocks, w, count, row_bytes, y, by_dot)                                \
    do {                                                                                       \
        if ((x)->q256_k4) q4_k_reordered(x, blocks, w, count, row_bytes, y);                   \
        else EACH_ROW(by_dot, x, blocks, w, count, row_bytes, y);                              \
    } while (0)
#define ONE_ROW_q6_k(x, blocks, w, count, row_bytes, y, by_dot)                                \
    do {                                                                                       \
        if ((blocks) >= Q6_K_GROUPED_MIN) q6_k_wide(x, blocks, w, count, row_bytes, y);        \
        else EACH_ROW(q6_k_per_block, x, blocks, w, count, row_bytes, y);                      \
    } while (0)
#else
#define ONE_ROW_q4_k(x, blocks, w, count, row_bytes, y, by_dot) \
    EACH_ROW(by_dot, x, blocks, w, count, row_bytes, y)
#define ONE_ROW_q6_k ONE_ROW_q4_k
#endif
#define ONE_ROW_q2_k(x, blocks, w, count, row_bytes, y, by_dot) \
    EACH_ROW(by_dot, x, blocks, w, count, row_bytes, y)
#define ONE_ROW_q3_k ONE_ROW_q2_k
#define ONE_ROW_q5_k ONE_ROW_q2_k

// ---- k-quant tiles filled straight from the blocks (AVX-512BW) -------------------------------
//
// The tiles of Q4_K (most of a Q4_K_M file) are filled without unpacking each row's block
// first: the packed bytes of 16 rows are transposed as 32-bit words, so that vector j holds
// word j of every row (lane r: row r), and the values, scales and minimums are then taken
// apart 16 rows at a time. Each tile word is the one k_tile_fill makes from the rows' parts:
// the same integers, so the same bits, in a third of the instructions. Such a tile is filled
// one block at a time, while it stays in the L1 cache, and met there by every activation row
// (NAME_by_block, where NAME_blockwise): a quarter less time than the rows' parts and a
// tile per block (NAME_tiled) at 16 rows, the weights read from memory. Q6_K keeps the
// latter, which measured faster for it (its sums in registers across the blocks), as do
// the rarer k-quants.
#if defined(__AVX512BW__)
#define K_DIRECT_FILL 1

// out[c] = word c of rows 0..15 (in[r]: 16 words of row r), lane r.
static inline void transpose16(const __m512i in[16], __m512i out[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {  // words 4L + {0, 1} | {2, 3} of rows 2i, 2i + 1
        a[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  // b[4i + j], 128-bit lane L: word 4L + j of rows 4i..4i+3
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {  // the lanes of rows 0-3, 4-7, 8-11 and 12-15 side by side
        const __m512i p0 = _mm512_shuffle_i32x4(b[j], b[4 + j], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i p1 = _mm512_shuffle_i32x4(b[j], b[4 + j], _MM_SHUFFLE(3, 1, 3, 1));
        const __m512i q0 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i q1 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], _MM_SHUFFLE(3, 1, 3, 1));
        out[j] = _mm512_shuffle_i32x4(p0, q0, _MM_SHUFFLE(2, 0, 2, 0));
        out[8 + j] = _mm512_shuffle_i32x4(p0, q0, _MM_SHUFFLE(3, 1, 3, 1));
        out[4 + j] = _mm512_shuffle_i32x4(p1, q1, _MM_SHUFFLE(2, 0, 2, 0));
        out[12 + j] = _mm512_shuffle_i32x4(p1, q1, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

// Words 16h .. 16h + 15 of the 16 rows from w (row r at w + r * row_bytes) as columns.
static inline void columns16(const uint8_t *w, int64_t row_bytes, __m512i out[16]) {
    __m512i in[16];
    for (int r = 0; r < KT_ROWS; r++) in[r] = _mm512_loadu_si512((const void *)(w + r * row_bytes));
    transpose16(in, out);
}

// The 4 words of 16 bytes from w of each row, as columns (out[q], lane r: word q of row r):
// rows r, r + 4, r + 8, r + 12 side by side, then a 4 x 4 transposition in each 128-bit lane.
static inline void columns4(const uint8_t *w, int64_t row_bytes, __m512i out[4]) {
    __m512i x[4];
    for (int q = 0; q < 4; q++) {
        x[q] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(w + q * row_bytes)));
        for (int l = 1; l < 4; l++)
            x[q] = _mm512_inserti32x4(
                x[q], _mm_loadu_si128((const __m128i *)(w + (q + 4 * l) * row_bytes)), l);
    }
    const __m512i lo01 = _mm512_unpacklo_epi32(x[0], x[1]);
    const __m512i hi01 = _mm512_unpackhi_epi32(x[0], x[1]);
    const __m512i lo23 = _mm512_unpacklo_epi32(x[2], x[3]);
    const __m512i hi23 = _mm512_unpackhi_epi32(x[2], x[3]);
    out[0] = _mm512_unpacklo_epi64(lo01, lo23);
    out[1] = _mm512_unpackhi_epi64(lo01, lo23);
    out[2] = _mm512_unpacklo_epi64(hi01, hi23);
    out[3] = _mm512_unpackhi_epi64(hi01, hi23);
}

// Byte i of each word, as a word.
static inline __m512i byte_word(__m512i v, int i) {
    return _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), _mm512_set1_epi32(0xFF));
}
// Byte i of each word, sign-extended to a word.
static inline __m512i signed_byte_word(__m512i v, int i) {
    return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24);
}
// Both float16 halves of each word widened: the low ones (lane r of *low) and the high.
static inline void halves_to_float(__m512i v, __m512 *low, __m512 *high) {
    *low = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
    *high = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
}
static inline __m512i nibbles_low(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
static inline __m512i nibbles_high(__m512i v) {
    return _mm512_and_si512(_mm512_srli_epi32(v, 4), _mm512_set1_epi8(0x0F));
}
static inline void store_lanes(int32_t *p, __m512i v) { _mm512_storeu_si512((void *)p, v); }

// Q4_K: d and dmin, 12 bytes of 6-bit scales and minimums, then 4 chunks of 32 bytes whose
// low nibbles are values 64c + [0, 32) and high ones 64c + [32, 64) (q4_k_parts).
// The 6-bit scales (sc) and minimums (mn) of 16 rows' Q4_K blocks, a byte each, from their
// header words 1-3 (head[q], lane r: word q of row r's block): sub-block j at byte j % 4 of
// sc[j / 4] and mn[j / 4].
static inline void q4_k_scale_bytes(const __m512i head[4], __m512i sc[2], __m512i mn[2]) {
    const __m512i six = _mm512_set1_epi8(0x3F), four = _mm512_set1_epi8(0x0F);
    const __m512i two = _mm512_set1_epi8(0x03);
    // the two high bits of scales (and minimums) 4..7: bits 6 and 7 of bytes 0..3
    const __m512i high_two_0 =
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(head[1], 6), two), 4);
    const __m512i high_two_1 =
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(head[2], 6), two), 4);
    sc[0] = _mm512_and_si512(head[1], six);
    sc[1] = _mm512_or_si512(_mm512_and_si512(head[3], four), high_two_0);
    mn[0] = _mm512_and_si512(head[2], six);
    mn[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(head[3], 4), four), high_two_1);
}

static inline void q4_k_tile_direct(const uint8_t *w, int64_t row_bytes, k_tile *t) {
    for (int h = 0; h < 2; h++) {  // chunks 2h and 2h + 1
        __m512i cols[16];
        columns16(w + 16 + 64 * h, row_bytes, cols);
        for (int j = 0; j < 16; j++) {  // word k = j % 8 of chunk c: values 64c + 4k, + 32
            const int c = 2 * h + j / 8, k = j % 8;
            store_lanes(t->u[16 * c + k], nibbles_low(cols[j]));
            store_lanes(t->u[16 * c + 8 + k], nibbles_high(cols[j]));
        }
    }
    __m512i head[4];  // d and dmin, then the scale bytes as k4_scales reads them
    columns4(w, row_bytes, head);
    __m512i scales[2], mins[2];
    q4_k_scale_bytes(head, scales, mins);
    for (int j = 0; j < 8; j++) {  // sub-block j: values 32j .. 32j + 31
        const __m512i scale = byte_word(scales[j / 4], j % 4);
        const __m512i least = byte_word(mins[j / 4], j % 4);
        store_lanes(t->scales[2 * j], scale);
        store_lanes(t->scales[2 * j + 1], scale);
        store_lanes(t->offsets[j], _mm512_or_si512(least, _mm512_slli_epi32(least, 16)));
    }
    __m512 d, dmin;
    halves_to_float(head[0], &d, &dmin);
    _mm512_storeu_ps(t->d, d);
    _mm512_storeu_ps(t->dmin, _mm512_xor_ps(dmin, _mm512_set1_ps(-0.0f)));
}

#endif

// The tile of block b of KT_ROWS weight rows (w: its first row's block), its next block's
// rows asked for ahead: straight from the blocks where K_DIRECT_FILL has the format, else
// from each row's parts.
#define DEFINE_K_TILE_FILL(NAME, BYTES, DIRECT)                                                  \
    static inline void NAME##_tile_fill(const uint8_t *w, int64_t row_bytes, k_tile *t) {      \
        for (int r = 0; r < KT_ROWS; r++) prefetch_ahead(w, r * row_bytes + BYTES, BYTES);     \
        DIRECT(NAME, w, row_bytes, t)                                                           \
    }
#define K_FILL_BY_PARTS(NAME, w, row_bytes, t)                                                  \
    k_parts parts[KT_ROWS];                                                                     \
    for (int r = 0; r < KT_ROWS; r++) NAME##_parts(w + r * row_bytes, &parts[r]);              \
    k_tile_fill(parts, t);
#define K_FILL_DIRECT(NAME, w, row_bytes, t) NAME##_tile_direct(w, row_bytes, t);
#ifdef K_DIRECT_FILL
#define K_FILL_q4_k K_FILL_DIRECT
enum { q4_k_blockwise = 1 };
#else
#define K_FILL_q4_k K_FILL_BY_PARTS
enum { q4_k_blockwise = 0 };
#endif
#define K_FILL_q6_k K_FILL_BY_PARTS
enum { q2_k_blockwise = 0, q3_k_blockwise = 0, q5_k_blockwise = 0, q6_k_blockwise = 0 };
#define K_FILL_q2_k K_FILL_BY_PARTS
#define K_FILL_q3_k K_FILL_BY_PARTS
#define K_FILL_q5_k K_FILL_BY_PARTS

// Block b of the tile against activation rows m..m+mr-1, their two float sums (acc[2i] and
// acc[2i + 1] for row m + i) carried in memory from block to block.
static inline __attribute__((always_inline)) void k_tile_step(int mr, const k_tile *t,
                                                              const act_rows *x, int64_t m,
                                                              int sub, int narrow, int64_t b,
                                                              flanes16 *acc) {
    flanes16 ss[KT_MR], ms[KT_MR];
    for (int i = 0; i < mr; i++) ss[i] = acc[2 * i], ms[i] = acc[2 * i + 1];
    k_tile_rows(t, x, m, mr, sub, narrow, b, ss, ms);
    for (int i = 0; i < mr; i++) acc[2 * i] = ss[i], acc[2 * i + 1] = ms[i];
}

// The k-quants' kernel. Below KT_MIN_ROWS activation rows, or for a last tile of fewer than
// KT_ROWS weight rows, each weight row goes alone (four activation rows sharing each
// unpacked block); otherwise the blocks of KT_ROWS weight rows are laid side by side in a
// k_tile per block, filled once, and every activation row meets them all, four at a time,
// its sums in registers. Both find the same integers and add them in the same order
// (k_dot), so a row's result does not depend on the path.
#define KT_MIN_ROWS 4
#define KT_STACK_ROWS 64  // activation rows whose sums the stack holds (by block); more: the heap

// The two float sums of `rows` activation rows (NULL: no memory).
static inline flanes16 *sums_alloc(int64_t rows) {
    return aligned_alloc(64, (size_t)rows * 2 * sizeof(flanes16));
}

#define DEFINE_K_KERNEL(NAME, BYTES, SUB)                                                          \
    DEFINE_K_TILE_FILL(NAME, BYTES, K_FILL_##NAME)                                                 \
    /* y[r * stride] for activation rows m..m+mr-1 (mr <= 4) against one weight row */             \
    static inline __attribute__((always_inline)) void NAME##_by_rows(                              \
        int mr, const act_rows *x, int64_t m, int64_t blocks, const uint8_t *w, float *y,          \
        int64_t stride) {                                                                          \
        __m128 acc[4];                                                                             \
        int64_t first[4]; /* each row's first block */                                             \
        for (int r = 0; r < mr; r++) acc[r] = _mm_setzero_ps(), first[r] = (m + r) * blocks;       \
        for (int64_t b = 0; b < blocks; b++) {                                                     \
            prefetch_block(w + b * BYTES, BYTES);                                                  \
            k_w wb;                                                                                \
            NAME##_unpack(w + b * BYTES, &wb);                                                     \
            for (int r = 0; r < mr; r++) acc[r] = k_dot(&wb, acts_256(x, first[r] + b), acc[r]);   \
        }                                                                                          \
        for (int r = 0; r < mr; r++) y[r * stride] = k_result(acc[r]);                             \
    }                                                                                              \
    static inline float NAME##_by_dot(const act_rows *x, int64_t blocks, const uint8_t *w) {       \
        float y;                                                                                   \
        NAME##_by_rows(1, x, 0, blocks, w, &y, 1);                                                 \
        return y;                                                                                  \
    }                                                                                              \
    static void NAME##_rowwise(const act_rows *x, int64_t rows, int64_t blocks,                    \
                               const uint8_t *w, float *y, int64_t stride) {                       \
        for (int64_t m = 0; m < rows; m += 4)                                                      \
            FOUR_ROWS(NAME##_by_rows, rows - m, x, m, blocks, w, y + m * stride, stride)           \
    }                                                                                              \
    /* the blocks of KT_ROWS weight rows into tiles[b], then every activation row past them */     \
    static inline void NAME##_tiled(const act_rows *x, int64_t rows, int64_t blocks,               \
                             const uint8_t *w, float *y, int64_t stride, k_tile *tiles) {          \
        const int64_t row_bytes = blocks * BYTES;                                                  \
        k_parts parts[KT_ROWS];                                                                    \
        for (int64_t b = 0; b < blocks; b++) {                                                     \
            for (int r = 0; r < KT_ROWS; r++) {                                                    \
                prefetch_ahead(w, r * row_bytes + (b + 1) * BYTES, BYTES);                         \
                NAME##_parts(w + r * row_bytes + b * BYTES, &parts[r]);                            \
            }                                                                                      \
            k_tile_fill(parts, &tiles[b]);                                                         \
        }                                                                                          \
        for (int64_t m = 0; m < rows; m += KT_MR)                                                  \
            FOUR_ROWS(k_tile_all, rows - m, tiles, x, m, SUB, NAME##_narrow, blocks,               \
                      y + m * stride, stride)                                                      \
    }                                                                                              \
    /* KT_ROWS weight rows against every activation row, block by block: the block's tile          \
       filled once, then met by the rows four at a time, each row's two sums carried in acc */     \
    static inline void NAME##_by_block(const act_rows *x, int64_t rows, int64_t blocks,            \
                               const uint8_t *w, float *y, int64_t stride, k_tile *tile,           \
                               flanes16 *acc) {                                                    \
        const int64_t row_bytes = blocks * BYTES;                                                  \
        for (int64_t i = 0; i < 2 * rows; i++) acc[i] = f16_zero();                                \
        for (int64_t b = 0; b < blocks; b++) {                                                     \
            NAME##_tile_fill(w + b * BYTES, row_bytes, tile);                                      \
            for (int64_t m = 0; m < rows; m += KT_MR)                                              \
                FOUR_ROWS(k_tile_step, rows - m, tile, x, m, SUB, NAME##_narrow, b, acc + 2 * m)   \
        }                                                                                          \
        for (int64_t m = 0; m < rows; m++)                                                         \
            f16_store_sum(y + m * stride, acc[2 * m], acc[2 * m + 1]);                             \
    }                                                                                              \
    /* every tile by block (stack memory: a tile, and up to KT_STACK_ROWS rows' sums) */           \
    static int64_t NAME##_tiles_by_block(const act_rows *x, int64_t rows, int64_t blocks,          \
                                         const uint8_t *w, int64_t count, float *y,                \
                                         int64_t stride) {                                         \
        k_tile tile;                                                                               \
        flanes16 near[2 * KT_STACK_ROWS];                                                          \
        flanes16 *acc = rows <= KT_STACK_ROWS ? near : sums_alloc(rows);                           \
        int64_t n = 0;                                                                             \
        for (; acc && n + KT_ROWS <= count; n += KT_ROWS)                                          \
            NAME##_by_block(x, rows, blocks, w + n * blocks * BYTES, y + n, stride, &tile, acc);   \
        if (acc != near) free(acc);                                                                \
        return n;                                                                                  \
    }                                                                                              \
    static void NAME##_i8(const void *acts, int64_t rows, int64_t k_in, const uint8_t *w,          \
                          int64_t count, float *y, int64_t stride) {                               \
        const act_rows *x = (const act_rows *)acts;                                                \
        const int64_t blocks = k_in / 256, row_bytes = blocks * BYTES;                             \
        int64_t n = 0;                                                                             \
        const bool tiled = rows >= KT_MIN_ROWS && count >= KT_ROWS;                                \
        if (tiled && NAME##_blockwise)                                                             \
            n = NAME##_tiles_by_block(x, rows, blocks, w, count, y, stride);                       \
        /* no memory for the tiles: each weight row alone, the same bits */                        \
        k_tile *tiles =                                                                            \
            tiled && !NAME##_blockwise ? malloc((size_t)blocks * sizeof *tiles) : NULL;            \
        if (tiles)                                                                                 \
            for (; n + KT_ROWS <= count; n += KT_ROWS)                                             \
                NAME##_tiled(x, rows, blocks, w + n * row_bytes, y + n, stride, tiles);            \
        free(tiles);                                                                               \
        if (rows == 1) /* a decode: the format's own kernel, the same bits */                     \
            ONE_ROW_##NAME(x, blocks, w + n * row_bytes, count - n, row_bytes, y + n,              \
                           NAME##_by_dot);                                                         \
        else                                                                                       \
            for (; n < count; n++)                                                                 \
                NAME##_rowwise(x, rows, blocks, w + n * row_bytes, y + n, stride);                 \
    }

// One kernel per format of quant_matmul.c's BLOCK_FORMATS: the 32-value formats' above,
// on activations in blocks of 32, and the k-quants'.
#define INT8_KERNEL_32(NAME, BYTES) DEFINE_INT8_KERNEL(NAME, 32, BYTES)
#define INT8_KERNEL_256(NAME, BYTES) DEFINE_K_KERNEL(NAME, BYTES, NAME##_sub)
#define INT8_KERNEL(T, NAME, BLOCK, BYTES) INT8_KERNEL_##BLOCK(NAME, BYTES)
BLOCK_FORMATS(INT8_KERNEL)

#endif
