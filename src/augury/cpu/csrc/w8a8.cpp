// augury's CPU kernel for int8 weights (symmetric, a float32 scale per group of 32 along K: GGUF's
// Q8_0 layout) against activations rounded per row to int8 in the same groups (as w4a8.cpp rounds
// them): the output layer of a quantised target. Built at first use by cpu/build.py.
//
//   y[m, n] = sum_g dx[m, g] s[n, g] sum_j w[n, g, j] xq[m, g, j]
//
// Weights in panels of 16 columns (as w4a8's): codes [P, G, 512] int8, P = ceil(N / 16), G = K / 32;
// per panel and group eight blocks of 64 bytes, byte 4 c + j of block b = column c's weight at
// k = 32 g + 4 b + j; scales [P, G, 16] float32. Columns past N are zero (never stored).
// One int32 lane per column: u8 x s8 dot products against 4 activation bytes broadcast to every lane.
// Each group's integer dot product is exact: with VNNI, (w + 128) against xq and 128 sum xq taken off
// (vpdpbusd does not saturate); on AVX2, |w| against xq carrying w's sign (maddubs' pair sums
// |2 * 127 * 127| < 2^15). Then per column, in group order, acc = fma(float(dot_g), s_g * dx_g, acc):
// the same float operations on every ISA and whatever the rows beside it and the threads (threads
// split the panels), so rows are row-count invariant: a verified node's logits are a decode step's.
// augury_w8a8_columns computes chosen columns only (the tokens a grammar's mask allows), one at a time
// with those same integer sums and float operations in the same order: the same bits as the panels'.
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "w4a8.h"

using namespace augury::w4a8;

namespace {

constexpr int W8_PANEL_BYTES = 512;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
template <int R>
inline void panel8(const int8_t *pw, const float *ps, int64_t G, int64_t Gp, const int8_t *xq, const float *dx,
                   const int32_t *xsum, int64_t K, float *out) {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *blk = pw + g * W8_PANEL_BYTES;
        prefetch_next(blk + G * W8_PANEL_BYTES, W8_PANEL_BYTES);
        __m512i ia[R];
        for (int r = 0; r < R; r++) ia[r] = _mm512_setzero_si512();
        for (int b = 0; b < 8; b++) {
            const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * b), bias);  // w + 128
            for (int r = 0; r < R; r++)
                ia[r] = _mm512_dpbusd_epi32(ia[r], u, _mm512_set1_epi32(load_i32(xq + r * K + g * GROUP + 4 * b)));
        }
        const __m512 sv = _mm512_loadu_ps(ps + g * PANEL);
        for (int r = 0; r < R; r++) {
            const __m512i dot = _mm512_sub_epi32(ia[r], _mm512_set1_epi32(xsum[r * Gp + g] * 128));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sv, _mm512_set1_ps(dx[r * Gp + g])), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * PANEL, acc[r]);
}
#else
template <int R>
inline void panel8(const int8_t *pw, const float *ps, int64_t G, int64_t Gp, const int8_t *xq, const float *dx,
                   const int32_t *xsum, int64_t K, float *out) {
    for (int h = 0; h < 2; h++) {
        __m256 acc[R];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            const int8_t *blk = pw + g * W8_PANEL_BYTES + 32 * h;
            if (h == 0) prefetch_next(blk + G * W8_PANEL_BYTES, W8_PANEL_BYTES);
            __m256i ia[R];
            for (int r = 0; r < R; r++) ia[r] = _mm256_setzero_si256();
#pragma GCC unroll 2  // unrolled whole, the compiler spilled the sums
            for (int b = 0; b < 8; b++) {
                const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * b));
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
                const __m256i u = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));  // w + 128
                for (int r = 0; r < R; r++) {
                    const __m256i x = _mm256_set1_epi32(load_i32(xq + r * K + g * GROUP + 4 * b));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                    ia[r] = _mm256_dpbusd_epi32(ia[r], u, x);
#else
                    ia[r] = _mm256_dpbusd_avx_epi32(ia[r], u, x);
#endif
                }
#else
                const __m256i aw = _mm256_sign_epi8(w, w);  // |w|
                for (int r = 0; r < R; r++) {
                    const __m256i x = _mm256_set1_epi32(load_i32(xq + r * K + g * GROUP + 4 * b));
                    ia[r] = _mm256_add_epi32(ia[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)),
                                                                      _mm256_set1_epi16(1)));
                }
#endif
            }
            const __m256 sv = _mm256_loadu_ps(ps + g * PANEL + 8 * h);
            for (int r = 0; r < R; r++) {
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
                const __m256i dot = _mm256_sub_epi32(ia[r], _mm256_set1_epi32(xsum[r * Gp + g] * 128));
#else
                const __m256i dot = ia[r];
#endif
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sv, _mm256_set1_ps(dx[r * Gp + g])),
                                         acc[r]);
            }
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * PANEL + 8 * h, acc[r]);
    }
}
#endif

}  // namespace

// y [M, N] float32 = x [M, K] w^T; x bfloat16 (flag 1) or float32 (0); the weights pack()'s panels
// (ceil(N / 16) of them). Returns 0, 1 for bad shapes, 2 when out of memory.
extern "C" int augury_w8a8_linear(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *w,
                                  const float *s, int64_t N, float *y, int nthreads) {
    const int64_t G = K / GROUP, P = (N + PANEL - 1) / PANEL;
    if (K % GROUP || M < 0 || N < 0) return 1;
    OwnedRounded a(M, K, G);
    if (!a.ok()) return 2;
    augury::prepare_then_run(M, nthreads, [&](augury::Barrier &bar) { round_rows(x, x_bf16 != 0, M, a, bar); },
                             [&](augury::Barrier &bar) {
        for (int64_t t0 = 0; t0 < M; t0 += ROW_TILE) {
            const int64_t t1 = t0 + ROW_TILE < M ? t0 + ROW_TILE : M;
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < P; p++) {
                const int8_t *pw = w + p * G * W8_PANEL_BYTES;
                const float *ps = s + p * G * PANEL;
                const int64_t nc = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
                for (int64_t m0 = t0, r; m0 < t1; m0 += r) {
                    r = block_rows(t1 - m0);  // w4a8.h: blocks of ROW_BLOCK, the last rows together where they fit
                    float out[ROW_BLOCK_MAX * PANEL];
                    const int8_t *xr = a.xq + m0 * K;
                    const float *dr = a.dx + m0 * G;
                    const int32_t *ir = a.xsum + m0 * G;
                    switch (r) {
#define AUGURY_ROWS(n) \
    case n: panel8<n>(pw, ps, G, G, xr, dr, ir, K, out); break;
#if defined(__AVX512F__) && defined(__AVX512BW__)
                        AUGURY_ROWS(8) AUGURY_ROWS(7)
#endif
                        AUGURY_ROWS(6) AUGURY_ROWS(5) AUGURY_ROWS(4) AUGURY_ROWS(3) AUGURY_ROWS(2) AUGURY_ROWS(1)
#undef AUGURY_ROWS
                    }
                    for (int64_t i = 0; i < r; i++)
                        for (int64_t c = 0; c < nc; c++) y[(m0 + i) * N + p * PANEL + c] = out[i * PANEL + c];
                }
            }
        }
        bar.wait();
    });
    return 0;
}

// Chosen columns of x [M, K] w^T: row m's columns ids[offsets[m] .. offsets[m + 1]) (each in 0..N-1)
// into y at the same positions, float32, the bits augury_w8a8_linear gives them (one thread: meant for
// a few hundred columns, where a pass over the whole weight costs ~1,000x more). Returns 0, 1 for bad
// shapes or a column out of range, 2 when out of memory.
extern "C" int augury_w8a8_columns(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *w,
                                   const float *s, int64_t N, const int64_t *ids, const int64_t *offsets,
                                   float *y) {
    const int64_t G = K / GROUP;
    if (K % GROUP || M < 0 || N < 0) return 1;
    for (int64_t m = 0; m < M; m++)
        if (offsets[m] > offsets[m + 1] || offsets[m] < 0) return 1;
    for (int64_t i = offsets[0]; i < offsets[M]; i++)
        if (ids[i] < 0 || ids[i] >= N) return 1;
    OwnedRounded a(M, K, G);
    if (!a.ok()) return 2;
    const int xb = x_bf16 ? 2 : 4;
    for (int64_t m = 0; m < M; m++)
        quantize_row(static_cast<const char *>(x) + m * K * xb, x_bf16 != 0, K, G, a.xq + m * K, a.dx + m * G,
                     a.xs + m * G, a.xsum + m * G);
    for (int64_t m = 0; m < M; m++) {
        const int8_t *xq = a.xq + m * K;
        const float *dx = a.dx + m * G;
        for (int64_t i = offsets[m]; i < offsets[m + 1]; i++) {
            const int64_t n = ids[i], p = n / PANEL, c = n % PANEL;
            const int8_t *pw = w + p * G * W8_PANEL_BYTES + 4 * c;
            const float *ps = s + p * G * PANEL + c;
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                int32_t dot = 0;  // exact, as the panels' integer sums
                for (int b = 0; b < 8; b++)
                    for (int j = 0; j < 4; j++)
                        dot += static_cast<int32_t>(pw[g * W8_PANEL_BYTES + 64 * b + j]) * xq[g * GROUP + 4 * b + j];
                acc = std::fma(static_cast<float>(dot), ps[g * PANEL] * dx[g], acc);  // the panels' fmadd
            }
            y[i] = acc;
        }
    }
    return 0;
}
