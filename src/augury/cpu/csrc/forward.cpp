// augury's whole layer stack in one call (CPU, bfloat16 activations, int4 weights on the w4a8
// kernel or dense bfloat16 weights on the bf16 kernel, exact attention rows): what models/llama.py runs layer by layer, operator by operator,
// done here inside ONE OpenMP parallel region, so a decode or verification step pays neither
// Python's nor ATen's per-operator cost (~12 ms of a ~28 ms demo decode step measured before) nor a
// thread wake-up per operator. Built at first use by models/cpu_kernels.py; models/fused.py
// decides when it runs and falls back to the layer-by-layer path everywhere else.
//
// Same numbers as the layer-by-layer path, bit for bit (tests/test_fused.py): the same row
// functions (elementwise.h, attention.h, w4a8.h) in the same order, rounding where that path
// rounds: every projection's output to bfloat16 (+ its bfloat16 bias, rounded again), the float32
// residual stream += the rounded output, the norms' and the rotary's outputs to bfloat16. Threads
// split rows or columns, never one value's sum, so rows stay batch- and thread-invariant.
//
// Per layer: h [T, H] float32 -> RMSNorm -> q|k|v -> rotary (q to scratch, k to the cache) and v to
// the cache -> attention over each row's own slots -> o_proj, added to h -> RMSNorm -> gate|up ->
// silu(gate) * up -> down, added to h; the chosen layers' h rounded into aux; the final norm at the end.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "attention.h"
#include "bf16.h"
#include "elementwise.h"
#include "w4a8.h"

using augury::bf16_to_f32;
using augury::f32_to_bf16;
using namespace augury::w4a8;

namespace {

// Fields of one layer's row in the pointer table (addresses; 0 for an absent bias; a dense projection
// has its packed weights in the _C field and 0 in _S and _Z)
enum Field {
    LN1, QKV_C, QKV_S, QKV_Z, QKV_B, O_C, O_S, O_Z, O_B, LN2, GU_C, GU_S, GU_Z, GU_B, DN_C, DN_S, DN_Z, DN_B, NFIELD
};

template <class T>
inline T *at(const int64_t *row, int f) {
    return reinterpret_cast<T *>(static_cast<uintptr_t>(row[f]));
}

inline int64_t padded_groups(int64_t K) { return (K / GROUP + CHUNK - 1) / CHUNK * CHUNK; }

// One projection of the rows x [T, K] (bfloat16) whose fields start at f: int4 on the w4a8 kernel
// (codes, scale, zero, bias), or dense bfloat16 panels (bf16.h) when the scale field is 0 (packed
// weights, 0, 0, bias). Worksharing loops: every thread of the region calls it.
template <class Store>
inline void project(const int64_t *p, int f, const uint16_t *x, int64_t T, Rounded &a, float *xf, int64_t N,
                    Store store) {
    const uint16_t *s = at<const uint16_t>(p, f + 1);
    if (s) {
        round_rows(x, true, T, a);
        columns(a, T, at<const uint8_t>(p, f), s, at<const uint16_t>(p, f + 2), N, store);
    } else {
        augury::bf16::widen_rows(x, true, T, a.K, xf);
        augury::bf16::columns(xf, T, a.K, at<const uint16_t>(p, f), N, store);
    }
}

}  // namespace

extern "C" int augury_forward_nfields() { return NFIELD; }

// h [T, H] float32, updated in place; layers [L, NFIELD] addresses; caches [L, S, nkv, hd] bfloat16
// (layer l at k_cache + l * layer_stride elements); slot_mapping [T]: where row t's key and value go;
// slots [T, W] / nkeys [T]: the cache slots row t attends to (the first nkeys[t]); cos / sin [T, hd]
// bfloat16 (a slot outside the cache is refused: return 1); aux [n_aux] layer indices whose output h is written, rounded, to aux_out [T, n_aux * H];
// out [T, H] bfloat16: the final norm of h. Returns 0, 1 for bad shapes, 2 when out of memory.
extern "C" int augury_forward_layers(float *h, int64_t T, int64_t H, int64_t nh, int64_t nkv, int64_t hd,
                                     int64_t I, int64_t L, float eps, const int64_t *layers, uint16_t *k_cache,
                                     uint16_t *v_cache, int64_t layer_stride, const int64_t *slot_mapping,
                                     const int64_t *slots, const int32_t *nkeys, int64_t W, const uint16_t *cos,
                                     const uint16_t *sin, const int32_t *aux, int64_t n_aux, uint16_t *aux_out,
                                     const uint16_t *final_w, uint16_t *out, int nthreads) {
    const int64_t NQ = nh * hd, NKV = nkv * hd, NQKV = NQ + 2 * NKV;
    if (T < 0 || H % GROUP || NQ % GROUP || I % GROUP || hd % 8 || hd > 512 || nkv < 1 || nh % nkv || W < 1)
        return 1;
    const int64_t S = layer_stride / NKV;  // cache slots per layer: every slot read or written must lie inside
    for (int64_t t = 0; t < T; t++) {
        if (nkeys[t] < 1 || nkeys[t] > W || slot_mapping[t] < 0 || slot_mapping[t] >= S) return 1;
        for (int64_t j = 0; j < nkeys[t]; j++)
            if (slots[t * W + j] < 0 || slots[t * W + j] >= S) return 1;
    }
    const int64_t Kmax = H > I ? (H > NQ ? H : NQ) : (I > NQ ? I : NQ);
    const int64_t Gmax = padded_groups(Kmax);
    // scratch: one block, carved up
    const size_t n16 = static_cast<size_t>(T) * static_cast<size_t>(H + NQKV + NQ + NQ + 2 * I + I);
    const size_t bytes = n16 * 2 + static_cast<size_t>(T * Kmax) * 5 + static_cast<size_t>(T * Gmax) * 12 + 256;
    char *mem = static_cast<char *>(std::malloc(bytes));
    if (!mem) return 2;
    uint16_t *xn = reinterpret_cast<uint16_t *>(mem);  // a norm's output [T, H]
    uint16_t *qkv = xn + T * H;                        // [T, NQKV]
    uint16_t *qr = qkv + T * NQKV;                     // rotated queries [T, NQ]
    uint16_t *att = qr + T * NQ;                       // attention output [T, NQ]
    uint16_t *gu = att + T * NQ;                       // [T, 2 I]
    uint16_t *act = gu + T * 2 * I;                    // silu(gate) * up [T, I]
    int8_t *xq = reinterpret_cast<int8_t *>(act + T * I);
    float *dx = reinterpret_cast<float *>((reinterpret_cast<uintptr_t>(xq + T * Kmax) + 63) & ~uintptr_t(63));
    float *xs = dx + T * Gmax;
    int32_t *xsum = reinterpret_cast<int32_t *>(xs + T * Gmax);
    float *xf = reinterpret_cast<float *>(xsum + T * Gmax);  // dense projections' widened rows [T, Kmax]
    Rounded aH, aQ, aI;  // the rounded activations for K = H, nh * hd and I (one scratch, used in turn)
    for (Rounded *a : {&aH, &aQ, &aI}) {
        a->xq = xq;
        a->dx = dx;
        a->xs = xs;
        a->xsum = xsum;
    }
    aH.K = H, aH.Gp = padded_groups(H);
    aQ.K = NQ, aQ.Gp = padded_groups(NQ);
    aI.K = I, aI.Gp = padded_groups(I);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    // the region's threads are awake already: split the (row, key-value head) tasks whenever there are two
    const bool split_attention = T * nkv > 1;
    if (nthreads < 1) nthreads = 1;

#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> scores;
        for (int64_t l = 0; l < L; l++) {
            const int64_t *p = layers + l * NFIELD;
            uint16_t *kc = k_cache + l * layer_stride, *vc = v_cache + l * layer_stride;
            // a projection's output rounded to bfloat16 (+ its bias, rounded again), as nn.Linear's
            auto rounded = [](float v, const uint16_t *bias, int64_t n) {
                float y = bf16_to_f32(f32_to_bf16(v + 0.0f));
                if (bias) y = bf16_to_f32(f32_to_bf16(y + bf16_to_f32(bias[n])));
                return y;
            };
            const uint16_t *qkv_b = at<const uint16_t>(p, QKV_B), *o_b = at<const uint16_t>(p, O_B);
            const uint16_t *gu_b = at<const uint16_t>(p, GU_B), *dn_b = at<const uint16_t>(p, DN_B);

#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                augury::rmsnorm_row(h + t * H, H, at<const void>(p, LN1), true, eps, xn + t * H, true);
            project(p, QKV_C, xn, T, aH, xf, NQKV, [&](int64_t m, int64_t n, float v) {
                        qkv[m * NQKV + n] = f32_to_bf16(rounded(v, qkv_b, n));
                    });
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                const uint16_t *row = qkv + t * NQKV;
                const int64_t slot = slot_mapping[t];
                augury::rope_row(row, nh, hd, cos + t * hd, sin + t * hd, true, qr + t * NQ);
                augury::rope_row(row + NQ, nkv, hd, cos + t * hd, sin + t * hd, true, kc + slot * NKV);
                std::memcpy(vc + slot * NKV, row + NQ + NKV, static_cast<size_t>(NKV) * 2);
            }
            if (split_attention) {
#pragma omp for schedule(static)
                for (int64_t task = 0; task < T * nkv; task++) {
                    const int64_t t = task / nkv, g = task % nkv;
                    augury::attend_task(qr, true, t, g, nh, hd, kc, vc, true, nkv, slots + t * W, nkeys[t], scale,
                                        att, true, scores);
                }
            } else {
#pragma omp single
                for (int64_t task = 0; task < T * nkv; task++) {
                    const int64_t t = task / nkv, g = task % nkv;
                    augury::attend_task(qr, true, t, g, nh, hd, kc, vc, true, nkv, slots + t * W, nkeys[t], scale,
                                        att, true, scores);
                }
            }
            project(p, O_C, att, T, aQ, xf, H, [&](int64_t m, int64_t n, float v) { h[m * H + n] += rounded(v, o_b, n); });
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                augury::rmsnorm_row(h + t * H, H, at<const void>(p, LN2), true, eps, xn + t * H, true);
            project(p, GU_C, xn, T, aH, xf, 2 * I, [&](int64_t m, int64_t n, float v) {
                        gu[m * 2 * I + n] = f32_to_bf16(rounded(v, gu_b, n));
                    });
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                augury::silu_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, I, true, act + t * I);
            project(p, DN_C, act, T, aI, xf, H, [&](int64_t m, int64_t n, float v) { h[m * H + n] += rounded(v, dn_b, n); });
            for (int64_t a = 0; a < n_aux; a++) {
                if (aux[a] != l) continue;
#pragma omp for schedule(static)
                for (int64_t t = 0; t < T; t++)
                    for (int64_t j = 0; j < H; j++) aux_out[t * n_aux * H + a * H + j] = f32_to_bf16(h[t * H + j]);
            }
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) augury::rmsnorm_row(h + t * H, H, final_w, true, eps, out + t * H, true);
    }
    std::free(mem);
    return 0;
}
