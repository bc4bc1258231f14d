// augury's CPU kernels for small per-row operations of a layer (models/layers.py), where torch's
// several operators per call cost more than the arithmetic at decode sizes: RMSNorm of the float32
// residual stream, the rotary embedding and the MLP's silu(gate) * up (and, at the end, the sampler's
// draw of a temperature-only row). Each computes in float32 and
// rounds its output once; every row on its own, in one fixed order (threads split rows past 64), so
// rows are batch-invariant. The row functions live in elementwise.h (forward.cpp runs the same).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
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

namespace {

constexpr int64_t DRAW_BLOCK = 256;

// float64 sums of DRAW_BLOCK p's at a time (8 lanes widened into two 4-lane sums, then (s0 + s2) +
// (s1 + s3), a tail after them in order): sums[b] for each block
void block_sums(const float *p, int64_t V, double *sums) {
    for (int64_t lo = 0, b = 0; lo < V; lo += DRAW_BLOCK, b++) {
        const int64_t hi = lo + DRAW_BLOCK < V ? lo + DRAW_BLOCK : V;
        __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
        int64_t i = lo;
        for (; i + 8 <= hi; i += 8) {
            const __m256 e = _mm256_loadu_ps(p + i);
            s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        alignas(32) double d[4];
        _mm256_store_pd(d, _mm256_add_pd(s0, s1));
        double s = (d[0] + d[2]) + (d[1] + d[3]);
        for (; i < hi; i++) s += static_cast<double>(p[i]);
        sums[b] = s;
    }
}

// The token at uniform u of the masses p (V of them, block sums `sums`): the first block whose running
// total exceeds u * total; within it, p's added one by one from the blocks before, the first token at
// which the sum exceeds it (a token of mass 0 never does), else (rounding between the block's sum and
// its one-by-one sum) the block's last token of positive mass; u * total at or past the whole total:
// the last token of positive mass; -1 where no token has mass.
int64_t pick_at(const float *p, int64_t V, const double *sums, double u) {
    const int64_t nb = (V + DRAW_BLOCK - 1) / DRAW_BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < nb; b++) total += sums[b];
    if (!(total > 0.0)) return -1;
    const double target = u * total;
    double before = 0.0;
    for (int64_t b = 0; b < nb; b++) {
        if (before + sums[b] > target) {
            const int64_t lo = b * DRAW_BLOCK, hi = lo + DRAW_BLOCK < V ? lo + DRAW_BLOCK : V;
            double c = before;
            for (int64_t k = lo; k < hi; k++) {
                c += static_cast<double>(p[k]);
                if (c > target) return k;
            }
            for (int64_t k = hi - 1; k >= lo; k--)
                if (p[k] > 0.0f) return k;
        }
        before += sums[b];
    }
    for (int64_t k = V - 1; k >= 0; k--)
        if (p[k] > 0.0f) return k;
    return -1;
}

// the k-th largest of y's V values (duplicates counted), 1 <= k <= V: a min-heap of the k largest
float kth_largest(const float *y, int64_t V, int64_t k, std::vector<float> &heap) {
    heap.assign(y, y + k);
    std::make_heap(heap.begin(), heap.end(), std::greater<float>());
    for (int64_t j = k; j < V; j++)
        if (y[j] > heap.front()) {
            std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
            heap.back() = y[j];
            std::push_heap(heap.begin(), heap.end(), std::greater<float>());
        }
    return heap.front();
}

// top-p's edge over the masses p (each in [0, 1], the largest 1, their total `total`): the smallest
// value v among the masses whose mass above them, F(v) = sum of the masses > v, is < top_p * total
// (a tie at the edge is kept whole; at least the largest mass is). Found without sorting the row: the
// masses' float bits >> 19 (exponent and 4 mantissa bits, in the order of the values) name 4,096
// buckets; their float64 sums (in token order) from the top give the bucket where the running mass
// reaches top_p * total, and only that bucket's members are sorted, their F the buckets above plus
// the members above them.
float nucleus_edge(const float *p, int64_t V, double top_p, double total, std::vector<double> &mass,
                   std::vector<float> &members) {
    constexpr int NB = 4096;
    mass.assign(NB, 0.0);
    auto key = [](float v) {
        uint32_t b;
        std::memcpy(&b, &v, 4);
        return static_cast<int>(b >> 19);
    };
    for (int64_t j = 0; j < V; j++)
        if (p[j] > 0.0f) mass[key(p[j])] += static_cast<double>(p[j]);
    const double want = top_p * total;
    double above = 0.0;
    int bucket = NB - 1;
    for (; bucket > 0; bucket--) {
        if (mass[bucket] > 0.0 && above + mass[bucket] >= want) break;
        above += mass[bucket];
    }
    members.clear();
    for (int64_t j = 0; j < V; j++)
        if (p[j] > 0.0f && key(p[j]) == bucket) members.push_back(p[j]);
    std::sort(members.begin(), members.end(), std::greater<float>());
    float edge = 1.0f;  // the largest mass (exp8(0)): kept whatever top_p is
    double f = above;   // the mass above the member at hand
    for (size_t i = 0; i < members.size();) {
        const float v = members[i];
        if (!(f < want)) break;
        edge = v;  // the members come in descending order
        size_t e = i;
        while (e < members.size() && members[e] == v) f += static_cast<double>(members[e++]);
        i = e;
    }
    return edge;
}

}  // namespace

// One token per row of logits [rows, V] float32 (raw, or shaped by the request: a grammar's -inf
// entries included), drawn at the row's uniform u in [0, 1) from softmax(x / t) filtered as
// sampling.apply_sampling_filters filters it (vLLM's order): top_k[r] > 0 keeps the logits at or
// above the k-th largest of x / t (ties kept), min_p[r] > 0 drops the masses under min_p times the
// largest, top_p[r] < 1 keeps the smallest most-probable set whose mass reaches top_p (ties at its
// edge kept); the draw is over what is kept. The sampler's and the verifier's draw
// (sampling.draw_sampled), in place of torch's divide, top-k, softmax, sort or top-k of 1,024 for
// top-p, float64 cumulative sum and search. In the engine on the Zen 5 VM (demo, 49,152 tokens, T=1):
// temperature alone 0.38 ms a row with an unused argmax against 0.09 ms here, most of that the first
// read of a row the output layer's threads left in another core's cache (0.04 ms on a row already
// in cache); top_p 0.9-0.95 a median of 0.82-0.89 ms a row (up to 4.2 ms where a flat row's
// nucleus passed the 1,024 most probable and torch sorted the row), 22-25% of decoding's time.
// Per row, in one fixed order on every ISA level (8-lane AVX2 code and scalar code only, so the same
// bits): m = max_j x_j; y_j = x_j / t; with top-k, the k-th largest y (a heap); p_j = exp8(y_j - m / t)
// (max(x) / t is max(x / t): division rounds monotonically; exp8(0) = 1 for the largest), 0 where
// top-k or min-p drops it; with top-p, its edge (nucleus_edge) over these masses and their block
// sums' total, and the masses under the edge set to 0; the draw (pick_at) over the block sums of
// what is left. A NaN logit, a +inf one (torch's softmax gives NaN there) or no finite one: -1
// (NO_TOKEN). temps > 0; out int64 [rows].
extern "C" void augury_draw_filtered(const float *logits, int64_t rows, int64_t V, const float *temps,
                                     const int64_t *top_k, const float *top_p, const float *min_p,
                                     const double *us, int64_t *out) {
    // kept between calls (a fresh 200 KB buffer could come from mmap, page faults and all)
    static thread_local std::vector<float> p, y, heap, members;
    static thread_local std::vector<double> sums, mass;
    p.resize(static_cast<size_t>(V));
    sums.resize(static_cast<size_t>((V + DRAW_BLOCK - 1) / DRAW_BLOCK));
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
        const int64_t k = top_k[r];
        float kth = -INFINITY;  // logits / t below it are dropped
        const float *yk = nullptr;  // x / t, where top-k computed it (the pass below reads it back)
        if (k > 0 && k < V) {
            y.resize(static_cast<size_t>(V));
            for (j = 0; j + 8 <= V; j += 8) _mm256_storeu_ps(y.data() + j, _mm256_div_ps(_mm256_loadu_ps(x + j), tv));
            for (; j < V; j++) y[j] = x[j] / t;
            kth = kth_largest(y.data(), V, k, heap);
            yk = y.data();
        }
        const float floor_p = min_p[r] > 0.0f ? min_p[r] : 0.0f;  // masses below it are dropped
        const __m256 kv = _mm256_set1_ps(kth), fv = _mm256_set1_ps(floor_p);
        for (j = 0; j + 8 <= V; j += 8) {
            const __m256 q = yk ? _mm256_loadu_ps(yk + j) : _mm256_div_ps(_mm256_loadu_ps(x + j), tv);
            __m256 e = augury::exp8(_mm256_sub_ps(q, mv));
            const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(q, kv, _CMP_GE_OQ), _mm256_cmp_ps(e, fv, _CMP_GE_OQ));
            _mm256_storeu_ps(p.data() + j, _mm256_and_ps(e, keep));
        }
        if (j < V) {  // the row's last few: exp8 over a padded group
            alignas(32) float tail[8], q[8];
            for (int64_t i = 0; i < 8; i++) {
                q[i] = j + i < V ? (yk ? yk[j + i] : x[j + i] / t) : -INFINITY;
                tail[i] = q[i] - m / t;
            }
            _mm256_store_ps(tail, augury::exp8(_mm256_load_ps(tail)));
            for (int64_t i = 0; j + i < V; i++) p[j + i] = q[i] >= kth && tail[i] >= floor_p ? tail[i] : 0.0f;
        }
        block_sums(p.data(), V, sums.data());
        if (top_p[r] < 1.0f) {
            double total = 0.0;
            for (double s : sums) total += s;
            const float edge = nucleus_edge(p.data(), V, static_cast<double>(top_p[r]), total, mass, members);
            for (j = 0; j < V; j++)
                if (p[j] < edge) p[j] = 0.0f;
            block_sums(p.data(), V, sums.data());
        }
        out[r] = pick_at(p.data(), V, sums.data(), us[r]);
    }
}
