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

// q . k over dim floats: 16 lanes at a time in one chain, then the lanes, then the tail. The
// same order for every query, whatever else the call attends.
static inline float dot(const float *q, const float *k, int64_t dim) {
    v16f acc = {0};
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16) acc = fma16(load_f32(q + i), load_f32(k + i), acc);
    float sum = hsum(acc);
    for (; i < dim; i++) sum += q[i] * k[i];
    return sum;
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

// scores[j] = e^(scores[j] - peak) for first <= j < len; returns their sum, in key order.
static float exponentiate(float *scores, int64_t first, int64_t len, float peak) {
    int64_t j = first;
    for (; j + 16 <= len; j += 16) {
        const v16f e = exp16(load_f32(scores + j) - splat(peak));
        memcpy(scores + j, &e, sizeof e);
    }
    for (; j < len; j++) {  // the tail through the same vector code
        float lane[16] = {0};
        lane[0] = scores[j] - peak;
        const v16f e = exp16(load_f32(lane));
        scores[j] = e[0];
    }
    float total = 0.0f;
    for (j = first; j < len; j++) total += scores[j];
    return total;
}

// The query heads of sequence s that share KV head kvh, over its visible keys: out = softmax(
// scores) . values with scores[j] = q . k_j * scale (softcapped where asked). Each key and
// value is read once for the whole group; each head's arithmetic is the same whatever the
// other heads, queries or sequences of the call, so a query attends alike alone or batched.
// scratch: group * stride scores, then group inverse totals.
static void attend(const spnl_paged_decode_args *a, int64_t s, int64_t kvh, float *scratch,
                   int64_t stride) {
    const int64_t heads = a->at.heads, kv_heads = a->at.kv_heads, dim = a->at.dim;
    const int64_t group = heads / kv_heads, row = kv_heads * dim;
    const int64_t *slots = a->at.slots + s * a->at.slot_stride;
    const int64_t len = a->at.lens[s], first = first_key(len, a->at.window);
    const float scale = a->at.scale, softcap = a->at.softcap;
    const float *k_cache = a->k_cache + kvh * dim, *v_cache = a->v_cache + kvh * dim;
    const float *q = a->q + (s * heads + kvh * group) * dim;
    float *out = a->at.out + (s * heads + kvh * group) * dim;
    float *scores = scratch, *inverse = scratch + group * stride;
    for (int64_t j = first; j < len; j++) {
        const float *kj = k_cache + slots[j] * row;
        for (int64_t g = 0; g < group; g++) {
            float score = dot(q + g * dim, kj, dim) * scale;
            if (softcap > 0.0f) score = softcap * tanhf(score / softcap);
            scores[g * stride + j] = score;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float peak = -INFINITY;
        for (int64_t j = first; j < len; j++)
            peak = scores[g * stride + j] > peak ? scores[g * stride + j] : peak;
        inverse[g] = 1.0f / exponentiate(scores + g * stride, first, len, peak);
    }
    for (int64_t i = 0; i < group * dim; i++) out[i] = 0.0f;
    for (int64_t j = first; j < len; j++) {
        const float *vj = v_cache + slots[j] * row;
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * stride + j] * inverse[g];
            float *o = out + g * dim;
            int64_t i = 0;
            for (; i + 16 <= dim; i += 16) {
                const v16f sum = fma16(splat(p), load_f32(vj + i), load_f32(o + i));
                memcpy(o + i, &sum, sizeof sum);
            }
            for (; i < dim; i++) o[i] += p * vj[i];
        }
    }
}

// One query per sequence over its cached keys (paged_attention_ref's decode path), every
// (sequence, KV head) pair a task of its own; each thread keeps one task's scratch.
int spnl_paged_decode(const spnl_paged_decode_args *a) {
    const spnl_attention *at = &a->at;
    if (at->heads < 1 || at->kv_heads < 1 || at->heads % at->kv_heads || at->dim < 1
        || at->seqs < 0)
        return BAD_ARGUMENT;
    if (!keys_in_bounds(at)) return OUT_OF_BOUNDS;
    const int64_t seqs = at->seqs, kv_heads = at->kv_heads, group = at->heads / kv_heads;
    const int64_t stride = longest_len(at) + 1;
    const size_t scratch_bytes = ((size_t)group * (size_t)stride + (size_t)group) * sizeof(float);
    int status = 0;
    #pragma omp parallel num_threads(at->threads)
    {
        float *scratch = malloc(scratch_bytes);
        if (!scratch) {
            #pragma omp atomic write
            status = NO_MEMORY;
        }
        // Round robin: a prompt's queries attend to more keys the later they come, so
        // halves in order would leave one thread most of the work.
        #pragma omp for schedule(static, 1) collapse(2)
        for (int64_t s = 0; s < seqs; s++)
            for (int64_t h = 0; h < kv_heads; h++)
                if (scratch) attend(a, s, h, scratch, stride);
        free(scratch);
    }
    return status;
}
