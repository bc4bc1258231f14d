// augury's CPU kernel for dense bfloat16 linears (AVX2 + FMA): the weights widened exactly to
// float32 in registers, float32 products and sums, the output rounded once (see bf16.h for the
// order, which makes rows row-count invariant). On CPUs without native bfloat16 arithmetic torch
// emulates bfloat16 GEMMs; this reads the weights once per 4 rows at the memory's pace instead.
// Built at first use by models/cpu_kernels.py.
#include <cstdint>
#include <cstdlib>

#include "bf16.h"

// y [M, N] = x [M, K] w^T (w packed as bf16.h says: [ceil(N / 8), K, 8] bfloat16; K % 8 == 0), then + bias [N] (bfloat16, optional)
// rounded as nn.Linear rounds it: y to bfloat16, + bias, to bfloat16 again; x bfloat16 (1) or
// float32 (0); y bfloat16 (1) or float32 (0, unrounded, bias added in float32).
// Returns 0, 1 for bad shapes, 2 when out of memory.
extern "C" int augury_bf16_linear(const void *x, int x_bf16, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                                  const uint16_t *bias, void *y, int y_bf16, int nthreads) {
    if (K % 8 || M < 0 || N < 0) return 1;
    float *xf = static_cast<float *>(std::malloc(sizeof(float) * static_cast<size_t>(M * K + 8)));
    if (!xf) return 2;
    auto store = [&](int64_t m, int64_t n, float v) {
        if (y_bf16) {
            uint16_t o = augury::f32_to_bf16(v + 0.0f);
            if (bias) o = augury::f32_to_bf16(augury::bf16_to_f32(o) + augury::bf16_to_f32(bias[n]));
            static_cast<uint16_t *>(y)[m * N + n] = o;
        } else {
            static_cast<float *>(y)[m * N + n] = v + (bias ? augury::bf16_to_f32(bias[n]) : 0.0f);
        }
    };
    augury::prepare_then_run(
        M, nthreads, [&](augury::Barrier &bar) { augury::bf16::widen_rows(x, x_bf16 != 0, M, K, xf, bar); },
        [&](augury::Barrier &bar) { augury::bf16::columns(xf, M, K, w, N, store, bar); });
    std::free(xf);
    return 0;
}
