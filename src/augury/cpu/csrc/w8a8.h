// The w8a8 kernel's panels (see w8a8.cpp for the maths), shared by w8a8.cpp and forward.cpp: int8
// weights in panels of 16 columns, a float32 scale per column and group of 32 and, where the format has
// them, an int8 sub-scale per column and half group (16 k: GGUF's Q6_K) and a float32 zero per column
// and group (Q5_1, Q5_K; Q4_K where it shares a matrix with those):
//
//   w[n, k] = s[n, g] sub[n, k / 16] q[n, k] + z[n, g]   (sub 1 and z 0 where absent)
//
// Per column and group the integer part is exact: dot = sub_0 dot_0 + sub_1 dot_1 over the two halves
// (|sub| <= 128, |dot_h| <= 16 * 128 * 127: within int32), then acc = fma(float(dot), s dx, acc) and,
// with zeros, acc = fma(z, dx xsum, acc): the same float operations in the same order on every ISA and
// whatever the rows beside it, so rows are row-count invariant and the ISA levels agree.
#pragma once
#include <immintrin.h>
#include <cstdint>

#include "w4a8.h"

namespace augury {
namespace w8a8 {

using namespace augury::w4a8;

constexpr int W8_PANEL_BYTES = 512;  // codes per panel and group: 8 blocks of 64, byte 4 c + j of block b
                                     // = column c's weight at k = 32 g + 4 b + j
constexpr int SUB_BYTES = 32;        // sub-scales per panel and group: [half 0: 16 columns, half 1: 16 columns]
constexpr int W6_PANEL_BYTES = 384;  // Q6_K's six-bit codes per panel and group (columns6)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// one panel against R rows: out[r * 16 + c]. Without sub-scales each group's dot is (w + 128) x xq
// - 128 xsum (vpdpbusd does not saturate); with them each half's is |w| x (xq carrying w's sign), so
// no per-half activation sums are needed.
template <int R, bool SUB, bool ZERO>
inline void panel8(const int8_t *pw, const float *ps, const float *pz, const int8_t *psub, int64_t G, int64_t Gp,
                   const int8_t *xq, const float *dx, const float *xs, const int32_t *xsum, int64_t K, float *out) {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *blk = pw + g * W8_PANEL_BYTES;
        prefetch_next(blk + G * W8_PANEL_BYTES, W8_PANEL_BYTES);
        __m512i dot[R];
        if constexpr (!SUB) {
            for (int r = 0; r < R; r++) dot[r] = _mm512_setzero_si512();
            for (int b = 0; b < 8; b++) {
                const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * b), bias);  // w + 128
                for (int r = 0; r < R; r++)
                    dot[r] = _mm512_dpbusd_epi32(dot[r], u, _mm512_set1_epi32(load_i32(xq + r * K + g * GROUP + 4 * b)));
            }
            for (int r = 0; r < R; r++) dot[r] = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(xsum[r * Gp + g] * 128));
        } else {
            const __m512i zero = _mm512_setzero_si512();
            for (int half = 0; half < 2; half++) {
                __m512i ih[R];
                for (int r = 0; r < R; r++) ih[r] = _mm512_setzero_si512();
                for (int b = 4 * half; b < 4 * half + 4; b++) {
                    const __m512i w = _mm512_loadu_si512(blk + 64 * b);
                    const __m512i aw = _mm512_abs_epi8(w);  // -128 -> 0x80, read as unsigned 128
                    const __mmask64 neg = _mm512_movepi8_mask(w);
                    for (int r = 0; r < R; r++) {
                        const __m512i x = _mm512_set1_epi32(load_i32(xq + r * K + g * GROUP + 4 * b));
                        ih[r] = _mm512_dpbusd_epi32(ih[r], aw, _mm512_mask_sub_epi8(x, neg, zero, x));
                    }
                }
                const __m512i sub = _mm512_cvtepi8_epi32(
                    _mm_loadu_si128(reinterpret_cast<const __m128i *>(psub + g * SUB_BYTES + 16 * half)));
                for (int r = 0; r < R; r++) {
                    const __m512i t = _mm512_mullo_epi32(ih[r], sub);
                    dot[r] = half ? _mm512_add_epi32(dot[r], t) : t;
                }
            }
        }
        const __m512 sv = _mm512_loadu_ps(ps + g * PANEL);
        for (int r = 0; r < R; r++) {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(sv, _mm512_set1_ps(dx[r * Gp + g])),
                                     acc[r]);
            if constexpr (ZERO) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(pz + g * PANEL), _mm512_set1_ps(xs[r * Gp + g]),
                                                         acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * PANEL, acc[r]);
}

// block b (0..7) of one group's six-bit codes (columns6's layout) as bytes 0..63
inline __m512i codes6(const uint8_t *blk, int b) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), low6 = _mm512_set1_epi8(0x3f), top2 = _mm512_set1_epi8(0x30);
    if (b < 4) return _mm512_and_si512(_mm512_loadu_si512(blk + 64 * b), low6);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(blk + 64 * (b - 4)), 2), top2);
    const __m512i nib = _mm512_loadu_si512(blk + 256 + 64 * (b & 1));
    return _mm512_or_si512(hi, _mm512_and_si512(b < 6 ? nib : _mm512_srli_epi16(nib, 4), low4));
}

// Q6_K in six bits a code (panel6's layout, see the general form's comment at columns6): w = d sub (q - 32).
// Each half's dot is sum q xq - 32 (the half's sum of xq: xlo, then xsum - xlo), q read as the unsigned
// 0..63 it is stored as: one vpdpbusd a row and block, no sign moved onto each row's activations (the
// same integers as sum (q - 32) xq, exact in int32). WIDE: pc holds the codes already rebuilt, 512 bytes
// a group (block b's 64 bytes at 64 b; columns6 rebuilds a panel once for a tile's row blocks). On a Zen 4
// EPYC (2 threads, 512 x 2,048 x 8,192) the signed form took 1.7x Q8_0's time, this one without WIDE 1.3x.
template <int R, bool WIDE = false>
inline void panel6(const uint8_t *pc, const uint16_t *pd, const int8_t *psub, int64_t G, int64_t Gp,
                   const int8_t *xq, const float *dx, const int32_t *xsum, const int32_t *xlo, int64_t K, float *out) {
    constexpr int64_t STRIDE = WIDE ? 512 : W6_PANEL_BYTES;
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *blk = pc + g * STRIDE;
        if constexpr (!WIDE) prefetch_next(blk + G * STRIDE, W6_PANEL_BYTES);
        __m512i dot[R];
        for (int half = 0; half < 2; half++) {
            __m512i ih[R];
            for (int r = 0; r < R; r++) {
                const int32_t lo = xlo[r * Gp + g];
                ih[r] = _mm512_set1_epi32(-32 * (half ? xsum[r * Gp + g] - lo : lo));
            }
            for (int b = 4 * half; b < 4 * half + 4; b++) {
                const __m512i q = WIDE ? _mm512_loadu_si512(blk + 64 * b) : codes6(blk, b);  // 0..63
                for (int r = 0; r < R; r++)
                    ih[r] = _mm512_dpbusd_epi32(ih[r], q, _mm512_set1_epi32(load_i32(xq + r * K + g * GROUP + 4 * b)));
            }
            const __m512i sub = _mm512_cvtepi8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i *>(psub + g * SUB_BYTES + 16 * half)));
            for (int r = 0; r < R; r++) {
                const __m512i t = _mm512_mullo_epi32(ih[r], sub);
                dot[r] = half ? _mm512_add_epi32(dot[r], t) : t;
            }
        }
        const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(pd + g / 8 * PANEL)));
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(sv, _mm512_set1_ps(dx[r * Gp + g])),
                                     acc[r]);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * PANEL, acc[r]);
}

// A block of 8 rows' activations packed for panel6_packed (pack8): per group PACK8_BYTES, the rows'
// four xq bytes of block b at 32 b + 4 r, then per row -32 xlo (int32, at 256), -32 (xsum - xlo) (at
// 288) and dx (float32, at 320). The panel then reads every row's operand at a constant offset from
// one pointer: with a pointer and the scalar sums per row, GCC spilled the pointers and spent more of
// the group on them than on its 64 vpdpbusd. (w4a8.h's panels of 8 rows, packed the same way, ran no
// faster: Q4_K 13.5 ms either way at 512 x 2,048 -> 8,192, 2 threads, Zen 5; the demo's int4 16-row
// step 2.91x a decode step against 2.96x.)
constexpr int64_t PACK8_BYTES = 352;

inline void pack8(const Rounded &a, int64_t m0, int64_t G, uint8_t *dst) {
    const int64_t K = a.K, Gp = a.Gp;
    for (int64_t g = 0; g < G; g++) {
        uint8_t *d = dst + g * PACK8_BYTES;
        for (int r = 0; r < 8; r++) {
            const int64_t row = m0 + r;
            for (int b = 0; b < 8; b++) std::memcpy(d + 32 * b + 4 * r, a.xq + row * K + g * GROUP + 4 * b, 4);
            const int32_t lo = a.xlo[row * Gp + g], n0 = -32 * lo, n1 = -32 * (a.xsum[row * Gp + g] - lo);
            std::memcpy(d + 256 + 4 * r, &n0, 4);
            std::memcpy(d + 288 + 4 * r, &n1, 4);
            std::memcpy(d + 320 + 4 * r, a.dx + row * Gp + g, 4);
        }
    }
}

// panel6<8, true>'s operations in its order (the same bits) from pack8's layout
inline void panel6_packed(const uint8_t *wide, const uint16_t *pd, const int8_t *psub, int64_t G,
                          const uint8_t *pk, float *out) {
    __m512 acc[8];
    for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *blk = wide + g * 512;
        const uint8_t *x = pk + g * PACK8_BYTES;
        __m512i dot[8];
        for (int half = 0; half < 2; half++) {
            __m512i ih[8];
            for (int r = 0; r < 8; r++)
                ih[r] = _mm512_set1_epi32(load_i32(reinterpret_cast<const int8_t *>(x + 256 + 32 * half + 4 * r)));
            for (int b = 4 * half; b < 4 * half + 4; b++) {
                const __m512i q = _mm512_loadu_si512(blk + 64 * b);  // 0..63
                for (int r = 0; r < 8; r++)
                    ih[r] = _mm512_dpbusd_epi32(ih[r], q,
                                                _mm512_set1_epi32(load_i32(reinterpret_cast<const int8_t *>(x + 32 * b + 4 * r))));
            }
            const __m512i sub = _mm512_cvtepi8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i *>(psub + g * SUB_BYTES + 16 * half)));
            for (int r = 0; r < 8; r++) {
                const __m512i t = _mm512_mullo_epi32(ih[r], sub);
                dot[r] = half ? _mm512_add_epi32(dot[r], t) : t;
            }
        }
        const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(pd + g / 8 * PANEL)));
        for (int r = 0; r < 8; r++) {
            float dxr;
            std::memcpy(&dxr, x + 320 + 4 * r, 4);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(sv, _mm512_set1_ps(dxr)), acc[r]);
        }
    }
    for (int r = 0; r < 8; r++) _mm512_storeu_ps(out + r * PANEL, acc[r]);
}
#define AUGURY_PACK8 1
#else
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define AUGURY_VNNI256 1
inline __m256i dpbusd8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#else
#define AUGURY_VNNI256 0
inline __m256i dpbusd8(__m256i acc, __m256i u, __m256i s) {  // |u| <= 128, |s| <= 127: pair sums fit int16
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

// one panel against R rows, a half of 8 columns at a time: out[r * 16 + c]
template <int R, bool SUB, bool ZERO>
inline void panel8(const int8_t *pw, const float *ps, const float *pz, const int8_t *psub, int64_t G, int64_t Gp,
                   const int8_t *xq, const float *dx, const float *xs, const int32_t *xsum, int64_t K, float *out) {
    for (int h = 0; h < 2; h++) {
        __m256 acc[R];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            const int8_t *blk = pw + g * W8_PANEL_BYTES + 32 * h;
            if (h == 0) prefetch_next(blk + G * W8_PANEL_BYTES, W8_PANEL_BYTES);
            __m256i dot[R];
            if constexpr (!SUB) {
                for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
#pragma GCC unroll 2  // unrolled whole, the compiler spilled the sums
                for (int b = 0; b < 8; b++) {
                    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * b));
#if AUGURY_VNNI256
                    const __m256i u = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));  // w + 128
                    for (int r = 0; r < R; r++)
                        dot[r] = dpbusd8(dot[r], u, _mm256_set1_epi32(load_i32(xq + r * K + g * GROUP + 4 * b)));
#else
                    const __m256i aw = _mm256_sign_epi8(w, w);  // |w|
                    for (int r = 0; r < R; r++) {
                        const __m256i x = _mm256_set1_epi32(load_i32(xq + r * K + g * GROUP + 4 * b));
                        dot[r] = dpbusd8(dot[r], aw, _mm256_sign_epi8(x, w));
                    }
#endif
                }
#if AUGURY_VNNI256
                for (int r = 0; r < R; r++) dot[r] = _mm256_sub_epi32(dot[r], _mm256_set1_epi32(xsum[r * Gp + g] * 128));
#endif
            } else {
                for (int half = 0; half < 2; half++) {
                    __m256i ih[R];
                    for (int r = 0; r < R; r++) ih[r] = _mm256_setzero_si256();
                    for (int b = 4 * half; b < 4 * half + 4; b++) {
                        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * b));
                        const __m256i aw = _mm256_sign_epi8(w, w);  // |w| (-128 stays 0x80: 128 unsigned)
                        for (int r = 0; r < R; r++) {
                            const __m256i x = _mm256_set1_epi32(load_i32(xq + r * K + g * GROUP + 4 * b));
                            ih[r] = dpbusd8(ih[r], aw, _mm256_sign_epi8(x, w));
                        }
                    }
                    const __m256i sub = _mm256_cvtepi8_epi32(
                        _mm_loadl_epi64(reinterpret_cast<const __m128i *>(psub + g * SUB_BYTES + 16 * half + 8 * h)));
                    for (int r = 0; r < R; r++) {
                        const __m256i t = _mm256_mullo_epi32(ih[r], sub);
                        dot[r] = half ? _mm256_add_epi32(dot[r], t) : t;
                    }
                }
            }
            const __m256 sv = _mm256_loadu_ps(ps + g * PANEL + 8 * h);
            for (int r = 0; r < R; r++) {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(sv, _mm256_set1_ps(dx[r * Gp + g])),
                                         acc[r]);
                if constexpr (ZERO)
                    acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(pz + g * PANEL + 8 * h), _mm256_set1_ps(xs[r * Gp + g]),
                                             acc[r]);
            }
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * PANEL + 8 * h, acc[r]);
    }
}

// columns 8 h .. 8 h + 7 of block b (0..7) of one group's six-bit codes (columns6's layout), bytes 0..63
inline __m256i codes6_8(const uint8_t *blk, int b, int h) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), low6 = _mm256_set1_epi8(0x3f), top2 = _mm256_set1_epi8(0x30);
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * (b & 3) + 32 * h));
    if (b < 4) return _mm256_and_si256(a, low6);
    const __m256i nib = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 256 + 64 * (b & 1) + 32 * h));
    return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 2), top2),
                           _mm256_and_si256(b < 6 ? nib : _mm256_srli_epi16(nib, 4), low4));
}

// Q6_K in six bits a code (see columns6), a half of 8 columns at a time: w = d sub (q - 32). As the
// AVX-512 form: each half's dot is sum q xq - 32 (xlo, or xsum - xlo), q the unsigned 0..63 stored;
// without VNNI two blocks' maddubs pair sums are added in int16 (2 x 2 x 63 x 128 < 2^15) and widened
// once. WIDE: pc holds the codes rebuilt (512 bytes a group, columns6).
template <int R, bool WIDE = false>
inline void panel6(const uint8_t *pc, const uint16_t *pd, const int8_t *psub, int64_t G, int64_t Gp,
                   const int8_t *xq, const float *dx, const int32_t *xsum, const int32_t *xlo, int64_t K, float *out) {
    constexpr int64_t STRIDE = WIDE ? 512 : W6_PANEL_BYTES;
    for (int h = 0; h < 2; h++) {
        __m256 acc[R];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *blk = pc + g * STRIDE;
            if (!WIDE && h == 0) prefetch_next(blk + G * STRIDE, W6_PANEL_BYTES);
            __m256i dot[R];
            for (int half = 0; half < 2; half++) {
                __m256i ih[R];
                for (int r = 0; r < R; r++) {
                    const int32_t lo = xlo[r * Gp + g];
                    ih[r] = _mm256_set1_epi32(-32 * (half ? xsum[r * Gp + g] - lo : lo));
                }
                for (int b = 4 * half; b < 4 * half + 4; b += 2) {
                    const __m256i q0 = WIDE ? _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * b + 32 * h))
                                            : codes6_8(blk, b, h);
                    const __m256i q1 = WIDE ? _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * b + 64 + 32 * h))
                                            : codes6_8(blk, b + 1, h);
                    for (int r = 0; r < R; r++) {
                        const int8_t *xr = xq + r * K + g * GROUP + 4 * b;
                        const __m256i x0 = _mm256_set1_epi32(load_i32(xr)), x1 = _mm256_set1_epi32(load_i32(xr + 4));
#if AUGURY_VNNI256
                        ih[r] = dpbusd8(dpbusd8(ih[r], q0, x0), q1, x1);
#else
                        const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(q0, x0), _mm256_maddubs_epi16(q1, x1));
                        ih[r] = _mm256_add_epi32(ih[r], _mm256_madd_epi16(t, _mm256_set1_epi16(1)));
#endif
                    }
                }
                const __m256i sub = _mm256_cvtepi8_epi32(
                    _mm_loadl_epi64(reinterpret_cast<const __m128i *>(psub + g * SUB_BYTES + 16 * half + 8 * h)));
                for (int r = 0; r < R; r++) {
                    const __m256i t = _mm256_mullo_epi32(ih[r], sub);
                    dot[r] = half ? _mm256_add_epi32(dot[r], t) : t;
                }
            }
            const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(pd + g / 8 * PANEL + 8 * h)));
            for (int r = 0; r < R; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(sv, _mm256_set1_ps(dx[r * Gp + g])),
                                         acc[r]);
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * PANEL + 8 * h, acc[r]);
    }
}
#undef AUGURY_VNNI256
#endif

// One panel p's 16 columns for rows m0 .. m0 + r - 1 into out (r <= ROW_BLOCK_MAX), the variant
// the format needs.
template <bool SUB, bool ZERO>
inline void panel_rows(int r, const int8_t *pw, const float *ps, const float *pz, const int8_t *psub, int64_t G,
                       int64_t Gp, const int8_t *xq, const float *dx, const float *xs, const int32_t *xsum, int64_t K,
                       float *out) {
    switch (r) {
#define AUGURY_ROWS(n) \
    case n: panel8<n, SUB, ZERO>(pw, ps, pz, psub, G, Gp, xq, dx, xs, xsum, K, out); break;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        AUGURY_ROWS(8) AUGURY_ROWS(7)
#endif
        AUGURY_ROWS(6) AUGURY_ROWS(5) AUGURY_ROWS(4) AUGURY_ROWS(3) AUGURY_ROWS(2) AUGURY_ROWS(1)
#undef AUGURY_ROWS
    }
}

// y[m, n] for every row and column of a matrix of full panels (N a multiple of 16): store.row16(m, n0, v)
// receives y[m, n0 .. n0 + 15] in float32 (no bias added). z and sub may be null (no zeros, sub-scales 1).
// Threads split the panels; rows go by in register blocks (block_rows), ROW_TILE rows at a time.
template <bool SUB, bool ZERO, class Store>
inline void columns_as(const Rounded &a, int64_t M, const int8_t *codes, const float *s, const float *z,
                       const int8_t *sub, int64_t N, Store store, augury::Barrier &bar) {
    const int64_t K = a.K, Gp = a.Gp, G = K / GROUP, P = N / PANEL;
    for (int64_t t0 = 0; t0 < M; t0 += ROW_TILE) {
        const int64_t t1 = t0 + ROW_TILE < M ? t0 + ROW_TILE : M;
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < P; p++) {
            const int8_t *pw = codes + p * G * W8_PANEL_BYTES, *psub = SUB ? sub + p * G * SUB_BYTES : nullptr;
            const float *ps = s + p * G * PANEL, *pz = ZERO ? z + p * G * PANEL : nullptr;
            for (int64_t m0 = t0, r; m0 < t1; m0 += r) {
                r = block_rows(t1 - m0);
                float out[ROW_BLOCK_MAX * PANEL];
                panel_rows<SUB, ZERO>(static_cast<int>(r), pw, ps, pz, psub, G, Gp, a.xq + m0 * K, a.dx + m0 * Gp,
                                      a.xs + m0 * Gp, a.xsum + m0 * Gp, K, out);
                for (int64_t i = 0; i < r; i++) store.row16(m0 + i, p * PANEL, out + i * PANEL);
            }
        }
    }
    bar.wait();
}

// GGUF's Q6_K in its own six bits a code (6.5625 bits a weight instead of the general form's 9.5):
// per panel and group 384 bytes, u = q + 32 (0..63) by the general form's blocks b = 0..7 (byte 4 c + j
// of a block: column c's code at k = 32 g + 4 b + j): 4 blocks of 64 bytes, byte 4 c + j of block a
// holding u of block a in bits 0-5 and the top two bits of block a + 4's in bits 6-7, then 2 blocks of
// 64 nibbles, block e's low nibbles the low four bits of block 4 + e's u, its high nibbles block 6 + e's.
// (Blocks 0-3 cost one AND to rebuild, 4-7 a few more.)
// d [P, G / 8, 16] float16 (one per 256 and column), sub [P, G, 32] int8 as the general form's. Each
// half's integer dot is sum (q - 32) xq = sum q xq - 32 (the half's sum of xq), exact in int32 however
// it is summed, then sub_0 dot_0 + sub_1 dot_1, then fma(float(dot), d dx, acc): the same integers and
// float operations as the general form's, the same bits. A tile of more rows than one register block
// rebuilds each panel's codes once into a buffer of the thread's (512 bytes a group: 224 KiB for
// Llama-3.1-8B's down projection, K = 14,336) and its row blocks read them from there: 512 x 2,048 x
// 8,192, 2 threads, Zen 4 EPYC, AVX-512: 33.4 ms against 39.8 rebuilding per row block (Q8_0's panels 30.4).
// one panel's six-bit codes rebuilt as bytes 0..63, 512 a group: block b's 64 bytes at 64 b
inline void rebuild6(const uint8_t *pc, int64_t G, uint8_t *wide) {
    for (int64_t g = 0; g < G; g++)
        for (int b = 0; b < 8; b++) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
            _mm512_storeu_si512(wide + g * 512 + 64 * b, codes6(pc + g * W6_PANEL_BYTES, b));
#else
            for (int h = 0; h < 2; h++)
                _mm256_storeu_si256(reinterpret_cast<__m256i *>(wide + g * 512 + 64 * b + 32 * h),
                                    codes6_8(pc + g * W6_PANEL_BYTES, b, h));
#endif
        }
}

template <class Store>
inline void columns6(const Rounded &a, int64_t M, const uint8_t *codes, const uint16_t *d, const int8_t *sub,
                     int64_t N, Store store, augury::Barrier &bar) {
    const int64_t K = a.K, Gp = a.Gp, G = K / GROUP, P = N / PANEL;
    for (int64_t t0 = 0; t0 < M; t0 += ROW_TILE) {
        const int64_t t1 = t0 + ROW_TILE < M ? t0 + ROW_TILE : M;
        // a tile of more than one row block rebuilds each panel's codes once, into 512 bytes a group
        uint8_t *wide = t1 - t0 > ROW_BLOCK_MAX ? panel_buffer(static_cast<size_t>(G) * 512) : nullptr;
#ifdef AUGURY_PACK8
        // the tile's blocks of 8 rows packed for panel6_packed, by each thread for itself
        uint8_t *packed = wide ? pack_buffer(static_cast<size_t>((t1 - t0) / 8 * G * PACK8_BYTES)) : nullptr;
        if (packed)
            for (int64_t m0 = t0, r, i = 0; m0 < t1; m0 += r) {
                r = block_rows(t1 - m0);
                if (r == 8) pack8(a, m0, G, packed + (i++) * G * PACK8_BYTES);
            }
#endif
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < P; p++) {
            const uint8_t *pc = codes + p * G * W6_PANEL_BYTES;
            const uint16_t *pd = d + p * (G / 8) * PANEL;
            const int8_t *psub = sub + p * G * SUB_BYTES;
            if (wide) rebuild6(pc, G, wide);
            for (int64_t m0 = t0, r, i = 0; m0 < t1; m0 += r) {
                r = block_rows(t1 - m0);
                float out[ROW_BLOCK_MAX * PANEL];
                const int8_t *xr = a.xq + m0 * K;
                const float *dr = a.dx + m0 * Gp;
                const int32_t *ir = a.xsum + m0 * Gp, *il = a.xlo + m0 * Gp;
#ifdef AUGURY_PACK8
                if (wide && packed && r == 8) {
                    panel6_packed(wide, pd, psub, G, packed + (i++) * G * PACK8_BYTES, out);
                    for (int64_t j = 0; j < r; j++) store.row16(m0 + j, p * PANEL, out + j * PANEL);
                    continue;
                }
#endif
                if (wide) {
                    switch (r) {
#define AUGURY_ROWS(n) \
    case n: panel6<n, true>(wide, pd, psub, G, Gp, xr, dr, ir, il, K, out); break;
#if defined(__AVX512F__) && defined(__AVX512BW__)
                        AUGURY_ROWS(8) AUGURY_ROWS(7)
#endif
                        AUGURY_ROWS(6) AUGURY_ROWS(5) AUGURY_ROWS(4) AUGURY_ROWS(3) AUGURY_ROWS(2) AUGURY_ROWS(1)
#undef AUGURY_ROWS
                    }
                    for (int64_t i = 0; i < r; i++) store.row16(m0 + i, p * PANEL, out + i * PANEL);
                    continue;
                }
                switch (r) {
#define AUGURY_ROWS(n) \
    case n: panel6<n>(pc, pd, psub, G, Gp, xr, dr, ir, il, K, out); break;
#if defined(__AVX512F__) && defined(__AVX512BW__)
                    AUGURY_ROWS(8) AUGURY_ROWS(7)
#endif
                    AUGURY_ROWS(6) AUGURY_ROWS(5) AUGURY_ROWS(4) AUGURY_ROWS(3) AUGURY_ROWS(2) AUGURY_ROWS(1)
#undef AUGURY_ROWS
                }
                for (int64_t i = 0; i < r; i++) store.row16(m0 + i, p * PANEL, out + i * PANEL);
            }
        }
    }
    bar.wait();
}

template <class Store>
inline void columns(const Rounded &a, int64_t M, const int8_t *codes, const float *s, const float *z,
                    const int8_t *sub, int64_t N, Store store, augury::Barrier &bar) {
    if (sub && z)
        columns_as<true, true>(a, M, codes, s, z, sub, N, store, bar);
    else if (sub)
        columns_as<true, false>(a, M, codes, s, z, sub, N, store, bar);
    else if (z)
        columns_as<false, true>(a, M, codes, s, z, sub, N, store, bar);
    else
        columns_as<false, false>(a, M, codes, s, z, sub, N, store, bar);
}

}  // namespace w8a8
}  // namespace augury
