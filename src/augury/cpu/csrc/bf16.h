// Dense bfloat16 weights against float32 activations, the parts shared by bf16.cpp (one linear per
// call) and forward.cpp (the whole layer stack).
//
// The weights are repacked once at load into panels of 8 columns, [ceil(N / 8), K, 8] bfloat16
// (columns past N zero): for each k, 8 consecutive columns, so one load widens 8 weights exactly
// to float32 and one broadcast of x[m, k] feeds them. A block of up to 6 rows x 16 columns keeps
// its 12 accumulators in registers while k runs; each output lane y[m, n] is the float32 FMA chain
// over k = 0 .. K-1 in order, whatever the rows beside it and the threads (threads split the
// panels), so rows are row-count invariant bit for bit.
#pragma once
#include <immintrin.h>
#include <cstdint>

#include "simd.h"

namespace augury {
namespace bf16 {

constexpr int PANEL = 8;       // columns per panel
constexpr int ROW_BLOCK = 6;   // rows per register block (6 x 2 panels = 12 accumulators)

inline __m256 widen(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))), 16));
}

// panels p0 and p1 ([K, 8] each; C = 1: p0 only) against R rows of x (float32, row stride K)
template <int R, int C>
inline void block(const uint16_t *p0, const uint16_t *p1, int64_t K, const float *x, __m256 out[][ROW_BLOCK]) {
    __m256 acc[C][R];  // in registers (not the caller's array) while k runs
    for (int i = 0; i < C; i++)
        for (int r = 0; r < R; r++) acc[i][r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 w0 = widen(p0 + k * PANEL);
        const __m256 w1 = C == 2 ? widen(p1 + k * PANEL) : w0;
        for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
            acc[0][r] = _mm256_fmadd_ps(w0, xb, acc[0][r]);
            if (C == 2) acc[C - 1][r] = _mm256_fmadd_ps(w1, xb, acc[C - 1][r]);
        }
    }
    for (int i = 0; i < C; i++)
        for (int r = 0; r < R; r++) out[i][r] = acc[i][r];
}

template <int C>
inline void rows_block(int r, const uint16_t *p0, const uint16_t *p1, int64_t K, const float *x,
                       __m256 acc[][ROW_BLOCK]) {
    switch (r) {
        case 6: block<6, C>(p0, p1, K, x, acc); break;
        case 5: block<5, C>(p0, p1, K, x, acc); break;
        case 4: block<4, C>(p0, p1, K, x, acc); break;
        case 3: block<3, C>(p0, p1, K, x, acc); break;
        case 2: block<2, C>(p0, p1, K, x, acc); break;
        default: block<1, C>(p0, p1, K, x, acc); break;
    }
}

// Rows of x (bfloat16 or float32, K % 8 == 0) widened into xf [M, K] float32: a worksharing loop
// (called inside a parallel region, the threads split it; serially, one thread does it all)
inline void widen_rows(const void *x, bool x_bf16, int64_t M, int64_t K, float *xf, Barrier &bar) {
#pragma omp for schedule(static) nowait
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(xf + m * K + k, load8(x, x_bf16, m * K + k));
    bar.wait();
}

// y[m, n] for every row and column of the packed weights (N columns); store(m, n, value) receives
// each (no bias added). A worksharing loop over pairs of panels, ending at bar.
template <class Store>
inline void columns(const float *xf, int64_t M, int64_t K, const uint16_t *packed, int64_t N, Store store,
                    Barrier &bar) {
    const int64_t panels = (N + PANEL - 1) / PANEL, pairs = (panels + 1) / 2;
#pragma omp for schedule(static) nowait
    for (int64_t q = 0; q < pairs; q++) {
        const int64_t p = 2 * q;
        const int c = p + 1 < panels ? 2 : 1;
        const uint16_t *p0 = packed + p * K * PANEL, *p1 = p0 + K * PANEL;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const int r = M - m0 < ROW_BLOCK ? static_cast<int>(M - m0) : ROW_BLOCK;
            __m256 acc[2][ROW_BLOCK];
            if (c == 2)
                rows_block<2>(r, p0, p1, K, xf + m0 * K, acc);
            else
                rows_block<1>(r, p0, p1, K, xf + m0 * K, acc);
            for (int i = 0; i < c; i++)
                for (int j = 0; j < r; j++) {
                    alignas(32) float v[PANEL];
                    _mm256_store_ps(v, acc[i][j]);
                    const int64_t n0 = (p + i) * PANEL;
                    for (int e = 0; e < PANEL && n0 + e < N; e++) store(m0 + j, n0 + e, v[e]);
                }
        }
    }
    bar.wait();
}

}  // namespace bf16
}  // namespace augury
