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
        || dim > SPNL_MAX_HEAD_DIM || at->scoring.sinks)  // sinks: the centre is added after
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

#define VALUE_CHUNK 64  // keys per partial sum of the values: fixed, whatever the threads

// What the tasks of one (sequence, KV head) share.
typedef struct {
    const spnl_coded_decode_args *a;
    const head_group *hg;
    float *scores;
    int64_t stride;
    float *partial;  // [chunks][group][dim]
} coded_call;

// Task j - first: query head g of the group against key j (unpacked once for the group),
// scaled and softcapped, into scores[g * stride + j].
static void score_key(void *ctx, int64_t task, int worker) {
    (void)worker;
    const coded_call *c = ctx;
    const spnl_coded_decode_args *a = c->a;
    const head_group *hg = c->hg;
    const int64_t dim = a->at.dim, kv_heads = a->at.kv_heads, group = a->at.heads / kv_heads;
    const int64_t j = hg->first + task, k_outliers = a->k_outliers;
    const float scale = a->at.scoring.scale, softcap = a->at.scoring.softcap;
    const float *qr = a->q_rot + hg->head * dim, *qo = a->q + hg->head * dim;
    const float *k_shift = a->k_shift + hg->head, *k_anchor = a->k_anchor + hg->head;
    const uint8_t *rec = a->k_pool + (hg->slots[j] * kv_heads + hg->kvh) * a->k_bytes;
    const float gain = record_gain(rec, a->k_bits, dim);
    const bool anchor = isnan(gain);
    float key[dim];
    if (!anchor) unpack_codes(rec, a->k_bits, a->k_lut, gain, dim, key);
    for (int64_t g = 0; g < group; g++) {
        float dot = 0.0f;
        if (anchor) {
            dot = k_anchor[g];
        } else {
            #pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < dim; i++) dot += qr[g * dim + i] * key[i];
            dot += outlier_dot(rec, a->k_bits, dim, k_outliers, qo + g * dim);
            dot += k_shift[g];
        }
        dot *= scale;
        if (softcap > 0.0f) dot = softcap * tanhf(dot / softcap);
        c->scores[g * c->stride + j] = dot;
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

// Task c: sum_j p_j * value_j over the keys of chunk c, into its own [group][dim] of the
// partials (so the sum's order never depends on the threads).
static void sum_chunk(void *ctx, int64_t chunk, int worker) {
    (void)worker;
    const coded_call *c = ctx;
    const spnl_coded_decode_args *a = c->a;
    const head_group *hg = c->hg;
    const int64_t dim = a->at.dim, kv_heads = a->at.kv_heads, group = a->at.heads / kv_heads;
    const int64_t start = hg->first + chunk * VALUE_CHUNK;
    const int64_t end = start + VALUE_CHUNK < hg->len ? start + VALUE_CHUNK : hg->len;
    const float *v_anchor = a->v_anchor + hg->kvh * dim;
    float *acc = c->partial + chunk * group * dim, value[dim];
    memset(acc, 0, (size_t)(group * dim) * sizeof(float));
    for (int64_t j = start; j < end; j++) {
        const uint8_t *rec = a->v_pool + (hg->slots[j] * kv_heads + hg->kvh) * a->v_bytes;
        const float gain = record_gain(rec, a->v_bits, dim);
        const float *vj = value;
        if (isnan(gain)) vj = v_anchor;
        else unpack_codes(rec, a->v_bits, a->v_lut, gain, dim, value);
        for (int64_t g = 0; g < group; g++) {
            const float p = c->scores[g * c->stride + j];
            #pragma omp simd
            for (int64_t i = 0; i < dim; i++) acc[g * dim + i] += p * vj[i];
        }
    }
}

// out[i] = the chunks' partial sums [chunks][size] of element i, added in chunk order.
static void add_partials(const float *partial, int64_t chunks, int64_t size, float *out) {
    for (int64_t i = 0; i < size; i++) {
        float sum = 0.0f;
        for (int64_t c = 0; c < chunks; c++) sum += partial[c * size + i];
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
    const int64_t most_chunks = (stride + VALUE_CHUNK - 1) / VALUE_CHUNK;
    float *scores = malloc((size_t)(group * stride) * sizeof(float) + 1);
    float *partial = malloc((size_t)(most_chunks * group * dim) * sizeof(float) + 1);
    if (!scores || !partial) { free(scores); free(partial); return NO_MEMORY; }
    for (int64_t s = 0; s < at->seqs; s++) {
        const int64_t len = at->lens[s], first = first_of(at, s);
        const int64_t chunks = (len - first + VALUE_CHUNK - 1) / VALUE_CHUNK;
        for (int64_t kvh = 0; kvh < kv_heads; kvh++) {
            const head_group hg = {at->slots + s * at->slot_stride, first, len, kvh,
                                   s * heads + kvh * group};
            coded_call call = {a, &hg, scores, stride, partial};
            spnl_parallel(len - first, score_key, &call, at->threads);
            softmax_rows(scores, group, stride, first, len);
            spnl_parallel(chunks, sum_chunk, &call, at->threads);
            add_partials(partial, chunks, group * dim, at->out + hg.head * dim);
        }
    }
    free(scores);
    free(partial);
    return 0;
}
