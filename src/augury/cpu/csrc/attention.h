// One (row, key-value head) task of augury's exact-rows attention, shared by attention.cpp and
// forward.cpp (see attention.cpp for what a row reads and why its order is fixed).
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace augury {

// e^x for 8 lanes (x <= 0 here: scores minus their maximum): x = n ln2 + r, |r| <= ln2 / 2, e^r by
// its Taylor polynomial to r^6 (relative error under 2e-7), times 2^n; below -87.3 (where float32
// runs out) 0; NaN stays NaN. The same operations on every ISA level, so the same bits.
inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(lo, x);  // NaN passes through (max returns its second operand)
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2 in two parts: exact n * hi
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    // 2^n for n in -126..0 (x >= -87.34 keeps n >= -126); NaN lanes keep p's NaN
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}

// Query heads h0 .. h0 + H - 1 (one key-value head's) of row r over the first n of slots sl: each key
// and value is loaded once for the H heads. Per head, in this fixed order: scores s_j = q . k_j (8-lane
// partial sums in dimension order, then hsum), m = max_j s_j, p_j = exp8(s_j - m), l = sum of p_j (8-lane
// partial sums in key order, then hsum, then the tail in order), o = (sum_j p_j v_j, in key order) / l.
template <int H>
inline void attend_heads(const void *q, bool q_bf16, int64_t r, int64_t h0, int64_t g, int64_t nh, int64_t hd,
                         const void *kc, const void *vc, bool kv_bf16, int64_t nkv, const int64_t *sl, int64_t n,
                         float scale, void *out, bool out_bf16, float *scores /* [H, n] */) {
    const int64_t nv = hd / 8;
    __m256 qv[H][64];  // hd / 8 <= 64
    for (int h = 0; h < H; h++)
        for (int64_t i = 0; i < nv; i++)
            qv[h][i] = _mm256_mul_ps(load8(q, q_bf16, (r * nh + h0 + h) * hd + 8 * i), _mm256_set1_ps(scale));
    float m[H];
    for (int h = 0; h < H; h++) m[h] = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        const int64_t base = (sl[j] * nkv + g) * hd;
        __m256 s[H];
        for (int h = 0; h < H; h++) s[h] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nv; i++) {
            const __m256 k = load8(kc, kv_bf16, base + 8 * i);
            for (int h = 0; h < H; h++) s[h] = _mm256_fmadd_ps(qv[h][i], k, s[h]);
        }
        for (int h = 0; h < H; h++) {
            const float x = hsum(s[h]);
            scores[h * n + j] = x;
            m[h] = x > m[h] ? x : m[h];
        }
    }
    float inv[H];
    for (int h = 0; h < H; h++) {
        float *sc = scores + h * n;
        const __m256 mv = _mm256_set1_ps(m[h]);
        __m256 l8 = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv));
            _mm256_storeu_ps(sc + j, p);
            l8 = _mm256_add_ps(l8, p);
        }
        float l = hsum(l8);
        if (j < n) {
            alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t e = j; e < n; e++) t[e - j] = sc[e];
            _mm256_store_ps(t, exp8(_mm256_sub_ps(_mm256_load_ps(t), mv)));
            for (int64_t e = j; e < n; e++) {
                sc[e] = t[e - j];
                l += t[e - j];
            }
        }
        inv[h] = 1.0f / l;
    }
    __m256 acc[H][64];
    for (int h = 0; h < H; h++)
        for (int64_t i = 0; i < nv; i++) acc[h][i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const int64_t base = (sl[j] * nkv + g) * hd;
        __m256 pv[H];
        for (int h = 0; h < H; h++) pv[h] = _mm256_set1_ps(scores[h * n + j]);
        for (int64_t i = 0; i < nv; i++) {
            const __m256 v = load8(vc, kv_bf16, base + 8 * i);
            for (int h = 0; h < H; h++) acc[h][i] = _mm256_fmadd_ps(pv[h], v, acc[h][i]);
        }
    }
    for (int h = 0; h < H; h++) {
        const __m256 iv = _mm256_set1_ps(inv[h]);
        const int64_t o = (r * nh + h0 + h) * hd;
        for (int64_t i = 0; i < nv; i++) {
            alignas(32) float v[8];
            _mm256_store_ps(v, _mm256_mul_ps(acc[h][i], iv));
            for (int e = 0; e < 8; e++) {
                if (out_bf16)
                    static_cast<uint16_t *>(out)[o + 8 * i + e] = f32_to_bf16(v[e]);
                else
                    static_cast<float *>(out)[o + 8 * i + e] = v[e];
            }
        }
    }
}

// Query heads g * rep .. (g + 1) * rep - 1 of row r (q [R, nh, hd]) over the first n of slots sl,
// into out [R, nh * hd], up to 4 heads sharing each key's load; scores is the caller's scratch
// (resized here). A head's numbers do not depend on which heads share its loads.
inline void attend_task(const void *q, bool q_bf16, int64_t r, int64_t g, int64_t nh, int64_t hd, const void *kc,
                        const void *vc, bool kv_bf16, int64_t nkv, const int64_t *sl, int64_t n, float scale,
                        void *out, bool out_bf16, std::vector<float> &scores) {
    const int64_t rep = nh / nkv;
    scores.resize(static_cast<size_t>(4 * n));
    for (int64_t h0 = g * rep; h0 < (g + 1) * rep; h0 += 4) {
        const int64_t left = (g + 1) * rep - h0;
        switch (left < 4 ? left : 4) {
#define AUGURY_HEADS(k) \
    case k: attend_heads<k>(q, q_bf16, r, h0, g, nh, hd, kc, vc, kv_bf16, nkv, sl, n, scale, out, out_bf16, scores.data()); break;
            AUGURY_HEADS(4) AUGURY_HEADS(3) AUGURY_HEADS(2) AUGURY_HEADS(1)
#undef AUGURY_HEADS
        }
    }
}

// waking a sleeping thread costs tens of microseconds: split the tasks only past a few thousand scores
inline bool attention_parallel(int64_t R, int64_t nh, int64_t nkv, int64_t W) { return R * nkv > 1 && R * nh * W >= 8192; }

}  // namespace augury
