// augury's CPU kernel for int4 weights (groups of 32 along K, a scale and a zero per group) against
// activations rounded per row to int8 in the same groups (one variant per x86-64 level, cpu/isa.py;
// built at first use by cpu/build.py; quant.Int4Linear falls back to torch's int4 kernel without it).
//
//   y[m, n] = sum_g dx[m, g] s[n, g] sum_j (q[n, g, j] - 8) xq[m, g, j] + z[n, g] dx[m, g] sum_j xq[m, g, j]
//
// = sum_k x~[m, k] w[n, k] with w = (q - 8) s + z (torch's int4 convention, q in 0..15) and
// x~ = dx xq: the activation rounded to 8 bits per group of 32 (dx = max |x| / 127, xq = round(x / dx)).
//
// Every y[m, n] is summed in one fixed order whatever the number of rows, their neighbours, the
// threads and the ISA level (threads split the columns; rows share only the weight loads; a vector
// lane is a column, so 8- and 16-lane variants do each column's operations in the same order), so a
// row comes out bit for bit the same alone or among others: verification and plain decoding, and
// every ISA variant, see the same numbers.
//
// Weights (w4a8.h): codes [N / 16, G, 256] uint8 in panels of 16 columns, G = K / 32; s and z
// [N / 16, G, 16] bfloat16. N is a multiple of 16.
#include <cstdint>
#include <cstdlib>

#include "w4a8.h"

using namespace augury::w4a8;

// y [M, N] = x [M, K] w^T; x and y bfloat16 (flag 1) or float32 (0) (a bias is the caller's:
// quant.Int4Linear adds its own). Returns 0, or 1 for bad shapes, 2 when out of memory.
extern "C" int augury_w4a8_linear(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes,
                                  const uint16_t *s, const uint16_t *z, int64_t N, void *y, int y_bf16, int nthreads) {
    if (K % GROUP || M < 0 || N < 0 || N % PANEL) return 1;
    OwnedRounded a(M, K, K / GROUP);
    if (!a.ok()) return 2;
    const StoreY store{y, y_bf16 != 0, N};
    augury::prepare_then_run(M, nthreads, [&](augury::Barrier &bar) { round_rows(x, x_bf16 != 0, M, a, bar); },
                             [&](augury::Barrier &bar) { columns(a, M, codes, s, z, N, store, bar); });
    return 0;
}

// The same with float32 scales and zeros and codes taken as they are: y = x w^T, w = q s + z (GGUF's
// Q4_K: s = d * sc, z = -dmin * m per group of 32, exact in float32; w4a8.h's code_offset). s and z
// [N / 16, G, 16] float32. Returns 0, 1 for bad shapes, 2 when out of memory.
extern "C" int augury_w4f_linear(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes,
                                 const float *s, const float *z, int64_t N, void *y, int y_bf16, int nthreads) {
    if (K % GROUP || M < 0 || N < 0 || N % PANEL) return 1;
    OwnedRounded a(M, K, K / GROUP);
    if (!a.ok()) return 2;
    const StoreY store{y, y_bf16 != 0, N};
    augury::prepare_then_run(M, nthreads, [&](augury::Barrier &bar) { round_rows(x, x_bf16 != 0, M, a, bar); },
                             [&](augury::Barrier &bar) { columns(a, M, codes, s, z, N, store, bar); });
    return 0;
}

// GGUF's Q4_0 in its own numbers (w4a8.h's Half): d [N / 16, G, 16] float16 bits, w = (q - 8) d, no zero.
// Returns 0, 1 for bad shapes, 2 when out of memory.
extern "C" int augury_w40_linear(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes,
                                 const uint16_t *d, int64_t N, void *y, int y_bf16, int nthreads) {
    if (K % GROUP || M < 0 || N < 0 || N % PANEL) return 1;
    OwnedRounded a(M, K, K / GROUP);
    if (!a.ok()) return 2;
    const StoreY store{y, y_bf16 != 0, N};
    const Half *s = reinterpret_cast<const Half *>(d), *z = nullptr;
    augury::prepare_then_run(M, nthreads, [&](augury::Barrier &bar) { round_rows(x, x_bf16 != 0, M, a, bar); },
                             [&](augury::Barrier &bar) { columns(a, M, codes, s, z, N, store, bar); });
    return 0;
}

// Q4_K in its own scales (w4a8.h): sm [N / 16, G, 32] uint8 (sc, then m, of the panel's 16 columns, 6-bit),
// dd [N / 16, G / 8, 32] float16 bits (d, then dmin); w = d sc q - dmin m, the float32 form's bits. With
// high [N / 16, G, 64] (null for Q4_K) each code's fifth bit (w4a8.h's panel): Q5_K, q 0..31.
// K a multiple of 256. Returns 0, 1 for bad shapes, 2 when out of memory.
extern "C" int augury_w4k_linear(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes,
                                 const uint8_t *sm, const uint16_t *dd, const uint8_t *high, int64_t N, void *y,
                                 int y_bf16, int nthreads) {
    if (K % (8 * GROUP) || M < 0 || N < 0 || N % PANEL) return 1;
    OwnedRounded a(M, K, K / GROUP);
    if (!a.ok()) return 2;
    const StoreY store{y, y_bf16 != 0, N};
    augury::prepare_then_run(M, nthreads, [&](augury::Barrier &bar) { round_rows(x, x_bf16 != 0, M, a, bar); },
                             [&](augury::Barrier &bar) { columns(a, M, codes, sm, dd, N, store, bar, high); });
    return 0;
}
