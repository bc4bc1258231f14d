// Helpers shared by augury's CPU kernels (AVX2): bfloat16 <-> float32 and a horizontal sum.
#pragma once
#include <immintrin.h>
#include <linux/futex.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>

namespace augury {

// Ask for bytes [p, p + n) in cache ahead of use (a hint: never faults, past the end included)
inline void prefetch_next(const void *p, int n) {
    for (int c = 0; c < n; c += 64) _mm_prefetch(static_cast<const char *>(p) + c, _MM_HINT_T0);
}

// 8 values from p + i, bfloat16 (widened exactly) or float32
inline __m256 load8(const void *p, bool bf16, int64_t i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(static_cast<const uint16_t *>(p) + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps(static_cast<const float *>(p) + i);
}

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// f32_to_bf16 for 8 lanes, as float32 (the low 16 bits zero): round to nearest even, NaN stays NaN
// (quiet bit set), the same bits as the scalar function lane for lane.
inline __m256 bf16_round8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), hi);
    const __m256i q = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)), hi);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(q), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// e^x for 8 lanes, x <= 0 (attention: scores minus their maximum; silu: minus |x|): x = n ln2 + r, |r| <= ln2 / 2, e^r by
// its Taylor polynomial to r^6 (relative error under 2e-7), times 2^n; below -87.3 (where float32
// runs out) 0; NaN stays NaN. The same operations on every ISA level, so the same bits.
inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(lo, x);  // NaN passes through (max returns its second operand)
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2 in two parts: exact n * hi
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    // 2^n for n in -126..0 (x >= -87.34 keeps n >= -126); NaN lanes keep p's NaN
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}

// 8 lanes already rounded to bfloat16 (bf16_round8) stored as 8 bfloat16 values at p
inline void store_bf16x8(uint16_t *p, __m256 rounded) {
    const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i *>(p), packed);
}

// 8 values to p + i: rounded to bfloat16 (bf16_round8: the scalar rounding's bits) or float32
inline void store8(void *p, bool bf16, int64_t i, __m256 v) {
    if (bf16)
        store_bf16x8(static_cast<uint16_t *>(p) + i, bf16_round8(v));
    else
        _mm256_storeu_ps(static_cast<float *>(p) + i, v);
}

// Below this many rows a kernel prepares its rows (rounds or widens them) serially, before its
// parallel region: waking a thread costs more than a few rows.
constexpr int64_t SERIAL_ROWS = 16;

// The barrier between the worksharing loops of augury's parallel regions (the kernels' worksharing
// loops end `nowait` and call wait()): a bounded spin (about SPIN_US, where a balanced step's threads
// meet), then sleep in the kernel (futex) until the last thread arrives. libgomp's own barrier spins
// for milliseconds before it sleeps (GOMP_SPINCOUNT): on a core shared with a busy process the
// spinning thread keeps its core busy while the thread it waits for sits behind the other process,
// and every one of a step's ~250 barriers can wait out a scheduler time slice. A sleeping thread
// frees its core, where the scheduler runs the late thread. The team is the calling OpenMP region's;
// outside a region (one thread) wait() returns at once.
class Barrier {
  public:
    static constexpr int SPIN_US = 50;

    void wait() {
        const int n = omp_get_num_threads();
        if (n <= 1) return;
        const uint32_t gen = gen_.load(std::memory_order_acquire);
        if (count_.fetch_add(1, std::memory_order_acq_rel) == n - 1) {  // the last to arrive
            count_.store(0, std::memory_order_relaxed);
            gen_.store(gen + 1, std::memory_order_seq_cst);
            if (sleepers_.load(std::memory_order_seq_cst) > 0)
                syscall(SYS_futex, reinterpret_cast<uint32_t *>(&gen_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
            return;
        }
        const auto start = std::chrono::steady_clock::now();
        for (int i = 1; gen_.load(std::memory_order_acquire) == gen; i++) {
            _mm_pause();
            if ((i & 63) || std::chrono::steady_clock::now() - start < std::chrono::microseconds(SPIN_US)) continue;
            sleepers_.fetch_add(1, std::memory_order_seq_cst);
            while (gen_.load(std::memory_order_seq_cst) == gen)
                syscall(SYS_futex, reinterpret_cast<uint32_t *>(&gen_), FUTEX_WAIT_PRIVATE, gen, nullptr, nullptr, 0);
            sleepers_.fetch_sub(1, std::memory_order_relaxed);
            return;
        }
    }

  private:
    static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word");
    alignas(64) std::atomic<uint32_t> gen_{0};
    alignas(64) std::atomic<int> count_{0};
    alignas(64) std::atomic<int> sleepers_{0};
};

// prepare(bar) (a worksharing loop over the M rows) then body(bar) (one over the columns) in one
// parallel region of nthreads threads, each ending at the barrier bar; for fewer than SERIAL_ROWS rows
// prepare runs first, serially. Either way every row is prepared by the same row function, so the
// results do not depend on M.
template <class Prepare, class Body>
inline void prepare_then_run(int64_t M, int nthreads, Prepare &&prepare, Body &&body) {
    const bool serial = M < SERIAL_ROWS;
    Barrier bar;
    if (serial) prepare(bar);
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1)
    {
        if (!serial) prepare(bar);
        body(bar);
    }
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// [hsum(v0), hsum(v1), hsum(v2), hsum(v3)]: the same additions in the same tree as hsum, lane for lane
// (s = low half + high half; then (s0 + s2) + (s1 + s3)), four vectors' at a time: 14 instructions
// instead of 24, and one store for four sums.
inline __m128 hsum4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    // [lo v0 + hi v0 | lo v1 + hi v1] and the same for v2, v3
    const __m256 t01 = _mm256_add_ps(_mm256_permute2f128_ps(v0, v1, 0x20), _mm256_permute2f128_ps(v0, v1, 0x31));
    const __m256 t23 = _mm256_add_ps(_mm256_permute2f128_ps(v2, v3, 0x20), _mm256_permute2f128_ps(v2, v3, 0x31));
    // per 128-bit half: [t0_0 + t0_2, t0_1 + t0_3, t2_0 + t2_2, t2_1 + t2_3] (the high half: t1, t3)
    const __m256 x = _mm256_add_ps(_mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 2, 3, 2)));
    // lanes 0, 1 of each half: [sum0, sum2] and [sum1, sum3]
    const __m256 y = _mm256_add_ps(_mm256_shuffle_ps(x, x, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(x, x, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm_unpacklo_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

// The largest lane of m (a NaN-free vector); which of +0 and -0 it returns where they tie does not
// change exp(s - m) for any s.
inline float hmax4(__m128 m) {
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

}  // namespace augury
