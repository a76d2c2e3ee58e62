// Decode attention over compressed KV: PolarQuant records (twin: attend_records in
// spnl_backend/compression/attention.py).
//
// A record (compression/polar.py) is: codes, `bits` per coordinate, each group of 8 a
// little-endian word of `bits` bytes; a float16 gain (NaN: the record is the layer's
// anchor, whose score and value the caller gives); `outliers` uint8 indices; as many
// float16 values. A coordinate is lut[code] * gain in the rotated domain. The keys'
// centre adds q . centre to every score (k_shift, per query head); the caller adds the
// values' centre after the sum (probabilities sum to one), so an anchor's value is given
// less that centre.

#include "common.h"

static void unpack_codes(const uint8_t *rec, int bits, const float *lut, float gain,
                         int64_t dim, float *out) {
    const uint64_t mask = (1u << bits) - 1;
    for (int64_t g = 0; g < dim / 8; g++) {
        uint64_t word = 0;
        memcpy(&word, rec + g * bits, (size_t)bits);
        for (int i = 0; i < 8; i++) out[g * 8 + i] = lut[(word >> (bits * i)) & mask] * gain;
    }
}

static float record_gain(const uint8_t *rec, int bits, int64_t dim) {
    return half_to_float(rec + dim * bits / 8);
}

static float outlier_dot(const uint8_t *rec, int bits, int64_t dim, int64_t outliers,
                         const float *q) {
    const uint8_t *index = rec + dim * bits / 8 + 2, *values = index + outliers;
    float dot = 0.0f;
    for (int64_t j = 0; j < outliers; j++) dot += q[index[j]] * half_to_float(values + 2 * j);
    return dot;
}


// One KV head of one sequence: its visible keys [first, len) at slots[j], and the first of
// its query heads (an index into [seqs][heads]).
typedef struct {
    const int64_t *slots;
    int64_t first, len, kvh, head;
} head_group;

// Every outlier index of every visible key record names a coordinate of the query.
static bool outliers_in_bounds(const spnl_coded_decode_args *a) {
    const spnl_attention *at = &a->at;
    const int64_t dim = at->dim, kv_heads = at->kv_heads, index = dim * a->k_bits / 8 + 2;
    for (int64_t s = 0; s < at->seqs; s++)
        for (int64_t j = 0; j < at->lens[s]; j++)
            for (int64_t h = 0; h < kv_heads; h++) {
                const int64_t slot = at->slots[s * at->slot_stride + j];
                const uint8_t *rec = a->k_pool + (slot * kv_heads + h) * a->k_bytes;
                for (int64_t o = 0; o < a->k_outliers; o++)
                    if (rec[index + o] >= dim) return false;
            }
    return true;
}

// 0, or the status of arguments that break what the kernel relies on.
static int check_args(const spnl_coded_decode_args *a) {
    const spnl_attention *at = &a->at;
    const int64_t dim = at->dim;
    if (at->kv_heads < 1 || at->heads % at->kv_heads || dim < 8 || dim % 8 || at->seqs < 0
        || dim > SPNL_MAX_HEAD_DIM)
        return BAD_ARGUMENT;
    if (a->k_bits < 1 || a->k_bits > 8 || a->v_bits < 1 || a->v_bits > 8 || a->k_outliers < 0
        || a->k_outliers > dim)  // also keeps the record size below from overflowing
        return BAD_ARGUMENT;
    if (a->k_bytes < dim * a->k_bits / 8 + 2 + 3 * a->k_outliers
        || a->v_bytes < dim * a->v_bits / 8 + 2)
        return BAD_ARGUMENT;
    if (!keys_in_bounds(at)) return OUT_OF_BOUNDS;
    if (FULL_CHECKS && !outliers_in_bounds(a)) return OUT_OF_BOUNDS;  // they index the query
    return 0;
}

// scores[g * stride + j]: query head g of the group against key j, scaled and softcapped.
// The keys are shared out among the threads, each unpacked once for the whole group.
static void score_keys(const spnl_coded_decode_args *a, const head_group *hg, float *scores,
                       int64_t stride) {
    const int64_t dim = a->at.dim, kv_heads = a->at.kv_heads, group = a->at.heads / kv_heads;
    const int64_t k_bytes = a->k_bytes, k_outliers = a->k_outliers, kvh = hg->kvh;
    const int64_t *slots = hg->slots, first = hg->first, len = hg->len;
    const int k_bits = a->k_bits;
    const float scale = a->at.scale, softcap = a->at.softcap, *k_lut = a->k_lut;
    const float *qr = a->q_rot + hg->head * dim, *qo = a->q + hg->head * dim;
    const float *k_shift = a->k_shift + hg->head, *k_anchor = a->k_anchor + hg->head;
    const uint8_t *k_pool = a->k_pool;
    #pragma omp parallel num_threads(a->at.threads)
    {
        float key[dim];
        #pragma omp for schedule(static)
        for (int64_t j = first; j < len; j++) {
            const uint8_t *rec = k_pool + (slots[j] * kv_heads + kvh) * k_bytes;
            const float gain = record_gain(rec, k_bits, dim);
            const bool anchor = isnan(gain);
            if (!anchor) unpack_codes(rec, k_bits, k_lut, gain, dim, key);
            for (int64_t g = 0; g < group; g++) {
                float dot = 0.0f;
                if (anchor) {
                    dot = k_anchor[g];
                } else {
                    #pragma omp simd reduction(+ : dot)
                    for (int64_t i = 0; i < dim; i++) dot += qr[g * dim + i] * key[i];
                    dot += outlier_dot(rec, k_bits, dim, k_outliers, qo + g * dim);
                    dot += k_shift[g];
                }
                dot *= scale;
                if (softcap > 0.0f) dot = softcap * tanhf(dot / softcap);
                scores[g * stride + j] = dot;
            }
        }
    }
}

// Each row of scores [group][stride], over [first, len), to probabilities.
static void softmax_rows(float *scores, int64_t group, int64_t stride, int64_t first,
                         int64_t len) {
    for (int64_t g = 0; g < group; g++) {
        float *row = scores + g * stride, peak = -INFINITY, total = 0.0f;
        for (int64_t j = first; j < len; j++) peak = row[j] > peak ? row[j] : peak;
        for (int64_t j = first; j < len; j++) total += row[j] = expf(row[j] - peak);
        for (int64_t j = first; j < len; j++) row[j] /= total;
    }
}

// Each thread's share of sum_j p_j * value_j, into its own [group][dim] of partial
// [threads][group][dim] (so the sum's order depends on the thread count only).
static void sum_values(const spnl_coded_decode_args *a, const head_group *hg,
                       const float *scores, int64_t stride, float *partial) {
    const int64_t dim = a->at.dim, kv_heads = a->at.kv_heads, group = a->at.heads / kv_heads;
    const int64_t v_bytes = a->v_bytes, kvh = hg->kvh;
    const int64_t *slots = hg->slots, first = hg->first, len = hg->len;
    const int v_bits = a->v_bits, threads = a->at.threads;
    const float *v_lut = a->v_lut, *v_anchor = a->v_anchor + kvh * dim;
    const uint8_t *v_pool = a->v_pool;
    memset(partial, 0, (size_t)(threads * group * dim) * sizeof(float));
    #pragma omp parallel num_threads(threads)
    {
        float value[dim];
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        float *acc = partial + me * group * dim;
        #pragma omp for schedule(static)
        for (int64_t j = first; j < len; j++) {
            const uint8_t *rec = v_pool + (slots[j] * kv_heads + kvh) * v_bytes;
            const float gain = record_gain(rec, v_bits, dim);
            const float *vj = value;
            if (isnan(gain)) vj = v_anchor;
            else unpack_codes(rec, v_bits, v_lut, gain, dim, value);
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g * stride + j];
                #pragma omp simd
                for (int64_t i = 0; i < dim; i++) acc[g * dim + i] += p * vj[i];
            }
        }
    }
}

// out[i] = the threads' partial sums [threads][size] of element i, added in thread order.
static void add_partials(const float *partial, int threads, int64_t size, float *out) {
    for (int64_t i = 0; i < size; i++) {
        float sum = 0.0f;
        for (int t = 0; t < threads; t++) sum += partial[t * size + i];
        out[i] = sum;
    }
}

// One query per sequence; out [seqs][heads][dim]: the probability-weighted sum of the value
// codes, rotated, centre not added. The KV heads of each sequence run in turn, the keys of
// each shared out among the threads.
int spnl_coded_decode(const spnl_coded_decode_args *a) {
    const int status = check_args(a);
    if (status) return status;
    const spnl_attention *at = &a->at;
    const int64_t heads = at->heads, kv_heads = at->kv_heads, dim = at->dim;
    const int64_t group = heads / kv_heads, stride = longest_len(at);
    const int threads = at->threads;
    float *scores = malloc((size_t)(group * stride) * sizeof(float) + 1);
    float *partial = calloc((size_t)(threads * group * dim), sizeof(float));
    if (!scores || !partial) { free(scores); free(partial); return NO_MEMORY; }
    for (int64_t s = 0; s < at->seqs; s++) {
        const int64_t len = at->lens[s], first = first_of(at, s);
        for (int64_t kvh = 0; kvh < kv_heads; kvh++) {
            const head_group hg = {at->slots + s * at->slot_stride, first, len, kvh,
                                   s * heads + kvh * group};
            score_keys(a, &hg, scores, stride);
            softmax_rows(scores, group, stride, first, len);
            sum_values(a, &hg, scores, stride, partial);
            add_partials(partial, threads, group * dim, at->out + hg.head * dim);
        }
    }
    free(scores);
    free(partial);
    return 0;
}
