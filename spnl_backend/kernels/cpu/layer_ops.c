// The element-wise operations of a layer, RMSNorm and RoPE (twins: rms_norm_ref,
// add_rms_norm_ref and qk_norm_rope_ref in spnl_backend/kernels/ops.py): one call each
// where torch runs several ops. The fused calls run the same per-row arithmetic
// as the single ones, so fusing changes no bit.

#include "common.h"

// out = x * (1 / sqrt(mean(x^2) + eps)) * scale over one row; out may be x.
static inline void norm_row(const float *x, const float *scale, float *out, int64_t dim,
                            float eps) {
    float sum = 0.0f;
    #pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; i++) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    #pragma omp simd
    for (int64_t i = 0; i < dim; i++) out[i] = x[i] * inv * scale[i];
}

// Rotate-half RoPE of one head in place (twin: rotate_ref), tables laid out as [cos, cos]
// and [-sin, sin]: x[i] = x[i] * cos[i] + x[i + half] * sin[i] and x[i + half] =
// x[i + half] * cos[i + half] + x[i] * sin[i + half].
static inline void rope_head(float *v, const float *c, const float *s, int64_t half) {
    #pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] + b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
    }
}

// out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * scale  (RMSNorm)
int spnl_rms_norm(const float *x, const float *scale, float *out, int64_t rows, int64_t dim,
                  float eps) {
    if (rows < 0 || dim < 1) return BAD_ARGUMENT;
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * dim, scale, out + r * dim, dim, eps);
    return 0;
}

// One row of spnl_add_rms_norm.
static inline void add_norm_row(float *xr, const float *d, const float *delta_scale,
                                float delta_eps, const float *scale, float eps, float *out,
                                int64_t dim) {
    if (delta_scale) {
        float sum = 0.0f;
        #pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) sum += d[i] * d[i];
        const float inv = 1.0f / sqrtf(sum / (float)dim + delta_eps);
        #pragma omp simd
        for (int64_t i = 0; i < dim; i++) xr[i] = xr[i] + d[i] * inv * delta_scale[i];
    } else {
        #pragma omp simd
        for (int64_t i = 0; i < dim; i++) xr[i] = xr[i] + d[i];
    }
    norm_row(xr, scale, out, dim, eps);
}

#define NORM_ROWS 8              // rows per task of the threaded norms
#define NORM_PARALLEL_FROM 16384 // values from which they share the rows out

typedef struct {
    float *x;
    const float *delta, *delta_scale, *scale;
    float delta_eps, eps;
    float *out;
    int64_t rows, dim;
} add_norm_call;

static void add_norm_task(void *ctx, int64_t task, int worker) {
    (void)worker;
    const add_norm_call *c = ctx;
    const int64_t end = (task + 1) * NORM_ROWS < c->rows ? (task + 1) * NORM_ROWS : c->rows;
    for (int64_t r = task * NORM_ROWS; r < end; r++)
        add_norm_row(c->x + r * c->dim, c->delta + r * c->dim, c->delta_scale, c->delta_eps,
                     c->scale, c->eps, c->out + r * c->dim, c->dim);
}

// The residual step between two sublayers: x[r] += delta[r] (normed first by delta_scale
// and delta_eps where delta_scale is given: Gemma's post-norms), then out[r] = RMSNorm of
// the new x[r] by scale and eps. x is updated in place. The rows are shared out among
// `threads` (a prefill's); each row's arithmetic is its own, so the same bits.
int spnl_add_rms_norm(float *x, const float *delta, const float *delta_scale, float delta_eps,
                      const float *scale, float eps, float *out, int64_t rows, int64_t dim,
                      int threads) {
    if (rows < 0 || dim < 1) return BAD_ARGUMENT;
    add_norm_call call = {x, delta, delta_scale, scale, delta_eps, eps, out, rows, dim};
    spnl_parallel((rows + NORM_ROWS - 1) / NORM_ROWS, add_norm_task, &call,
                  rows * dim < NORM_PARALLEL_FROM ? 1 : threads);
    return 0;
}

// One token's queries and keys, as spnl_qk_norm_rope makes them.
static void qk_token(const spnl_qk_args *a, int64_t t) {
    const int64_t dim = a->head_dim, rot = a->rotary_dim;
    const float *c = a->cos + t * rot, *s = a->sin + t * rot;
    for (int64_t h = 0; h < a->heads; h++) {
        float *v = a->q + t * a->q_row + h * dim;
        if (a->q_scale) norm_row(v, a->q_scale, v, dim, a->eps);
        rope_head(v, c, s, rot / 2);
    }
    for (int64_t h = 0; h < a->kv_heads; h++) {
        float *v = a->k + t * a->k_row + h * dim;
        if (a->k_scale) norm_row(v, a->k_scale, v, dim, a->eps);
        rope_head(v, c, s, rot / 2);
    }
}

static bool qk_args_bad(const spnl_qk_args *a) {
    const int64_t dim = a->head_dim, rot = a->rotary_dim;
    return rot < 2 || rot % 2 || rot > dim || a->tokens < 0 || a->heads < 0 ||
           a->kv_heads < 0 || a->q_row < a->heads * dim || a->k_row < a->kv_heads * dim;
}

static void qk_task(void *ctx, int64_t task, int worker) {
    (void)worker;
    const spnl_qk_args *a = ctx;
    const int64_t end = (task + 1) * NORM_ROWS < a->tokens ? (task + 1) * NORM_ROWS : a->tokens;
    for (int64_t t = task * NORM_ROWS; t < end; t++) qk_token(a, t);
}

// Queries and keys of one step made ready for attention, in place: each head normed by
// its scale (where one is given: per-head q/k norms) and rotated. q[t] starts at q + t *
// q_row, k[t] at k + t * k_row (both may be parts of one q/k/v product row); a token's
// heads are consecutive. The tokens are shared out among `threads`: the same bits.
int spnl_qk_norm_rope(const spnl_qk_args *a, int threads) {
    if (qk_args_bad(a)) return BAD_ARGUMENT;
    const int64_t values = a->tokens * (a->heads + a->kv_heads) * a->head_dim;
    spnl_parallel((a->tokens + NORM_ROWS - 1) / NORM_ROWS, qk_task, (void *)a,
                  values < NORM_PARALLEL_FROM ? 1 : threads);
    return 0;
}

#define ACT_PIECE 2048           // values per task: a row of a wide MLP is a few tasks
#define ACT_PARALLEL_FROM 16384  // values from which the pool shares the work out

typedef struct {
    int kind;
    const float *gate, *up;
    int64_t inner, pieces, gate_stride, up_stride;
    float *out;
} gated_act_call;

// One piece of one row: 16 values at a time, the tail through the same vector code (each
// value's arithmetic is its own, so where a value falls changes no bit).
static void gated_act_piece(void *ctx, int64_t task, int worker) {
    (void)worker;
    const gated_act_call *c = ctx;
    const int64_t row = task / c->pieces, lo = task % c->pieces * ACT_PIECE;
    const int64_t hi = lo + ACT_PIECE < c->inner ? lo + ACT_PIECE : c->inner;
    const float *g = c->gate + row * c->gate_stride, *u = c->up + row * c->up_stride;
    float *out = c->out + row * c->inner;
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        const v16f a = gated16(c->kind, load_f32(g + i), load_f32(u + i));
        memcpy(out + i, &a, sizeof a);
    }
    if (i == hi) return;
    float gs[16] = {0}, us[16] = {0};
    memcpy(gs, g + i, (size_t)(hi - i) * sizeof(float));
    memcpy(us, u + i, (size_t)(hi - i) * sizeof(float));
    const v16f a = gated16(c->kind, load_f32(gs), load_f32(us));
    memcpy(out + i, &a, (size_t)(hi - i) * sizeof(float));
}

// out[r][i] = act(gate[r][i]) * up[r][i] (twin: gated_act_ref in spnl_backend/kernels/ops.py):
// gate's rows gate_stride floats apart, up's up_stride, out's inner. Element-wise, so the
// same bits at any thread count and for any rows beside a row.
int spnl_gated_act(int kind, const float *gate, const float *up, int64_t rows, int64_t inner,
                   int64_t gate_stride, int64_t up_stride, float *out, int threads) {
    if ((kind != SPNL_ACT_SILU && kind != SPNL_ACT_GELU_TANH) || rows < 0 || inner < 1 ||
        gate_stride < inner || up_stride < inner)
        return BAD_ARGUMENT;
    const int64_t pieces = (inner + ACT_PIECE - 1) / ACT_PIECE;
    gated_act_call call = {kind, gate, up, inner, pieces, gate_stride, up_stride, out};
    spnl_parallel(rows * pieces, gated_act_piece, &call,
                  rows * inner < ACT_PARALLEL_FROM ? 1 : threads);
    return 0;
}
