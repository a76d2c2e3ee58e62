// The element-wise operations of a layer, RMSNorm and RoPE (twins: rms_norm_ref and
// rotate_ref in spnl_backend/kernels/ops.py): one call each where torch runs several ops.

#include "common.h"

// out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * scale  (RMSNorm)
int spnl_rms_norm(const float *x, const float *scale, float *out, int64_t rows, int64_t dim,
                  float eps) {
    if (rows < 0 || dim < 1) return BAD_ARGUMENT;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float sum = 0.0f;
        #pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        float *o = out + r * dim;
        #pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv * scale[i];
    }
    return 0;
}

// Rotate-half RoPE in place (twin: RotaryTables.apply): for each token and head,
// x[i] = x[i] * cos[i] + x[i + half] * sin[i] and x[i + half] = x[i + half] * cos[i + half]
// + x[i] * sin[i + half], with the tables laid out as [cos, cos] and [-sin, sin].
int spnl_rope(float *x, const float *cos, const float *sin, int64_t tokens, int64_t heads,
              int64_t head_dim, int64_t rotary_dim) {
    if (rotary_dim < 2 || rotary_dim % 2 || rotary_dim > head_dim || tokens < 0 || heads < 0)
        return BAD_ARGUMENT;
    const int64_t half = rotary_dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * rotary_dim, *s = sin + t * rotary_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + (t * heads + h) * head_dim;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
    return 0;
}
