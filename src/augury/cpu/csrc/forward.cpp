// augury's whole layer stack in one call (CPU, bfloat16 activations, int4 weights on the w4a8
// kernel (bfloat16, float32 or Q4_K's own scales), int8 weights on w8a8's general form (GGUF's Q8_0,
// Q6_K, Q5_*) or dense bfloat16 weights on the bf16 kernel, each projection its own kind; exact attention rows): what models/llama.py runs layer by layer, operator by operator,
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
//
// Tensor parallelism (augury_forward_tp): a rank holds some heads and MLP columns, so o_proj and
// down give partial sums that every rank must add up before the residual stream takes them. The
// stack is then a sequence of 2L + 1 steps (layer l's attention half is step 2l, its MLP half 2l + 1,
// the final norm 2L); a step ends at its projection's float32 partial sum, and the next step starts by
// adding the sum over ranks, rounded as one projection's output (+ its bias once), to h. Two ways
// to sum: Python's collective between calls of one step each (gloo, any machines), or, for ranks on
// one machine, a shared-memory exchange inside this one call (the whole stack, as without tensor
// parallelism: no return to Python, no thread wake-up): each rank writes its partial into its slot,
// publishes a counter, waits (bounded spin, then yield; a peer silent for timeout_ms fails the call)
// for every other rank's, and every rank adds the slots in rank order (the same bits everywhere).
#include <sched.h>
#include <time.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "attention.h"
#include "elementwise.h"
#include "project.h"

using augury::bf16_to_f32;
using augury::f32_to_bf16;
using namespace augury::w4a8;

namespace {

using namespace augury::proj;

enum Field {
    LN1,
    QKV = 1,
    QKV_B = QKV + P_B,
    O = QKV + PART_FIELDS,
    O_B = O + P_B,
    LN2 = O + PART_FIELDS,
    GU = LN2 + 1,
    GU_B = GU + P_B,
    DN = GU + PART_FIELDS,
    DN_B = DN + P_B,
    NFIELD = DN + PART_FIELDS
};

}  // namespace

extern "C" int augury_forward_nfields() { return NFIELD; }

namespace {

// Shared-memory exchange between the ranks of one machine: a header of one 64-byte line per rank
// (its arrival counter), then two buffers of `size` slots of `cap` floats (double buffering: a rank
// writes op k + 1's partial while the others may still read op k's).
struct Exchange {
    char *base = nullptr;
    int64_t rank = 0, size = 1, cap = 0, timeout_ms = 0;
    int64_t *counter = nullptr;  // this rank's ops so far (kept by the caller between calls)
    static constexpr int64_t HEADER = 4096;
    int64_t *seq(int64_t r) const { return reinterpret_cast<int64_t *>(base + r * 64); }
    // the header's last line: nonzero once a rank has failed (the watchdog writes it): stop waiting
    const int64_t *abort_flag() const { return reinterpret_cast<const int64_t *>(base + HEADER - 64); }
    float *slot(int64_t buf, int64_t r) const {
        return reinterpret_cast<float *>(base + HEADER) + (buf * size + r) * cap;
    }
};

// Everything one call needs: the arguments, the scratch carved from one block, the rounded activations.
struct Stack {
    float *h;
    int64_t T, H, nh, nkv, hd, I, L;
    float eps;
    const int64_t *layers;
    uint16_t *k_cache, *v_cache;
    int64_t layer_stride;
    const int64_t *slot_mapping, *slots;
    const int32_t *nkeys;
    int64_t W;
    const uint16_t *cos, *sin;
    const int32_t *aux;
    int64_t n_aux;
    uint16_t *aux_out;
    const int64_t *aux_rows;  // null: row t's features at aux_out row t; else at row aux_rows[t] (< aux_cap)
    int64_t aux_cap;
    const uint16_t *final_w;
    uint16_t *out;
    int nthreads;
    int64_t NQ = 0, NKV = 0, NQKV = 0;
    float scale = 0;
    bool split_attention = false;
    augury::AttnPlan plan;  // who reads which keys in attention (attention.h)
    char *mem = nullptr;
    uint16_t *xn = nullptr, *qkv = nullptr, *qr = nullptr, *att = nullptr, *gu = nullptr, *act = nullptr;
    float *xf = nullptr;
    Rounded aH, aQ, aI;
    augury::Barrier bar;  // between the worksharing loops (simd.h: a bounded spin, then sleep)

    // Checks the shapes and every slot, allocates the scratch: 0, 1 (bad shapes) or 2 (out of memory).
    int setup() {
        NQ = nh * hd, NKV = nkv * hd, NQKV = NQ + 2 * NKV;
        if (T < 0 || H % GROUP || NQ % GROUP || I % GROUP || hd % 8 || hd > 512 || nkv < 1 || nh % nkv || W < 1)
            return 1;
        const int64_t S = layer_stride / NKV;  // cache slots per layer: every slot read or written must lie inside
        for (int64_t t = 0; t < T; t++) {
            if (nkeys[t] < 1 || nkeys[t] > W || slot_mapping[t] < 0 || slot_mapping[t] >= S) return 1;
            for (int64_t j = 0; j < nkeys[t]; j++)
                if (slots[t * W + j] < 0 || slots[t * W + j] >= S) return 1;
            if (aux_rows && n_aux && (aux_rows[t] < 0 || aux_rows[t] >= aux_cap)) return 1;
        }
        const int64_t Kmax = H > I ? (H > NQ ? H : NQ) : (I > NQ ? I : NQ);
        const int64_t Gmax = padded_groups(Kmax);
        // scratch: one block, carved up
        const size_t n16 = static_cast<size_t>(T) * static_cast<size_t>(H + NQKV + NQ + NQ + 2 * I + I);
        const size_t bytes = n16 * 2 + static_cast<size_t>(T * Kmax) * 5 + static_cast<size_t>(T * Gmax) * 16 + 256;
        mem = static_cast<char *>(std::malloc(bytes));
        if (!mem) return 2;
        xn = reinterpret_cast<uint16_t *>(mem);  // a norm's output [T, H]
        qkv = xn + T * H;                        // [T, NQKV]
        qr = qkv + T * NQKV;                     // rotated queries [T, NQ]
        att = qr + T * NQ;                       // attention output [T, NQ]
        gu = att + T * NQ;                       // [T, 2 I]
        act = gu + T * 2 * I;                    // silu(gate) * up [T, I]
        int8_t *xq = reinterpret_cast<int8_t *>(act + T * I);
        float *dx = reinterpret_cast<float *>((reinterpret_cast<uintptr_t>(xq + T * Kmax) + 63) & ~uintptr_t(63));
        float *xs = dx + T * Gmax;
        int32_t *xsum = reinterpret_cast<int32_t *>(xs + T * Gmax);
        int32_t *xlo = xsum + T * Gmax;
        xf = reinterpret_cast<float *>(xlo + T * Gmax);  // dense projections' widened rows [T, Kmax]
        for (Rounded *a : {&aH, &aQ, &aI}) {  // the rounded activations for K = H, nh * hd and I (used in turn)
            a->xq = xq;
            a->dx = dx;
            a->xs = xs;
            a->xsum = xsum;
            a->xlo = xlo;
        }
        aH.K = H, aH.Gp = padded_groups(H);
        aQ.K = NQ, aQ.Gp = padded_groups(NQ);
        aI.K = I, aI.Gp = padded_groups(I);
        scale = 1.0f / std::sqrt(static_cast<float>(hd));
        // the region's threads are awake already: split the (row, key-value head) tasks whenever there are two
        split_attention = T * nkv > 1;
        if (nthreads < 1) nthreads = 1;
        plan.build(T, slots, W, nkeys, nkv);
        return 0;
    }

    ~Stack() { std::free(mem); }

    void write_aux(int64_t l) {
        for (int64_t a = 0; a < n_aux; a++) {
            if (aux[a] != l) continue;
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < T; t++) {
                uint16_t *row = aux_out + (aux_rows ? aux_rows[t] : t) * n_aux * H + a * H;
                for (int64_t j = 0; j < H; j++) row[j] = f32_to_bf16(h[t * H + j]);
            }
            bar.wait();
        }
    }

    // Step s by every thread of the region (2l: layer l's attention half, 2l + 1: its MLP half, 2L: the
    // final norm). part null: each half's projection is added to h here (no tensor parallelism); else its
    // float32 partial sum [T, H] goes to part, for the ranks' sum and `apply`.
    void step(int64_t s, float *part, augury::AttnScratch &scratch) {
        if (s == 2 * L) {
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < T; t++) augury::rmsnorm_row(h + t * H, H, final_w, true, eps, out + t * H, true);
            bar.wait();
            return;
        }
        const int64_t l = s / 2;
        const int64_t *p = layers + l * NFIELD;
        if (s % 2 == 0) {
            uint16_t *kc = k_cache + l * layer_stride, *vc = v_cache + l * layer_stride;
            const uint16_t *qkv_b = at<const uint16_t>(p, QKV_B), *o_b = at<const uint16_t>(p, O_B);
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < T; t++)
                augury::rmsnorm_row(h + t * H, H, at<const void>(p, LN1), true, eps, xn + t * H, true);
            bar.wait();
            project(p, QKV, xn, T, aH, xf, NQKV, ToBf16{qkv, NQKV, qkv_b}, bar);
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < T; t++) {
                const uint16_t *row = qkv + t * NQKV;
                const int64_t slot = slot_mapping[t];
                augury::rope_row(row, nh, hd, cos + t * hd, sin + t * hd, true, qr + t * NQ);
                augury::rope_row(row + NQ, nkv, hd, cos + t * hd, sin + t * hd, true, kc + slot * NKV);
                std::memcpy(vc + slot * NKV, row + NQ + NKV, static_cast<size_t>(NKV) * 2);
            }
            bar.wait();
            // each thread its share of the (row, key-value head) pairs (attention.h: AttnPlan)
            if (split_attention || omp_get_thread_num() == 0) {
                int64_t b = 0, e = T * nkv;
                if (split_attention) plan.share(omp_get_thread_num(), omp_get_num_threads(), b, e);
                plan.run(b, e, qr, true, nh, hd, kc, vc, true, slots, W, nkeys, scale, att, true, scratch);
            }
            bar.wait();
            if (part)
                project(p, O, att, T, aQ, xf, H, Raw{part, H}, bar);
            else
                project(p, O, att, T, aQ, xf, H, AddRounded{h, H, o_b}, bar);
        } else {
            const uint16_t *gu_b = at<const uint16_t>(p, GU_B), *dn_b = at<const uint16_t>(p, DN_B);
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < T; t++)
                augury::rmsnorm_row(h + t * H, H, at<const void>(p, LN2), true, eps, xn + t * H, true);
            bar.wait();
            project(p, GU, xn, T, aH, xf, 2 * I, ToBf16{gu, 2 * I, gu_b}, bar);
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < T; t++)
                augury::silu_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, I, true, act + t * I);
            bar.wait();
            if (part) {
                project(p, DN, act, T, aI, xf, H, Raw{part, H}, bar);
            } else {
                project(p, DN, act, T, aI, xf, H, AddRounded{h, H, dn_b}, bar);
                write_aux(l);
            }
        }
    }

    // After step s's partial sums were added up over the ranks (`parts` of them, read in rank order,
    // each [T, H]): h += that sum, rounded as the projection's output with its bias; the layer's aux.
    void apply(int64_t s, const float *const *parts, int64_t nparts) {
        const int64_t *p = layers + (s / 2) * NFIELD;
        const uint16_t *bias = at<const uint16_t>(p, s % 2 == 0 ? O_B : DN_B);
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < H; j++) {
                float v = parts[0][t * H + j];
                for (int64_t r = 1; r < nparts; r++) v += parts[r][t * H + j];
                h[t * H + j] += rounded(v, bias, j);
            }
        bar.wait();
        if (s % 2 == 1) write_aux(s / 2);
    }
};

// Publish this rank's partial of op k and wait for every rank's (one thread); false on a timeout.
bool exchange(const Exchange &ex, int64_t k) {
    __atomic_store_n(ex.seq(ex.rank), k, __ATOMIC_RELEASE);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < ex.size; r++) {
        bool napping = false;
        for (int64_t spins = 0; __atomic_load_n(ex.seq(r), __ATOMIC_ACQUIRE) < k; spins++) {
            if (spins < 2048) continue;  // a peer a few microseconds behind: spin
            if (napping) {               // far behind (its first forward, a busy machine): sleep a little
                struct timespec ts = {0, 20000};
                nanosleep(&ts, nullptr);
            } else {
                sched_yield();  // further behind (or descheduled): let the cores go
            }
            if ((spins & 255) == 0 || napping) {
                const auto waited = std::chrono::steady_clock::now() - start;
                if (__atomic_load_n(ex.abort_flag(), __ATOMIC_RELAXED) || waited > std::chrono::milliseconds(ex.timeout_ms))
                    return false;
                napping = waited > std::chrono::milliseconds(2);
            }
        }
    }
    return true;
}

}  // namespace

// h [T, H] float32, updated in place; layers [L, NFIELD] addresses; caches [L, S, nkv, hd] bfloat16
// (layer l at k_cache + l * layer_stride elements); slot_mapping [T]: where row t's key and value go;
// slots [T, W] / nkeys [T]: the cache slots row t attends to (the first nkeys[t]); cos / sin [T, hd]
// bfloat16 (a slot outside the cache is refused: return 1); aux [n_aux] layer indices whose output h is written, rounded, to aux_out [T, n_aux * H],
// or, where aux_rows [T] is given, row t's to aux_out's row aux_rows[t] of aux_cap (a feature store's rows; one outside is refused);
// out [T, H] bfloat16: the final norm of h. Returns 0, 1 for bad shapes, 2 when out of memory.
extern "C" int augury_forward_layers(float *h, int64_t T, int64_t H, int64_t nh, int64_t nkv, int64_t hd,
                                     int64_t I, int64_t L, float eps, const int64_t *layers, uint16_t *k_cache,
                                     uint16_t *v_cache, int64_t layer_stride, const int64_t *slot_mapping,
                                     const int64_t *slots, const int32_t *nkeys, int64_t W, const uint16_t *cos,
                                     const uint16_t *sin, const int32_t *aux, int64_t n_aux, uint16_t *aux_out,
                                     const int64_t *aux_rows, int64_t aux_cap, const uint16_t *final_w, uint16_t *out,
                                     int nthreads) {
    Stack st{h, T, H, nh, nkv, hd, I, L, eps, layers, k_cache, v_cache, layer_stride, slot_mapping, slots, nkeys, W,
             cos, sin, aux, n_aux, aux_out, aux_rows, aux_cap, final_w, out, nthreads};
    if (int rc = st.setup()) return rc;
#pragma omp parallel num_threads(st.nthreads)
    {
        augury::AttnScratch scratch;
        for (int64_t s = 0; s <= 2 * L; s++) st.step(s, nullptr, scratch);
    }
    return 0;
}

// One tensor-parallel rank's stack (the arguments as augury_forward_layers', its own heads and MLP
// columns; the o/down biases are added once, after the sum). Steps [s0, s1) of the 2L + 1, each but
// the last ending at a partial sum:
// - shm null: Python sums between calls, one step each: step s0 > 0 first adds part [T, H] (step
//   s0 - 1's partials summed over the ranks) to h, then writes its own partial to part;
// - shm (one machine): the whole stack, s0 = 0 and s1 = 2L + 1, each partial summed through the
//   shared-memory exchange at shm (rank, size, cap floats per slot (>= T H), counter: this rank's ops
//   so far, updated; a peer silent for timeout_ms ends the call with 3).
// Returns 0, 1 (bad shapes or steps), 2 (out of memory) or 3 (a rank did not arrive).
extern "C" int augury_forward_tp(float *h, int64_t T, int64_t H, int64_t nh, int64_t nkv, int64_t hd, int64_t I,
                                 int64_t L, float eps, const int64_t *layers, uint16_t *k_cache, uint16_t *v_cache,
                                 int64_t layer_stride, const int64_t *slot_mapping, const int64_t *slots,
                                 const int32_t *nkeys, int64_t W, const uint16_t *cos, const uint16_t *sin,
                                 const int32_t *aux, int64_t n_aux, uint16_t *aux_out, const int64_t *aux_rows,
                                 int64_t aux_cap, const uint16_t *final_w, uint16_t *out, int nthreads, float *part,
                                 int64_t s0, int64_t s1, char *shm,
                                 int64_t rank, int64_t size, int64_t cap, int64_t *counter, int64_t timeout_ms) {
    if (s0 < 0 || s1 > 2 * L + 1 || s0 >= s1) return 1;
    Exchange ex;
    if (shm) {
        if (s0 != 0 || s1 != 2 * L + 1 || size < 1 || size * 64 >= Exchange::HEADER || rank < 0 || rank >= size ||
            cap < T * H || !counter)
            return 1;
        ex.base = shm, ex.rank = rank, ex.size = size, ex.cap = cap, ex.counter = counter, ex.timeout_ms = timeout_ms;
    } else if (!part || s1 != s0 + 1) {
        return 1;  // without the exchange each partial must go back to Python to be summed
    }
    Stack st{h, T, H, nh, nkv, hd, I, L, eps, layers, k_cache, v_cache, layer_stride, slot_mapping, slots, nkeys, W,
             cos, sin, aux, n_aux, aux_out, aux_rows, aux_cap, final_w, out, nthreads};
    if (int rc = st.setup()) return rc;
    bool failed = false;
    std::vector<const float *> parts(static_cast<size_t>(size > 0 ? size : 1));
#pragma omp parallel num_threads(st.nthreads)
    {
        augury::AttnScratch scratch;
        if (!shm && s0 > 0) {
            const float *mine = part;
            st.apply(s0 - 1, &mine, 1);
        }
        for (int64_t s = s0; s < s1; s++) {
            if (!shm || s == 2 * L) {
                st.step(s, s == 2 * L ? nullptr : part, scratch);
                continue;
            }
            const int64_t k = *ex.counter + 1;  // read by every thread before the single below moves it
            st.step(s, ex.slot(k & 1, rank), scratch);  // ends with a barrier: this rank's partial is whole
#pragma omp single
            {
                failed = !exchange(ex, k);
                *ex.counter = k;
                for (int64_t r = 0; r < size; r++) parts[r] = ex.slot(k & 1, r);
            }
            if (failed) break;  // every thread sees it after the single's barrier: all leave together
            st.apply(s, parts.data(), size);
        }
    }
    return failed ? 3 : 0;
}

// ---- the shared-memory channel between the ranks of one machine (distributed/comm.py drives it) ----

// This rank's n floats into its slot of exchange op *counter + 1 (the fused stack's exchange, same
// layout and counter), published, then every rank's awaited. Returns the op's buffer (0 or 1: read
// the slots there), -1 when a rank did not arrive within timeout_ms, -2 for bad arguments.
extern "C" int64_t augury_shm_exchange(char *base, int64_t rank, int64_t size, int64_t cap, int64_t *counter,
                                       const float *src, int64_t n, int64_t timeout_ms) {
    if (!base || !counter || n < 0 || n > cap || size < 1 || size * 64 >= Exchange::HEADER || rank < 0 || rank >= size)
        return -2;
    Exchange ex;
    ex.base = base, ex.rank = rank, ex.size = size, ex.cap = cap, ex.counter = counter, ex.timeout_ms = timeout_ms;
    const int64_t k = *counter + 1;
    std::memcpy(ex.slot(k & 1, rank), src, static_cast<size_t>(n) * 4);
    if (!exchange(ex, k)) return -1;
    *counter = k;
    return k & 1;
}

// *addr = value, after every write this thread made before (a release store).
extern "C" void augury_shm_publish(int64_t *addr, int64_t value) { __atomic_store_n(addr, value, __ATOMIC_RELEASE); }

// Wait until *addr >= target: spin about spin_us (a peer that is about to arrive), then nap 50 us at
// a time (a wake-up at most ~50 us late while the engine is busy: a draft tree between two commands),
// and after 50 ms, naps growing to 1 ms (an idle engine costs next to nothing). timeout_ms <= 0 waits
// for ever; a nonzero *abort (when given) ends the wait. 0 when reached, 1 on timeout or abort.
// (Called through ctypes, which lets other Python threads run.)
extern "C" int augury_shm_wait(const int64_t *addr, int64_t target, int64_t timeout_ms, int64_t spin_us,
                               const int64_t *abort) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    int64_t nap_us = 50;
    for (int64_t spins = 0; __atomic_load_n(addr, __ATOMIC_ACQUIRE) < target; spins++) {
        if ((spins & 127) != 0) continue;
        if (abort && __atomic_load_n(abort, __ATOMIC_RELAXED)) return 1;
        const auto waited = std::chrono::duration_cast<std::chrono::microseconds>(clock::now() - start).count();
        if (timeout_ms > 0 && waited > timeout_ms * 1000) return 1;
        if (waited < spin_us) continue;
        struct timespec ts = {0, static_cast<long>(nap_us) * 1000};
        nanosleep(&ts, nullptr);
        if (waited > 50000 && nap_us < 1000) nap_us += nap_us / 4 + 1;
    }
    return 0;
}
