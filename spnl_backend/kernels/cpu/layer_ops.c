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

// The residual step between two sublayers: x[r] += delta[r] (normed first by delta_scale
// and delta_eps where delta_scale is given: Gemma's post-norms), then out[r] = RMSNorm of
// the new x[r] by scale and eps. x is updated in place.
int spnl_add_rms_norm(float *x, const float *delta, const float *delta_scale, float delta_eps,
                      const float *scale, float eps, float *out, int64_t rows, int64_t dim) {
    if (rows < 0 || dim < 1) return BAD_ARGUMENT;
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim;
        const float *d = delta + r * dim;
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
        norm_row(xr, scale, out + r * dim, dim, eps);
    }
    return 0;
}

// Queries and keys of one step made ready for attention, in place: each head normed by
// its scale (where one is given: per-head q/k norms) and rotated. q[t] starts at q + t *
// q_row, k[t] at k + t * k_row (both may be parts of one q/k/v product row); a token's
// heads are consecutive.
int spnl_qk_norm_rope(const spnl_qk_args *a) {
    const int64_t dim = a->head_dim, rot = a->rotary_dim;
    if (rot < 2 || rot % 2 || rot > dim || a->tokens < 0 || a->heads < 0 || a->kv_heads < 0 ||
        a->q_row < a->heads * dim || a->k_row < a->kv_heads * dim)
        return BAD_ARGUMENT;
    for (int64_t t = 0; t < a->tokens; t++) {
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
    return 0;
}
