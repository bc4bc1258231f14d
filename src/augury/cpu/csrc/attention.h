// One (row, key-value head) task of augury's exact-rows attention, shared by attention.cpp and
// forward.cpp (see attention.cpp for what a row reads and why its order is fixed).
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace augury {

// Keys and values a task reads lie wherever their blocks are, and a decode step's weights (tens of
// megabytes) have pushed the cache's last contents out of every cache level by the time a layer reads
// them: without help each key's two lines are a miss the loop waits for (on an AVX2 EPYC, 15% of a
// demo decode step sat on those loads). So key j + KV_AHEAD's key and value rows are asked for while
// key j is scored. A hint: it changes no number and never faults.
constexpr int64_t KV_AHEAD = 16;

inline void prefetch_kv(const void *kc, const void *vc, bool kv_bf16, int64_t nkv, int64_t g, int64_t hd, int64_t slot) {
    const int bytes = static_cast<int>(hd) * (kv_bf16 ? 2 : 4);
    const int64_t at = (slot * nkv + g) * bytes;
    prefetch_next(static_cast<const char *>(kc) + at, bytes);
    prefetch_next(static_cast<const char *>(vc) + at, bytes);
}

// p_j = exp8(s_j - m) in place over a head's n scores, and 1 / l, l = sum_j p_j (8-lane partial sums
// in key order, then hsum, then the tail in order).
inline float softmax_inplace(float *sc, int64_t n, float m) {
    const __m256 mv = _mm256_set1_ps(m);
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
    return 1.0f / l;
}

inline void store_out(void *out, bool out_bf16, int64_t o, const float *v, int count) {
    for (int e = 0; e < count; e++) {
        if (out_bf16)
            static_cast<uint16_t *>(out)[o + e] = f32_to_bf16(v[e]);
        else
            static_cast<float *>(out)[o + e] = v[e];
    }
}

// Each head's n scores (scores [H, n]) and their maximum m[h] (NaN scores passed over), from
// lanes(j, v), which gives key j's 8-lane sums v[h]: s_j = hsum(v[h]), four keys' sums at a time
// (hsum4: the same bits), the rest one by one.
template <int H, class Lanes>
inline void score_keys(Lanes &&lanes, int64_t n, float *scores, float *m) {
    __m128 m4[H];
    for (int h = 0; h < H; h++) {
        m[h] = -INFINITY;
        m4[h] = _mm_set1_ps(-INFINITY);
    }
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        __m256 v[4][H];
        for (int u = 0; u < 4; u++) lanes(j + u, v[u]);
        for (int h = 0; h < H; h++) {
            const __m128 x = hsum4(v[0][h], v[1][h], v[2][h], v[3][h]);
            _mm_storeu_ps(scores + h * n + j, x);
            m4[h] = _mm_max_ps(x, m4[h]);  // maxps returns its second operand for a NaN
        }
    }
    for (; j < n; j++) {
        __m256 v[H];
        lanes(j, v);
        for (int h = 0; h < H; h++) {
            const float x = hsum(v[h]);
            scores[h * n + j] = x;
            m[h] = x > m[h] ? x : m[h];
        }
    }
    for (int h = 0; h < H; h++) {
        const float x = hmax4(m4[h]);
        m[h] = x > m[h] ? x : m[h];
    }
}

// Query heads h0 .. h0 + H - 1 (one key-value head's) of row r over the first n of slots sl: each key
// and value is loaded once for the H heads. Per head, in this fixed order on every ISA level: q scaled
// (q * scale per element); each score s_j = hsum(A + B), where A and B are 8-lane FMA chains over the
// dimensions in order, A over 16 c .. 16 c + 7 and B over 16 c + 8 .. 16 c + 15 (c = 0, 1, ...); m =
// max_j s_j; softmax_inplace; o = (sum_j p_j v_j, per dimension in key order) * (1 / l). The AVX-512
// variant holds A and B in one register's halves (the same operations lane for lane).
template <int H>
inline void attend_heads256(const void *q, bool q_bf16, int64_t r, int64_t h0, int64_t g, int64_t nh, int64_t hd,
                            const void *kc, const void *vc, bool kv_bf16, int64_t nkv, const int64_t *sl, int64_t n,
                            float scale, void *out, bool out_bf16, float *scores /* [H, n] */) {
    const int64_t nv = hd / 8;
    __m256 qv[H][64];  // hd / 8 <= 64
    for (int h = 0; h < H; h++)
        for (int64_t i = 0; i < nv; i++)
            qv[h][i] = _mm256_mul_ps(load8(q, q_bf16, (r * nh + h0 + h) * hd + 8 * i), _mm256_set1_ps(scale));
    for (int64_t j = 0; j < KV_AHEAD && j < n; j++) prefetch_kv(kc, vc, kv_bf16, nkv, g, hd, sl[j]);
    // key j's A + B per head (its score is their hsum)
    auto lanes = [&](int64_t j, __m256 *v) {
        if (j + KV_AHEAD < n) prefetch_kv(kc, vc, kv_bf16, nkv, g, hd, sl[j + KV_AHEAD]);
        const int64_t base = (sl[j] * nkv + g) * hd;
        __m256 a[H], b[H];
        for (int h = 0; h < H; h++) a[h] = b[h] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nv; i += 2) {
            const __m256 k = load8(kc, kv_bf16, base + 8 * i);
            for (int h = 0; h < H; h++) a[h] = _mm256_fmadd_ps(qv[h][i], k, a[h]);
            if (i + 1 < nv) {
                const __m256 k1 = load8(kc, kv_bf16, base + 8 * i + 8);
                for (int h = 0; h < H; h++) b[h] = _mm256_fmadd_ps(qv[h][i + 1], k1, b[h]);
            }
        }
        for (int h = 0; h < H; h++) v[h] = _mm256_add_ps(a[h], b[h]);
    };
    float m[H];
    score_keys<H>(lanes, n, scores, m);
    float inv[H];
    for (int h = 0; h < H; h++) inv[h] = softmax_inplace(scores + h * n, n, m[h]);
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
        for (int64_t i = 0; i < nv; i++) {
            alignas(32) float v[8];
            _mm256_store_ps(v, _mm256_mul_ps(acc[h][i], iv));
            store_out(out, out_bf16, (r * nh + h0 + h) * hd + 8 * i, v, 8);
        }
    }
}

#if defined(__AVX512F__)
inline __m512 load16(const void *p, bool bf16, int64_t i) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(static_cast<const uint16_t *>(p) + i))),
            16));
    return _mm512_loadu_ps(static_cast<const float *>(p) + i);
}

// attend_heads256's numbers for hd % 16 == 0, 16 lanes at a time; NC = hd / 16 when known (0: hd / 16)
template <int H, int NC>
inline void attend_heads512(const void *q, bool q_bf16, int64_t r, int64_t h0, int64_t g, int64_t nh, int64_t hd,
                            const void *kc, const void *vc, bool kv_bf16, int64_t nkv, const int64_t *sl, int64_t n,
                            float scale, void *out, bool out_bf16, float *scores) {
    const int64_t nc = NC ? NC : hd / 16;
    constexpr int CAP = NC ? NC : 32;  // hd <= 512
    __m512 qz[H][CAP];
    for (int h = 0; h < H; h++)
        for (int64_t c = 0; c < nc; c++)
            qz[h][c] = _mm512_mul_ps(load16(q, q_bf16, (r * nh + h0 + h) * hd + 16 * c), _mm512_set1_ps(scale));
    for (int64_t j = 0; j < KV_AHEAD && j < n; j++) prefetch_kv(kc, vc, kv_bf16, nkv, g, hd, sl[j]);
    // key j's A + B per head: the low and high halves of one 16-lane chain
    auto lanes = [&](int64_t j, __m256 *v) {
        if (j + KV_AHEAD < n) prefetch_kv(kc, vc, kv_bf16, nkv, g, hd, sl[j + KV_AHEAD]);
        const int64_t base = (sl[j] * nkv + g) * hd;
        __m512 s[H];
        for (int h = 0; h < H; h++) s[h] = _mm512_setzero_ps();
        for (int64_t c = 0; c < nc; c++) {
            const __m512 k = load16(kc, kv_bf16, base + 16 * c);
            for (int h = 0; h < H; h++) s[h] = _mm512_fmadd_ps(qz[h][c], k, s[h]);
        }
        for (int h = 0; h < H; h++)
            v[h] = _mm256_add_ps(_mm512_castps512_ps256(s[h]),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s[h]), 1)));
    };
    float m[H];
    score_keys<H>(lanes, n, scores, m);
    float inv[H];
    for (int h = 0; h < H; h++) inv[h] = softmax_inplace(scores + h * n, n, m[h]);
    __m512 acc[H][CAP];
    for (int h = 0; h < H; h++)
        for (int64_t c = 0; c < nc; c++) acc[h][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const int64_t base = (sl[j] * nkv + g) * hd;
        __m512 pv[H];
        for (int h = 0; h < H; h++) pv[h] = _mm512_set1_ps(scores[h * n + j]);
        for (int64_t c = 0; c < nc; c++) {
            const __m512 v = load16(vc, kv_bf16, base + 16 * c);
            for (int h = 0; h < H; h++) acc[h][c] = _mm512_fmadd_ps(pv[h], v, acc[h][c]);
        }
    }
    for (int h = 0; h < H; h++) {
        const __m512 iv = _mm512_set1_ps(inv[h]);
        for (int64_t c = 0; c < nc; c++) {
            alignas(64) float v[16];
            _mm512_store_ps(v, _mm512_mul_ps(acc[h][c], iv));
            store_out(out, out_bf16, (r * nh + h0 + h) * hd + 16 * c, v, 16);
        }
    }
}
#endif

template <int H>
inline void attend_heads(const void *q, bool q_bf16, int64_t r, int64_t h0, int64_t g, int64_t nh, int64_t hd,
                         const void *kc, const void *vc, bool kv_bf16, int64_t nkv, const int64_t *sl, int64_t n,
                         float scale, void *out, bool out_bf16, float *scores) {
#if defined(__AVX512F__)
    if (hd == 64) return attend_heads512<H, 4>(q, q_bf16, r, h0, g, nh, hd, kc, vc, kv_bf16, nkv, sl, n, scale, out, out_bf16, scores);
    if (hd == 128) return attend_heads512<H, 8>(q, q_bf16, r, h0, g, nh, hd, kc, vc, kv_bf16, nkv, sl, n, scale, out, out_bf16, scores);
    if (hd % 16 == 0) return attend_heads512<H, 0>(q, q_bf16, r, h0, g, nh, hd, kc, vc, kv_bf16, nkv, sl, n, scale, out, out_bf16, scores);
#endif
    attend_heads256<H>(q, q_bf16, r, h0, g, nh, hd, kc, vc, kv_bf16, nkv, sl, n, scale, out, out_bf16, scores);
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
