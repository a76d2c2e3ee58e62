// The paged float KV cache (twins: store_kv_ref and paged_attention_ref in
// spnl_backend/kernels/paged_ref.py): a pool of slots [num_slots][kv_heads][dim], written
// a token's row at a time and read by one query per sequence at decode. A prefill's
// queries are each a decode of their own, with the same bits; where several of them see a
// chunk of keys whole, they are attended together, each key and value read once for them.
// The pool holds float32 or float16 (`half`); float16 is widened exactly as it is read, so
// the arithmetic is float32 over the stored values either way. The functions that read the
// pool take `half` as a constant from the two instances of attend_rows, and are inlined
// into them.

#include "common.h"

#define INLINE static inline __attribute__((always_inline))

// New K/V rows into their cache slots; slot -1 writes nothing (twin: store_kv_ref).
int spnl_store_kv(const float *k, const float *v, void *k_cache, void *v_cache,
                  const int64_t *slots, int64_t tokens, int64_t row, int64_t num_slots,
                  int half) {
    if (tokens < 0 || row < 1) return BAD_ARGUMENT;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return OUT_OF_BOUNDS;
    const size_t width = half ? sizeof(uint16_t) : sizeof(float);
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        char *kd = (char *)k_cache + slots[t] * row * width;
        char *vd = (char *)v_cache + slots[t] * row * width;
        if (half) {
            floats_to_half(k + t * row, (uint16_t *)kd, row);
            floats_to_half(v + t * row, (uint16_t *)vd, row);
        } else {
            memcpy(kd, k + t * row, row * sizeof(float));
            memcpy(vd, v + t * row, row * sizeof(float));
        }
    }
    return 0;
}

// Element i of a pool row, and 16 of them from i on.
INLINE float kv_at(const void *p, int64_t i, bool half) {
    return half ? half_to_float((const uint8_t *)((const uint16_t *)p + i)) : ((const float *)p)[i];
}
INLINE v16f kv_load(const void *p, int64_t i, bool half) {
    return half ? load_f16((const uint16_t *)p + i) : load_f32((const float *)p + i);
}
// A pool row's address: `slot` rows of `row` elements in.
INLINE const void *kv_row(const void *pool, int64_t slot, int64_t row, bool half) {
    return (const char *)pool + slot * row * (half ? 2 : 4);
}

// q . k over dim floats: 16 lanes at a time in one chain, then the lanes, then the tail. The
// same order for every query, whatever else the call attends.
INLINE float dot(const float *q, const void *k, int64_t dim, bool half) {
    v16f acc = {0};
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16) acc = fma16(load_f32(q + i), kv_load(k, i, half), acc);
    float sum = hsum(acc);
    for (; i < dim; i++) sum += q[i] * kv_at(k, i, half);
    return sum;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// 8 elements of a pool row from i on.
INLINE __m256 load8(const void *p, int64_t i, bool half) {
    if (!half) return _mm256_loadu_ps((const float *)p + i);
#if defined(__F16C__)  // every AVX2 CPU has it; a build told otherwise widens one by one
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
#else
    float wide[8];
    for (int k = 0; k < 8; k++) wide[k] = kv_at(p, i + k, true);
    return _mm256_loadu_ps(wide);
#endif
}
#endif

// sums[t] = dot(q, keys[t], dim) for t < n (n <= DOTS; sums has room for DOTS). With
// AVX-512 and whole vectors of dim, the 16 dot products run side by side and their lanes are
// summed together: each by the tree of _mm512_reduce_add_ps (lanes i and i + 8, then i + 4,
// i + 2, i + 1), so every sum has dot's bits, whatever keys share the call.
#define DOTS 16
#if defined(__AVX512F__)
static inline __m512 fold_pairs(__m512 a, __m512 b, int level) {
    switch (level) {
    case 0:  // lanes 0-7: a_i + a_(i+8); lanes 8-15: the same of b
        return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    case 1:  // within each half: i + (i + 4)
        return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    case 2: {  // within each 128 bits: i + (i + 2)
        const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
        return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    default:  // i + (i + 1)
        return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    }
}
#endif

INLINE void dots(const float *q, const void *const *keys, int64_t n, int64_t dim, float *sums,
                 bool half) {
#if defined(__AVX512F__)
    if (dim % 16 == 0) {
        __m512 acc[DOTS];
        for (int t = 0; t < DOTS; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t i = 0; i < dim; i += 16) {
            const __m512 qi = _mm512_loadu_ps(q + i);
            for (int t = 0; t < DOTS; t++)
                acc[t] = _mm512_fmadd_ps(qi, (__m512)kv_load(keys[t], i, half), acc[t]);
        }
        for (int level = 0, width = DOTS; level < 4; level++, width /= 2)
            for (int t = 0; t < width / 2; t++)
                acc[t] = fold_pairs(acc[2 * t], acc[2 * t + 1], level);
        // the tree leaves key t in lane (t % 4) * 4 + t / 4; sums has room for DOTS
        const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7,
                                                11, 15);
        _mm512_storeu_ps(sums, _mm512_permutexvar_ps(order, acc[0]));
        return;
    }
#endif
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    // Four keys side by side, each in dot's own lanes, chain and order (8-lane registers
    // hold its 16 lanes as two halves): the same bits as dot, four chains in flight.
    const int64_t whole = dim - dim % 16;
    for (; t + 4 <= n; t += 4) {
        __m256 acc[4][2];
        for (int u = 0; u < 4; u++) acc[u][0] = acc[u][1] = _mm256_setzero_ps();
        for (int64_t i = 0; i < whole; i += 16) {
            const __m256 q0 = _mm256_loadu_ps(q + i), q1 = _mm256_loadu_ps(q + i + 8);
            for (int u = 0; u < 4; u++) {
                acc[u][0] = _mm256_fmadd_ps(q0, load8(keys[t + u], i, half), acc[u][0]);
                acc[u][1] = _mm256_fmadd_ps(q1, load8(keys[t + u], i + 8, half), acc[u][1]);
            }
        }
        for (int u = 0; u < 4; u++) {
            float lanes[16];
            _mm256_storeu_ps(lanes, acc[u][0]);
            _mm256_storeu_ps(lanes + 8, acc[u][1]);
            float sum = 0.0f;  // hsum's order
            for (int l = 0; l < 16; l++) sum += lanes[l];
            for (int64_t i = whole; i < dim; i++) sum += q[i] * kv_at(keys[t + u], i, half);
            sums[t + u] = sum;
        }
    }
#endif
    for (; t < n; t++) sums[t] = dot(q, keys[t], dim, half);
}

// out[i] = sum over j < count, in key order, of e[j] * value j [i]: 64 floats of the head at
// a time held in registers while the keys pass.
INLINE void weigh_values(const void *v_cache, int64_t row, const int64_t *slots, int64_t count,
                         const float *e, int64_t dim, float *out, bool half) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    // The same FMAs lane for lane in 8-lane registers: GCC keeps 16-lane vectors on the
    // stack where the hardware has no 16-lane registers.
    for (; i + 64 <= dim; i += 64) {
        __m256 o[8];
        for (int h = 0; h < 8; h++) o[h] = _mm256_setzero_ps();
        for (int64_t j = 0; j < count; j++) {
            const void *vj = kv_row(v_cache, slots[j], row, half);
            const __m256 w = _mm256_set1_ps(e[j]);
            for (int h = 0; h < 8; h++) o[h] = _mm256_fmadd_ps(w, load8(vj, i + 8 * h, half), o[h]);
        }
        for (int h = 0; h < 8; h++) _mm256_storeu_ps(out + i + 8 * h, o[h]);
    }
#endif
    for (; i + 64 <= dim; i += 64) {
        v16f o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0};
        for (int64_t j = 0; j < count; j++) {
            const void *vj = kv_row(v_cache, slots[j], row, half);
            const v16f w = splat(e[j]);
            o0 = fma16(w, kv_load(vj, i, half), o0);
            o1 = fma16(w, kv_load(vj, i + 16, half), o1);
            o2 = fma16(w, kv_load(vj, i + 32, half), o2);
            o3 = fma16(w, kv_load(vj, i + 48, half), o3);
        }
        memcpy(out + i, &o0, sizeof o0);
        memcpy(out + i + 16, &o1, sizeof o1);
        memcpy(out + i + 32, &o2, sizeof o2);
        memcpy(out + i + 48, &o3, sizeof o3);
    }
    for (; i + 16 <= dim; i += 16) {
        v16f o = {0};
        for (int64_t j = 0; j < count; j++)
            o = fma16(splat(e[j]), kv_load(kv_row(v_cache, slots[j], row, half), i, half), o);
        memcpy(out + i, &o, sizeof o);
    }
    for (; i < dim; i++) {
        float o = 0.0f;
        for (int64_t j = 0; j < count; j++)
            o = fmaf(e[j], kv_at(kv_row(v_cache, slots[j], row, half), i, half), o);
        out[i] = o;
    }
}

#if defined(__AVX512F__)
// weigh_values for `tile` heads at once (e: their rows of weights, `stride` apart; out: their
// rows of dim, dim a multiple of 64): each value row is read, and widened, once for them all,
// and each head's lanes take weigh_values' FMAs in its key order, so its bits.
INLINE void weigh_values_tile(const void *v_cache, int64_t row, const int64_t *slots,
                              int64_t count, const float *e, int64_t stride, int tile,
                              int64_t dim, float *out, bool half) {
    for (int64_t i = 0; i < dim; i += 64) {
        v16f o[4][4];
        for (int g = 0; g < tile; g++)
            for (int h = 0; h < 4; h++) o[g][h] = (v16f){0};
        for (int64_t j = 0; j < count; j++) {
            const void *vj = kv_row(v_cache, slots[j], row, half);
            const v16f v[4] = {kv_load(vj, i, half), kv_load(vj, i + 16, half),
                               kv_load(vj, i + 32, half), kv_load(vj, i + 48, half)};
            for (int g = 0; g < tile; g++) {
                // broadcast from memory: splat's 0 + e cost an add and a shuffle per weight,
                // and gives the same bits (no weight is -0; and fma(-0, v, o) == o here)
                const v16f w = (v16f)_mm512_set1_ps(e[g * stride + j]);
                for (int h = 0; h < 4; h++) o[g][h] = fma16(w, v[h], o[g][h]);
            }
        }
        for (int g = 0; g < tile; g++)
            for (int h = 0; h < 4; h++) memcpy(out + g * dim + i + 16 * h, &o[g][h], sizeof o[g][h]);
    }
}
#endif

// weigh_values for each of `group` heads (e: their rows of weights, `stride` apart; out: their
// rows of dim). With AVX-512 and whole 64-float strips the heads go four at a time through
// weigh_values_tile, reading and widening each value once per four heads rather than once
// per head (that repeated work, not the reads, bounded a long decode's attention).
INLINE void weigh_group(const void *v_cache, int64_t row, const int64_t *slots, int64_t count,
                        const float *e, int64_t stride, int64_t group, int64_t dim, float *out,
                        bool half) {
    int64_t g = 0;
#if defined(__AVX512F__)
    if (dim % 64 == 0) {
        for (; g + 4 <= group; g += 4)  // the tile a constant: its registers unrolled
            weigh_values_tile(v_cache, row, slots, count, e + g * stride, stride, 4, dim,
                              out + g * dim, half);
        if (group - g == 3)
            weigh_values_tile(v_cache, row, slots, count, e + g * stride, stride, 3, dim,
                              out + g * dim, half);
        else if (group - g == 2)
            weigh_values_tile(v_cache, row, slots, count, e + g * stride, stride, 2, dim,
                              out + g * dim, half);
        g = group - g == 1 ? g : group;
    }
#endif
    for (; g < group; g++)
        weigh_values(v_cache, row, slots, count, e + g * stride, dim, out + g * dim, half);
}

// A sequence's keys are attended in chunks of KEY_CHUNK at fixed positions (multiples of
// KEY_CHUNK), each giving a partial softmax: per query head its peak score, the sum of
// e^(score - peak) and the values weighed by those. The chunks then combine in order. The
// split depends on the key positions alone, so a query's arithmetic is the same whether its
// chunks run on one thread or several, alone or batched; and a single long sequence (a
// decode with one KV head) spreads over every thread.
#define KEY_CHUNK 256

// scores[j] = e^(scores[j] - peak) for j < count.
static void exp_row(float *scores, int64_t count, float peak) {
    int64_t j = 0;
    for (; j + 16 <= count; j += 16) {
        const v16f e = exp16(load_f32(scores + j) - splat(peak));
        memcpy(scores + j, &e, sizeof e);
    }
    for (; j < count; j++) {  // the tail through the same vector code
        float lane[16] = {0};
        lane[0] = scores[j] - peak;
        const v16f e = exp16(load_f32(lane));
        scores[j] = e[0];
    }
}

// For each of `rows` rows of count scores (KEY_CHUNK apart): its peak, its scores made
// e^(score - peak) in place, and their sum in key order, into stats (peak, sum) per row; a
// row whose every score is -inf (every key out of reach) gets weight 0, as in one softmax.
// Four rows at a time, their chains side by side: each a serial chain of maxima or sums in
// its own key order (so its bits), four in flight rather than one.
static void softmax_rows(float *scores, int64_t rows, int64_t count, float *stats) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        float *row[4];
        for (int u = 0; u < 4; u++) row[u] = scores + (r0 + u < rows ? r0 + u : r0) * KEY_CHUNK;
        float peak[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, total[4] = {0};
        for (int64_t j = 0; j < count; j++)
            for (int u = 0; u < 4; u++) peak[u] = row[u][j] > peak[u] ? row[u][j] : peak[u];
        const int n = rows - r0 < 4 ? (int)(rows - r0) : 4;
        for (int u = 0; u < n; u++) {
            if (peak[u] == -INFINITY)
                memset(row[u], 0, (size_t)count * sizeof(float));
            else
                exp_row(row[u], count, peak[u]);
        }
        for (int64_t j = 0; j < count; j++)
            for (int u = 0; u < 4; u++) total[u] += row[u][j];
        for (int u = 0; u < n; u++) {
            stats[2 * (r0 + u)] = peak[u];
            stats[2 * (r0 + u) + 1] = total[u];
        }
    }
}

// The most dims for which a float16 pool's keys are widened once for a group of query heads
// (DOTS rows of a worker's scratch); wider heads widen them per head, as they are read.
#define WIDE_DIM 1024

// Queries of one sequence attended together over a chunk they all see whole (a prefill's):
// the chunk's keys and values are read, and widened, once for them all.
#define QUERY_BLOCK 16

typedef struct {
    const spnl_paged_decode_args *a;
    int64_t group, dim, part;  // part: floats of one chunk's partial (group x (dim + 2))
    int64_t block;             // queries attended together (1: each alone)
    int64_t wide;              // floats of widened keys in a worker's scratch (0: none)
    int64_t wide_values;       // floats of a chunk's widened values, with room for their
                               // slots (0: none; a block of a float16 pool's queries)
    int64_t work;  // a worker's scratch for one chunk: scores (block x group rows), widened
                   // keys, widened values, then a block's partials (block x part)
} attention_plan;

static inline int64_t chunk_of(int64_t key) { return key / KEY_CHUNK; }

// The chunks of sequence s: [*c0, *c0 + count).
static inline int64_t chunks_of(const spnl_attention *at, int64_t s, int64_t *c0) {
    const int64_t len = at->lens[s];
    *c0 = chunk_of(first_of(at, s));
    return len > 0 ? chunk_of(len - 1) + 1 - *c0 : 0;
}

// The n float16 rows of keys widened into `wide` (n rows of dim floats), keys[t] pointed at
// them; the rows past n (keys[0]'s, as padding) at the first.
INLINE void widen_keys(const void **keys, int64_t n, int64_t dim, float *wide) {
    for (int64_t t = 0; t < n; t++) {
        float *to = wide + t * dim;
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16) {
            const v16f v = kv_load(keys[t], i, true);
            memcpy(to + i, &v, sizeof v);
        }
        for (; i < dim; i++) to[i] = kv_at(keys[t], i, true);
        keys[t] = to;
    }
    for (int64_t t = n; t < DOTS; t++) keys[t] = wide;
}

// How many keys ahead of the ones being scored their rows are asked for, and the values of
// those being scored too, for the weighing that follows (a prefetch never faults).
#define KEYS_AHEAD 32
INLINE void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 3);
}

// Keys [lo, hi) (slots: their row of the table) against the query heads that share KV head
// kvh, for each of `count` queries (members; rows m * group + g of scores, KEY_CHUNK
// apart): scale * q.k, softcapped. Each key is read once for all the rows; a float16 key is
// widened once for them too where `wide` gives room (widening is exact, so every row's dot
// has the bits it has over the float16 row).
INLINE void score_rows(const attention_plan *p, const int64_t *members, int64_t count,
                       int64_t kvh, const int64_t *slots, int64_t lo, int64_t hi,
                       float *scores, float *wide, bool half) {
    const spnl_paged_decode_args *a = p->a;
    const int64_t group = p->group, dim = p->dim, row = a->at.kv_heads * dim;
    const float scale = a->at.scoring.scale, softcap = a->at.scoring.softcap;
    const void *k_cache = kv_row(a->k_cache, kvh, dim, half);
    const bool widened = half && wide && count * group > 1;
    const void *v_cache = kv_row(a->v_cache, kvh, dim, half);
    const int64_t bytes = dim * (half ? 2 : 4);
    for (int64_t j = lo; j < hi && j < lo + KEYS_AHEAD; j++)
        prefetch_row(kv_row(k_cache, slots[j], row, half), bytes);
    for (int64_t j = lo; j < hi; j += DOTS) {
        const int64_t n = hi - j < DOTS ? hi - j : DOTS;
        for (int64_t t = 0; t < n; t++) {
            if (j + t + KEYS_AHEAD < hi)
                prefetch_row(kv_row(k_cache, slots[j + t + KEYS_AHEAD], row, half), bytes);
            prefetch_row(kv_row(v_cache, slots[j + t], row, half), bytes);
        }
        const void *keys[DOTS];
        for (int64_t t = 0; t < DOTS; t++)
            keys[t] = kv_row(k_cache, slots[j + (t < n ? t : 0)], row, half);
        if (widened) widen_keys(keys, n, dim, wide);
        for (int64_t m = 0; m < count; m++) {
            const float *q = a->q + (members[m] * a->at.heads + kvh * group) * dim;
            for (int64_t g = 0; g < group; g++) {
                float sums[DOTS];
                if (widened)  // two instances, each with its storage a constant
                    dots(q + g * dim, keys, n, dim, sums, false);
                else
                    dots(q + g * dim, keys, n, dim, sums, half);
                float *out = scores + (m * group + g) * KEY_CHUNK + j - lo;
                if (softcap > 0.0f) {
                    for (int64_t t = 0; t < n; t++)
                        out[t] = softcap * tanhf(sums[t] * scale / softcap);
                } else if (n == DOTS) {  // the same products, 16 to a vector
                    const v16f scaled = load_f32(sums) * splat(scale);
                    memcpy(out, &scaled, sizeof scaled);
                } else {
                    for (int64_t t = 0; t < n; t++) out[t] = sums[t] * scale;
                }
            }
        }
    }
}

// Keys [lo, hi) of chunk c for `count` queries (members) over KV head kvh: per row (query
// m, head g) the chunk's partial softmax, its weighed values into acc (rows of dim) and
// (peak, sum) into stats. scores: the worker's p->work floats (rows x KEY_CHUNK scores,
// then the widened keys).
INLINE void attend_rows(const attention_plan *p, const int64_t *members, int64_t count,
                        int64_t kvh, int64_t lo, int64_t hi, float *scores, float *acc,
                        float *stats, bool half) {
    const spnl_paged_decode_args *a = p->a;
    const int64_t rows = count * p->group, dim = p->dim, row = a->at.kv_heads * dim;
    const int64_t *slots = a->at.slots + members[0] * a->at.slot_stride;
    float *wide = p->wide ? scores + p->block * p->group * KEY_CHUNK : NULL;
    score_rows(p, members, count, kvh, slots, lo, hi, scores, wide, half);
    softmax_rows(scores, rows, hi - lo, stats);
    const void *v_cache = kv_row(a->v_cache, kvh, dim, half);
    if (half && count > 1 && p->wide_values) {
        // Each value widened once for the block rather than once per tile of four rows
        // (exactly: the same FMAs over the same floats).
        float *values = wide + p->wide;
        int64_t *order = (int64_t *)(values + KEY_CHUNK * dim);
        for (int64_t j = 0; j < hi - lo; j++) {
            const void *from = kv_row(v_cache, slots[lo + j], row, true);
            int64_t i = 0;
            for (; i + 16 <= dim; i += 16) {
                const v16f v = kv_load(from, i, true);
                memcpy(values + j * dim + i, &v, sizeof v);
            }
            for (; i < dim; i++) values[j * dim + i] = kv_at(from, i, true);
            order[j] = j;
        }
        weigh_group(values, dim, order, hi - lo, scores, KEY_CHUNK, rows, dim, acc, false);
        return;
    }
    weigh_group(v_cache, row, slots + lo, hi - lo, scores, KEY_CHUNK, rows, dim, acc, half);
}

// The two instances: a float32 pool and a float16 one.
static void attend_rows_f32(const attention_plan *p, const int64_t *members, int64_t count,
                            int64_t kvh, int64_t lo, int64_t hi, float *scores, float *acc,
                            float *stats) {
    attend_rows(p, members, count, kvh, lo, hi, scores, acc, stats, false);
}
static void attend_rows_f16(const attention_plan *p, const int64_t *members, int64_t count,
                            int64_t kvh, int64_t lo, int64_t hi, float *scores, float *acc,
                            float *stats) {
    attend_rows(p, members, count, kvh, lo, hi, scores, acc, stats, true);
}

// Keys [lo, hi) of sequence s's chunk c: the keys it sees of that chunk.
static inline void chunk_keys(const spnl_attention *at, int64_t s, int64_t c, int64_t *lo,
                              int64_t *hi) {
    const int64_t len = at->lens[s], first = first_of(at, s);
    *lo = c * KEY_CHUNK > first ? c * KEY_CHUNK : first;
    *hi = (c + 1) * KEY_CHUNK < len ? (c + 1) * KEY_CHUNK : len;
}

// Chunk c of the query heads of sequence s that share KV head kvh: part holds group rows of
// dim weighed values, then (peak, total) per head.
static void attend_chunk(const attention_plan *p, int64_t s, int64_t kvh, int64_t c,
                         float *scores, float *part) {
    int64_t lo, hi;
    chunk_keys(&p->a->at, s, c, &lo, &hi);
    (p->a->half ? attend_rows_f16 : attend_rows_f32)(p, &s, 1, kvh, lo, hi, scores, part,
                                                     part + p->group * p->dim);
}

// Chunk c, whole, for `count` queries (members) whose tables agree on it: each query's
// partial into parts[m] (the bits attend_chunk gives it alone: every row's arithmetic is
// its own), the block's rows gathered in the worker's scratch first.
static void attend_chunk_together(const attention_plan *p, const int64_t *members,
                                  int64_t count, int64_t kvh, int64_t c, float *scores,
                                  float *const *parts) {
    const int64_t group = p->group, dim = p->dim;
    float *acc = scores + p->work - p->block * p->part, *stats = acc + count * group * dim;
    (p->a->half ? attend_rows_f16 : attend_rows_f32)(p, members, count, kvh, c * KEY_CHUNK,
                                                     (c + 1) * KEY_CHUNK, scores, acc, stats);
    for (int64_t m = 0; m < count; m++) {
        memcpy(parts[m], acc + m * group * dim, (size_t)(group * dim) * sizeof(float));
        memcpy(parts[m] + group * dim, stats + 2 * m * group, (size_t)(2 * group) * sizeof(float));
    }
}

// The chunks' partials of (s, kvh), in order, into the group's output rows; a head's sink
// (where given) joins the peak and the denominator.
static void combine(const attention_plan *p, int64_t s, int64_t kvh, const float *parts,
                    int64_t chunks) {
    const int64_t group = p->group, dim = p->dim;
    float *out = p->a->at.out + (s * p->a->at.heads + kvh * group) * dim;
    const float *sinks = p->a->at.scoring.sinks;
    if (sinks) sinks += kvh * group;
    for (int64_t g = 0; g < group; g++) {
        float peak = sinks ? sinks[g] : -INFINITY, total = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const float chunk_peak = parts[c * p->part + group * dim + 2 * g];
            peak = chunk_peak > peak ? chunk_peak : peak;
        }
        if (sinks) total = expf(sinks[g] - peak);  // the sink's share: no value beside it
        float *o = out + g * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const float *part = parts + c * p->part;
            const float weight = expf(part[group * dim + 2 * g] - peak);
            total += weight * part[group * dim + 2 * g + 1];
            for (int64_t i = 0; i < dim; i++) o[i] += weight * part[g * dim + i];
        }
        if (chunks == 0) continue;  // no visible key: zeros
        const float inverse = 1.0f / total;
        for (int64_t i = 0; i < dim; i++) o[i] *= inverse;
    }
}

// What the tasks of one attention share: the plan, each worker's scratch (`floats` each),
// and, chunk by chunk, where each pair's chunks start (first) and their partials (parts).
typedef struct {
    const attention_plan *p;
    float *scratch;
    size_t floats;
    const int64_t *first;
    float *parts;
    int64_t max_chunks;
} attention_call;

// Whether query s sees every key of chunk c, and its table there is the leader's.
static bool joins(const spnl_attention *at, int64_t leader, int64_t s, int64_t c) {
    if (first_of(at, s) > c * KEY_CHUNK || at->lens[s] < (c + 1) * KEY_CHUNK) return false;
    const int64_t *mine = at->slots + s * at->slot_stride + c * KEY_CHUNK;
    const int64_t *theirs = at->slots + leader * at->slot_stride + c * KEY_CHUNK;
    return mine == theirs || !memcmp(mine, theirs, KEY_CHUNK * sizeof(int64_t));
}

// The query block of the n-th task of each KV head: 0, last, 1, last - 1, ... A prefill's
// later queries see more keys; so taken, any run of consecutive tasks (each thread's part
// of the pool's job, and the chunks stolen from its end) costs about its length, and the
// threads end together rather than one waiting on the other's costliest blocks.
static inline int64_t zigzag(int64_t n, int64_t blocks) {
    return n % 2 ? blocks - 1 - n / 2 : n / 2;
}

// Block task: up to p->block consecutive queries of one KV head. Chunk by chunk, the
// queries that see it whole over the same table go together, the others alone; then each
// query's partials combine, in chunk order. scratch: the chunk's work, then per query its
// partials (max_chunks of them).
static void block_task(void *ctx, int64_t task, int worker) {
    const attention_call *call = ctx;
    const attention_plan *p = call->p;
    const spnl_attention *at = &p->a->at;
    const int64_t blocks = (at->seqs + p->block - 1) / p->block;
    const int64_t kvh = task % at->kv_heads;
    const int64_t s0 = zigzag(task / at->kv_heads, blocks) * p->block;
    const int64_t count = at->seqs - s0 < p->block ? at->seqs - s0 : p->block;
    float *scores = call->scratch + (size_t)worker * call->floats;
    float *parts = scores + p->work;
    int64_t c0[QUERY_BLOCK], chunks[QUERY_BLOCK], low = INT64_MAX, high = 0;
    for (int64_t m = 0; m < count; m++) {
        chunks[m] = chunks_of(at, s0 + m, &c0[m]);
        if (!chunks[m]) continue;
        low = c0[m] < low ? c0[m] : low;
        high = c0[m] + chunks[m] > high ? c0[m] + chunks[m] : high;
    }
    for (int64_t c = low; c < high; c++) {
        int64_t members[QUERY_BLOCK], together = 0;
        float *into[QUERY_BLOCK];
        for (int64_t m = 0; m < count; m++) {
            if (c < c0[m] || c >= c0[m] + chunks[m]) continue;
            float *part = parts + (m * call->max_chunks + c - c0[m]) * p->part;
            if (joins(at, together ? members[0] : s0 + m, s0 + m, c)) {
                members[together] = s0 + m;
                into[together++] = part;
            } else {
                attend_chunk(p, s0 + m, kvh, c, scores, part);
            }
        }
        if (together == 1)
            attend_chunk(p, members[0], kvh, c, scores, into[0]);
        else if (together > 1)
            attend_chunk_together(p, members, together, kvh, c, scores, into);
    }
    for (int64_t m = 0; m < count; m++)
        combine(p, s0 + m, kvh, parts + m * call->max_chunks * p->part, chunks[m]);
}

// Chunk task t: one chunk of keys of one pair, its partial kept.
static void chunk_task(void *ctx, int64_t t, int worker) {
    const attention_call *c = ctx;
    const attention_plan *p = c->p;
    const spnl_attention *at = &p->a->at;
    int64_t pair = 0, c0;
    while (t >= c->first[pair + 1]) pair++;
    const int64_t s = pair / at->kv_heads, kvh = pair % at->kv_heads;
    chunks_of(at, s, &c0);
    attend_chunk(p, s, kvh, c0 + t - c->first[pair], c->scratch + (size_t)worker * c->floats,
                 c->parts + t * p->part);
}

// Combine task: a pair's chunk partials, in chunk order.
static void combine_task(void *ctx, int64_t pair, int worker) {
    (void)worker;
    const attention_call *c = ctx;
    const int64_t kv_heads = c->p->a->at.kv_heads;
    combine(c->p, pair / kv_heads, pair % kv_heads, c->parts + c->first[pair] * c->p->part,
            c->first[pair + 1] - c->first[pair]);
}

// Many (sequence, KV head) pairs: blocks of p->block queries of a KV head, each a task.
static int by_blocks(const attention_plan *p, int64_t max_chunks) {
    const spnl_attention *at = &p->a->at;
    const int64_t tasks = (at->seqs + p->block - 1) / p->block * at->kv_heads;
    const int threads = at->threads < tasks ? at->threads : (int)tasks;
    const size_t floats = (size_t)p->work + (size_t)(p->block * max_chunks * p->part);
    attention_call call = {.p = p, .scratch = malloc(floats * (size_t)threads * sizeof(float)),
                           .floats = floats, .max_chunks = max_chunks};
    if (!call.scratch) return NO_MEMORY;
    spnl_parallel(tasks, block_task, &call, threads);
    free(call.scratch);
    return 0;
}

// Fewer pairs than threads (a decode of one or two sequences): every chunk a task, the
// partials kept, then combined per pair.
static int by_chunks(const attention_plan *p) {
    const spnl_attention *at = &p->a->at;
    const int64_t pairs = at->seqs * at->kv_heads;
    int64_t *first = malloc((size_t)(pairs + 1) * sizeof(int64_t));
    if (!first) return NO_MEMORY;
    first[0] = 0;
    for (int64_t pair = 0; pair < pairs; pair++) {
        int64_t c0;
        first[pair + 1] = first[pair] + chunks_of(at, pair / at->kv_heads, &c0);
    }
    const int64_t tasks = first[pairs];
    const size_t floats = (size_t)p->work;
    attention_call call = {p, malloc(floats * (size_t)at->threads * sizeof(float)), floats,
                           first, malloc(((size_t)tasks * (size_t)p->part + 1) * sizeof(float)),
                           0};
    int status = 0;
    if (call.scratch && call.parts) {
        spnl_parallel(tasks, chunk_task, &call, at->threads);
        spnl_parallel(pairs, combine_task, &call, at->threads);
    } else {
        status = NO_MEMORY;
    }
    free(call.scratch);
    free(call.parts);
    free(first);
    return status;
}

// One query per sequence over its cached keys (paged_attention_ref's decode path).
int spnl_paged_decode(const spnl_paged_decode_args *a) {
    const spnl_attention *at = &a->at;
    if (at->heads < 1 || at->kv_heads < 1 || at->heads % at->kv_heads || at->dim < 1
        || at->seqs < 0 || at->threads < 1)
        return BAD_ARGUMENT;
    if (!keys_in_bounds(at)) return OUT_OF_BOUNDS;
    const int64_t group = at->heads / at->kv_heads, pairs = at->seqs * at->kv_heads;
    // Blocks of queries where there are many (a prefill's, most of them sharing a table),
    // small enough to leave each thread four tasks or more to balance (a batch of decodes
    // whose tables differ gains nothing from blocks); which queries go together changes no
    // bits.
    int64_t block = pairs / (4 * (int64_t)at->threads);
    block = block < 1 ? 1 : block > QUERY_BLOCK ? QUERY_BLOCK : block;
    // Keys widened once for the rows that share them where the rows fit.
    const int64_t wide = a->half && at->dim <= WIDE_DIM ? DOTS * at->dim : 0;
    const int64_t part = group * (at->dim + 2);
    const int64_t wide_values = wide && block > 1 ? KEY_CHUNK * (at->dim + 2) : 0;
    const attention_plan plan = {
        a, group, at->dim, part, block, wide, wide_values,
        block * group * KEY_CHUNK + wide + wide_values + (block > 1 ? block * part : 0)};
    if (pairs >= at->threads) {
        int64_t max_chunks = 0;
        for (int64_t s = 0; s < at->seqs; s++) {
            int64_t c0;
            const int64_t chunks = chunks_of(at, s, &c0);
            max_chunks = chunks > max_chunks ? chunks : max_chunks;
        }
        return by_blocks(&plan, max_chunks);
    }
    return by_chunks(&plan);
}
