// One (row, key-value head) task of augury's exact-rows attention, shared by attention.cpp and
// forward.cpp (see attention.cpp for what a row reads and why its order is fixed).
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace augury {

// Keys and values a task reads lie wherever their blocks are, and a decode step's weights (tens of
// megabytes) have pushed the cache's last contents out of every cache level by the time a layer reads
// them: without help each key's two lines are a miss the loop waits for (on an AVX2 EPYC, 15% of a
// demo decode step sat on those loads). So key j + KV_AHEAD's key and value rows are asked for while
// key j is scored. A hint: it changes no number and never faults.
constexpr int64_t KV_AHEAD = 16;

// A cache's element format (kv): float32, bfloat16, or fp8 e4m3 (the OCP "fn" form torch calls
// float8_e4m3fn: 4 exponent bits, bias 7, 3 mantissa bits, no infinities, S.1111.111 is NaN). Every
// format widens to float32 exactly, and from there each path runs the same float32 arithmetic.
enum : int { KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2 };

inline int kv_bytes(int kv) { return kv == KV_F32 ? 4 : kv == KV_BF16 ? 2 : 1; }

// f(std::integral_constant<int, kv>()): the key format as a template argument, for the functions
// written per format (a format tested inside a key loop cost GCC its registers: pv_pass512k, score512)
template <class F>
inline void with_kv(int kv, F &&f) {
    if (kv == KV_BF16) f(std::integral_constant<int, KV_BF16>());
    else if (kv == KV_FP8) f(std::integral_constant<int, KV_FP8>());
    else f(std::integral_constant<int, KV_F32>());
}

// fp8 e4m3 -> float32 by a 256-entry table (exact; read by gathers, the same bits on every ISA level)
struct Fp8Table {
    alignas(64) float v[256];
    Fp8Table() {
        for (int b = 0; b < 256; b++) {
            const int e = (b >> 3) & 15, m = b & 7;
            float x = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(8.0f + m, e - 10);
            if (e == 15 && m == 7) x = NAN;
            v[b] = (b & 128) ? -x : x;
        }
    }
};
inline const Fp8Table FP8_TABLE;

// 8 cache elements from element i as float32 (a bfloat16 or float32 row as load8 reads it)
inline __m256 load8kv(const void *p, int kv, int64_t i) {
    if (kv == KV_FP8) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(static_cast<const uint8_t *>(p) + i));
        return _mm256_i32gather_ps(FP8_TABLE.v, _mm256_cvtepu8_epi32(b), 4);
    }
    return load8(p, kv == KV_BF16, i);
}

inline void prefetch_kv(const void *kc, const void *vc, int kv, int64_t nkv, int64_t g, int64_t hd, int64_t slot) {
    const int bytes = static_cast<int>(hd) * kv_bytes(kv);
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

// Each head's n scores (head h's at scores + h * ld) and their maximum m[h] (NaN scores passed over), from
// lanes(j, v), which gives key j's sums v[h] (V: 8 lanes, or 16 whose halves are A and B): s_j =
// one(v[h]), four keys' at a time by four(v0, v1, v2, v3) (the same bits: hsum4, hsum4x16), the rest
// one by one; ahead(j) before keys j .. j + 3 (the AVX-512 path's prefetches, hoisted out of its keys:
// 0.93x the time at 3 heads of 64 against a prefetch in each key). The callers' lambdas are forced
// inline: GCC called the AVX-512 key as a function, its sums through memory (1.7x the time).
template <int H, class V, class Lanes, class Ahead, class Four, class One>
inline void score_keys(Lanes &&lanes, Ahead &&ahead, Four &&four, One &&one, int64_t n, int64_t ld, float *scores,
                       float *m) {
    __m128 m4[H];
#pragma GCC unroll 16
    for (int h = 0; h < H; h++) {
        m[h] = -INFINITY;
        m4[h] = _mm_set1_ps(-INFINITY);
    }
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        ahead(j);
        V v0[H], v1[H], v2[H], v3[H];
        lanes(j, v0);
        lanes(j + 1, v1);
        lanes(j + 2, v2);
        lanes(j + 3, v3);
#pragma GCC unroll 16
        for (int h = 0; h < H; h++) {
            const __m128 x = four(v0[h], v1[h], v2[h], v3[h]);
            _mm_storeu_ps(scores + h * ld + j, x);
            m4[h] = _mm_max_ps(x, m4[h]);  // maxps returns its second operand for a NaN
        }
    }
    for (; j < n; j++) {
        V v[H];
        ahead(j);
        lanes(j, v);
        for (int h = 0; h < H; h++) {
            const float x = one(v[h]);
            scores[h * ld + j] = x;
            m[h] = x > m[h] ? x : m[h];
        }
    }
    for (int h = 0; h < H; h++) {
        const float x = hmax4(m4[h]);
        m[h] = x > m[h] ? x : m[h];
    }
}

// o[h * hd + d] = (sum_j p_j v_j[d]) * inv[h] for H heads (p_j = scores[h * n + j]), each dimension's
// sum an FMA chain in key order: a dimension's bits do not depend on which lane it sits in, so the
// value rows are widened in whichever lanes are cheapest. A bfloat16 row is widened by interleaving
// zeros below each value within 128-bit blocks (one in-lane shuffle per 8 values instead of a
// cross-lane widening and a shift): the low result holds dimensions 8b .. 8b + 3 of each block b, the
// high 8b + 4 .. 8b + 7. A pass keeps its dimensions' sums in registers over all n keys; GCC kept
// them there only in a function of its own (inlined, it also stored every sum after each FMA: the
// AVX-512 variant at 8 rows on a Zen 4 EPYC, 19 cycles a key and head against 13 now).
// A pass over part of a row's keys (attend_group): PV_RESUME starts from the sums an earlier part left
// in `sums` (each H * w floats a pass of w dimensions, in the pass's register order), else from zero;
// PV_FINISH scales and writes o as the whole pass did, else the sums go back to `sums`. Stored and
// reloaded float32 sums are the same numbers, so a dimension's FMA chain over a row's keys is the same
// whether its keys come in one part or several.
enum : int { PV_RESUME = 1, PV_FINISH = 2 };

inline int pv_dim(bool bf16, int lanes, int half, int i) {  // the dimension (within its load) of lane i
    return bf16 ? 8 * (i / 4) + 4 * half + i % 4 : lanes * half + i;
}

template <int H, int KV>
__attribute__((noinline)) void pv_pass256k(const void *vc, int64_t nkv, int64_t g, int64_t hd,
                                           const int64_t *sl, int64_t n, const float *scores, int64_t ld,
                                           int64_t d0, const float *inv, float *o, float *sums, int mode) {
    __m256 acc[H][2];
    for (int h = 0; h < H; h++)
        for (int half = 0; half < 2; half++)
            acc[h][half] = mode & PV_RESUME ? _mm256_loadu_ps(sums + (2 * h + half) * 8) : _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const int64_t base = (sl[j] * nkv + g) * hd + d0;
        __m256 lo, hi;
        if (KV == KV_BF16) {
            const __m256i v =
                _mm256_loadu_si256(reinterpret_cast<const __m256i *>(static_cast<const uint16_t *>(vc) + base));
            lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
            hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
        } else if (KV == KV_FP8) {
            lo = load8kv(vc, KV, base);
            hi = load8kv(vc, KV, base + 8);
        } else {
            lo = _mm256_loadu_ps(static_cast<const float *>(vc) + base);
            hi = _mm256_loadu_ps(static_cast<const float *>(vc) + base + 8);
        }
        for (int h = 0; h < H; h++) {
            const __m256 p = _mm256_set1_ps(scores[h * ld + j]);
            acc[h][0] = _mm256_fmadd_ps(p, lo, acc[h][0]);
            acc[h][1] = _mm256_fmadd_ps(p, hi, acc[h][1]);
        }
    }
    if (!(mode & PV_FINISH)) {
        for (int h = 0; h < H; h++)
            for (int half = 0; half < 2; half++) _mm256_storeu_ps(sums + (2 * h + half) * 8, acc[h][half]);
        return;
    }
    for (int h = 0; h < H; h++)
        for (int half = 0; half < 2; half++) {
            alignas(32) float t[8];
            _mm256_store_ps(t, _mm256_mul_ps(acc[h][half], _mm256_set1_ps(inv[h])));
            for (int i = 0; i < 8; i++) o[h * hd + d0 + pv_dim(KV == KV_BF16, 8, half, i)] = t[i];
        }
}

template <int H>
inline void pv_pass256(const void *vc, int kv, int64_t nkv, int64_t g, int64_t hd, const int64_t *sl, int64_t n,
                       const float *scores, int64_t ld, int64_t d0, const float *inv, float *o, float *sums,
                       int mode) {
    with_kv(kv, [&](auto k) {
        pv_pass256k<H, decltype(k)::value>(vc, nkv, g, hd, sl, n, scores, ld, d0, inv, o, sums, mode);
    });
}

// pv_pass256 over all hd dimensions (hd % 8 == 0), 16 at a time (one pass per 16: more sums at once
// spilled on AVX2's 16 registers, 20 vs 16.5 cycles a key and head at 8 rows), a last 8 as load8
// widens them
template <int H>
inline void pv_sums256(const void *vc, int kv, int64_t nkv, int64_t g, int64_t hd, const int64_t *sl,
                       int64_t n, const float *scores, int64_t ld, const float *inv, float *o, float *sums,
                       int mode) {
    int64_t d0 = 0;
    for (; d0 + 16 <= hd; d0 += 16)
        pv_pass256<H>(vc, kv, nkv, g, hd, sl, n, scores, ld, d0, inv, o, sums ? sums + H * d0 : nullptr, mode);
    if (d0 < hd) {  // 8 left
        float *st = sums ? sums + H * d0 : nullptr;
        __m256 acc[H];
        for (int h = 0; h < H; h++) acc[h] = mode & PV_RESUME ? _mm256_loadu_ps(st + 8 * h) : _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const __m256 v = load8kv(vc, kv, (sl[j] * nkv + g) * hd + d0);
            for (int h = 0; h < H; h++) acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(scores[h * ld + j]), v, acc[h]);
        }
        for (int h = 0; h < H; h++) {
            if (mode & PV_FINISH)
                _mm256_storeu_ps(o + h * hd + d0, _mm256_mul_ps(acc[h], _mm256_set1_ps(inv[h])));
            else
                _mm256_storeu_ps(st + 8 * h, acc[h]);
        }
    }
}

// score_keys for scores256 (qv [H][64]: H heads' scaled queries, 8 lanes a vector), a function of
// its own per key format (with the format tested per key the scores took ~1.3x the time)
template <int H, int KV>
__attribute__((noinline)) void score256(const __m256 *qv, const void *kc, const void *vc, int64_t nkv, int64_t g,
                                        int64_t hd, const int64_t *sl, int64_t n, int64_t ld, float *scores,
                                        float *m) {
    const int64_t nv = hd / 8;
    for (int64_t j = 0; j < KV_AHEAD && j < n; j++) prefetch_kv(kc, vc, KV, nkv, g, hd, sl[j]);
    // key j's A + B per head (its score is their hsum)
    auto lanes = [&](int64_t j, __m256 *v) __attribute__((always_inline)) {
        if (j + KV_AHEAD < n) prefetch_kv(kc, vc, KV, nkv, g, hd, sl[j + KV_AHEAD]);
        const int64_t base = (sl[j] * nkv + g) * hd;
        __m256 a[H], b[H];
        for (int h = 0; h < H; h++) a[h] = b[h] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nv; i += 2) {
            const __m256 k = load8kv(kc, KV, base + 8 * i);
            for (int h = 0; h < H; h++) a[h] = _mm256_fmadd_ps(qv[h * 64 + i], k, a[h]);
            if (i + 1 < nv) {
                const __m256 k1 = load8kv(kc, KV, base + 8 * i + 8);
                for (int h = 0; h < H; h++) b[h] = _mm256_fmadd_ps(qv[h * 64 + i + 1], k1, b[h]);
            }
        }
        for (int h = 0; h < H; h++) v[h] = _mm256_add_ps(a[h], b[h]);
    };
    auto four = [](__m256 a, __m256 b, __m256 c, __m256 d) __attribute__((always_inline)) {
        return hsum4(a, b, c, d);
    };
    score_keys<H, __m256>(lanes, [](int64_t) {}, four, [](__m256 v) { return hsum(v); }, n, ld, scores, m);
}

// Heads h0 .. h0 + H - 1 of row r: scores over the n keys at slots sl (head h's at scores + h * ld) and
// their maxima m
template <int H>
inline void scores256(const void *q, bool q_bf16, int64_t r, int64_t h0, int64_t g, int64_t nh, int64_t hd,
                      const void *kc, const void *vc, int kv, int64_t nkv, const int64_t *sl, int64_t n, float scale,
                      int64_t ld, float *scores, float *m) {
    const int64_t nv = hd / 8;
    __m256 qv[H][64];  // hd / 8 <= 64
    for (int h = 0; h < H; h++)
        for (int64_t i = 0; i < nv; i++)
            qv[h][i] = _mm256_mul_ps(load8(q, q_bf16, (r * nh + h0 + h) * hd + 8 * i), _mm256_set1_ps(scale));
    with_kv(kv, [&](auto k) { score256<H, decltype(k)::value>(&qv[0][0], kc, vc, nkv, g, hd, sl, n, ld, scores, m); });
}

#if defined(__AVX512F__)
inline __m512 load16(const void *p, bool bf16, int64_t i) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(static_cast<const uint16_t *>(p) + i))),
            16));
    return _mm512_loadu_ps(static_cast<const float *>(p) + i);
}

// 16 cache elements from element i as float32 (load8kv's numbers, 16 lanes)
inline __m512 load16kv(const void *p, int kv, int64_t i) {
    if (kv == KV_FP8) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(static_cast<const uint8_t *>(p) + i));
        return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(b), FP8_TABLE.v, 4);
    }
    return load16(p, kv == KV_BF16, i);
}

// pv_pass256's numbers 16 lanes at a time: C chunks of 32 dimensions (a 64-byte bfloat16 row part
// widened by the same in-lane interleave: pv_dim with 16 lanes). The key format is a template
// argument: with its test inside the key loop GCC kept every sum in memory as well, storing all
// 2 H C of them after each key (H 3, C 2 on the Zen 5 VM: the pass took 1.5x the time it takes now).
template <int H, int C, int KV>
__attribute__((noinline)) void pv_pass512k(const void *vc, int64_t nkv, int64_t g, int64_t hd,
                                          const int64_t *sl, int64_t n, const float *scores, int64_t ld,
                                          int64_t d0, const float *inv, float *o, float *sums, int mode) {
    __m512 acc[H][C][2];
#pragma GCC unroll 16
    for (int h = 0; h < H; h++)
#pragma GCC unroll 16
        for (int c = 0; c < C; c++)
            for (int half = 0; half < 2; half++)
                acc[h][c][half] = mode & PV_RESUME ? _mm512_loadu_ps(sums + ((h * C + c) * 2 + half) * 16)
                                                   : _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const int64_t base = (sl[j] * nkv + g) * hd + d0;
        __m512 pv[H];
#pragma GCC unroll 16
        for (int h = 0; h < H; h++) pv[h] = _mm512_set1_ps(scores[h * ld + j]);
#pragma GCC unroll 16
        for (int c = 0; c < C; c++) {
            __m512 lo, hi;
            if (KV == KV_BF16) {
                const __m512i v = _mm512_loadu_si512(static_cast<const uint16_t *>(vc) + base + 32 * c);
                lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), v));
                hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), v));
            } else if (KV == KV_FP8) {
                lo = load16kv(vc, KV, base + 32 * c);
                hi = load16kv(vc, KV, base + 32 * c + 16);
            } else {
                lo = _mm512_loadu_ps(static_cast<const float *>(vc) + base + 32 * c);
                hi = _mm512_loadu_ps(static_cast<const float *>(vc) + base + 32 * c + 16);
            }
#pragma GCC unroll 16
            for (int h = 0; h < H; h++) {
                acc[h][c][0] = _mm512_fmadd_ps(pv[h], lo, acc[h][c][0]);
                acc[h][c][1] = _mm512_fmadd_ps(pv[h], hi, acc[h][c][1]);
            }
        }
    }
    if (!(mode & PV_FINISH)) {
        for (int h = 0; h < H; h++)
            for (int c = 0; c < C; c++)
                for (int half = 0; half < 2; half++)
                    _mm512_storeu_ps(sums + ((h * C + c) * 2 + half) * 16, acc[h][c][half]);
        return;
    }
    for (int h = 0; h < H; h++)
        for (int c = 0; c < C; c++)
            for (int half = 0; half < 2; half++) {
                alignas(64) float t[16];
                _mm512_store_ps(t, _mm512_mul_ps(acc[h][c][half], _mm512_set1_ps(inv[h])));
                for (int i = 0; i < 16; i++) o[h * hd + d0 + 32 * c + pv_dim(KV == KV_BF16, 16, half, i)] = t[i];
            }
}

template <int H, int C>
inline void pv_pass512(const void *vc, int kv, int64_t nkv, int64_t g, int64_t hd, const int64_t *sl, int64_t n,
                       const float *scores, int64_t ld, int64_t d0, const float *inv, float *o, float *sums,
                       int mode) {
    with_kv(kv, [&](auto k) {
        pv_pass512k<H, C, decltype(k)::value>(vc, nkv, g, hd, sl, n, scores, ld, d0, inv, o,
                                              sums ? sums + H * d0 : nullptr, mode);
    });
}

// pv_pass512 over all hd dimensions (hd % 32 == 0: pv_part sends it 32, 64, 96 and 128): passes of up
// to 4 x 32 (hd 128 in one: 24 of the 32 registers)
template <int H>
inline void pv_sums512(const void *vc, int kv, int64_t nkv, int64_t g, int64_t hd, const int64_t *sl,
                       int64_t n, const float *scores, int64_t ld, const float *inv, float *o, float *sums,
                       int mode) {
    int64_t d0 = 0;
    for (; d0 + 128 <= hd; d0 += 128) pv_pass512<H, 4>(vc, kv, nkv, g, hd, sl, n, scores, ld, d0, inv, o, sums, mode);
    switch ((hd - d0) / 32) {
        case 3: pv_pass512<H, 3>(vc, kv, nkv, g, hd, sl, n, scores, ld, d0, inv, o, sums, mode); break;
        case 2: pv_pass512<H, 2>(vc, kv, nkv, g, hd, sl, n, scores, ld, d0, inv, o, sums, mode); break;
        case 1: pv_pass512<H, 1>(vc, kv, nkv, g, hd, sl, n, scores, ld, d0, inv, o, sums, mode); break;
    }
}

// [hsum(fold a), hsum(fold b), hsum(fold c), hsum(fold d)] where fold s = s's low 8 lanes + its high 8:
// the same additions as fold then hsum4, lane for lane, with the four keys side by side in one register
// (14 instructions instead of 22)
inline __m128 hsum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
    // [fold a | fold b], [fold c | fold d]
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
    // per 128-bit lane k (key k): w = fold's low 4 + its high 4
    const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
    // [w0 + w2, w1 + w3, ..], then element 0: (w0 + w2) + (w1 + w3)
    const __m512 x = _mm512_add_ps(w, _mm512_permute_ps(w, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512 y = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(first, y));
}

// score_keys for scores512 (H heads' scaled queries qz [H][NC] in 16-lane chunks; key j's A + B per
// head are the low and high halves of one 16-lane chain): a function of its own per key format, four
// keys' sums reduced side by side (hsum4x16). Before (the format tested per key, a 256-bit fold then
// hsum4) the scores took ~1.3x the time. Against a copy of score_keys' loop written out here, the
// shared one took 0.83-0.91x the time at 3-4 heads of 128 and 4 of 64 a key-value head, 1.07-1.11x at
// the demo's 3 of 64 (one thread, Zen 5 VM), where the rows bench saw no difference.
template <int H, int NC, int KV>
__attribute__((noinline)) void score512(const __m512 *qz, const void *kc, const void *vc, int64_t nkv, int64_t g,
                                        int64_t hd, const int64_t *sl, int64_t n, int64_t ld, float *scores,
                                        float *m) {
    __m512 q[H][NC];
#pragma GCC unroll 16
    for (int h = 0; h < H; h++)
#pragma GCC unroll 32
        for (int c = 0; c < NC; c++) q[h][c] = qz[h * NC + c];
    for (int64_t j = 0; j < KV_AHEAD && j < n; j++) prefetch_kv(kc, vc, KV, nkv, g, hd, sl[j]);
    auto ahead = [&](int64_t j) __attribute__((always_inline)) {  // keys j + KV_AHEAD .. + 3, those there are
        if (j + KV_AHEAD + 4 <= n)
            for (int u = 0; u < 4; u++) prefetch_kv(kc, vc, KV, nkv, g, hd, sl[j + KV_AHEAD + u]);
        else
            for (int u = 0; u < 4; u++)
                if (j + KV_AHEAD + u < n) prefetch_kv(kc, vc, KV, nkv, g, hd, sl[j + KV_AHEAD + u]);
    };
    auto key = [&](int64_t j, __m512 *s) __attribute__((always_inline)) {
        const int64_t base = (sl[j] * nkv + g) * hd;
#pragma GCC unroll 16
        for (int h = 0; h < H; h++) s[h] = _mm512_setzero_ps();
#pragma GCC unroll 32
        for (int c = 0; c < NC; c++) {
            const __m512 k = load16kv(kc, KV, base + 16 * c);
#pragma GCC unroll 16
            for (int h = 0; h < H; h++) s[h] = _mm512_fmadd_ps(q[h][c], k, s[h]);
        }
    };
    auto one = [](__m512 v) __attribute__((always_inline)) {  // fold (A + B), then hsum
        const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
        return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
    };
    auto four = [](__m512 a, __m512 b, __m512 c, __m512 d) __attribute__((always_inline)) {
        return hsum4x16(a, b, c, d);
    };
    score_keys<H, __m512>(key, ahead, four, one, n, ld, scores, m);
}

// scores256's numbers for hd % 16 == 0, 16 lanes at a time; NC = hd / 16
template <int H, int NC>
inline void scores512(const void *q, bool q_bf16, int64_t r, int64_t h0, int64_t g, int64_t nh, int64_t hd,
                      const void *kc, const void *vc, int kv, int64_t nkv, const int64_t *sl, int64_t n, float scale,
                      int64_t ld, float *scores, float *m) {
    __m512 qz[H * NC];
    for (int h = 0; h < H; h++)
        for (int64_t c = 0; c < NC; c++)
            qz[h * NC + c] = _mm512_mul_ps(load16(q, q_bf16, (r * nh + h0 + h) * hd + 16 * c), _mm512_set1_ps(scale));
    with_kv(kv, [&](auto k) { score512<H, NC, decltype(k)::value>(qz, kc, vc, nkv, g, hd, sl, n, ld, scores, m); });
}

#endif

// A head group's scores (scores512 where the AVX-512 path takes the head size, else scores256) and its
// weighted sums (pv_sums512 or pv_sums256 to match): the one place the head size picks the path
template <int H>
inline void score_part(const void *q, bool q_bf16, int64_t r, int64_t h0, int64_t g, int64_t nh, int64_t hd,
                       const void *kc, const void *vc, int kv, int64_t nkv, const int64_t *sl, int64_t n, float scale,
                       int64_t ld, float *scores, float *m) {
#if defined(__AVX512F__)
    if (hd == 64) return scores512<H, 4>(q, q_bf16, r, h0, g, nh, hd, kc, vc, kv, nkv, sl, n, scale, ld, scores, m);
    if (hd == 128) return scores512<H, 8>(q, q_bf16, r, h0, g, nh, hd, kc, vc, kv, nkv, sl, n, scale, ld, scores, m);
    if (hd == 32) return scores512<H, 2>(q, q_bf16, r, h0, g, nh, hd, kc, vc, kv, nkv, sl, n, scale, ld, scores, m);
    if (hd == 96) return scores512<H, 6>(q, q_bf16, r, h0, g, nh, hd, kc, vc, kv, nkv, sl, n, scale, ld, scores, m);
#endif
    scores256<H>(q, q_bf16, r, h0, g, nh, hd, kc, vc, kv, nkv, sl, n, scale, ld, scores, m);
}

template <int H>
inline void pv_part(const void *vc, int kv, int64_t nkv, int64_t g, int64_t hd, const int64_t *sl, int64_t n,
                    const float *scores, int64_t ld, const float *inv, float *o, float *sums, int mode) {
#if defined(__AVX512F__)
    if (hd == 64 || hd == 128 || hd == 32 || hd == 96)
        return pv_sums512<H>(vc, kv, nkv, g, hd, sl, n, scores, ld, inv, o, sums, mode);
#endif
    pv_sums256<H>(vc, kv, nkv, g, hd, sl, n, scores, ld, inv, o, sums, mode);
}

// Query heads h0 .. h0 + H - 1 (one key-value head's) of row r over the first n of slots sl: each key
// and value is loaded once for the H heads. Per head, in this fixed order on every ISA level: q scaled
// (q * scale per element); each score s_j = hsum(A + B), where A and B are 8-lane FMA chains over the
// dimensions in order, A over 16 c .. 16 c + 7 and B over 16 c + 8 .. 16 c + 15 (c = 0, 1, ...); m =
// max_j s_j; softmax_inplace; o = (sum_j p_j v_j, per dimension in key order) * (1 / l). The AVX-512
// variant holds A and B in one register's halves (the same operations lane for lane).
template <int H>
inline void attend_heads(const void *q, bool q_bf16, int64_t r, int64_t h0, int64_t g, int64_t nh, int64_t hd,
                         const void *kc, const void *vc, int kv, int64_t nkv, const int64_t *sl, int64_t n,
                         float scale, void *out, bool out_bf16, float *scores /* [H, n] */) {
    float m[H];
    score_part<H>(q, q_bf16, r, h0, g, nh, hd, kc, vc, kv, nkv, sl, n, scale, n, scores, m);
    float inv[H];
    for (int h = 0; h < H; h++) inv[h] = softmax_inplace(scores + h * n, n, m[h]);
    float o[H * 512];
    pv_part<H>(vc, kv, nkv, g, hd, sl, n, scores, n, inv, o, nullptr, PV_FINISH);
    for (int h = 0; h < H; h++) store_out(out, out_bf16, (r * nh + h0 + h) * hd, o + h * hd, static_cast<int>(hd));
}

// Query heads g * rep .. (g + 1) * rep - 1 of row r (q [R, nh, hd]) over the first n of slots sl,
// into out [R, nh * hd], up to 4 heads sharing each key's load; scores is the caller's scratch
// (resized here). A head's numbers do not depend on which heads share its loads.
inline void attend_task(const void *q, bool q_bf16, int64_t r, int64_t g, int64_t nh, int64_t hd, const void *kc,
                        const void *vc, int kv, int64_t nkv, const int64_t *sl, int64_t n, float scale,
                        void *out, bool out_bf16, std::vector<float> &scores) {
    const int64_t rep = nh / nkv;
    scores.resize(static_cast<size_t>(4 * n));
    for (int64_t h0 = g * rep; h0 < (g + 1) * rep; h0 += 4) {
        const int64_t left = (g + 1) * rep - h0;
        switch (left < 4 ? left : 4) {
#define AUGURY_HEADS(k) \
    case k: attend_heads<k>(q, q_bf16, r, h0, g, nh, hd, kc, vc, kv, nkv, sl, n, scale, out, out_bf16, scores.data()); break;
            AUGURY_HEADS(4) AUGURY_HEADS(3) AUGURY_HEADS(2) AUGURY_HEADS(1)
#undef AUGURY_HEADS
        }
    }
}

// One thread's scratch for attend_group
struct AttnScratch {
    std::vector<float> scores, sums, o, m, inv;
    std::vector<int64_t> off;
};

// Keys attend_group takes at once: a part's keys and values (~96 KiB of them a key-value head) stay in
// the core's L2 cache while each row of the group reads them
inline int64_t group_part(int64_t hd, int kv) {
    int64_t b = (96 * 1024) / (2 * hd * kv_bytes(kv));
    b -= b % 16;
    return b < 16 ? 16 : b;
}

// attend_heads' numbers, each row's in the same order, for rows r0 .. r1 - 1 (slots [R, W], nkeys [R])
// taken together a part of the keys at a time: every row's scores over keys j0 .. j0 + B - 1 of its own
// slots, the next part, and so on; each row's softmax; then the weighted sums the same way, each pass's
// sums carried from part to part (PV_RESUME). Rows that read the same slots (a verification's rows share
// their context; a prompt's rows their prefix) find a part's keys and values in the cache after the
// first row has read them, where row after row over all its keys read the whole context again each time
// (a chain of 3 rows after 1,500 tokens of the demo: the target's step 1.38x a decode step's time
// before, 1.22x with the same rows merely ordered by key-value head, Zen 5 EPYC, 2 threads).
// A part of keys boundary is a multiple of 4 keys, where score_keys' groups of four fall anyway.
template <int H>
inline void attend_group_heads(const void *q, bool q_bf16, int64_t r0, int64_t r1, int64_t h0, int64_t g, int64_t nh,
                               int64_t hd, const void *kc, const void *vc, int kv, int64_t nkv, const int64_t *slots,
                               int64_t W, const int32_t *nkeys, float scale, void *out, bool out_bf16,
                               AttnScratch &s) {
    const int64_t nr = r1 - r0;
    s.off.resize(static_cast<size_t>(nr + 1));
    s.off[0] = 0;
    int64_t most = 0;
    for (int64_t i = 0; i < nr; i++) {
        const int64_t n = nkeys[r0 + i];
        s.off[i + 1] = s.off[i] + H * n;
        most = n > most ? n : most;
    }
    s.scores.resize(static_cast<size_t>(s.off[nr]));
    s.m.assign(static_cast<size_t>(nr * H), -INFINITY);
    s.inv.resize(static_cast<size_t>(nr * H));
    s.sums.resize(static_cast<size_t>(nr * H * hd));
    s.o.resize(static_cast<size_t>(H * hd));
    const int64_t B = group_part(hd, kv);
    for (int64_t j0 = 0; j0 < most; j0 += B)
        for (int64_t i = 0; i < nr; i++) {
            const int64_t n = nkeys[r0 + i];
            if (j0 >= n) continue;
            float mb[H];
            score_part<H>(q, q_bf16, r0 + i, h0, g, nh, hd, kc, vc, kv, nkv, slots + (r0 + i) * W + j0,
                          n - j0 < B ? n - j0 : B, scale, n, s.scores.data() + s.off[i] + j0, mb);
            for (int h = 0; h < H; h++) {
                float &mm = s.m[i * H + h];
                mm = mb[h] > mm ? mb[h] : mm;
            }
        }
    for (int64_t i = 0; i < nr; i++) {
        const int64_t n = nkeys[r0 + i];
        for (int h = 0; h < H; h++)
            s.inv[i * H + h] = softmax_inplace(s.scores.data() + s.off[i] + h * n, n, s.m[i * H + h]);
    }
    for (int64_t j0 = 0; j0 < most; j0 += B)
        for (int64_t i = 0; i < nr; i++) {
            const int64_t n = nkeys[r0 + i];
            if (j0 >= n) continue;
            const int64_t len = n - j0 < B ? n - j0 : B;
            const int mode = (j0 ? PV_RESUME : 0) | (j0 + len == n ? PV_FINISH : 0);
            pv_part<H>(vc, kv, nkv, g, hd, slots + (r0 + i) * W + j0, len, s.scores.data() + s.off[i] + j0, n,
                       s.inv.data() + i * H, s.o.data(), s.sums.data() + i * H * hd, mode);
            if (mode & PV_FINISH)
                for (int h = 0; h < H; h++)
                    store_out(out, out_bf16, ((r0 + i) * nh + h0 + h) * hd, s.o.data() + h * hd, static_cast<int>(hd));
        }
}

// Query heads g * rep .. (g + 1) * rep - 1 of rows r0 .. r1 - 1, attend_task's numbers row for row
inline void attend_group(const void *q, bool q_bf16, int64_t r0, int64_t r1, int64_t g, int64_t nh, int64_t hd,
                         const void *kc, const void *vc, int kv, int64_t nkv, const int64_t *slots, int64_t W,
                         const int32_t *nkeys, float scale, void *out, bool out_bf16, AttnScratch &s) {
    if (r1 - r0 == 1)
        return attend_task(q, q_bf16, r0, g, nh, hd, kc, vc, kv, nkv, slots + r0 * W, nkeys[r0], scale, out,
                           out_bf16, s.scores);
    const int64_t rep = nh / nkv;
    for (int64_t h0 = g * rep; h0 < (g + 1) * rep; h0 += 4) {
        const int64_t left = (g + 1) * rep - h0;
        switch (left < 4 ? left : 4) {
#define AUGURY_HEADS(k)                                                                                        \
    case k:                                                                                                    \
        attend_group_heads<k>(q, q_bf16, r0, r1, h0, g, nh, hd, kc, vc, kv, nkv, slots, W, nkeys, scale, out, \
                              out_bf16, s);                                                                    \
        break;
            AUGURY_HEADS(4) AUGURY_HEADS(3) AUGURY_HEADS(2) AUGURY_HEADS(1)
#undef AUGURY_HEADS
        }
    }
}

// Who reads which keys: a step's (row, key-value head) pairs in the order the threads take them. Rows
// fall into groups, runs of consecutive rows whose first slot is the same (one sequence's rows, or
// sequences sharing a cached prefix); within a group the pairs go key-value head by key-value head, rows
// in order. Each pair weighs its keys plus 16 (a call's fixed cost), and thread k of n takes the
// pairs from where the running weight reaches k / n of the total: even shares of the work (a prompt's
// later rows read more keys), each a run in which a key-value head's rows mostly sit together, so a
// key is read by one thread or two, not once a row. A run's rows of one group and key-value head go to
// attend_group together, at most GROUP_ROWS at a time (its scratch stays small). Which thread takes a
// pair, and which rows share a call, changes no row's numbers. (Before: one (row, key-value head) task
// at a time, dealt out in turn; a chain of 3 rows after 1,500 tokens of the demo, the target's step
// 1.38x a decode step's time, where 1.22x with the tasks merely ordered by key-value head, Zen 5 EPYC,
// 2 threads.)
struct AttnPlan {
    static constexpr int64_t GROUP_ROWS = 16;
    int64_t R = 0, nkv = 1;
    std::vector<int64_t> starts;  // group bounds: starts[0] = 0 < ... < starts.back() = R
    std::vector<int64_t> cum;     // cum[i]: the weight of the pairs before pair i (R nkv + 1 of them)

    void build(int64_t rows, const int64_t *slots, int64_t W, const int32_t *nkeys, int64_t kv_heads) {
        R = rows, nkv = kv_heads;
        starts.clear();
        for (int64_t r = 0; r < R; r++)
            if (r == 0 || slots[r * W] != slots[(r - 1) * W]) starts.push_back(r);
        starts.push_back(R);
        cum.assign(static_cast<size_t>(R * nkv + 1), 0);
        int64_t i = 0;
        for (size_t G = 0; G + 1 < starts.size(); G++)
            for (int64_t g = 0; g < nkv; g++)
                for (int64_t r = starts[G]; r < starts[G + 1]; r++, i++) cum[i + 1] = cum[i] + nkeys[r] + 16;
    }

    // the pairs [b, e) of thread k of n
    void share(int k, int n, int64_t &b, int64_t &e) const {
        const int64_t total = cum.back();
        auto first_at = [&](int64_t w) {
            return static_cast<int64_t>(std::lower_bound(cum.begin(), cum.end() - 1, w) - cum.begin());
        };
        b = k == 0 ? 0 : first_at(total * k / n);
        e = k + 1 >= n ? R * nkv : first_at(total * (k + 1) / n);
    }

    // attend_group over pairs [b, e)
    void run(int64_t b, int64_t e, const void *q, bool q_bf16, int64_t nh, int64_t hd, const void *kc,
             const void *vc, int kv, const int64_t *slots, int64_t W, const int32_t *nkeys, float scale, void *out,
             bool out_bf16, AttnScratch &s) const {
        for (int64_t i = b; i < e;) {
            const size_t G = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), i / nkv) -
                                                 starts.begin()) - 1;
            const int64_t size = starts[G + 1] - starts[G], off = i - starts[G] * nkv;
            const int64_t g = off / size, r = starts[G] + off % size;
            int64_t len = starts[G + 1] - r;
            len = len < e - i ? len : e - i;
            len = len < GROUP_ROWS ? len : GROUP_ROWS;
            attend_group(q, q_bf16, r, r + len, g, nh, hd, kc, vc, kv, nkv, slots, W, nkeys, scale, out, out_bf16, s);
            i += len;
        }
    }
};

// waking a sleeping thread costs tens of microseconds: split the tasks only past a few thousand scores
inline bool attention_parallel(int64_t R, int64_t nh, int64_t nkv, int64_t W) { return R * nkv > 1 && R * nh * W >= 8192; }

}  // namespace augury
