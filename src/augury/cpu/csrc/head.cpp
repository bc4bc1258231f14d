// An EAGLE-3 head's forward in one call (CPU, bfloat16 activations, a float32 residual stream): what
// models/eagle3_head.py runs operator by operator, for the rows of one draft level or one catch-up
// chunk of every request at once, its linears on the target's kernels in their own formats
// (project.h: int4 on w4a8, int8 on w8a8's general form, dense bfloat16 panels), then the draft
// vocabulary's top k and their log-softmax values for the rows asked, without a float row going
// back to Python. models/eagle3_fused.py builds the pointer table and decides when it runs.
//
// Per row t: [h = fc(aux features), when given] -> x = cat(RMSNorm_in(embed(token)), RMSNorm_h(h)) ->
// q|k|v -> rotary (q to scratch, k to the cache at slot_mapping[t]), v to the cache -> attention over
// the row's own slots (its context, then its tree ancestors and itself) -> h += o_proj -> RMSNorm ->
// gate|up -> silu(gate) * up -> h += down. h (the pre-norm output, fed back as the next level's h)
// stays float32 and comes back in place. For the rows in logit_rows: RMSNorm(h) -> lm_head (float32
// sums) -> the k largest logits (ties to the lower id) and logit - logsumexp over the row's first Vd.
//
// Bits: every part is a row function of project.h, elementwise.h and attention.h, which compute a
// row in one fixed order whatever the other rows, the threads and the ISA level (threads split rows
// or columns, never one value's sum); the logsumexp sums 8 lanes in column order, then the lanes,
// with the same exp8 on every level. So a row's outputs are the same bits at every ISA level, thread
// count and batch.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "attention.h"
#include "elementwise.h"
#include "project.h"

namespace {

using namespace augury::proj;

// The head's pointer table (one int64 row): each projection's fields in Part's order, each norm's
// bfloat16 weight.
enum HeadField {
    FC = 0,
    LN_IN = FC + PART_FIELDS,  // input_layernorm (on the token's embedding)
    HNORM,                     // hidden_norm (on h)
    QKV,
    O = QKV + PART_FIELDS,
    LN2 = O + PART_FIELDS,  // post_attention_layernorm
    GU,
    DN = GU + PART_FIELDS,
    NORM = DN + PART_FIELDS,  // the final norm, before lm_head
    LM,
    NFIELD = LM + PART_FIELDS
};

// The k largest of x[0..n) (larger first, equal values in id order) and their x - logsumexp(x).
void top_row(const float *x, int64_t n, int64_t k, int64_t *ids, float *lp) {
    int64_t cnt = 0;
    for (int64_t j = 0; j < n; j++) {
        const float v = x[j];
        if (cnt == k && !(v > lp[k - 1])) continue;
        int64_t i = cnt < k ? cnt++ : k - 1;
        for (; i > 0 && v > lp[i - 1]; i--) {
            lp[i] = lp[i - 1];
            ids[i] = ids[i - 1];
        }
        lp[i] = v;
        ids[i] = j;
    }
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m8);
    float m = lanes[0];
    for (int e = 1; e < 8; e++) m = lanes[e] > m ? lanes[e] : m;
    for (int64_t e = j; e < n; e++) m = x[e] > m ? x[e] : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 s8 = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) s8 = _mm256_add_ps(s8, augury::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv)));
    if (j < n) {  // the tail through a buffer padded with -inf (exp8 gives 0 there): the same lanes' sums
        alignas(32) float t[8];
        for (int e = 0; e < 8; e++) t[e] = j + e < n ? x[j + e] : -INFINITY;
        s8 = _mm256_add_ps(s8, augury::exp8(_mm256_sub_ps(_mm256_load_ps(t), mv)));
    }
    const float lse = m + std::log(augury::hsum(s8));
    for (int64_t i = 0; i < cnt; i++) lp[i] -= lse;
}

struct Head {
    // arguments
    const int64_t *p;
    int64_t T, H, A, nh, nkv, hd, I;
    float eps;
    const uint16_t *aux;
    float *h;
    const int64_t *tokens;
    const uint16_t *embed;
    int64_t V;
    uint16_t *kc, *vc;
    int64_t S;
    const int64_t *slot_mapping, *slots;
    const int32_t *nkeys;
    int64_t W;
    const uint16_t *cos, *sin;
    const int64_t *logit_rows;
    int64_t R, NL, Vd, K;
    int64_t *top_ids;
    float *top_lp;
    int nthreads;
    // scratch
    int64_t NQ = 0, NKV = 0, NQKV = 0;
    float scale = 0;
    char *mem = nullptr;
    uint16_t *xn = nullptr, *qkv = nullptr, *qr = nullptr, *att = nullptr, *gu = nullptr, *act = nullptr;
    float *e32 = nullptr, *xf = nullptr, *logits = nullptr;
    Rounded aA, aX, aQ, aI, aH;
    augury::Barrier bar;

    // 0, 1 (bad shapes, ids, rows or slots) or 2 (out of memory)
    int setup() {
        NQ = nh * hd, NKV = nkv * hd, NQKV = NQ + 2 * NKV;
        if (T < 0 || H % GROUP || NQ % GROUP || I % GROUP || A % GROUP || hd % 8 || hd > 512 || nkv < 1 ||
            nh % nkv || W < 1 || R < 0 || R > T || NL % 16 || Vd < 1 || Vd > NL || (R > 0 && (K < 1 || K > Vd)))
            return 1;
        if (aux && A < 1) return 1;
        for (int64_t t = 0; t < T; t++) {
            if (tokens[t] < 0 || tokens[t] >= V || nkeys[t] < 1 || nkeys[t] > W || slot_mapping[t] < 0 ||
                slot_mapping[t] >= S)
                return 1;
            for (int64_t j = 0; j < nkeys[t]; j++)
                if (slots[t * W + j] < 0 || slots[t * W + j] >= S) return 1;
        }
        for (int64_t r = 0; r < R; r++)
            if (logit_rows[r] < 0 || logit_rows[r] >= T) return 1;
        int64_t Kmax = 2 * H;
        for (int64_t k : {A, NQ, I})
            if (k > Kmax) Kmax = k;
        const int64_t Gmax = padded_groups(Kmax);
        const size_t n16 = static_cast<size_t>(T) * static_cast<size_t>(2 * H + NQKV + 2 * NQ + 3 * I);
        const size_t n32 = static_cast<size_t>(T) * static_cast<size_t>(H + Kmax) + static_cast<size_t>(R * NL);
        const size_t bytes = n16 * 2 + n32 * 4 + static_cast<size_t>(T * Kmax) + static_cast<size_t>(T * Gmax) * 16 + 256;
        mem = static_cast<char *>(std::malloc(bytes));
        if (!mem) return 2;
        xn = reinterpret_cast<uint16_t *>(mem);  // the two norms side by side [T, 2H] (then one norm [T, H])
        qkv = xn + T * 2 * H;                    // [T, NQKV]
        qr = qkv + T * NQKV;                     // rotated queries [T, NQ]
        att = qr + T * NQ;                       // [T, NQ]
        gu = att + T * NQ;                       // [T, 2I]
        act = gu + T * 2 * I;                    // [T, I]
        float *f = reinterpret_cast<float *>((reinterpret_cast<uintptr_t>(act + T * I) + 63) & ~uintptr_t(63));
        e32 = f;                   // the tokens' embeddings, widened [T, H]
        xf = e32 + T * H;          // dense projections' widened rows [T, Kmax]
        logits = xf + T * Kmax;    // [R, NL]
        float *dx = logits + R * NL;
        float *xs = dx + T * Gmax;
        int32_t *xsum = reinterpret_cast<int32_t *>(xs + T * Gmax);
        int32_t *xlo = xsum + T * Gmax;
        int8_t *xq = reinterpret_cast<int8_t *>(xlo + T * Gmax);
        const int64_t widths[5] = {A, 2 * H, NQ, I, H};
        Rounded *rs[5] = {&aA, &aX, &aQ, &aI, &aH};
        for (int i = 0; i < 5; i++) {  // one buffer, used in turn
            rs[i]->xq = xq, rs[i]->dx = dx, rs[i]->xs = xs, rs[i]->xsum = xsum, rs[i]->xlo = xlo;
            rs[i]->K = widths[i], rs[i]->Gp = padded_groups(widths[i] > 0 ? widths[i] : GROUP);
        }
        scale = 1.0f / std::sqrt(static_cast<float>(hd));
        if (nthreads < 1) nthreads = 1;
        if (aux) std::memset(h, 0, sizeof(float) * static_cast<size_t>(T * H));  // h = 0 + fc's rounded output
        return 0;
    }

    ~Head() { std::free(mem); }

    void run(std::vector<float> &scores) {
        if (aux) project(p, FC, aux, T, aA, xf, H, AddRounded{h, H, at<const uint16_t>(p, FC + P_B)}, bar);
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < T; t++) {
            float *e = e32 + t * H;
            const uint16_t *row = embed + tokens[t] * H;
            for (int64_t j = 0; j < H; j++) e[j] = augury::bf16_to_f32(row[j]);
            augury::rmsnorm_row(e, H, at<const void>(p, LN_IN), true, eps, xn + t * 2 * H, true);
            augury::rmsnorm_row(h + t * H, H, at<const void>(p, HNORM), true, eps, xn + t * 2 * H + H, true);
        }
        bar.wait();
        project(p, QKV, xn, T, aX, xf, NQKV, ToBf16{qkv, NQKV, at<const uint16_t>(p, QKV + P_B)}, bar);
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < T; t++) {
            const uint16_t *row = qkv + t * NQKV;
            const int64_t slot = slot_mapping[t];
            augury::rope_row(row, nh, hd, cos + t * hd, sin + t * hd, true, qr + t * NQ);
            augury::rope_row(row + NQ, nkv, hd, cos + t * hd, sin + t * hd, true, kc + slot * NKV);
            std::memcpy(vc + slot * NKV, row + NQ + NKV, static_cast<size_t>(NKV) * 2);
        }
        bar.wait();
#pragma omp for schedule(static, 1) nowait  // in turn: a catch-up's later rows read more keys
        for (int64_t task = 0; task < T * nkv; task++) {
            const int64_t t = task / nkv, g = task % nkv;
            augury::attend_task(qr, true, t, g, nh, hd, kc, vc, true, nkv, slots + t * W, nkeys[t], scale, att, true,
                                scores);
        }
        bar.wait();
        project(p, O, att, T, aQ, xf, H, AddRounded{h, H, at<const uint16_t>(p, O + P_B)}, bar);
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < T; t++)
            augury::rmsnorm_row(h + t * H, H, at<const void>(p, LN2), true, eps, xn + t * H, true);
        bar.wait();
        project(p, GU, xn, T, aH, xf, 2 * I, ToBf16{gu, 2 * I, at<const uint16_t>(p, GU + P_B)}, bar);
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < T; t++) augury::silu_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, I, true, act + t * I);
        bar.wait();
        project(p, DN, act, T, aI, xf, H, AddRounded{h, H, at<const uint16_t>(p, DN + P_B)}, bar);
        if (R == 0) return;
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < R; r++)
            augury::rmsnorm_row(h + logit_rows[r] * H, H, at<const void>(p, NORM), true, eps, xn + r * H, true);
        bar.wait();
        project(p, LM, xn, R, aH, xf, NL, Raw{logits, NL}, bar);
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < R; r++) top_row(logits + r * NL, Vd, K, top_ids + r * K, top_lp + r * K);
        bar.wait();
    }
};

}  // namespace

extern "C" int augury_head_nfields() { return NFIELD; }

// table [NFIELD] addresses; aux [T, A] bfloat16 (the three target features; null: h is given) ; h [T, H]
// float32, in place (in: the head's h where aux is null; out: the pre-norm output); tokens [T] ids into
// embed [V, H] bfloat16; caches [S, nkv, hd] bfloat16; slot_mapping [T]: where row t's key and value go;
// slots [T, W] / nkeys [T]: the slots row t attends to (its own last); cos / sin [T, hd] bfloat16;
// logit_rows [R]: rows whose top k to give, lm_head's NL columns (a multiple of 16) of which the first Vd
// count; top_ids [R, k] int64, top_lp [R, k] float32. Returns 0, 1 (bad shapes, ids or slots: checked
// before anything is read or written), 2 (out of memory).
extern "C" int augury_head_forward(const int64_t *table, int64_t T, int64_t H, int64_t A, int64_t nh, int64_t nkv,
                                   int64_t hd, int64_t I, float eps, const uint16_t *aux, float *h,
                                   const int64_t *tokens, const uint16_t *embed, int64_t V, uint16_t *k_cache,
                                   uint16_t *v_cache, int64_t S, const int64_t *slot_mapping, const int64_t *slots,
                                   const int32_t *nkeys, int64_t W, const uint16_t *cos, const uint16_t *sin,
                                   const int64_t *logit_rows, int64_t R, int64_t NL, int64_t Vd, int64_t k,
                                   int64_t *top_ids, float *top_lp, int nthreads) {
    Head hd_{table, T, H, A, nh, nkv, hd, I, eps, aux, h, tokens, embed, V, k_cache, v_cache, S, slot_mapping, slots,
             nkeys, W, cos, sin, logit_rows, R, NL, Vd, k, top_ids, top_lp, nthreads};
    if (int rc = hd_.setup()) return rc;
    if (T == 0) return 0;
#pragma omp parallel num_threads(hd_.nthreads)
    {
        std::vector<float> scores;
        hd_.run(scores);
    }
    return 0;
}
