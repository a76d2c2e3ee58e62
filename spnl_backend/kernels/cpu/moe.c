// A mixture-of-experts layer in one call (twin: the grouped torch path of SparseMoE in
// spnl_backend/models/layers.py): each token's router logits, softmax and top-k (weights
// renormalised over the k where the architecture does), its experts' gate and up products,
// SiLU(gate) * up (or gpt-oss's clamped SwiGLU), their down products, and the weighted sum
// over its experts in id order; the router's and the experts' biases where they have them.
//
// The (token, expert) pairs are sorted by expert, so each chosen expert's weights are read
// once for all its tokens and an idle expert's not at all, and both products run as one
// grouped call each (spnl_qmatmul_groups): each reads the weights in one pool job, whatever
// the number of tokens (the routing, SiLU and the sums are jobs of their own). Every row of
// those products is computed as it would be alone, and the router's and the sum's
// arithmetic is per token, so a token's output does not depend on its step.

#include "common.h"

#define MAX_EXPERTS 256      // two products each in one grouped call (MAX_PRODUCTS)
#define CHUNK_TOKENS 256     // tokens per pass: bounds the scratch of a long prefill
#define PARALLEL_PAIRS 16    // pairs from which the element-wise parts use the threads

// sum_i a[i] * b[i] in a fixed order: two 16-lane chains, then the tail.
static float dot(const float *a, const float *b, int64_t n) {
    v16f even = {0}, odd = {0};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        even = fma16(load_f32(a + i), load_f32(b + i), even);
        odd = fma16(load_f32(a + i + 16), load_f32(b + i + 16), odd);
    }
    float sum = hsum(even + odd);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

// One token's route from its router logits: the top_k experts by softmax probability (ties
// to the lower id), their probabilities renormalised over the k where asked, then sorted by
// expert id, the order its sum runs in.
static void route(const spnl_moe_args *m, const float *logits, int64_t *ids, float *weights) {
    const int64_t experts = m->experts, k = m->top_k;
    float probs[MAX_EXPERTS], peak = logits[0], total = 0.0f;
    bool taken[MAX_EXPERTS] = {false};
    for (int64_t e = 1; e < experts; e++) peak = logits[e] > peak ? logits[e] : peak;
    for (int64_t e = 0; e < experts; e++) total += probs[e] = expf(logits[e] - peak);
    for (int64_t e = 0; e < experts; e++) probs[e] = probs[e] / total;
    float chosen = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < experts; e++)
            if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
        taken[best] = true;
        ids[j] = best, weights[j] = probs[best];
        chosen += probs[best];
    }
    for (int64_t j = 0; m->renormalize && j < k; j++) weights[j] = weights[j] / chosen;
    for (int64_t j = 1; j < k; j++)  // insertion sort by id: k is small
        for (int64_t i = j; i > 0 && ids[i - 1] > ids[i]; i--) {
            const int64_t id = ids[i];
            const float w = weights[i];
            ids[i] = ids[i - 1], weights[i] = weights[i - 1];
            ids[i - 1] = id, weights[i - 1] = w;
        }
}

static inline v16f pick16(v16i take_a, v16f a, v16f b) {
    return (v16f)(((v16i)a & take_a) | ((v16i)b & ~take_a));
}

// One layer's gating of 16 gate and up values.
static inline v16f glu16(const spnl_moe_args *m, v16f g, v16f u) {
    if (!m->clamped) return gated16(SPNL_ACT_SILU, g, u);  // SiLU(g) * up, as a dense MLP's
    const v16f limit = splat(m->limit), low = splat(-m->limit);
    g = pick16(g > limit, limit, g);  // NaN stays NaN, as torch's clamp keeps it
    u = pick16(u > limit, limit, pick16(u < low, low, u));
    return (u + splat(1.0f)) * (g * sigmoid16(g * splat(m->alpha)));
}

// act[i] = the gating of gate[i] and up[i] over one pair's row.
static void glu_row(const spnl_moe_args *m, const float *gate, const float *up, float *act,
                    int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const v16f a = glu16(m, load_f32(gate + i), load_f32(up + i));
        memcpy(act + i, &a, sizeof a);
    }
    for (; i < n; i++) {  // the tail through the same vector code
        float g[16] = {0}, u[16] = {0};
        g[0] = gate[i], u[0] = up[i];
        act[i] = glu16(m, load_f32(g), load_f32(u))[0];
    }
}

// One chunk's working memory, carved from the caller's scratch (a fresh allocation per call
// would be a new mapping each time: a prefill chunk's tens of MB faulted in page by page).
typedef struct {
    float *logits;       // [tokens][experts]
    int64_t *ids;        // [tokens][top_k]: each token's experts, in id order
    float *weights;      // [tokens][top_k]
    int64_t *pair;       // [tokens][top_k]: each (token, expert)'s row among the sorted pairs
    int64_t *expert;     // [tokens * top_k]: each sorted pair row's expert
    int64_t *first;      // [experts + 1]: each expert's first pair row
    int *qtypes;         // the grouped calls' products: up to 2 per expert
    const uint8_t **w;
    int64_t *w_bytes, *n_outs;
    spnl_group *groups;
    float *xs;           // [pairs][hidden]: each pair's token (tokens > 1)
    float *gate_up;      // [pairs][2 inner]
    float *act;          // [pairs][inner]
    float *y;            // [pairs][hidden]
} moe_scratch;

// The next `bytes` of the block at `base` (NULL: only counted), from offset *at, each part at
// a 64-byte boundary (the block itself 64-byte aligned).
static void *take(char *base, size_t *at, size_t bytes) {
    void *part = base ? base + *at : NULL;
    *at += (bytes + 63) / 64 * 64;
    return part;
}

// The parts of moe_scratch for `tokens` tokens, laid out from `base` (NULL: only counted);
// returns the bytes they take.
static size_t lay_out(const spnl_moe_args *m, int64_t tokens, char *base, moe_scratch *s) {
    const size_t pairs = (size_t)(tokens * m->top_k), experts = (size_t)m->experts;
    const size_t products = 2 * experts, hidden = (size_t)m->hidden, inner = (size_t)m->inner;
    size_t at = 0;
    s->logits = take(base, &at, tokens * experts * sizeof(float));
    s->ids = take(base, &at, pairs * sizeof(int64_t));
    s->weights = take(base, &at, pairs * sizeof(float));
    s->pair = take(base, &at, pairs * sizeof(int64_t));
    s->expert = take(base, &at, pairs * sizeof(int64_t));
    s->first = take(base, &at, (experts + 1) * sizeof(int64_t));
    s->qtypes = take(base, &at, products * sizeof(int));
    s->w = take(base, &at, products * sizeof(uint8_t *));
    s->w_bytes = take(base, &at, products * sizeof(int64_t));
    s->n_outs = take(base, &at, products * sizeof(int64_t));
    s->groups = take(base, &at, products * sizeof(spnl_group));
    s->xs = take(base, &at, pairs * hidden * sizeof(float));
    s->gate_up = take(base, &at, pairs * 2 * inner * sizeof(float));
    s->act = take(base, &at, pairs * inner * sizeof(float));
    s->y = take(base, &at, pairs * hidden * sizeof(float));
    return at;
}

// Each token's experts and weights, and each pair's row: pairs sorted by expert, an
// expert's tokens in order.
// What the element-wise tasks of one layer share.
typedef struct {
    const spnl_moe_args *m;
    const float *x;
    moe_scratch *s;
    float *out;
} moe_call;

// Task i: token i / experts's router logit for expert i % experts.
static void logit_task(void *ctx, int64_t i, int worker) {
    (void)worker;
    const moe_call *c = ctx;
    const int64_t experts = c->m->experts, hidden = c->m->hidden;
    const float logit = dot(c->m->router + (i % experts) * hidden,
                            c->x + (i / experts) * hidden, hidden);
    c->s->logits[i] = c->m->router_bias ? logit + c->m->router_bias[i % experts] : logit;
}

// Task i: pair row i's gating of its gate and up (their biases added first, as a biased
// projection adds them to its product).
static void act_task(void *ctx, int64_t i, int worker) {
    (void)worker;
    const moe_call *c = ctx;
    const int64_t inner = c->m->inner;
    float *gate_up = c->s->gate_up + i * 2 * inner;
    if (c->m->gate_up_bias) {
        const float *bias = c->m->gate_up_bias + c->s->expert[i] * 2 * inner;
        for (int64_t j = 0; j < 2 * inner; j++) gate_up[j] = gate_up[j] + bias[j];
    }
    glu_row(c->m, gate_up, gate_up + inner, c->s->act + i * inner, inner);
}

// Task t: token t's weighted sum over its experts, in id order.
static void sum_task(void *ctx, int64_t t, int worker) {
    (void)worker;
    const moe_call *c = ctx;
    const int64_t k = c->m->top_k, hidden = c->m->hidden;
    float *o = c->out + t * hidden;
    memset(o, 0, hidden * sizeof(float));
    for (int64_t j = 0; j < k; j++) {  // experts in id order
        const float w = c->s->weights[t * k + j], *y = c->s->y + c->s->pair[t * k + j] * hidden;
        if (c->m->down_bias) {  // the biased product first, then weighed
            const float *bias = c->m->down_bias + c->s->ids[t * k + j] * hidden;
            for (int64_t i = 0; i < hidden; i++) o[i] = o[i] + w * (y[i] + bias[i]);
        } else {
            for (int64_t i = 0; i < hidden; i++) o[i] = o[i] + w * y[i];
        }
    }
}

static void route_tokens(const spnl_moe_args *m, const float *x, int64_t tokens,
                         moe_scratch *s, int threads) {
    const int64_t experts = m->experts, k = m->top_k;
    moe_call call = {m, x, s, NULL};
    spnl_parallel(tokens * experts, logit_task, &call, threads);
    int64_t fill[MAX_EXPERTS] = {0};
    for (int64_t t = 0; t < tokens; t++) {
        route(m, s->logits + t * experts, s->ids + t * k, s->weights + t * k);
        for (int64_t j = 0; j < k; j++) fill[s->ids[t * k + j]]++;
    }
    s->first[0] = 0;
    for (int64_t e = 0; e < experts; e++) s->first[e + 1] = s->first[e] + fill[e], fill[e] = 0;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = s->ids[t * k + j];
            s->pair[t * k + j] = s->first[e] + fill[e]++;
            s->expert[s->pair[t * k + j]] = e;
        }
}

// The grouped call's products: of every expert with pairs, `which` (gate_up or down), each
// product on that expert's pair rows (x from x_row where one row serves all: a lone token),
// column by column as the expert's products lie side by side. Returns the product count.
static int plan_experts(const spnl_moe_args *m, const spnl_products *which, moe_scratch *s,
                        int lone_token, spnl_products *p) {
    int count = 0;
    for (int64_t e = 0; e < m->experts; e++) {
        const int64_t rows = s->first[e + 1] - s->first[e];
        int64_t col = 0;
        for (int i = 0; rows && i < which[e].count; i++, count++) {
            s->qtypes[count] = which[e].qtypes[i];
            s->w[count] = which[e].weights[i];
            s->w_bytes[count] = which[e].w_bytes[i];
            s->n_outs[count] = which[e].n_outs[i];
            s->groups[count] = (spnl_group){lone_token ? 0 : s->first[e], s->first[e], rows, col};
            col += which[e].n_outs[i];
        }
    }
    *p = (spnl_products){count, s->qtypes, s->w, s->w_bytes, s->n_outs};
    return count;
}

static int moe_chunk(const spnl_moe_args *m, const float *x, int64_t tokens, float *out,
                     char *scratch, int threads, int exact) {
    const int64_t k = m->top_k, hidden = m->hidden, inner = m->inner, pairs = tokens * k;
    moe_scratch s;
    lay_out(m, tokens, scratch, &s);
    route_tokens(m, x, tokens, &s, threads);
    const int lone = tokens == 1;  // its pairs all read row 0 of x: nothing to gather
    if (!lone)
        for (int64_t i = 0; i < pairs; i++)
            memcpy(s.xs + s.pair[i] * hidden, x + i / k * hidden, hidden * sizeof(float));
    spnl_products p;
    plan_experts(m, m->gate_up, &s, lone, &p);
    int status = spnl_qmatmul_groups(&p, s.groups, lone ? x : s.xs, lone ? 1 : pairs, hidden,
                                     s.gate_up, pairs, 2 * inner, threads, exact);
    if (status) return status;
    const int elementwise = pairs >= PARALLEL_PAIRS ? threads : 1;
    moe_call call = {m, x, &s, out};
    spnl_parallel(pairs, act_task, &call, elementwise);
    plan_experts(m, m->down, &s, 0, &p);
    status = spnl_qmatmul_groups(&p, s.groups, s.act, pairs, inner, s.y, pairs, hidden, threads,
                                 exact);
    if (status) return status;
    spnl_parallel(tokens, sum_task, &call, elementwise);
    return 0;
}

// Whether every expert has a gate and an up product of inner rows and a down of hidden rows.
static bool experts_fit(const spnl_moe_args *m) {
    for (int64_t e = 0; e < m->experts; e++) {
        const spnl_products *gu = &m->gate_up[e], *down = &m->down[e];
        if (gu->count != 2 || gu->n_outs[0] != m->inner || gu->n_outs[1] != m->inner ||
            down->count != 1 || down->n_outs[0] != m->hidden)
            return false;
    }
    return true;
}

// The scratch bytes spnl_moe takes for `tokens` tokens (-1: arguments it refuses).
int64_t spnl_moe_scratch_bytes(const spnl_moe_args *m, int64_t tokens) {
    if (tokens < 1 || m->experts < 1 || m->experts > MAX_EXPERTS || m->top_k < 1 ||
        m->top_k > m->experts || m->hidden < 1 || m->inner < 1)
        return -1;
    moe_scratch s;
    return (int64_t)lay_out(m, tokens < CHUNK_TOKENS ? tokens : CHUNK_TOKENS, NULL, &s);
}

// out [tokens][hidden] = the layer's output for x [tokens][hidden], a chunk of tokens at a
// time (each token's result is its own, so chunks change no bit), in `scratch` (64-byte
// aligned, at least spnl_moe_scratch_bytes of it).
int spnl_moe(const spnl_moe_args *m, const float *x, int64_t tokens, float *out, void *scratch,
             int64_t scratch_bytes, int threads, int exact) {
    const int64_t needed = spnl_moe_scratch_bytes(m, tokens);
    if (needed < 0 || scratch_bytes < needed || (uintptr_t)scratch % 64 || !experts_fit(m))
        return BAD_ARGUMENT;
    for (int64_t t0 = 0; t0 < tokens; t0 += CHUNK_TOKENS) {
        const int64_t n = tokens - t0 < CHUNK_TOKENS ? tokens - t0 : CHUNK_TOKENS;
        const int status = moe_chunk(m, x + t0 * m->hidden, n, out + t0 * m->hidden, scratch,
                                     threads, exact);
        if (status) return status;
    }
    return 0;
}
