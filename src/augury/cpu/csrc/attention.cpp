// augury's CPU attention for exact rows (attention/torch_paged.py): each query row attends over its
// own list of cache slots (context, then its tree ancestors and itself, in position order), read in
// place from the paged KV cache, in float32 (16- and 8-bit caches are widened exactly). Built at first
// use by models/cpu_kernels.py; torch's attention runs where it cannot be built.
//
// A row's output depends only on its query, its slots and the cache: scores, softmax and the weighted
// sum run in one fixed order per (row, head) whatever the other rows and the threads (threads split
// groups of rows and key-value heads; attention.h's attend_group), so a decode step's row and the same
// token's row in a verification come out bit for bit the same.
#include <cstdint>
#include <vector>

#include "attention.h"

// q [R, nh, hd]; caches [S, nkv, hd] in format kv (attention.h: 0 float32, 1 bfloat16, 2 fp8 e4m3);
// slots [R, W] int64 (the first nkeys[r] are row r's keys, each in 0..S-1); out [R, nh * hd]. hd % 8 == 0, nh % nkv == 0 (query head h reads key-value head h / (nh / nkv)).
// Returns 0, 1 for bad shapes, 2 for a key count outside 1..W, 3 for a slot outside the cache (checked
// before anything is read: the slots are raw offsets).
extern "C" int augury_attend_rows(const void *q, int q_bf16, int64_t R, int64_t nh, int64_t hd, const void *kc,
                                  const void *vc, int kv, int64_t nkv, int64_t S, const int64_t *slots,
                                  const int32_t *nkeys, int64_t W, float scale, void *out, int out_bf16,
                                  int nthreads) {
    if (kv < augury::KV_F32 || kv > augury::KV_FP8 || hd % 8 || hd > 512 || nkv < 1 || nh % nkv || R < 0 || W < 1
        || S < 0)
        return 1;
    for (int64_t r = 0; r < R; r++) {
        if (nkeys[r] < 1 || nkeys[r] > W) return 2;
        for (int64_t j = 0; j < nkeys[r]; j++)
            if (static_cast<uint64_t>(slots[r * W + j]) >= static_cast<uint64_t>(S)) return 3;
    }
    if (nthreads < 1) nthreads = 1;
    const bool parallel = augury::attention_parallel(R, nh, nkv, W);
    augury::AttnPlan plan;
    plan.build(R, slots, W, nkeys, nkv);
#pragma omp parallel num_threads(nthreads) if (parallel)
    {
        augury::AttnScratch scratch;
        int64_t b, e;
        plan.share(omp_get_thread_num(), omp_get_num_threads(), b, e);
        plan.run(b, e, q, q_bf16 != 0, nh, hd, kc, vc, kv, slots, W, nkeys, scale, out, out_bf16 != 0, scratch);
    }
    return 0;
}
