// augury's CPU kernels for small per-row operations of a layer (models/layers.py), where torch's
// several operators per call cost more than the arithmetic at decode sizes: RMSNorm of the float32
// residual stream, the rotary embedding and the MLP's silu(gate) * up. Each computes in float32 and
// rounds its output once; every row on its own, in one fixed order (threads split rows past 64), so
// rows are batch-invariant. The row functions live in elementwise.h (forward.cpp runs the same).
#include <cstdint>

#include "elementwise.h"

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w; x float32 [rows, dim]; w, out bfloat16 (1) or float32 (0)
extern "C" void augury_rmsnorm(const float *x, int64_t rows, int64_t dim, const void *w, int w_bf16, float eps,
                               void *out, int out_bf16, int nthreads) {
    const int ob = out_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static) if (rows > 64)
    for (int64_t r = 0; r < rows; r++)
        augury::rmsnorm_row(x + r * dim, dim, w, w_bf16 != 0, eps, static_cast<char *>(out) + r * dim * ob,
                            out_bf16 != 0);
}

// x [rows, heads, hd] (rows = batch * queries), cos / sin [rows, hd]: Llama's rotate-half rotation,
// out = x cos + rotate_half(x) sin; all bfloat16 (1) or float32 (0) alike
extern "C" void augury_rope(const void *x, int64_t rows, int64_t heads, int64_t hd, const void *cos,
                            const void *sin, int bf16, void *out, int nthreads) {
    const int64_t b = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static) if (rows > 64)
    for (int64_t r = 0; r < rows; r++)
        augury::rope_row(static_cast<const char *>(x) + r * heads * hd * b, heads, hd,
                         static_cast<const char *>(cos) + r * hd * b, static_cast<const char *>(sin) + r * hd * b,
                         bf16 != 0, static_cast<char *>(out) + r * heads * hd * b);
}

// gu [rows, 2 n] (gate then up, as the fused projection writes them) -> out [rows, n] = silu(gate) * up;
// bfloat16 (1) or float32 (0) alike
extern "C" void augury_silu_mul(const void *gu, int64_t rows, int64_t n, int bf16, void *out, int nthreads) {
    const int64_t b = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static) if (rows > 64)
    for (int64_t r = 0; r < rows; r++) {
        const char *g = static_cast<const char *>(gu) + r * 2 * n * b;
        augury::silu_mul_row(g, g + n * b, n, bf16 != 0, static_cast<char *>(out) + r * n * b);
    }
}
