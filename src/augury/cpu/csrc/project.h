// The projections of augury's fused kernels (forward.cpp: the target's layer stack; head.cpp: an
// EAGLE-3 head's draft level): one linear of rows already rounded, on the kernel its kind names, its
// outputs handed to a store (rounded to bfloat16, added to a float32 stream, or as they are). Shared so
// that both compute the same bits for the same weights and rows.
#pragma once
#include <cstdint>

#include "bf16.h"
#include "w4a8.h"
#include "w8a8.h"

namespace augury {
namespace proj {

using augury::bf16_to_f32;
using augury::f32_to_bf16;
using namespace augury::w4a8;

// A projection's fields in a kernel's pointer table (Part's order): its kind, up to four addresses and
// its bias (0 where absent): dense bfloat16 panels (C), int4 on the w4a8
// kernel with bfloat16 (C, S, Z: offset 8) or float32 scales and zeros (offset 0: Q4_K), int8 on the
// w8a8 kernel's general form (C, S, optional Z and X: sub-scales per 16; Q8_0, Q6_K, Q5_*), int4 with
// Q4_K's own super-block scales (C, S: sc and m uint8, Z: d and dmin float16, X: Q5_K's fifth bits or 0;
// w4a8.h).
// Q6_K in six bits a code (C, S: d float16, X: sub-scales; w8a8.h's columns6). Q4_0 in its own numbers
// (C, S: d float16 per 32, no zero; w4a8.h's Half).
// A projection whose row blocks differ in kind (a Q4_K_M layer's q|k in Q4_K, v in Q6_K) is SEGMENTS:
// C points to an int64 table [count, then per segment n0, n, kind, C, S, Z, X], each segment a quantised
// kind over output columns n0 .. n0 + n - 1, all of them on the same rounded activations.
enum Kind { DENSE = 0, W4A8 = 1, W4F = 2, W8G = 3, W4K = 4, W6K = 5, SEGMENTS = 6, W40 = 7 };
enum Part { P_KIND, P_C, P_S, P_Z, P_X, P_B, PART_FIELDS };

template <class T>
inline T *at(const int64_t *row, int f) {
    return reinterpret_cast<T *>(static_cast<uintptr_t>(row[f]));
}

inline int64_t padded_groups(int64_t K) { return (K / GROUP + CHUNK - 1) / CHUNK * CHUNK; }

// a projection's output rounded to bfloat16 (+ its bias, rounded again), as nn.Linear's
inline float rounded(float v, const uint16_t *bias, int64_t n) {
    float y = bf16_to_f32(f32_to_bf16(v + 0.0f));
    if (bias) y = bf16_to_f32(f32_to_bf16(y + bf16_to_f32(bias[n])));
    return y;
}

// rounded() for 8 columns n .. n + 7, the same bits lane for lane
inline __m256 rounded8(__m256 v, const uint16_t *bias, int64_t n) {
    __m256 y = augury::bf16_round8(_mm256_add_ps(v, _mm256_setzero_ps()));
    if (bias) y = augury::bf16_round8(_mm256_add_ps(y, augury::load8(bias, true, n)));
    return y;
}

// Where a projection's outputs go: operator() one value (the dense kernel), row16 16 columns of a row
// (the w4a8 kernel), the same bits either way. ToBf16: out [., ld] bfloat16 = rounded; AddRounded:
// h [., ld] float32 += rounded; Raw: out [., ld] float32 = the sum as it is (a tensor-parallel partial).
struct ToBf16 {
    uint16_t *out;
    int64_t ld;
    const uint16_t *bias;
    void operator()(int64_t m, int64_t n, float v) const { out[m * ld + n] = f32_to_bf16(rounded(v, bias, n)); }
    void row16(int64_t m, int64_t n0, const float *v) const {
        for (int e = 0; e < 16; e += 8)
            augury::store_bf16x8(out + m * ld + n0 + e, rounded8(_mm256_loadu_ps(v + e), bias, n0 + e));
    }
};

struct AddRounded {
    float *h;
    int64_t ld;
    const uint16_t *bias;
    void operator()(int64_t m, int64_t n, float v) const { h[m * ld + n] += rounded(v, bias, n); }
    void row16(int64_t m, int64_t n0, const float *v) const {
        for (int e = 0; e < 16; e += 8) {
            float *p = h + m * ld + n0 + e;
            _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), rounded8(_mm256_loadu_ps(v + e), bias, n0 + e)));
        }
    }
};

struct Raw {
    float *out;
    int64_t ld;
    void operator()(int64_t m, int64_t n, float v) const { out[m * ld + n] = v; }
    void row16(int64_t m, int64_t n0, const float *v) const {
        for (int e = 0; e < 16; e += 8) _mm256_storeu_ps(out + m * ld + n0 + e, _mm256_loadu_ps(v + e));
    }
};

// A store writing columns n + off: one segment of a projection into the whole projection's output.
template <class Store>
struct Shifted {
    Store s;
    int64_t off;
    void operator()(int64_t m, int64_t n, float v) const { s(m, n + off, v); }
    void row16(int64_t m, int64_t n0, const float *v) const { s.row16(m, n0 + off, v); }
};

// The quantised kinds on activations already rounded (a): q points to the kind's C, S, Z, X addresses.
template <class Store>
inline void quantised(int64_t kind, const int64_t *q, int64_t T, Rounded &a, int64_t N, Store store,
                      augury::Barrier &bar) {
    switch (kind) {
        case W4A8:
            columns(a, T, at<const uint8_t>(q, 0), at<const uint16_t>(q, 1), at<const uint16_t>(q, 2), N, store, bar);
            break;
        case W4F:
            columns(a, T, at<const uint8_t>(q, 0), at<const float>(q, 1), at<const float>(q, 2), N, store, bar);
            break;
        case W4K:
            columns(a, T, at<const uint8_t>(q, 0), at<const uint8_t>(q, 1), at<const uint16_t>(q, 2), N, store, bar,
                    at<const uint8_t>(q, 3));
            break;
        case W40:
            columns(a, T, at<const uint8_t>(q, 0), at<const Half>(q, 1), static_cast<const Half *>(nullptr), N, store,
                    bar);
            break;
        case W6K:
            augury::w8a8::columns6(a, T, at<const uint8_t>(q, 0), at<const uint16_t>(q, 1), at<const int8_t>(q, 3), N,
                                   store, bar);
            break;
        default:  // W8G
            augury::w8a8::columns(a, T, at<const int8_t>(q, 0), at<const float>(q, 1), at<const float>(q, 2),
                                  at<const int8_t>(q, 3), N, store, bar);
    }
}

// One projection of the rows x [T, K] (bfloat16) whose fields start at f (Part's order), on the kernel
// its kind names (each segment's, for SEGMENTS). Worksharing loops: every thread of the region calls it.
template <class Store>
inline void project(const int64_t *p, int f, const uint16_t *x, int64_t T, Rounded &a, float *xf, int64_t N,
                    Store store, augury::Barrier &bar) {
    const int64_t kind = p[f + P_KIND];
    if (kind == DENSE) {
        augury::bf16::widen_rows(x, true, T, a.K, xf, bar);
        augury::bf16::columns(xf, T, a.K, at<const uint16_t>(p, f + P_C), N, store, bar);
        return;
    }
    round_rows(x, true, T, a, bar);
    if (kind != SEGMENTS) {
        quantised(kind, p + f + P_C, T, a, N, store, bar);
        return;
    }
    const int64_t *table = at<const int64_t>(p, f + P_C);
    for (int64_t i = 0; i < table[0]; i++) {
        const int64_t *seg = table + 1 + 7 * i;
        quantised(seg[2], seg + 3, T, a, seg[1], Shifted<Store>{store, seg[0]}, bar);
    }
}

}  // namespace proj
}  // namespace augury
