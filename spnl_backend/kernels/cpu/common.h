// What the CPU's native kernels share: the entry points and their argument structs (declared
// here once; the ctypes mirrors in __init__.py follow them field for field), the status
// codes, the index-check switch, float16, and the 16-lane vector helpers.
//
// One translation unit per kernel family (quant_matmul.c, layer_ops.c, paged_attention.c,
// coded_decode.c) and build_info.c, all linked into one library compiled at first use with
// -O3 -march=native; GCC/Clang vector extensions keep it portable (AVX2, AVX-512, NEON).

#ifndef SPNL_COMMON_H
#define SPNL_COMMON_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// Status codes of the entry points (0 is success): the caller turns them into exceptions.
enum { BAD_ARGUMENT = -1, NO_MEMORY = -2, OUT_OF_BOUNDS = -3 };

// The thread pool (pool.c): tasks 0 .. tasks - 1 of fn, each called once as fn(ctx, task,
// worker) on up to `threads` threads, the caller among them; worker is 0 .. threads - 1
// (for per-thread scratch). Returns when every task has run. Tasks must be independent:
// which thread runs one, and how many there are, never changes what it computes.
typedef void (*spnl_task)(void *ctx, int64_t task, int worker);
void spnl_parallel(int64_t tasks, spnl_task fn, void *ctx, int threads);

// The widest head the coded decode takes: each of its threads unpacks a key and a value
// of this many floats on its stack.
#define SPNL_MAX_HEAD_DIM 4096

// Every entry point checks the extents it is given (buffer sizes, counts) before it
// reads or writes anything. Built with -DSPNL_CHECKS (MISTRALRS_NATIVE_CHECKS=true) it
// also checks every index it follows (each slot of each key, each row id) before use.
#ifdef SPNL_CHECKS
#define FULL_CHECKS 1
#else
#define FULL_CHECKS 0
#endif

// ---- the entry points ----------------------------------------------------------------------

// Several quantized matrices that multiply the same activations (q, k and v; gate and up):
// matrix i is weights[i], w_bytes[i] bytes of GGML type qtypes[i], n_outs[i] rows.
typedef struct {
    int count;
    const int *qtypes;
    const uint8_t *const *weights;
    const int64_t *w_bytes, *n_outs;
} spnl_products;

// Which rows a product of spnl_qmatmul_groups takes: x rows x_row .. x_row + rows - 1, written
// to the same number of y rows from y_row, from column col.
typedef struct {
    int64_t x_row, y_row, rows, col;
} spnl_group;

// A mixture-of-experts layer (moe.c): a float32 router [experts][hidden] and each expert's
// products, gate_up[e] (its gate and its up, inner rows each) and down[e] (hidden rows); each
// token takes its top_k experts by softmax, weights renormalised over them where renormalize.
// Biases (NULL: none): router_bias [experts], gate_up_bias [experts][2 inner] (gate's, then
// up's), down_bias [experts][hidden]. clamped: gpt-oss's gating, (clamp(up, -limit, limit)
// + 1) * g * sigmoid(alpha * g) with g = min(gate, limit), in place of SiLU(gate) * up.
typedef struct {
    const float *router;
    const spnl_products *gate_up, *down;
    int64_t experts, top_k, hidden, inner;
    int renormalize;
    const float *router_bias, *gate_up_bias, *down_bias;
    int clamped;
    float alpha, limit;
} spnl_moe_args;

// One adapter's share of a LoRA product (lora.c): its `count` rows (indices into the step's
// rows), a [rank][k_in], bt [rank][n_out] (B transposed) and the scale.
typedef struct {
    const int64_t *rows;
    int64_t count;
    const float *a, *bt;
    int64_t rank;
    float scale;
} spnl_lora_segment;

// The layer blocks' view of a step's adapters: its rows by adapter slot and scale factor
// (a step's groups), and each projection's adapters by slot (a table; a[slot] NULL: the
// slot has none there). A row's scale is (float)(scale[slot] * factor), as Python's.
typedef struct {
    int64_t slot;
    double factor;
    const int64_t *rows;
    int64_t count;
} spnl_lora_group;

typedef struct {
    int64_t slots;
    const float *const *a, *const *bt;
    const int64_t *rank;
    const double *scale;
} spnl_lora_table;

// The projections a layer's table list follows, in order.
enum { LORA_Q, LORA_K, LORA_V, LORA_O, LORA_GATE, LORA_UP, LORA_DOWN, LORA_PROJECTIONS };

// A gated MLP's activation of the gate (layer_ops.c's spnl_gated_act): SiLU or GELU's tanh
// form.
enum { SPNL_ACT_SILU, SPNL_ACT_GELU_TANH };

// How a layer's scores become softmax weights (kernels/scoring.py): scale * q.k, capped
// to softcap * tanh(s / softcap) where softcap > 0, over the last `window` keys where
// window > 0, with a logit per query head in the denominator alone where sinks is set
// (gpt-oss's attention sinks); where chunk > 0, over the keys of the query's own chunk of
// `chunk` positions alone (Llama 4's chunked attention).
typedef struct {
    float scale, softcap;
    int64_t window;
    const float *sinks;  // [heads] or NULL
    int64_t chunk;
} spnl_scoring;

// One decode attention, whichever the cache: a query per sequence, over the keys at
// slots[s * slot_stride + j] for firsts[s] <= j < lens[s]; without firsts, the last
// `scoring.window` of them where it is > 0 (all where it is 0).
typedef struct {
    const int64_t *slots;
    int64_t slot_stride, slot_width;  // the table's rows; lens[s] <= slot_width
    const int64_t *lens;              // [seqs]
    int64_t num_slots;                // slots in the pool
    int64_t seqs, heads, kv_heads, dim;
    spnl_scoring scoring;
    float *out;  // [seqs][heads][dim]
    int threads;
    const int64_t *firsts;  // [seqs] or NULL (a PIC query's keys are listed already windowed)
} spnl_attention;

// Over a float cache: q [seqs][heads][dim], caches [num_slots][kv_heads][dim] of float32,
// or of float16 where half is 1 (read back exactly, computed in float32).
typedef struct {
    spnl_attention at;
    const float *q;
    const void *k_cache, *v_cache;
    int half;
} spnl_paged_decode_args;

// Over PolarQuant records (see coded_decode.c): pools [num_slots][kv_heads][k_bytes or
// v_bytes], each a code per coordinate into a codebook (k_lut, v_lut) of 1 << bits entries;
// key records also carry k_outliers exact coordinates.
typedef struct {
    spnl_attention at;
    const float *q_rot, *q;              // [seqs][heads][dim]: rotated like the keys; as is
    const float *k_shift, *k_anchor;     // [seqs][heads]: q . key centre, q . key anchor
    const float *v_anchor;               // [kv_heads][dim]: value anchor less centre, rotated
    const uint8_t *k_pool, *v_pool;
    int64_t k_bytes, v_bytes, k_outliers;
    const float *k_lut, *v_lut;
    int k_bits, v_bits;
} spnl_coded_decode_args;

// One step's queries and keys to norm (per head, where a scale is given) and rotate in
// place: q [tokens][q_row] with the heads first in each row, k [tokens][k_row] likewise;
// tables [tokens][rotary_dim].
typedef struct {
    float *q, *k;
    int64_t q_row, k_row, tokens, heads, kv_heads, head_dim, rotary_dim;
    const float *q_scale, *k_scale;  // NULL: no norm
    float eps;
    const float *cos, *sin;
} spnl_qk_args;

// What every layer of one step shares (layer_blocks.c): the residual stream x and its
// normed copy h [tokens][hidden] (updated), scratch rows, the activation the caller
// writes between the blocks, where this step's keys go and which keys each query sees
// (at: slots, lens and seqs, one per query; the rest is set per layer), the rotary
// tables (0: global, 1: local layers).
typedef struct {
    int64_t tokens;
    float *x, *h;
    float *qkv, *q, *kv, *attn, *out, *gate_up;  // scratch
    float *act;                                   // [tokens][inner]
    const int64_t *slot_mapping;
    int64_t num_slots;
    spnl_attention at;
    const float *cos[2], *sin[2];
    int64_t rotary_dim[2];
    int threads, exact;
    // Where windowed is 1, the keys of the layers with a window (a step with PIC queries,
    // whose windows are by position: their lists differ from the other layers').
    spnl_attention at_windowed;
    int windowed;
    // The MoE layers' working memory (spnl_moe_scratch_bytes for this step's tokens).
    void *scratch;
    int64_t scratch_bytes;
    // This step's rows of LoRA adapters (lora_count 0: none).
    const spnl_lora_group *lora_groups;
    int64_t lora_count;
    // Where not NULL, the layers with a window keep their K and V in a pool of their own
    // (the sliding-window layers' pool): their tokens go to these slots of its
    // window_num_slots, and their keys are at_windowed's (windowed is then 1).
    const int64_t *window_slot_mapping;
    int64_t window_num_slots;
} spnl_step_args;

// One layer's fixed part: its products, norms (scales, one eps; NULL: none), cache and
// attention settings. attn_delta_norm/mlp_delta_norm norm a sublayer's output before the
// residual add (Gemma's post-norms); attn_out_norm/mlp_out_norm norm the sum (the MLP's
// input norm, and the next layer's input norm or the final one).
typedef struct {
    const spnl_products *qkv, *o, *gate_up, *down;
    int64_t hidden, inner, heads, kv_heads, head_dim;
    const float *q_norm, *k_norm;
    const float *attn_delta_norm, *attn_out_norm, *mlp_delta_norm, *mlp_out_norm;
    float eps;
    void *k_cache, *v_cache;
    int half, local;
    spnl_scoring scoring;
    // OLMoE: q_norm and k_norm over the whole projections (not per head), and q, k and v
    // clamped to [-clip, clip] where has_clip.
    int qk_full, has_clip;
    float clip;
    int act;                   // a dense MLP's activation (SPNL_ACT_*)
    const spnl_moe_args *moe;  // NULL: a dense MLP (gate_up and down)
    const spnl_lora_table *lora[LORA_PROJECTIONS];  // NULL: no adapter at that projection
} spnl_layer_args;

// What the loader asks of this build (build_info.c, quant_matmul.c).
int spnl_full_checks(void);
int spnl_has_int8(void);
int64_t spnl_sizeof_products(void);
int64_t spnl_sizeof_paged_decode(void);
int64_t spnl_sizeof_coded_decode(void);
int64_t spnl_sizeof_qk(void);
int64_t spnl_sizeof_step(void);
int64_t spnl_sizeof_layer(void);
int64_t spnl_sizeof_group(void);
int64_t spnl_sizeof_moe(void);
int64_t spnl_sizeof_lora_segment(void);
int64_t spnl_sizeof_lora_group(void);
int64_t spnl_sizeof_lora_table(void);

// quant_matmul.c
int64_t spnl_row_bytes(int qtype, int64_t k_in);
int spnl_qmatmul(const spnl_products *p, const float *x, int64_t rows, int64_t k_in, float *y,
                 int64_t y_stride, int threads, int exact);
int spnl_qmatmul_groups(const spnl_products *p, const spnl_group *g, const float *x,
                        int64_t x_rows, int64_t k_in, float *y, int64_t y_rows, int64_t y_stride,
                        int threads, int exact);
int spnl_dequantize(int qtype, const uint8_t *w, int64_t w_bytes, int64_t n_rows, int64_t k_in,
                    float *out, int threads);
int spnl_gather_rows(int qtype, const uint8_t *w, int64_t n_rows, const int64_t *ids,
                     int64_t count, int64_t k_in, float *out);

// layer_ops.c
int spnl_rms_norm(const float *x, const float *scale, float *out, int64_t rows, int64_t dim,
                  float eps);
int spnl_add_rms_norm(float *x, const float *delta, const float *delta_scale, float delta_eps,
                      const float *scale, float eps, float *out, int64_t rows, int64_t dim,
                      int threads);
int spnl_qk_norm_rope(const spnl_qk_args *a, int threads);
int spnl_gated_act(int kind, const float *gate, const float *up, int64_t rows, int64_t inner,
                   int64_t gate_stride, int64_t up_stride, float *out, int threads);

// paged_attention.c
int spnl_store_kv(const float *k, const float *v, void *k_cache, void *v_cache,
                  const int64_t *slots, int64_t tokens, int64_t row, int64_t num_slots, int half);
int spnl_paged_decode(const spnl_paged_decode_args *a);

// coded_decode.c
int spnl_coded_decode(const spnl_coded_decode_args *a);

// layer_blocks.c
int spnl_attention_block(const spnl_step_args *s, const spnl_layer_args *l);
int spnl_mlp_block(const spnl_step_args *s, const spnl_layer_args *l);
int spnl_moe_block(const spnl_step_args *s, const spnl_layer_args *l);
int spnl_layers(const spnl_step_args *s, const spnl_layer_args *layers, int64_t count,
                int64_t *failed);

// moe.c
int64_t spnl_moe_scratch_bytes(const spnl_moe_args *m, int64_t tokens);
int spnl_moe(const spnl_moe_args *m, const float *x, int64_t tokens, float *out, void *scratch,
             int64_t scratch_bytes, int threads, int exact);

// lora.c
// out rows (out_stride apart, n_out wide) += each segment's product on its rows of x (x_stride
// apart, k_in wide; x_rows of them), in place.
int spnl_lora_add(const spnl_lora_segment *segs, int64_t n_segs, const float *x,
                  int64_t x_stride, int64_t x_rows, int64_t k_in, float *out,
                  int64_t out_stride, int64_t n_out, int threads);
// The same for a layer block's projection: the step's groups through the projection's table.
int spnl_lora_table_add(const spnl_lora_table *t, const spnl_lora_group *groups,
                        int64_t n_groups, const float *x, int64_t x_stride, int64_t x_rows,
                        int64_t k_in, float *out, int64_t out_stride, int64_t n_out,
                        int threads);

// state_layers.c: one sequence's tokens through a state layer's recurrence, the state
// updated in place. The gated delta rule: q, k [tokens][heads][dk], v [tokens][heads][dv],
// g, beta [tokens][heads], state [heads][dk][dv] → out [tokens][heads][dv]. The SSD scan:
// x [tokens][heads][p], dt [tokens][heads], a [heads], b, c [tokens][heads][n], state
// [heads][p][n] → out [tokens][heads][p]. Mamba-1's selective scan: x, dt [tokens][d],
// a [d][n], b, c [tokens][n], state [d][n] → out [tokens][d].
int spnl_delta_rule(const float *q, const float *k, const float *v, const float *g,
                    const float *beta, float *state, float *out, int64_t tokens, int64_t heads,
                    int64_t dk, int64_t dv, int threads);
int spnl_ssd_scan(const float *x, const float *dt, const float *a, const float *b,
                  const float *c, float *state, float *out, int64_t tokens, int64_t heads,
                  int64_t p, int64_t n, int threads);
int spnl_selective_scan(const float *x, const float *dt, const float *a, const float *b,
                        const float *c, float *state, float *out, int64_t tokens,
                        int64_t channels, int64_t n, int threads);

// ---- shared by the attention kernels ---------------------------------------------------------

// Whether every sequence's visible keys stay inside the slot table and the pool: the
// lengths always (one per sequence), every slot in the checked build (one per key).
static inline bool keys_in_bounds(const spnl_attention *at) {
    for (int64_t s = 0; s < at->seqs; s++) {
        const int64_t len = at->lens[s];
        if (len < 0 || len > at->slot_width) return false;
        if (at->firsts && (at->firsts[s] < 0 || at->firsts[s] > len)) return false;
        for (int64_t j = 0; FULL_CHECKS && j < len; j++) {
            const int64_t slot = at->slots[s * at->slot_stride + j];
            if (slot < 0 || slot >= at->num_slots) return false;
        }
    }
    return true;
}

// The first visible key of a sequence of `len` keys (its query at position len - 1): the
// window's start or the chunk's, whichever is later.
static inline int64_t first_key(int64_t len, const spnl_scoring *scoring) {
    const int64_t window = scoring->window, chunk = scoring->chunk;
    const int64_t first = window > 0 && len > window ? len - window : 0;
    const int64_t chunk_first = chunk > 0 && len > 0 ? (len - 1) / chunk * chunk : 0;
    return chunk_first > first ? chunk_first : first;
}

// The first visible key of sequence s.
static inline int64_t first_of(const spnl_attention *at, int64_t s) {
    return at->firsts ? at->firsts[s] : first_key(at->lens[s], &at->scoring);
}

// The longest sequence: the stride of the score rows.
static inline int64_t longest_len(const spnl_attention *at) {
    int64_t most = 0;
    for (int64_t s = 0; s < at->seqs; s++) most = at->lens[s] > most ? at->lens[s] : most;
    return most;
}

// ---- float16 (the blocks' scales, the records' gains and outliers) ----------------------------

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    // Not through _Float16: with AVX512-FP16 that compiles to a conversion that merges into
    // its destination register, a dependency that chained every block of a row (2.5x slower).
    return _cvtsh_ss(h);
#elif defined(__FLT16_MAX__)
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, m = h & 0x3FF, bits;
    if (exponent == 0x1F) bits = sign | 0x7F800000u | (m << 13);
    else if (exponent) bits = sign | ((exponent + 112) << 23) | (m << 13);
    else if (!m) bits = sign;
    else {
        int shift = 0;
        while (!(m & 0x400)) { m <<= 1; shift++; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

// float32 to float16, rounded to nearest (ties to even), saturating: a value past float16's
// range is stored as its largest finite value, never as infinity (twin: paged_ref.to_cache).
#define HALF_MAX 65504.0f
static inline uint16_t float_to_half(float v) {
    v = v > HALF_MAX ? HALF_MAX : v < -HALF_MAX ? -HALF_MAX : v;  // NaN stays NaN
#if defined(__F16C__)
    return _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
#else
    _Float16 h = (_Float16)v;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return bits;
#endif
}

static inline void floats_to_half(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 top = _mm512_set1_ps(HALF_MAX), bottom = _mm512_set1_ps(-HALF_MAX);
    for (; i + 16 <= n; i += 16) {
        // max/min return their second operand where either is NaN: x goes second, so NaN stays
        const __m512 v = _mm512_min_ps(top, _mm512_max_ps(bottom, _mm512_loadu_ps(x + i)));
        _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
#elif defined(__F16C__)
    const __m256 top = _mm256_set1_ps(HALF_MAX), bottom = _mm256_set1_ps(-HALF_MAX);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_min_ps(top, _mm256_max_ps(bottom, _mm256_loadu_ps(x + i)));
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
#endif
    for (; i < n; i++) out[i] = float_to_half(x[i]);
}

// ---- 16-lane vectors -------------------------------------------------------------------------

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef int8_t v16i8 __attribute__((vector_size(16)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));

static const v16i LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

static inline v16f splat(float v) { return (v16f){0} + v; }
static inline v16f load_f32(const float *p) { v16f v; memcpy(&v, p, 64); return v; }
// 16 float16 values, widened exactly.
static inline v16f load_f16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (v16f)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    typedef union { v16f v; __m256 half[2]; } halves;
    halves r;
    r.half[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    r.half[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    return r.v;
#else
    v16f v;
    for (int i = 0; i < 16; i++) v[i] = half_to_float((const uint8_t *)(p + i));
    return v;
#endif
}
// 16 bytes widened to 16 int32 lanes. Compilers scalarise the generic conversion, so x86
// gets the widening instructions by name.
#if defined(__AVX512F__)
static inline v16i load_u8(const uint8_t *p) {
    return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline v16i load_i8(const uint8_t *p) {
    return (v16i)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}
#elif defined(__AVX2__)
typedef union { v16i v; __m256i half[2]; } v16i_halves;
static inline v16i load_u8(const uint8_t *p) {
    v16i_halves r;
    r.half[0] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    r.half[1] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    return r.v;
}
static inline v16i load_i8(const uint8_t *p) {
    v16i_halves r;
    r.half[0] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    r.half[1] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    return r.v;
}
#else
static inline v16i load_u8(const uint8_t *p) {
    v16u8 v;
    memcpy(&v, p, 16);
    return __builtin_convertvector(v, v16i);
}
static inline v16i load_i8(const uint8_t *p) {
    v16i8 v;
    memcpy(&v, p, 16);
    return __builtin_convertvector(v, v16i);
}
#endif
static inline v16f to_f32(v16i v) { return __builtin_convertvector(v, v16f); }
static inline float hsum(v16f v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
#endif
}
// a * b + c with one rounding where the hardware has FMA (the sums' order differs from the
// twin's anyway; the values themselves are dequantized exactly).
static inline v16f fma16(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
    return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    typedef union { v16f v; __m256 half[2]; } halves;
    halves x = {a}, y = {b}, z = {c}, r;
    r.half[0] = _mm256_fmadd_ps(x.half[0], y.half[0], z.half[0]);
    r.half[1] = _mm256_fmadd_ps(x.half[1], y.half[1], z.half[1]);
    return r.v;
#else
    return a * b + c;
#endif
}
// e^x for x <= 0, 16 lanes: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by a degree-7 polynomial
// (within 2 ulp of expf), times 2^n; below -87.3 (where e^x is under float's normal range)
// it is 0.
static inline v16f exp16(v16f x) {
    const v16f low = splat(-87.3f), magic = splat(12582912.0f);  // 1.5 * 2^23: rounds
    const v16i under = x < low;
    x = (v16f)((v16i)x & ~under) + (v16f)((v16i)low & under);
    const v16f n = (x * splat(1.44269504f) + magic) - magic;
    const v16f r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
    v16f p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    const v16i two_n = (__builtin_convertvector(n, v16i) + 127) << 23;
    return (v16f)((v16i)(p * (v16f)two_n) & ~under);
}

// sigmoid(z) through e^-|z| (at most 1: never overflows).
static inline v16f sigmoid16(v16f z) {
    const v16i negative = z < splat(0.0f);
    const v16f e = exp16((v16f)((v16i)z | INT32_MIN));  // e^-|z|: the sign bit set
    const v16f up = splat(1.0f) / (splat(1.0f) + e);           // sigmoid(|z|)
    return (v16f)(((v16i)(e * up) & negative) | ((v16i)up & ~negative));
}

// A gated MLP's activation of 16 gate and up values: act(g) * u. GELU's tanh form,
// g/2 * (1 + tanh(y)) with y = sqrt(2/pi) (g + 0.044715 g^3), is g * sigmoid(2y): the same
// function, through the sigmoid that cannot overflow.
static inline v16f gated16(int kind, v16f g, v16f u) {
    if (kind == SPNL_ACT_SILU) return g * sigmoid16(g) * u;
    const v16f z = (g + splat(0.044715f) * g * g * g) * splat(1.5957691216f);  // 2y
    return g * sigmoid16(z) * u;
}

// Bit (first + lane) of a 32-bit word, per lane.
static inline v16i bits_of(uint32_t word, int first) {
    return ((v16i){0} + (int32_t)(word >> first)) >> LANE & 1;
}

#endif
