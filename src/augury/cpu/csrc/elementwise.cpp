// augury's CPU kernels for small per-row operations of a layer (models/layers.py), where torch's
// several operators per call cost more than the arithmetic at decode sizes: RMSNorm of the float32
// residual stream, the rotary embedding and the MLP's silu(gate) * up (and, at the end, the sampler's
// draw of a temperature-only row). Each computes in float32 and
// rounds its output once; every row on its own, in one fixed order (threads split rows past 64), so
// rows are batch-invariant. The row functions live in elementwise.h (forward.cpp runs the same).
#include <cmath>
#include <cstdint>
#include <vector>

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

// One token per row of logits [rows, V] float32 (raw, or shaped by the request: a grammar's -inf
// entries included), drawn from softmax(x / t) at the row's uniform u in [0, 1): the sampler's path
// for rows whose only filter is a temperature t > 0 (sampling.draw_sampled), in place of torch's
// divide, softmax, float64 cumulative sum and search (in the engine on the Zen 5 VM, 0.38 ms a
// 49,152-token row with an unused argmax, against 0.09 ms here, most of it the first read of a row
// the output layer's threads left in another core's cache; 0.04 ms on a row already in cache). Per row, in one fixed order on every ISA level (8-lane AVX2 code
// only): m = max_j x_j; y_j = x_j / t, p_j = exp8(y_j - m / t), stored in scratch (max(x) / t is max(x / t):
// division rounds monotonically); block sums of 256 p's in float64 (8 lanes widened into two
// 4-lane sums, then (s0 + s2) + (s1 + s3), a tail after them in order); the running total over
// blocks; u * total; the first block whose running total exceeds it; within it, p's added one by one
// from the blocks before, the first token at which the sum exceeds it (a token of mass 0 never does),
// else (rounding between the block's sum and its one-by-one sum) the block's last token of positive
// mass; u * total at or past the whole total: the row's last token of positive mass. A NaN logit, a
// +inf one (torch's softmax gives NaN there) or no finite one: -1 (NO_TOKEN). out int64 [rows].
extern "C" void augury_draw_temperature(const float *logits, int64_t rows, int64_t V, const float *temps,
                                        const double *us, int64_t *out) {
    constexpr int64_t BLOCK = 256;
    static thread_local std::vector<float> p;  // kept between calls: a fresh 200 KB buffer each call
    static thread_local std::vector<double> sums;  // could come from mmap, page faults and all
    p.resize(static_cast<size_t>(V));
    sums.resize(static_cast<size_t>((V + BLOCK - 1) / BLOCK));
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * V;
        const float t = temps[r];
        // the largest logit; NaN anywhere marks the row
        __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= V; j += 8) {
            const __m256 v = _mm256_loadu_ps(x + j);
            mx = _mm256_max_ps(mx, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, mx);
        float m = lanes[0];
        for (int e = 1; e < 8; e++) m = lanes[e] > m ? lanes[e] : m;
        bool bad = _mm256_movemask_ps(nan) != 0;
        for (; j < V; j++) {
            bad = bad || std::isnan(x[j]);
            m = x[j] > m ? x[j] : m;
        }
        if (bad || !(m > -INFINITY) || m == INFINITY || !(t > 0.0f)) {
            out[r] = -1;
            continue;
        }
        const __m256 tv = _mm256_set1_ps(t), mv = _mm256_set1_ps(m / t);
        const int64_t nb = (V + BLOCK - 1) / BLOCK;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t lo = b * BLOCK, hi = lo + BLOCK < V ? lo + BLOCK : V;
            __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
            int64_t i = lo;
            for (; i + 8 <= hi; i += 8) {
                const __m256 e = augury::exp8(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), tv), mv));
                _mm256_storeu_ps(p.data() + i, e);
                s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
                s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
            }
            alignas(32) double d[4];
            _mm256_store_pd(d, _mm256_add_pd(s0, s1));
            double s = (d[0] + d[2]) + (d[1] + d[3]);
            if (i < hi) {  // the row's last few: exp8 over a padded group, added in order
                alignas(32) float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int64_t k = i; k < hi; k++) tail[k - i] = x[k] / t - m / t;
                for (int64_t k = hi; k < i + 8; k++) tail[k - i] = -INFINITY;
                _mm256_store_ps(tail, augury::exp8(_mm256_load_ps(tail)));
                for (int64_t k = i; k < hi; k++) {
                    p[k] = tail[k - i];
                    s += static_cast<double>(tail[k - i]);
                }
            }
            sums[b] = s;
        }
        double total = 0.0;
        for (int64_t b = 0; b < nb; b++) total += sums[b];
        const double target = us[r] * total;
        int64_t pick = -1;
        double before = 0.0;
        for (int64_t b = 0; b < nb && pick < 0; b++) {
            if (before + sums[b] > target) {
                const int64_t lo = b * BLOCK, hi = lo + BLOCK < V ? lo + BLOCK : V;
                double c = before;
                for (int64_t k = lo; k < hi; k++) {
                    c += static_cast<double>(p[k]);
                    if (c > target) {
                        pick = k;
                        break;
                    }
                }
                for (int64_t k = hi - 1; pick < 0 && k >= lo; k--)
                    if (p[k] > 0.0f) pick = k;
            }
            before += sums[b];
        }
        for (int64_t k = V - 1; pick < 0 && k >= 0; k--)
            if (p[k] > 0.0f) pick = k;
        out[r] = pick;
    }
}
