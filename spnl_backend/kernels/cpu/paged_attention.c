// The paged float KV cache (twins: store_kv_ref and paged_attention_ref in
// spnl_backend/kernels/paged_ref.py): a pool of slots [num_slots][kv_heads][dim], written
// a token's row at a time and read by one query per sequence at decode.

#include "common.h"

// New K/V rows into their cache slots; slot -1 writes nothing (twin: store_kv_ref).
int spnl_store_kv(const float *k, const float *v, float *k_cache, float *v_cache,
                  const int64_t *slots, int64_t tokens, int64_t row, int64_t num_slots) {
    if (tokens < 0 || row < 1) return BAD_ARGUMENT;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return OUT_OF_BOUNDS;
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row, k + t * row, row * sizeof(float));
        memcpy(v_cache + slots[t] * row, v + t * row, row * sizeof(float));
    }
    return 0;
}

// One query head of sequence s over its visible keys: out = softmax(scores) . values, with
// scores[j] = q . k_j * scale (softcapped where asked), summed in key order.
static void attend(const spnl_paged_decode_args *a, int64_t s, int64_t h, float *scores) {
    const int64_t heads = a->at.heads, kv_heads = a->at.kv_heads, dim = a->at.dim;
    const int64_t group = heads / kv_heads, row = kv_heads * dim, kvh = h / group;
    const int64_t *slots = a->at.slots + s * a->at.slot_stride;
    const int64_t len = a->at.lens[s], first = first_key(len, a->at.window);
    const float scale = a->at.scale, softcap = a->at.softcap;
    const float *k_cache = a->k_cache + kvh * dim, *v_cache = a->v_cache + kvh * dim;
    const float *qh = a->q + (s * heads + h) * dim;
    float peak = -INFINITY;
    for (int64_t j = first; j < len; j++) {
        const float *kj = k_cache + slots[j] * row;
        float dot = 0.0f;
        #pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < dim; i++) dot += qh[i] * kj[i];
        dot *= scale;
        if (softcap > 0.0f) dot = softcap * tanhf(dot / softcap);
        scores[j] = dot;
        peak = dot > peak ? dot : peak;
    }
    float total = 0.0f;
    for (int64_t j = first; j < len; j++) {
        scores[j] = expf(scores[j] - peak);
        total += scores[j];
    }
    float *o = a->at.out + (s * heads + h) * dim;
    for (int64_t i = 0; i < dim; i++) o[i] = 0.0f;
    for (int64_t j = first; j < len; j++) {
        const float *vj = v_cache + slots[j] * row;
        const float p = scores[j] / total;
        #pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] += p * vj[i];
    }
}

// One query per sequence over its cached keys (paged_attention_ref's decode path), every
// (sequence, head) pair a task of its own.
int spnl_paged_decode(const spnl_paged_decode_args *a) {
    const spnl_attention *at = &a->at;
    if (at->kv_heads < 1 || at->heads % at->kv_heads || at->dim < 1 || at->seqs < 0)
        return BAD_ARGUMENT;
    if (!keys_in_bounds(at)) return OUT_OF_BOUNDS;
    const int64_t seqs = at->seqs, heads = at->heads, longest = longest_len(at);
    float *scores = malloc((size_t)(seqs * heads) * (size_t)longest * sizeof(float) + 1);
    if (!scores) return NO_MEMORY;
    #pragma omp parallel for schedule(static) num_threads(at->threads) collapse(2)
    for (int64_t s = 0; s < seqs; s++)
        for (int64_t h = 0; h < heads; h++) attend(a, s, h, scores + (s * heads + h) * longest);
    free(scores);
    return 0;
}
