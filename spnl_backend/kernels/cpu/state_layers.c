// The state layers' recurrences, token by token (twins: recurrent in
// spnl_backend/kernels/delta_rule.py, spnl_backend/kernels/ssd.py and
// spnl_backend/kernels/selective_scan.py): one sequence's tokens per call, its heads (a
// Mamba-1's channels, in runs) in parallel on the pool (a task per head, which owns its
// part of the state and of the outputs), the state updated in place.
//
// Token by token, not a chunk at a time: a token's arithmetic is then the same wherever
// the pieces of a sequence start or end, so a layer that runs this for every piece gets
// the same bits from a prefix hit, a resumed prefill or a cold run. The products are
// element-wise in the state's own order (no contraction, -ffp-contract=off), so the state
// rounds as the twin's does; only the sums over a head's rows take another order.

#include "common.h"

// ---- the gated delta rule (Gated DeltaNet) ---------------------------------------------------

typedef struct {
    const float *q, *k, *v, *g, *beta;  // [T][H][dk] (q, k), [T][H][dv] (v), [T][H]
    float *state, *out;                 // [H][dk][dv] (updated), [T][H][dv]
    int64_t tokens, heads, dk, dv;
} delta_call;

// One value head through every token: S *= exp(g); S += k (beta (v - S^T k))^T; o = S^T q.
// Two passes over S per token: the decay with the prediction S^T k, then the write with
// the read-out (which needs the written S).
static void delta_head(void *ctx, int64_t h, int worker) {
    (void)worker;
    const delta_call *c = ctx;
    const int64_t heads = c->heads, dk = c->dk, dv = c->dv;
    float *s = c->state + h * dk * dv;
    float delta[dv];  // dv <= SPNL_MAX_HEAD_DIM, checked by the entry point
    for (int64_t t = 0; t < c->tokens; t++) {
        const int64_t at = t * heads + h;
        const float *q = c->q + at * dk, *k = c->k + at * dk, *v = c->v + at * dv;
        float *o = c->out + at * dv;
        const float decay = expf(c->g[at]), beta = c->beta[at];
        memset(delta, 0, (size_t)dv * sizeof(float));
        for (int64_t i = 0; i < dk; i++) {
            float *row = s + i * dv;
            const float ki = k[i];
            #pragma omp simd
            for (int64_t j = 0; j < dv; j++) {
                row[j] *= decay;
                delta[j] += row[j] * ki;
            }
        }
        #pragma omp simd
        for (int64_t j = 0; j < dv; j++) delta[j] = (v[j] - delta[j]) * beta;
        memset(o, 0, (size_t)dv * sizeof(float));
        for (int64_t i = 0; i < dk; i++) {
            float *row = s + i * dv;
            const float ki = k[i], qi = q[i];
            #pragma omp simd
            for (int64_t j = 0; j < dv; j++) {
                row[j] += ki * delta[j];
                o[j] += row[j] * qi;
            }
        }
    }
}

int spnl_delta_rule(const float *q, const float *k, const float *v, const float *g,
                    const float *beta, float *state, float *out, int64_t tokens, int64_t heads,
                    int64_t dk, int64_t dv, int threads) {
    if (tokens < 0 || heads < 0 || dk < 1 || dv < 1 || dv > SPNL_MAX_HEAD_DIM)
        return BAD_ARGUMENT;
    delta_call call = {q, k, v, g, beta, state, out, tokens, heads, dk, dv};
    spnl_parallel(heads, delta_head, &call, threads);
    return 0;
}

// ---- Mamba-2's selective state space (the SSD scan) ------------------------------------------

typedef struct {
    const float *x, *dt, *a, *b, *c;  // [T][H][P], [T][H], [H], [T][H][N] (b, c)
    float *state, *out;               // [H][P][N] (updated), [T][H][P]
    int64_t tokens, heads, p, n;
} ssd_call;

// One head through every token: h = h exp(dt a) + (dt x) b^T; y = h c. One pass over h per
// token: each channel's row is decayed, written and read out in turn.
static void ssd_head(void *ctx, int64_t h, int worker) {
    (void)worker;
    const ssd_call *c = ctx;
    const int64_t heads = c->heads, p = c->p, n = c->n;
    float *s = c->state + h * p * n;
    for (int64_t t = 0; t < c->tokens; t++) {
        const int64_t at = t * heads + h;
        const float *x = c->x + at * p, *b = c->b + at * n, *read = c->c + at * n;
        float *y = c->out + at * p;
        const float dt = c->dt[at], decay = expf(dt * c->a[h]);
        for (int64_t i = 0; i < p; i++) {
            float *row = s + i * n;
            const float written = dt * x[i];
            float sum = 0.0f;
            #pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) {
                row[j] = row[j] * decay + written * b[j];
                sum += row[j] * read[j];
            }
            y[i] = sum;
        }
    }
}

int spnl_ssd_scan(const float *x, const float *dt, const float *a, const float *b,
                  const float *c, float *state, float *out, int64_t tokens, int64_t heads,
                  int64_t p, int64_t n, int threads) {
    if (tokens < 0 || heads < 0 || p < 1 || n < 1) return BAD_ARGUMENT;
    ssd_call call = {x, dt, a, b, c, state, out, tokens, heads, p, n};
    spnl_parallel(heads, ssd_head, &call, threads);
    return 0;
}

// ---- Mamba-1's selective scan ----------------------------------------------------------------

typedef struct {
    const float *x, *dt, *a, *b, *c;  // [T][D] (x, dt), [D][N] (a), [T][N] (b, c)
    float *state, *out;               // [D][N] (updated), [T][D]
    int64_t tokens, channels, n;
} selective_call;

#define SELECTIVE_RUN 64  // channels per task

// A run of channels through every token: h = h exp(dt a) + (dt b) x; y = h c. Each channel
// has its own rates a, so the decay is one exp per state element, as in the twin.
static void selective_run(void *ctx, int64_t task, int worker) {
    (void)worker;
    const selective_call *c = ctx;
    const int64_t channels = c->channels, n = c->n, first = task * SELECTIVE_RUN;
    const int64_t last = first + SELECTIVE_RUN < channels ? first + SELECTIVE_RUN : channels;
    for (int64_t t = 0; t < c->tokens; t++) {
        const float *b = c->b + t * n, *read = c->c + t * n;
        for (int64_t d = first; d < last; d++) {
            const float dt = c->dt[t * channels + d], x = c->x[t * channels + d];
            const float *a = c->a + d * n;
            float *row = c->state + d * n;
            float sum = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                row[j] = row[j] * expf(dt * a[j]) + (dt * b[j]) * x;
                sum += row[j] * read[j];
            }
            c->out[t * channels + d] = sum;
        }
    }
}

int spnl_selective_scan(const float *x, const float *dt, const float *a, const float *b,
                        const float *c, float *state, float *out, int64_t tokens,
                        int64_t channels, int64_t n, int threads) {
    if (tokens < 0 || channels < 0 || n < 1) return BAD_ARGUMENT;
    selective_call call = {x, dt, a, b, c, state, out, tokens, channels, n};
    spnl_parallel((channels + SELECTIVE_RUN - 1) / SELECTIVE_RUN, selective_run, &call, threads);
    return 0;
}
