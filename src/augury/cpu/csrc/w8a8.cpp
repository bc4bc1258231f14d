// augury's CPU kernel for int8 weights (symmetric, a float32 scale per group of 32 along K: GGUF's
// Q8_0 layout) against activations rounded per row to int8 in the same groups (as w4a8.cpp rounds
// them): the output layer of a quantised target. Built at first use by models/cpu_kernels.py.
//
//   y[m, n] = sum_g dx[m, g] s[n, g] sum_j w[n, g, j] xq[m, g, j]
//
// The integer dot product of each group is exact (AVX2 maddubs of |xq| against w carrying xq's
// sign: |products| <= 127 * 127, pair sums < 2^15; weights in -127..127), widened to float and
// scaled into one accumulator per (row, column), whose 8 lanes are summed once at the end. Every
// y[m, n] is summed in one fixed order whatever the rows beside it and the threads (threads split
// the columns), so rows are row-count invariant: a verified node's logits are a decode step's.
//
// Weights: w [N, K] int8, s [N, Gp] float32 (Gp = K / 32 rounded up to a multiple of 8, zero-padded).
#include <cstdint>
#include <cstdlib>

#include "w4a8.h"

using namespace augury::w4a8;

namespace {

template <int R>
inline void block8(const int8_t *w, const float *s, int64_t G, int64_t Gp, const int8_t *xq, const float *dx,
                   int64_t K, float *out) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    alignas(32) float sc[R][CHUNK];
    for (int64_t c = 0; c < G; c += CHUNK) {
        const __m256 sv = _mm256_loadu_ps(s + c);
        for (int r = 0; r < R; r++) _mm256_store_ps(sc[r], _mm256_mul_ps(_mm256_loadu_ps(dx + r * Gp + c), sv));
        const int64_t nj = G - c < CHUNK ? G - c : CHUNK;
        for (int64_t j = 0; j < nj; j++) {
            const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(w + (c + j) * GROUP));
            for (int r = 0; r < R; r++) {
                const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xq + r * K + (c + j) * GROUP));
                // |xq| against w carrying xq's sign; |127 * 127 * 2| < 2^15
                const __m256 d = _mm256_cvtepi32_ps(augury::dot_u8s8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(wv, x)));
                acc[r] = _mm256_fmadd_ps(d, _mm256_broadcast_ss(&sc[r][j]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = augury::hsum(acc[r]);
}

}  // namespace

// y [M, N] float32 = x [M, K] w^T; x bfloat16 (flag 1) or float32 (0). Returns 0, 1 for bad shapes,
// 2 when out of memory.
extern "C" int augury_w8a8_linear(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *w,
                                  const float *s, int64_t N, int64_t Gp, float *y, int nthreads) {
    const int64_t G = K / GROUP;
    if (K % GROUP || M < 0 || N < 0 || Gp % CHUNK || Gp < G || Gp >= G + CHUNK) return 1;
    OwnedRounded a(M, K, Gp);
    if (!a.ok()) return 2;
    augury::prepare_then_run(M, nthreads, [&] { round_rows(x, x_bf16 != 0, M, a); }, [&] {
        for (int64_t t0 = 0; t0 < M; t0 += ROW_TILE) {
            const int64_t t1 = t0 + ROW_TILE < M ? t0 + ROW_TILE : M;
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++) {
                for (int64_t m0 = t0; m0 < t1; m0 += 4) {
                    const int r = t1 - m0 < 4 ? static_cast<int>(t1 - m0) : 4;
                    float out[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    const int8_t *wn = w + n * K, *xr = a.xq + m0 * K;
                    const float *sn = s + n * Gp, *dr = a.dx + m0 * Gp;
                    switch (r) {
                        case 4: block8<4>(wn, sn, G, Gp, xr, dr, K, out); break;
                        case 3: block8<3>(wn, sn, G, Gp, xr, dr, K, out); break;
                        case 2: block8<2>(wn, sn, G, Gp, xr, dr, K, out); break;
                        default: block8<1>(wn, sn, G, Gp, xr, dr, K, out); break;
                    }
                    for (int i = 0; i < r; i++) y[(m0 + i) * N + n] = out[i];
                }
            }
        }
    });
    return 0;
}
