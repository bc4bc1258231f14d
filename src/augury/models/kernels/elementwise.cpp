// augury's CPU kernels for small per-row operations of a layer (models/layers.py), where torch's
// several operators per call cost more than the arithmetic at decode sizes: RMSNorm of the float32
// residual stream and the rotary embedding. Each computes in float32 and rounds its output once;
// every row on its own, in one fixed order (threads split rows past 64), so rows are batch-invariant.
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace {

inline float ld(const void *p, bool bf16, int64_t i) {
    return bf16 ? augury::bf16_to_f32(static_cast<const uint16_t *>(p)[i]) : static_cast<const float *>(p)[i];
}

inline void st(void *p, bool bf16, int64_t i, float f) {
    if (bf16)
        static_cast<uint16_t *>(p)[i] = augury::f32_to_bf16(f);
    else
        static_cast<float *>(p)[i] = f;
}

}  // namespace

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w; x float32 [rows, dim]; w, out bfloat16 (1) or float32 (0)
extern "C" void augury_rmsnorm(const float *x, int64_t rows, int64_t dim, const void *w, int w_bf16, float eps,
                               void *out, int out_bf16, int nthreads) {
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static) if (rows > 64)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        float ss = _mm_cvtss_f32(s);
        for (; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
        for (int64_t j = 0; j < dim; j++) st(out, out_bf16, r * dim + j, xr[j] * inv * ld(w, w_bf16, j));
    }
}

// x [rows, heads, hd] (rows = batch * queries), cos / sin [rows, hd]: Llama's rotate-half rotation,
// out = x cos + rotate_half(x) sin; all bfloat16 (1) or float32 (0) alike
extern "C" void augury_rope(const void *x, int64_t rows, int64_t heads, int64_t hd, const void *cos,
                            const void *sin, int bf16, void *out, int nthreads) {
    const int64_t half = hd / 2;
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static) if (rows > 64)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t base = (r * heads + h) * hd;
            for (int64_t i = 0; i < hd; i++) {
                const float rot = i < half ? -ld(x, bf16, base + i + half) : ld(x, bf16, base + i - half);
                st(out, bf16, base + i, ld(x, bf16, base + i) * ld(cos, bf16, r * hd + i) + rot * ld(sin, bf16, r * hd + i));
            }
        }
}
