// The w4a8 kernel's parts (see w4a8.cpp for the maths), shared by w4a8.cpp and forward.cpp.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "simd.h"

namespace augury {
namespace w4a8 {



constexpr int GROUP = 32;
constexpr int CHUNK = 8;      // groups reduced together (one float lane each)
constexpr int ROW_TILE = 64;  // rows whose int8 activations stay in cache while the columns stream

inline __m256 load_bf16x8(const uint16_t *p) { return load8(p, true, 0); }

// one row: xq [K] int8, dx [Gp] scales, xsum [Gp] the group's sum of xq, xs = dx * xsum; padding groups zero.
// A group holding a NaN or an infinity gets dx = xs = NaN (and codes 0), so every output of the row is
// NaN: maxps drops NaNs and the int8 conversion would turn them into finite codes, a plausible token.
inline void quantize_row(const void *x, bool bf16, int64_t K, int64_t Gp, int8_t *xq, float *dx, float *xs,
                  int32_t *xsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const int64_t G = K / GROUP;
    for (int64_t g = 0; g < G; g++) {
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = load8(x, bf16, g * GROUP + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        }
        __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        a = _mm_max_ps(a, _mm_movehl_ps(a, a));
        a = _mm_max_ss(a, _mm_movehdup_ps(a));
        const float m = _mm_cvtss_f32(a);
        if (_mm256_movemask_ps(nan) || !(m <= 3.40282347e38f)) {  // NaN or infinity in the group
            std::memset(xq + g * GROUP, 0, GROUP);
            dx[g] = xs[g] = __builtin_nanf("");
            xsum[g] = 0;
            continue;
        }
        const float d = m / 127.0f;
        const __m256 id = _mm256_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));  // nearest, ties to even
        __m256i s01 = _mm256_packs_epi32(q[0], q[1]);
        __m256i s23 = _mm256_packs_epi32(q[2], q[3]);
        __m256i b = _mm256_packs_epi16(s01, s23);
        // the packs interleave 128-bit lanes: dwords come out 0 4 1 5 2 6 3 7
        b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(xq + g * GROUP), b);
        __m256i s32 = _mm256_madd_epi16(_mm256_add_epi16(s01, s23), _mm256_set1_epi16(1));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        const int32_t sum = _mm_cvtsi128_si32(t);
        dx[g] = d;
        xsum[g] = sum;
        xs[g] = d * static_cast<float>(sum);
    }
    for (int64_t g = G; g < Gp; g++) {
        dx[g] = xs[g] = 0.0f;
        xsum[g] = 0;
    }
}

// 8 groups' int32 dot products, 8 lanes each -> one lane per group (lane j = group j)
inline __m256i reduce8(const __m256i p[8]) {
    __m256i h01 = _mm256_hadd_epi32(p[0], p[1]);
    __m256i h23 = _mm256_hadd_epi32(p[2], p[3]);
    __m256i h45 = _mm256_hadd_epi32(p[4], p[5]);
    __m256i h67 = _mm256_hadd_epi32(p[6], p[7]);
    __m256i h0123 = _mm256_hadd_epi32(h01, h23);  // low half: groups 0-3 over k 0-15 of each; high: k 16-31
    __m256i h4567 = _mm256_hadd_epi32(h45, h67);
    __m256i lo = _mm256_permute2x128_si256(h0123, h4567, 0x20);
    __m256i hi = _mm256_permute2x128_si256(h0123, h4567, 0x31);
    return _mm256_add_epi32(lo, hi);
}

// one chunk of 8 groups from group c (NJ of them with codes; the rest of the chunk is padding) against
// R rows (rows r * K of xq, r * Gp of dx / xsum): acc[r] += per group dx s sum_j (q - 8) xq
template <int R, int NJ>
inline void chunk(const uint8_t *codes, __m256 sv, int64_t c, int64_t Gp, const int8_t *xq, const float *dx,
                  const int32_t *xsum, int64_t K, __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    alignas(32) uint8_t wb[CHUNK * GROUP];  // the chunk's codes unpacked, one byte each, shared by the rows
    for (int j = 0; j < NJ; j++) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(codes + (c + j) * 16));
        _mm256_store_si256(reinterpret_cast<__m256i *>(wb + j * GROUP),
                           _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4));
    }
    for (int r = 0; r < R; r++) {
        const int8_t *xr = xq + r * K + c * GROUP;
        __m256i p[CHUNK];
        for (int j = 0; j < CHUNK; j++) {
            if (j < NJ) {
                const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i *>(wb + j * GROUP));
                const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xr + j * GROUP));
                p[j] = augury::dot_u8s8(w, x);  // |15 * 127 * 2| < 2^15
            } else {
                p[j] = _mm256_setzero_si256();
            }
        }
        // sum_j (q - 8) xq exactly in integers, then one rounding to float
        const __m256i xsum8 =
            _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(xsum + r * Gp + c)), 3);
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_sub_epi32(reduce8(p), xsum8));
        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(_mm256_loadu_ps(dx + r * Gp + c), sv), acc[r]);
    }
}

// column n against R rows; out[r] = y without bias. Groups past G (the tail of the last chunk) have
// no codes; their s, z, dx, xs and xsum are zero, so they add exactly nothing.
template <int R>
inline void column(const uint8_t *codes, const uint16_t *s, const uint16_t *z, int64_t G, int64_t Gp,
                   const int8_t *xq, const float *dx, const float *xs, const int32_t *xsum, int64_t K, float *out) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + CHUNK <= G; c += CHUNK) chunk<R, CHUNK>(codes, load_bf16x8(s + c), c, Gp, xq, dx, xsum, K, acc);
    if (c < G) {
        const __m256 sv = load_bf16x8(s + c);
        switch (G - c) {
#define AUGURY_TAIL(t) \
    case t: chunk<R, t>(codes, sv, c, Gp, xq, dx, xsum, K, acc); break;
            AUGURY_TAIL(1) AUGURY_TAIL(2) AUGURY_TAIL(3) AUGURY_TAIL(4) AUGURY_TAIL(5) AUGURY_TAIL(6) AUGURY_TAIL(7)
#undef AUGURY_TAIL
        }
    }
    for (int r = 0; r < R; r++) {  // + sum_g z dx sum_j xq
        __m256 az = _mm256_setzero_ps();
        for (int64_t g = 0; g < Gp; g += CHUNK)
            az = _mm256_fmadd_ps(load_bf16x8(z + g), _mm256_loadu_ps(xs + r * Gp + g), az);
        out[r] = hsum(_mm256_add_ps(acc[r], az));
    }
}


// One matrix's activations, rounded: per row xq [K] int8, dx / xs [Gp] float32, xsum [Gp] int32.
struct Rounded {
    int8_t *xq = nullptr;
    float *dx = nullptr, *xs = nullptr;
    int32_t *xsum = nullptr;
    int64_t K = 0, Gp = 0;
};

// Rounded activations owning their memory for M rows of K (ok() false when out of memory)
struct OwnedRounded : Rounded {
    OwnedRounded(int64_t M, int64_t K_, int64_t Gp_) {
        K = K_;
        Gp = Gp_;
        xq = static_cast<int8_t *>(std::malloc(static_cast<size_t>(M * K + 1)));
        dx = static_cast<float *>(std::malloc(sizeof(float) * static_cast<size_t>(M * Gp + 1)));
        xs = static_cast<float *>(std::malloc(sizeof(float) * static_cast<size_t>(M * Gp + 1)));
        xsum = static_cast<int32_t *>(std::malloc(sizeof(int32_t) * static_cast<size_t>(M * Gp + 1)));
    }
    ~OwnedRounded() {
        std::free(xq);
        std::free(dx);
        std::free(xs);
        std::free(xsum);
    }
    OwnedRounded(const OwnedRounded &) = delete;
    OwnedRounded &operator=(const OwnedRounded &) = delete;
    bool ok() const { return xq && dx && xs && xsum; }
};

// Worksharing constructs without their own parallel region: called from inside one (the threads
// split the work and meet at the end) or from serial code (one thread does it all).
inline void round_rows(const void *x, bool bf16, int64_t M, Rounded &a) {
    const int xb = bf16 ? 2 : 4;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        quantize_row(static_cast<const char *>(x) + m * a.K * xb, bf16, a.K, a.Gp, a.xq + m * a.K, a.dx + m * a.Gp,
                     a.xs + m * a.Gp, a.xsum + m * a.Gp);
}

// y[m, n] for every row and column; store(m, n, value) receives each in float32 (no bias added).
template <class Store>
inline void columns(const Rounded &a, int64_t M, const uint8_t *codes, const uint16_t *s, const uint16_t *z,
                    int64_t N, Store store) {
    const int64_t K = a.K, Gp = a.Gp, G = K / GROUP;
    for (int64_t t0 = 0; t0 < M; t0 += ROW_TILE) {
        const int64_t t1 = t0 + ROW_TILE < M ? t0 + ROW_TILE : M;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *cn = codes + n * G * 16;
            const uint16_t *sn = s + n * Gp, *zn = z + n * Gp;
            for (int64_t m0 = t0; m0 < t1; m0 += 4) {
                const int r = t1 - m0 < 4 ? static_cast<int>(t1 - m0) : 4;
                float out[4];
                const int8_t *xr = a.xq + m0 * K;
                const float *dr = a.dx + m0 * Gp, *sr = a.xs + m0 * Gp;
                const int32_t *ir = a.xsum + m0 * Gp;
                switch (r) {
                    case 4: column<4>(cn, sn, zn, G, Gp, xr, dr, sr, ir, K, out); break;
                    case 3: column<3>(cn, sn, zn, G, Gp, xr, dr, sr, ir, K, out); break;
                    case 2: column<2>(cn, sn, zn, G, Gp, xr, dr, sr, ir, K, out); break;
                    default: column<1>(cn, sn, zn, G, Gp, xr, dr, sr, ir, K, out); break;
                }
                for (int i = 0; i < r; i++) store(m0 + i, n, out[i]);
            }
        }
    }
}

}  // namespace w4a8
}  // namespace augury
