// augury's CPU kernel for int4 weights (groups of 32 along K, a scale and a zero per group) against
// activations rounded per row to int8 in the same groups (AVX2 + FMA; built at first use by
// models/cpu_kernels.py, which falls back to torch's int4 kernel when it cannot build or load it).
//
//   y[m, n] = sum_g dx[m, g] s[n, g] sum_j (q[n, g, j] - 8) xq[m, g, j] + z[n, g] dx[m, g] sum_j xq[m, g, j]
//
// = sum_k x~[m, k] w[n, k] with w = (q - 8) s + z (torch's int4 convention, q in 0..15) and
// x~ = dx xq: the activation rounded to 8 bits per group of 32 (dx = max |x| / 127, xq = round(x / dx)).
//
// Every y[m, n] is summed in one fixed order whatever the number of rows, their neighbours and the
// threads (threads split the columns; rows share only the unpacked weights), so a row comes out bit
// for bit the same alone or among others: verification and plain decoding see the same numbers.
//
// Weights: codes [N, G, 16] uint8, G = K / 32 (byte j of group g: low nibble = code of k = 32 g + j,
// high nibble = code of k = 32 g + 16 + j); s and z [N, Gp] bfloat16, Gp = G rounded up to a
// multiple of 8, the padding zero (so the tail of the last chunk of 8 groups adds exactly nothing).
#include <cstdint>
#include <cstdlib>

#include "w4a8.h"

using namespace augury::w4a8;

// y [M, N] = x [M, K] w^T; x and y bfloat16 (flag 1) or float32 (0) (a bias is the caller's:
// quant.Int4Linear adds its own). Returns 0, or 1 for bad shapes, 2 when out of memory.
extern "C" int augury_w4a8_linear(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes,
                                  const uint16_t *s, const uint16_t *z, int64_t N, int64_t Gp, void *y, int y_bf16,
                                  int nthreads) {
    const int64_t G = K / GROUP;
    if (K % GROUP || M < 0 || N < 0 || Gp % CHUNK || Gp < G || Gp >= G + CHUNK) return 1;
    OwnedRounded a(M, K, Gp);
    if (!a.ok()) return 2;
    auto store = [&](int64_t m, int64_t n, float v) {
        if (y_bf16)
            static_cast<uint16_t *>(y)[m * N + n] = augury::f32_to_bf16(v);
        else
            static_cast<float *>(y)[m * N + n] = v;
    };
    augury::prepare_then_run(M, nthreads, [&] { round_rows(x, x_bf16 != 0, M, a); },
                             [&] { columns(a, M, codes, s, z, N, store); });
    return 0;
}
