// Per-row parts of a layer shared by elementwise.cpp (one call per operator) and forward.cpp (the
// whole layer stack in one call): each computes in float32 and rounds its output once, one row at
// a time in one fixed order, so both paths give the same bits.
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>

#include "simd.h"

namespace augury {

inline float ld(const void *p, bool bf16, int64_t i) {
    return bf16 ? bf16_to_f32(static_cast<const uint16_t *>(p)[i]) : static_cast<const float *>(p)[i];
}

inline void st(void *p, bool bf16, int64_t i, float f) {
    if (bf16)
        static_cast<uint16_t *>(p)[i] = f32_to_bf16(f);
    else
        static_cast<float *>(p)[i] = f;
}

// out[j] = x[j] / sqrt(mean(x^2) + eps) * w[j] for one float32 row of dim values
inline void rmsnorm_row(const float *xr, int64_t dim, const void *w, bool w_bf16, float eps, void *out,
                        bool out_bf16) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
        const __m256 v = _mm256_loadu_ps(xr + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (; i < dim; i++) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    for (int64_t j = 0; j < dim; j++) st(out, out_bf16, j, xr[j] * inv * ld(w, w_bf16, j));
}

// Llama's rotate-half rotation of `heads` heads of one row: out = x cos + rotate_half(x) sin, with
// cos / sin [hd] of the row's position; x and out may not overlap
inline void rope_row(const void *x, int64_t heads, int64_t hd, const void *cos, const void *sin, bool bf16,
                     void *out) {
    const int64_t half = hd / 2;
    for (int64_t h = 0; h < heads; h++) {
        const int64_t base = h * hd;
        for (int64_t i = 0; i < hd; i++) {
            const float rot = i < half ? -ld(x, bf16, base + i + half) : ld(x, bf16, base + i - half);
            st(out, bf16, base + i, ld(x, bf16, base + i) * ld(cos, bf16, i) + rot * ld(sin, bf16, i));
        }
    }
}

// out[j] = silu(g[j]) * u[j] = g / (1 + exp(-g)) * u for one row of n values
inline void silu_mul_row(const void *g, const void *u, int64_t n, bool bf16, void *out) {
    for (int64_t j = 0; j < n; j++) {
        const float a = ld(g, bf16, j);
        st(out, bf16, j, a / (1.0f + std::exp(-a)) * ld(u, bf16, j));
    }
}

}  // namespace augury
