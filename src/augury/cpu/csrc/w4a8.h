// The w4a8 kernel's parts (see w4a8.cpp for the maths), shared by w4a8.cpp and forward.cpp.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace augury {
namespace w4a8 {



constexpr int GROUP = 32;
constexpr int CHUNK = 8;      // per-group activation arrays are padded to a multiple of this
constexpr int ROW_TILE = 64;  // rows whose int8 activations stay in cache while the columns stream

inline __m256 load_bf16x8(const uint16_t *p) { return load8(p, true, 0); }

// one row: xq [K] int8, dx [Gp] scales, xsum [Gp] the group's sum of xq, xs = dx * xsum, xlo [Gp] the sum
// of the group's first 16 xq (Q6_K's sub-blocks: w8a8.h's panel6); padding groups zero.
// A group holding a NaN or an infinity gets dx = xs = NaN (and codes 0), so every output of the row is
// NaN: maxps drops NaNs and the int8 conversion would turn them into finite codes, a plausible token.
inline void quantize_row(const void *x, bool bf16, int64_t K, int64_t Gp, int8_t *xq, float *dx, float *xs,
                  int32_t *xsum, int32_t *xlo) {
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
            xsum[g] = xlo[g] = 0;
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
        // s01 holds the codes of k 0..15 (packs keeps each 128-bit lane's order: 0-3 8-11 | 4-7 12-15)
        __m256i l32 = _mm256_madd_epi16(s01, _mm256_set1_epi16(1));
        __m128i u = _mm_add_epi32(_mm256_castsi256_si128(l32), _mm256_extracti128_si256(l32, 1));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4e));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xb1));
        xlo[g] = _mm_cvtsi128_si32(u);
        dx[g] = d;
        xsum[g] = sum;
        xs[g] = d * static_cast<float>(sum);
    }
    for (int64_t g = G; g < Gp; g++) {
        dx[g] = xs[g] = 0.0f;
        xsum[g] = xlo[g] = 0;
    }
}

// Weights in panels of PANEL = 16 columns: per panel p and group g, 256 bytes of codes, four blocks
// of 64 (b = 0..3); byte 4 c + j of block b holds column c's code of k = 32 g + 8 b + j in its low
// nibble and of k = 32 g + 8 b + 4 + j in its high nibble (c = 0..15, j = 0..3). So one 64-byte block,
// masked or shifted, is 4 consecutive k of 16 columns, one int32 lane per column, and u8 x s8 dot
// products against 4 activation bytes broadcast to every lane sum each column's products in its own
// lane: no horizontal sums. Scales and zeros [P, G, 16] bfloat16: the panel's 16 columns per group.
constexpr int PANEL = 16;
constexpr int PANEL_BYTES = 256;  // codes per panel and group

using augury::prefetch_next;  // simd.h

// a buffer of this thread's, one per Tag, kept between calls and grown as asked: null when out of memory
template <int Tag>
inline uint8_t *thread_buffer(size_t bytes) {
    thread_local struct Buffer {
        uint8_t *p = nullptr;
        size_t n = 0;
        ~Buffer() { std::free(p); }
    } buf;
    if (buf.n < bytes) {
        std::free(buf.p);
        buf.p = static_cast<uint8_t *>(std::malloc(bytes));
        buf.n = buf.p ? bytes : 0;
    }
    return buf.p;
}
// one panel's codes rebuilt as bytes (rebuild5, w8a8.h's columns6); null: the caller rebuilds the codes
// per row block, as for a few rows
inline uint8_t *panel_buffer(size_t bytes) { return thread_buffer<0>(bytes); }
// a tile's activations packed (w8a8.h's pack8); null: the rows are read as they lie
inline uint8_t *pack_buffer(size_t bytes) { return thread_buffer<1>(bytes); }
constexpr int64_t BUF_GROUP_BYTES = 512;  // a group's rebuilt codes: per block b, its low plane then its high

// Three storages of the scales and zeros (S the scales' element type, Z the zeros'), one kernel:
// - bfloat16 s and z [P, G, 16], codes offset by 8 (w = (q - 8) s + z, torch's int4 convention: Q4_0 /
//   Q4_1 and augury's own int4);
// - float32 s and z [P, G, 16], codes as they are (w = q s + z: GGUF's Q4_K with s = d sc and
//   z = -dmin m, exact in float32, so the weights are the format's values to the bit);
// - Q4_K's own super-block scales: S = uint8_t, sc then m [P, G, 32] (16 columns each, 6-bit values),
//   Z = uint16_t, d then dmin [P, G / 8, 32] float16; per group s = d sc and z = -(dmin m), computed
//   exactly in float32: the float32 form's numbers and bits in 4.625 bits a weight instead of 6.
// - GGUF's Q4_0 in its own numbers: S = Z = Half (float16 bits), d [P, G, 16], w = (q - 8) d and no
//   zero (z is not read: pass null): 4.5 bits a weight, the format's values exactly (the bfloat16
//   form rounds d and stores a zero of 0 beside it, 5 bits a weight).
struct Half {
    uint16_t bits;
};
template <class S>
constexpr int code_offset = 8;
template <>
constexpr int code_offset<float> = 0;
template <>
constexpr int code_offset<uint8_t> = 0;
template <class S>
constexpr bool has_zero = true;  // false: no zero term, not even an fma of 0 (Q4_0)
template <>
constexpr bool has_zero<Half> = false;
template <class S>
constexpr int64_t scale_width = PANEL;  // scale elements per panel and group
template <>
constexpr int64_t scale_width<uint8_t> = 2 * PANEL;
template <class S>
inline int64_t zero_stride(int64_t G) { return G * PANEL; }  // zero elements per panel
template <>
inline int64_t zero_stride<uint8_t>(int64_t G) { return G / 8 * 2 * PANEL; }
template <>
inline int64_t zero_stride<Half>(int64_t) { return 0; }  // no zeros

// columns h * 8 .. h * 8 + 7 of group g's scales and zeros
inline void scales8(const uint16_t *ps, const uint16_t *pz, int64_t g, int h, __m256 &s, __m256 &z) {
    s = load_bf16x8(ps + g * PANEL + 8 * h), z = load_bf16x8(pz + g * PANEL + 8 * h);
}
inline void scales8(const float *ps, const float *pz, int64_t g, int h, __m256 &s, __m256 &z) {
    s = _mm256_loadu_ps(ps + g * PANEL + 8 * h), z = _mm256_loadu_ps(pz + g * PANEL + 8 * h);
}
inline __m256 u8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))));
}
inline __m256 f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))); }
inline void scales8(const Half *ps, const Half *, int64_t g, int h, __m256 &s, __m256 &z) {
    s = f16x8(&ps[g * PANEL + 8 * h].bits), z = _mm256_setzero_ps();
}
inline void scales8(const uint8_t *ps, const uint16_t *pz, int64_t g, int h, __m256 &s, __m256 &z) {
    const uint8_t *q = ps + g * 2 * PANEL + 8 * h;
    const uint16_t *d = pz + g / 8 * 2 * PANEL + 8 * h;
    s = _mm256_mul_ps(f16x8(d), u8x8(q));  // exact: an 11-bit significand times a 6-bit integer
    z = _mm256_xor_ps(_mm256_mul_ps(f16x8(d + PANEL), u8x8(q + PANEL)), _mm256_set1_ps(-0.0f));  // -(dmin m)
}

inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// Each column's sum, the same float operations in the same order on every ISA (lanes are columns):
//   acc = 0; for g: acc = fma(float(dot_g - 8 xsum_g), s_g * dx_g, acc); acc = fma(z_g, xs_g, acc)
// (the second fma only where the storage has zeros: has_zero)
// with dot_g = sum_j q xq over the group, exact in int32.
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int ROW_BLOCK = 8;  // rows sharing each weight load (32 zmm registers)
constexpr int ROW_BLOCK_MAX = 8;  // ... and the most one block takes (see block_rows)
constexpr int W4_ROW_BLOCK_MAX = 8;  // the same for w4a8's panels

inline __m512i dpbusd512(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))), 16));
}
// group g's scales and zeros of the panel's 16 columns (the storages above)
inline void scales16(const uint16_t *ps, const uint16_t *pz, int64_t g, __m512 &s, __m512 &z) {
    s = load_bf16x16(ps + g * PANEL), z = load_bf16x16(pz + g * PANEL);
}
inline void scales16(const float *ps, const float *pz, int64_t g, __m512 &s, __m512 &z) {
    s = _mm512_loadu_ps(ps + g * PANEL), z = _mm512_loadu_ps(pz + g * PANEL);
}
inline void scales16(const uint8_t *ps, const uint16_t *pz, int64_t g, __m512 &s, __m512 &z) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i *>(ps + g * 2 * PANEL));
    const __m128i m = _mm_loadu_si128(reinterpret_cast<const __m128i *>(ps + g * 2 * PANEL + PANEL));
    const uint16_t *d = pz + g / 8 * 2 * PANEL;
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(d)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(d + PANEL)));
    s = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)));
    z = _mm512_xor_ps(_mm512_mul_ps(mv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m))), _mm512_set1_ps(-0.0f));
}
inline void scales16(const Half *ps, const Half *, int64_t g, __m512 &s, __m512 &z) {
    s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(ps + g * PANEL))), z = _mm512_setzero_ps();
}

// one panel's 16 columns against R rows (rows r * K of xq, r * Gp of dx / xs / xsum): out[r * 16 + c].
// HB: a fifth bit per code (Q5_K), ph [G, 64] per panel: byte 4 c + j, bit 2 b + plane = the bit of the
// code in block b's low (plane 0) or high (plane 1) nibble at that byte; OR-ed in as 16 before the sums.
template <int R, class S, class Z, bool HB = false>
inline void panel(const uint8_t *pc, const S *ps, const Z *pz, int64_t G, int64_t Gp,
                  const int8_t *xq, const float *dx, const float *xs, const int32_t *xsum, int64_t K, float *out,
                  const uint8_t *ph = nullptr) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *blk = pc + g * PANEL_BYTES;
        prefetch_next(blk + G * PANEL_BYTES, PANEL_BYTES);  // the next panel's group: loads overlap the arithmetic
        __m512i high = _mm512_setzero_si512();
        if constexpr (HB) {
            high = _mm512_loadu_si512(ph + g * 64);
            prefetch_next(ph + G * 64 + g * 64, 64);
        }
        // each column's sum starts at -8 xsum (the codes' offset of 8), so the dot products land on
        // dot_g - 8 xsum_g without a subtraction per row (the same integers: int32 sums are exact)
        __m512i ia[R];
        for (int r = 0; r < R; r++) ia[r] = _mm512_set1_epi32(-code_offset<S> * xsum[r * Gp + g]);
        for (int b = 0; b < 4; b++) {
            const __m512i v = _mm512_loadu_si512(blk + 64 * b);
            __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            if constexpr (HB) {
                lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(high, _mm512_set1_epi8(1 << (2 * b))), lo, sixteen);
                hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(high, _mm512_set1_epi8(2 << (2 * b))), hi, sixteen);
            }
            for (int r = 0; r < R; r++) {
                const int8_t *xr = xq + r * K + g * GROUP + 8 * b;
                ia[r] = dpbusd512(ia[r], lo, _mm512_set1_epi32(load_i32(xr)));
                ia[r] = dpbusd512(ia[r], hi, _mm512_set1_epi32(load_i32(xr + 4)));
            }
        }
        __m512 sv, zv;
        scales16(ps, pz, g, sv, zv);
        for (int r = 0; r < R; r++) {
            const __m512 dot = _mm512_cvtepi32_ps(ia[r]);
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(sv, _mm512_set1_ps(dx[r * Gp + g])), acc[r]);
            if constexpr (has_zero<S>) acc[r] = _mm512_fmadd_ps(zv, _mm512_set1_ps(xs[r * Gp + g]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * PANEL, acc[r]);
}
#else
constexpr int ROW_BLOCK = 4;  // rows sharing each weight load (16 ymm registers)
// ... and the most one block of w8a8's panels takes (see block_rows): 5 or 6 rows' sums and
// accumulators still fit the registers, and a pass over the codes for the last row or two costs more
// than the wider block (single-threaded, 576 x 4,096 in cache, Zen 4 EPYC: 1.88 vs 2.18 cycles per
// 32 products at 5 rows, 1.85 vs 2.08 at 6)
constexpr int ROW_BLOCK_MAX = 6;
// w4a8's panel holds two sums a row (both halves of 16 columns): past 4 rows they spill, so 5 and 6
// rows go as 4 + 1 and 4 + 2 (the same setting: 0.36 vs 0.38 and 0.34 vs 0.41 ns per 32 products, and
// with blocks of 5 and 6 compiled in, GCC spilled in the block of 4 too: 0.33 vs 0.41 at 4 and 8 rows)
constexpr int W4_ROW_BLOCK_MAX = 4;

inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));  // |2 * 15 * 127| < 2^15
#endif
}

// one panel's 16 columns against R rows, two ymm registers a row (one lane per column): each
// broadcast of 4 activation bytes serves both halves of the panel, and the codes are unpacked once
// per block of rows, one nibble plane at a time (fewer registers live than both planes at once). A
// pass per half of 8 columns, as before, spent more instructions per product: single-threaded, a
// 576 x 3,072 matrix in cache, the AVX2 variant on a Zen 4 EPYC took 0.60 vs 0.48 ns per 32 products
// at 1 row, 0.44 vs 0.33 at 4 and 8 rows (with W4_ROW_BLOCK_MAX's blocks). out[r * 16 + c]
template <int R, class S, class Z, bool HB = false, bool BUF = false>
__attribute__((noinline))  // compiled alone, whatever the caller: fewer spills
void panel(const uint8_t *pc, const S *ps, const Z *pz, int64_t G, int64_t Gp, const int8_t *xq,
           const float *dx, const float *xs, const int32_t *xsum, int64_t K, float *out, const uint8_t *ph = nullptr) {
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
    constexpr bool WIDE = true;  // int32 sums from the start
#else
    // AVX2 sums the maddubs pairs in int16 for 4-bit codes (8 x |2 * 15 * 127| < 2^15); 5-bit codes
    // (8 x 2 * 31 * 127 would not fit) widen each pair sum to int32 at once: the same integers
    constexpr bool WIDE = HB;  // BUF: Q5_K's codes (HB), five bits
#endif
    const __m256i low4 = _mm256_set1_epi8(0x0f), sixteen = _mm256_set1_epi8(16);
    __m256 acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *blk = pc + g * (BUF ? BUF_GROUP_BYTES : PANEL_BYTES);
        if constexpr (!BUF) prefetch_next(blk + G * PANEL_BYTES, PANEL_BYTES);
        if constexpr (HB && !BUF) prefetch_next(ph + G * 64 + g * 64, 64);
        __m256i ia[R][2];
        for (int r = 0; r < R; r++) ia[r][0] = ia[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1  // unrolled, no faster (the sums already fill the registers)
        for (int b = 0; b < 4; b++) {
            // the low nibbles' plane for every row, then the high nibbles' (fewer registers live: the
            // codes are loaded again from L1)
            for (int plane = 0; plane < 2; plane++) {
                const __m256i *at = reinterpret_cast<const __m256i *>(blk + (BUF ? 128 * b + 64 * plane : 64 * b));
                __m256i u0 = _mm256_loadu_si256(at), u1 = _mm256_loadu_si256(at + 1);
                if constexpr (!BUF) {
                    if (plane) u0 = _mm256_srli_epi16(u0, 4), u1 = _mm256_srli_epi16(u1, 4);
                    u0 = _mm256_and_si256(u0, low4), u1 = _mm256_and_si256(u1, low4);
                }
                if constexpr (HB && !BUF) {
                    const __m128i *hp = reinterpret_cast<const __m128i *>(ph + g * 64);
                    const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << (2 * b + plane)));
                    const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(hp));
                    const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(hp) + 1);
                    u0 = _mm256_or_si256(u0, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h0, bit), bit), sixteen));
                    u1 = _mm256_or_si256(u1, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h1, bit), bit), sixteen));
                }
                for (int r = 0; r < R; r++) {
                    const __m256i x = _mm256_set1_epi32(load_i32(xq + r * K + g * GROUP + 8 * b + 4 * plane));
                    if constexpr (WIDE) {
                        ia[r][0] = dpbusd256(ia[r][0], u0, x);
                        ia[r][1] = dpbusd256(ia[r][1], u1, x);
                    } else {
                        // AVX2: the group's maddubs pair sums added in int16 (8 x |2 * 15 * 127| < 2^15),
                        // widened to int32 once per group below: the same integers, fewer instructions
                        ia[r][0] = _mm256_add_epi16(ia[r][0], _mm256_maddubs_epi16(u0, x));
                        ia[r][1] = _mm256_add_epi16(ia[r][1], _mm256_maddubs_epi16(u1, x));
                    }
                }
            }
        }
        __m256 sv[2], zv[2];
        scales8(ps, pz, g, 0, sv[0], zv[0]);
        scales8(ps, pz, g, 1, sv[1], zv[1]);
        for (int r = 0; r < R; r++) {
            const __m256i x8 = _mm256_set1_epi32(xsum[r * Gp + g] * code_offset<S>);
            const __m256 d = _mm256_set1_ps(dx[r * Gp + g]), x = _mm256_set1_ps(xs[r * Gp + g]);
            for (int h = 0; h < 2; h++) {
                const __m256i sum = WIDE ? ia[r][h] : _mm256_madd_epi16(ia[r][h], _mm256_set1_epi16(1));
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_sub_epi32(sum, x8));
                acc[r][h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(sv[h], d), acc[r][h]);
                if constexpr (has_zero<S>) acc[r][h] = _mm256_fmadd_ps(zv[h], x, acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * PANEL + 8 * h, acc[r][h]);
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__))
// Q5_K's codes of one panel rebuilt as bytes for BUF's panels: per group and block b, the low nibbles'
// plane (64 bytes, the fifth bits of ph [G, 64] OR-ed in as 16) then the high nibbles'. Only the 256-bit
// forms take it, and only for Q5_K: a 512 x 2,048 x 8,192 product on 2 threads of a Zen 4 EPYC, AVX2
// level, took 59.9 ms from the buffer against 75.8 (Q4_K's codes 47.3 against 45.8: no gain); with
// AVX-512 the buffer (twice the packed bytes, 32 KiB a panel at K = 2,048, out of L1) was slower for
// both, 37 ms against 28-31.
inline void rebuild5(const uint8_t *pc, const uint8_t *ph, int64_t G, uint8_t *buf) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), sixteen = _mm256_set1_epi8(16);
    for (int64_t g = 0; g < G; g++)
        for (int b = 0; b < 4; b++)
            for (int plane = 0; plane < 2; plane++)
                for (int e = 0; e < 2; e++) {
                    __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(pc + g * PANEL_BYTES + 64 * b + 32 * e));
                    if (plane) u = _mm256_srli_epi16(u, 4);
                    u = _mm256_and_si256(u, low4);
                    const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << (2 * b + plane)));
                    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(ph + g * 64 + 32 * e));
                    u = _mm256_or_si256(u, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), sixteen));
                    _mm256_storeu_si256(reinterpret_cast<__m256i *>(buf + g * BUF_GROUP_BYTES + 128 * b + 64 * plane + 32 * e), u);
                }
}
#endif

// One matrix's activations, rounded: per row xq [K] int8, dx / xs [Gp] float32, xsum / xlo [Gp] int32.
struct Rounded {
    int8_t *xq = nullptr;
    float *dx = nullptr, *xs = nullptr;
    int32_t *xsum = nullptr, *xlo = nullptr;
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
        xlo = static_cast<int32_t *>(std::malloc(sizeof(int32_t) * static_cast<size_t>(M * Gp + 1)));
    }
    ~OwnedRounded() {
        std::free(xq);
        std::free(dx);
        std::free(xs);
        std::free(xsum);
        std::free(xlo);
    }
    OwnedRounded(const OwnedRounded &) = delete;
    OwnedRounded &operator=(const OwnedRounded &) = delete;
    bool ok() const { return xq && dx && xs && xsum && xlo; }
};

// Worksharing constructs without their own parallel region: called from inside one (the threads
// split the work and meet at bar) or from serial code (one thread does it all).
inline void round_rows(const void *x, bool bf16, int64_t M, Rounded &a, augury::Barrier &bar) {
    const int xb = bf16 ? 2 : 4;
#pragma omp for schedule(static) nowait
    for (int64_t m = 0; m < M; m++)
        quantize_row(static_cast<const char *>(x) + m * a.K * xb, bf16, a.K, a.Gp, a.xq + m * a.K, a.dx + m * a.Gp,
                     a.xs + m * a.Gp, a.xsum + m * a.Gp, a.xlo + m * a.Gp);
    bar.wait();
}

// The standalone kernel's output: y [M, N] in float32, or rounded to bfloat16 (row16 for w4a8's
// columns, operator() one value at a time), the same bits either way.
struct StoreY {
    void *y;
    bool bf16;
    int64_t N;
    void operator()(int64_t m, int64_t n, float v) const {
        if (bf16)
            static_cast<uint16_t *>(y)[m * N + n] = augury::f32_to_bf16(v);
        else
            static_cast<float *>(y)[m * N + n] = v;
    }
    void row16(int64_t m, int64_t n0, const float *v) const {
        for (int h = 0; h < 16; h += 8) augury::store8(y, bf16, m * N + n0 + h, _mm256_loadu_ps(v + h));
    }
};

// Rows the next register block takes when `rest` are left: ROW_BLOCK, and the last rows together
// where they fit one block (`most`, ROW_BLOCK_MAX for w8a8's panels): there 5 rows one block of 5, 9
// a block of 4 then one of 5, a prefill's 64-row tiles blocks of 4 (wider blocks spend more per row
// where rows are compute-bound: a 1,500-token prefill ~1.5% slower with blocks of 6). A row's sums
// are the same whatever its block.
inline int block_rows(int64_t rest, int most = ROW_BLOCK_MAX) {
    return rest <= most ? static_cast<int>(rest) : ROW_BLOCK;
}

// y[m, n] for every row and column (N a multiple of PANEL); store.row16(m, n0, v) receives y[m, n0 ..
// n0 + 15] in float32 (no bias added), n0 a multiple of 16. Threads split the panels; each panel's codes (G * 256 bytes) stay in L1
// while its rows go by in register blocks (block_rows), ROW_TILE rows' activations staying in cache.
template <class Store, class S, class Z>
inline void columns(const Rounded &a, int64_t M, const uint8_t *codes, const S *s, const Z *z,
                    int64_t N, Store store, augury::Barrier &bar, const uint8_t *high = nullptr) {
    const int64_t K = a.K, Gp = a.Gp, G = K / GROUP, P = N / PANEL;
    for (int64_t t0 = 0; t0 < M; t0 += ROW_TILE) {
        const int64_t t1 = t0 + ROW_TILE < M ? t0 + ROW_TILE : M;
#if !(defined(__AVX512F__) && defined(__AVX512BW__))
        // Q5_K: a tile of more than one row block rebuilds each panel's codes as bytes once (rebuild5)
        uint8_t *buf = std::is_same<S, uint8_t>::value && high && t1 - t0 > W4_ROW_BLOCK_MAX
                           ? panel_buffer(static_cast<size_t>(G * BUF_GROUP_BYTES))
                           : nullptr;
#endif
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < P; p++) {
            const uint8_t *pc = codes + p * G * PANEL_BYTES;
            const S *ps = s + p * G * scale_width<S>;
            const Z *pz = z + p * zero_stride<S>(G);
            // Q5_K's fifth bits [P, G, 64] (only with Q4_K's own scales)
            const uint8_t *ph = std::is_same<S, uint8_t>::value && high ? high + p * G * 64 : nullptr;
#if !(defined(__AVX512F__) && defined(__AVX512BW__))
            if (buf) rebuild5(pc, ph, G, buf);
#endif
            for (int64_t m0 = t0, r; m0 < t1; m0 += r) {
                r = block_rows(t1 - m0, W4_ROW_BLOCK_MAX);
                float out[ROW_BLOCK_MAX * PANEL];
                const int8_t *xr = a.xq + m0 * K;
                const float *dr = a.dx + m0 * Gp, *sr = a.xs + m0 * Gp;
                const int32_t *ir = a.xsum + m0 * Gp;
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define AUGURY_ROW_CASES(X) X(8) X(7) X(6) X(5) X(4) X(3) X(2) X(1)
#else
#define AUGURY_ROW_CASES(X) X(4) X(3) X(2) X(1)
#endif
#if !(defined(__AVX512F__) && defined(__AVX512BW__))
                if (buf) {  // 5-bit codes: HB's int32 sums, from the buffer
                    if constexpr (std::is_same<S, uint8_t>::value) {
                        switch (r) {
#define AUGURY_ROWS(n) \
    case n: panel<n, S, Z, true, true>(buf, ps, pz, G, Gp, xr, dr, sr, ir, K, out); break;
                            AUGURY_ROW_CASES(AUGURY_ROWS)
#undef AUGURY_ROWS
                        }
                    }
                } else
#endif
                if (ph) {
                    if constexpr (std::is_same<S, uint8_t>::value) {
                        switch (r) {
#define AUGURY_ROWS(n) \
    case n: panel<n, S, Z, true>(pc, ps, pz, G, Gp, xr, dr, sr, ir, K, out, ph); break;
                            AUGURY_ROW_CASES(AUGURY_ROWS)
#undef AUGURY_ROWS
                        }
                    }
                } else {
                    switch (r) {
#define AUGURY_ROWS(n) \
    case n: panel<n>(pc, ps, pz, G, Gp, xr, dr, sr, ir, K, out); break;
                        AUGURY_ROW_CASES(AUGURY_ROWS)
#undef AUGURY_ROWS
                    }
                }
#undef AUGURY_ROW_CASES
                for (int64_t i = 0; i < r; i++) store.row16(m0 + i, p * PANEL, out + i * PANEL);
            }
        }
    }
    bar.wait();
}

}  // namespace w4a8
}  // namespace augury
