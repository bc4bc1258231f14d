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
// augury_w8g_linear is the general form (w8a8.h): optional int8 sub-scales per 16 and float32 zeros per
// group, bfloat16 or float32 out, for GGUF's Q8_0, Q6_K and Q5_* linears (models/native.py).
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "w8a8.h"

using namespace augury::w8a8;

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
                    panel_rows<false, false>(static_cast<int>(r), pw, ps, nullptr, nullptr, G, G, xr, dr, a.xs + m0 * G,
                                             ir, K, out);
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
                     a.xs + m * G, a.xsum + m * G, a.xlo + m * G);
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

// The general form (w8a8.h): y [M, N] = x [M, K] w^T with w = s sub q + z, z [P, G, 16] float32 and sub
// [P, G, 32] int8 each optional (null), N a multiple of 16; y float32 or bfloat16 (flag 1), rounded once.
// GGUF's Q8_0, Q6_K (d per super-block in s, the int8 scale per 16 in sub), Q5_0, Q5_1 and Q5_K in their
// exact values (models/native.py). Returns 0, 1 for bad shapes, 2 when out of memory.
extern "C" int augury_w8g_linear(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *w, const float *s,
                                 const float *z, const int8_t *sub, int64_t N, void *y, int y_bf16, int nthreads) {
    if (K % GROUP || M < 0 || N < 0 || N % PANEL) return 1;
    OwnedRounded a(M, K, K / GROUP);
    if (!a.ok()) return 2;
    const StoreY store{y, y_bf16 != 0, N};
    augury::prepare_then_run(M, nthreads, [&](augury::Barrier &bar) { round_rows(x, x_bf16 != 0, M, a, bar); },
                             [&](augury::Barrier &bar) { columns(a, M, w, s, z, sub, N, store, bar); });
    return 0;
}

// Q6_K in its own six bits a code (w8a8.h's columns6): codes [P, G, 384], d [P, G / 8, 16] float16 bits,
// sub [P, G, 32] int8; N a multiple of 16, K of 256. The general form's bits for the same weights.
// Returns 0, 1 for bad shapes, 2 when out of memory.
extern "C" int augury_w6k_linear(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes,
                                 const uint16_t *d, const int8_t *sub, int64_t N, void *y, int y_bf16, int nthreads) {
    if (K % (8 * GROUP) || M < 0 || N < 0 || N % PANEL) return 1;
    OwnedRounded a(M, K, K / GROUP);
    if (!a.ok()) return 2;
    const StoreY store{y, y_bf16 != 0, N};
    augury::prepare_then_run(M, nthreads, [&](augury::Barrier &bar) { round_rows(x, x_bf16 != 0, M, a, bar); },
                             [&](augury::Barrier &bar) { columns6(a, M, codes, d, sub, N, store, bar); });
    return 0;
}
