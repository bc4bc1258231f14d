// augury's CPU attention for exact rows (attention/torch_paged.py): each query row attends over its
// own list of cache slots (context, then its tree ancestors and itself, in position order), read in
// place from the paged KV cache, in float32 (16-bit caches are widened exactly). Built at first use by
// models/cpu_kernels.py; torch's attention runs where it cannot be built.
//
// A row's output depends only on its query, its slots and the cache: scores, softmax and the weighted
// sum run in one fixed order per (row, head) whatever the other rows and the threads (threads split
// rows and key-value heads), so a decode step's row and the same token's row in a verification come
// out bit for bit the same.
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

using augury::f32_to_bf16;
using augury::hsum;
using augury::load8;

// q [R, nh, hd]; caches [S, nkv, hd]; slots [R, W] int64 (the first nkeys[r] are row r's keys);
// out [R, nh * hd]. hd % 8 == 0, nh % nkv == 0 (query head h reads key-value head h / (nh / nkv)).
// Returns 0, or 1 for bad shapes.
extern "C" int augury_attend_rows(const void *q, int q_bf16, int64_t R, int64_t nh, int64_t hd, const void *kc,
                                  const void *vc, int kv_bf16, int64_t nkv, const int64_t *slots,
                                  const int32_t *nkeys, int64_t W, float scale, void *out, int out_bf16,
                                  int nthreads) {
    if (hd % 8 || hd > 512 || nkv < 1 || nh % nkv || R < 0 || W < 1) return 1;
    for (int64_t r = 0; r < R; r++)
        if (nkeys[r] < 1 || nkeys[r] > W) return 1;
    const int64_t rep = nh / nkv, nv = hd / 8;
    if (nthreads < 1) nthreads = 1;
    // waking a sleeping thread costs tens of microseconds: only past a few thousand scores
    const bool parallel = R * nkv > 1 && R * nh * W >= 8192;
#pragma omp parallel num_threads(nthreads) if (parallel)
    {
        std::vector<float> scores;
        __m256 qv[64], acc[64];  // hd / 8 <= 64
#pragma omp for schedule(static)
        for (int64_t t = 0; t < R * nkv; t++) {
            const int64_t r = t / nkv, g = t % nkv, n = nkeys[r];
            const int64_t *sl = slots + r * W;
            scores.resize(static_cast<size_t>(n));
            for (int64_t h = g * rep; h < (g + 1) * rep; h++) {
                for (int64_t i = 0; i < nv; i++)
                    qv[i] = _mm256_mul_ps(load8(q, q_bf16, (r * nh + h) * hd + 8 * i), _mm256_set1_ps(scale));
                float m = -INFINITY;
                for (int64_t j = 0; j < n; j++) {
                    const int64_t base = (sl[j] * nkv + g) * hd;
                    __m256 s = _mm256_setzero_ps();
                    for (int64_t i = 0; i < nv; i++) s = _mm256_fmadd_ps(qv[i], load8(kc, kv_bf16, base + 8 * i), s);
                    const float x = hsum(s);
                    scores[j] = x;
                    m = x > m ? x : m;
                }
                float l = 0.0f;
                for (int64_t i = 0; i < nv; i++) acc[i] = _mm256_setzero_ps();
                for (int64_t j = 0; j < n; j++) {
                    const float p = std::exp(scores[j] - m);
                    l += p;
                    const __m256 pv = _mm256_set1_ps(p);
                    const int64_t base = (sl[j] * nkv + g) * hd;
                    for (int64_t i = 0; i < nv; i++) acc[i] = _mm256_fmadd_ps(pv, load8(vc, kv_bf16, base + 8 * i), acc[i]);
                }
                const __m256 inv = _mm256_set1_ps(1.0f / l);
                const int64_t o = (r * nh + h) * hd;
                for (int64_t i = 0; i < nv; i++) {
                    alignas(32) float v[8];
                    _mm256_store_ps(v, _mm256_mul_ps(acc[i], inv));
                    for (int e = 0; e < 8; e++) {
                        if (out_bf16)
                            static_cast<uint16_t *>(out)[o + 8 * i + e] = f32_to_bf16(v[e]);
                        else
                            static_cast<float *>(out)[o + 8 * i + e] = v[e];
                    }
                }
            }
        }
    }
    return 0;
}
