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
    // x * inv * w, 8 values at a time (the scalar tail does the same two products: the same bits)
    const __m256 invv = _mm256_set1_ps(inv);
    int64_t j = 0;
    for (; j + 8 <= dim; j += 8) store8(out, out_bf16, j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + j), invv),
                                                                    load8(w, w_bf16, j)));
    for (; j < dim; j++) st(out, out_bf16, j, xr[j] * inv * ld(w, w_bf16, j));
}

// Llama's rotate-half rotation of `heads` heads of one row: out = x cos + rotate_half(x) sin, with
// cos / sin [hd] of the row's position; x and out may not overlap
inline void rope_row(const void *x, int64_t heads, int64_t hd, const void *cos, const void *sin, bool bf16,
                     void *out) {
    const int64_t half = hd / 2;
    if (half % 8 == 0) {  // 8 values at a time: x cos - x' sin, x cos + x' sin, products then a sum, as below
        for (int64_t h = 0; h < heads; h++) {
            const int64_t base = h * hd;
            for (int64_t i = 0; i < half; i += 8) {
                const __m256 a = load8(x, bf16, base + i), b = load8(x, bf16, base + i + half);
                const __m256 c0 = load8(cos, bf16, i), s0 = load8(sin, bf16, i);
                const __m256 c1 = load8(cos, bf16, i + half), s1 = load8(sin, bf16, i + half);
                store8(out, bf16, base + i, _mm256_sub_ps(_mm256_mul_ps(a, c0), _mm256_mul_ps(b, s0)));
                store8(out, bf16, base + i + half, _mm256_add_ps(_mm256_mul_ps(b, c1), _mm256_mul_ps(a, s1)));
            }
        }
        return;
    }
    for (int64_t h = 0; h < heads; h++) {
        const int64_t base = h * hd;
        for (int64_t i = 0; i < hd; i++) {
            const float rot = i < half ? -ld(x, bf16, base + i + half) : ld(x, bf16, base + i - half);
            st(out, bf16, base + i, ld(x, bf16, base + i) * ld(cos, bf16, i) + rot * ld(sin, bf16, i));
        }
    }
}

// silu(a) * b for 8 lanes: with e = e^-|a| (exp8's domain, no overflow), a / (1 + e) where a >= 0 and
// a e / (1 + e) where a < 0
inline __m256 silu_mul8(__m256 a, __m256 b) {
    const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), abs));
    const __m256 num = _mm256_blendv_ps(a, _mm256_mul_ps(a, e), _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), b);
}

// out[j] = silu(g[j]) * u[j] for one row of n values, 8 at a time (a last partial group through a
// padded buffer, the same operations per value: each value's bits do not depend on its place)
inline void silu_mul_row(const void *g, const void *u, int64_t n, bool bf16, void *out) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        store8(out, bf16, j, silu_mul8(load8(g, bf16, j), load8(u, bf16, j)));
    }
    if (j < n) {
        alignas(32) float a[8] = {0}, b[8] = {0}, y[8];
        for (int64_t k = 0; j + k < n; k++) {
            a[k] = ld(g, bf16, j + k);
            b[k] = ld(u, bf16, j + k);
        }
        _mm256_store_ps(y, silu_mul8(_mm256_load_ps(a), _mm256_load_ps(b)));
        for (int64_t k = 0; j + k < n; k++) st(out, bf16, j + k, y[k]);
    }
}

}  // namespace augury
