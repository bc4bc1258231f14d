// One (row, key-value head) task of augury's exact-rows attention, shared by attention.cpp and
// forward.cpp (see attention.cpp for what a row reads and why its order is fixed).
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace augury {

// Query heads g * rep .. (g + 1) * rep - 1 of row r (q [R, nh, hd]) over the first n of slots sl,
// into out [R, nh * hd]; scores is the caller's scratch (resized here).
inline void attend_task(const void *q, bool q_bf16, int64_t r, int64_t g, int64_t nh, int64_t hd, const void *kc,
                        const void *vc, bool kv_bf16, int64_t nkv, const int64_t *sl, int64_t n, float scale,
                        void *out, bool out_bf16, std::vector<float> &scores) {
    const int64_t rep = nh / nkv, nv = hd / 8;
    __m256 qv[64], acc[64];  // hd / 8 <= 64
    scores.resize(static_cast<size_t>(n));
    for (int64_t h = g * rep; h < (g + 1) * rep; h++) {
        for (int64_t i = 0; i < nv; i++)
            qv[i] = _mm256_mul_ps(load8(q, q_bf16, (r * nh + h) * hd + 8 * i), _mm256_set1_ps(scale));
        float m = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            const int64_t base = (sl[j] * nkv + g) * hd;
            __m256 s = _mm256_setzero_ps();
            for (int64_t i = 0; i < nv; i++) s = _mm256_fmadd_ps(qv[i], load8(kc, kv_bf16, base + 8 * i), s);
            const float x = hsum(s);
            scores[j] = x;
            m = x > m ? x : m;
        }
        float l = 0.0f;
        for (int64_t i = 0; i < nv; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const float p = std::exp(scores[j] - m);
            l += p;
            const __m256 pv = _mm256_set1_ps(p);
            const int64_t base = (sl[j] * nkv + g) * hd;
            for (int64_t i = 0; i < nv; i++) acc[i] = _mm256_fmadd_ps(pv, load8(vc, kv_bf16, base + 8 * i), acc[i]);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / l);
        const int64_t o = (r * nh + h) * hd;
        for (int64_t i = 0; i < nv; i++) {
            alignas(32) float v[8];
            _mm256_store_ps(v, _mm256_mul_ps(acc[i], inv));
            for (int e = 0; e < 8; e++) {
                if (out_bf16)
                    static_cast<uint16_t *>(out)[o + 8 * i + e] = f32_to_bf16(v[e]);
                else
                    static_cast<float *>(out)[o + 8 * i + e] = v[e];
            }
        }
    }
}

// waking a sleeping thread costs tens of microseconds: split the tasks only past a few thousand scores
inline bool attention_parallel(int64_t R, int64_t nh, int64_t nkv, int64_t W) { return R * nkv > 1 && R * nh * W >= 8192; }

}  // namespace augury
