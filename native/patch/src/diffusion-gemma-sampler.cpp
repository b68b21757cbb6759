// Native per-step pass of the DiffusionGemma sampler: see include/diffusion-gemma-sampler.h.
//
// Why native: the real model yields 256 x 262144 logits per denoising step; temperature, softmax
// entropy, argmax and a multinomial draw over that in numpy take about as long as a small model's
// forward. Here a row is read three times: divide + max (stored in place), exp + sums (weights in a
// per-thread scratch row), then a walk over the weights up to the sampled index. The first two
// loops use 8-wide generic vectors (8 independent accumulators, branch-free exp), so their
// reduction order differs from numpy's, which only moves the entropy in its last bits.

#include "diffusion-gemma-sampler.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__GNUC__) && !defined(__clang__)
// 32-byte vectors only cross function boundaries inside one translation unit (inlined helpers)
#    pragma GCC diagnostic ignored "-Wpsabi"
#endif

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
// one AVX2+FMA clone besides the baseline, picked at load time: 2x on most x86 servers
#    define DG_SAMPLER_CLONES __attribute__((target_clones("avx2,fma", "default")))
#else
#    define DG_SAMPLER_CLONES
#endif

namespace {

// GCC/Clang generic vectors: lowered to AVX2, SSE or NEON as the target allows, no intrinsics.
typedef float   v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef double  v8d __attribute__((vector_size(64)));
constexpr int32_t LANES = 8;

inline v8f splat(float value) {
    return v8f{ value, value, value, value, value, value, value, value };
}

inline v8f load8(const float * p) {
    v8f v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

inline void store8(float * p, v8f v) {
    std::memcpy(p, &v, sizeof(v));
}

// exp(x) for x <= 0 (a logit minus its row maximum), within ~2 ulp of expf; exactly 0 below the
// float range, where expf underflows too. Cephes' expf: Cody-Waite reduction by ln2, degree-6
// polynomial, 2^n through the exponent bits.
inline v8f exp_nonpositive(v8f x) {
    const v8f lower    = splat(-87.3f);
    const v8i vanishes = x < lower;
    x = vanishes ? lower : x;
    const v8f magic = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to nearest
    const v8f n     = (x * splat(1.44269504088896341f) + magic) - magic;
    v8f r = x - n * splat(0.693359375f);
    r     = r + n * splat(2.12194440e-4f);
    v8f p = splat(1.9875691500e-4f);
    p     = p * r + splat(1.3981999507e-3f);
    p     = p * r + splat(8.3334519073e-3f);
    p     = p * r + splat(4.1665795894e-2f);
    p     = p * r + splat(1.6666665459e-1f);
    p     = p * r + splat(5.0000001201e-1f);
    p     = p * r * r + r + splat(1.0f);
    const v8i bits  = (__builtin_convertvector(n, v8i) + 127) << 23;
    const v8f scale = (v8f) bits;
    return vanishes ? splat(0.0f) : p * scale;
}

inline float exp_nonpositive(float x) {
    v8f v = splat(x);
    return exp_nonpositive(v)[0];
}

struct step_args {
    float *        logits;
    int32_t        n_vocab;
    float          temperature;
    const double * uniforms;
    double *       entropy_out;
    int32_t *      argmax_out;
    int32_t *      sampled_out;
};

// logits /= t in place; returns the row maximum, and whether every value was finite.
DG_SAMPLER_CLONES
float divide_and_max(float * x, int32_t n, float t, bool & finite) {
    const v8f vt   = splat(t);
    v8f       vmax = splat(-INFINITY);
    v8f       vbad = splat(0.0f);
    int32_t   i    = 0;
    for (; i + LANES <= n; i += LANES) {
        // division, not multiplication by 1/t: bit-identical to the reference's `logits / t`
        const v8f v = load8(x + i) / vt;
        store8(x + i, v);
        vmax = v > vmax ? v : vmax;
        vbad += v - v;  // 0 for finite values, NaN for inf/NaN: a branch-free finiteness test
    }
    float best = -INFINITY;
    float bad  = 0.0f;
    for (; i < n; ++i) {
        const float v = x[i] / t;
        x[i] = v;
        best = v > best ? v : best;
        bad += v - v;
    }
    for (int32_t l = 0; l < LANES; ++l) {
        best = vmax[l] > best ? vmax[l] : best;
        bad += vbad[l];
    }
    finite = bad == 0.0f;
    return best;
}

// weights = exp(x - best); returns sum(weights) and sum(weights * (x - best)) in double.
DG_SAMPLER_CLONES
void exp_and_sums(const float * x, float * weights, int32_t n, float best, double & total, double & weighted) {
    const v8f vbest     = splat(best);
    v8d       vtotal    = {};
    v8d       vweighted = {};
    int32_t   i         = 0;
    for (; i + LANES <= n; i += LANES) {
        const v8f shifted = load8(x + i) - vbest;
        const v8f w       = exp_nonpositive(shifted);
        store8(weights + i, w);
        const v8d wd = __builtin_convertvector(w, v8d);
        vtotal += wd;
        vweighted += wd * __builtin_convertvector(shifted, v8d);
    }
    total    = 0.0;
    weighted = 0.0;
    for (; i < n; ++i) {
        const float shifted = x[i] - best;
        const float w       = exp_nonpositive(shifted);
        weights[i] = w;
        total += (double) w;
        weighted += (double) w * (double) shifted;
    }
    for (int32_t l = 0; l < LANES; ++l) {
        total += vtotal[l];
        weighted += vweighted[l];
    }
}

// Returns false if the row held a non-finite value.
bool process_row(const step_args & a, int32_t row, std::vector<float> & weights) {
    float *       x = a.logits + (size_t) row * (size_t) a.n_vocab;
    const int32_t n = a.n_vocab;

    bool        finite = true;
    const float best   = divide_and_max(x, n, a.temperature, finite);
    if (!finite) {
        return false;
    }
    int32_t best_idx = 0;
    while (x[best_idx] != best) {  // the first index of the maximum, as numpy/torch argmax
        ++best_idx;
    }

    double total    = 0.0;
    double weighted = 0.0;
    exp_and_sums(x, weights.data(), n, best, total, weighted);
    const double entropy = std::log(total) - weighted / total;
    a.entropy_out[row] = entropy > 0.0 ? entropy : 0.0;
    a.argmax_out[row]  = best_idx;

    if (a.uniforms != nullptr) {
        // inverse CDF in index order, cumsum in double (numpy: searchsorted(cumsum, u * sum, 'right'))
        const double target    = a.uniforms[row] * total;
        double       cdf       = 0.0;
        int32_t      pick      = -1;
        int32_t      last_kept = best_idx;
        for (int32_t i = 0; i < n; ++i) {
            const float w = weights[i];
            cdf += (double) w;
            last_kept = w > 0.0f ? i : last_kept;
            if (cdf > target) {
                pick = i;
                break;
            }
        }
        // `total` was summed lane-wise, so the sequential cdf can end a hair below u * total
        a.sampled_out[row] = pick >= 0 ? pick : last_kept;
    }
    return true;
}

}  // namespace

extern "C" int dg_sampler_step(float * logits, int32_t n_rows, int32_t n_vocab, float temperature,
                               const double * uniforms, double * entropy_out, int32_t * argmax_out,
                               int32_t * sampled_out, int32_t n_threads) {
    if (logits == nullptr || entropy_out == nullptr || argmax_out == nullptr || n_rows <= 0 || n_vocab <= 0 ||
        !(temperature > 0.0f) || !std::isfinite(temperature) || (uniforms != nullptr && sampled_out == nullptr)) {
        return 1;
    }
    const step_args args = { logits, n_vocab, temperature, uniforms, entropy_out, argmax_out, sampled_out };

    int32_t threads = n_threads > 0 ? n_threads : (int32_t) std::max(1u, std::thread::hardware_concurrency());
    threads = std::min(threads, n_rows);

    std::atomic<int32_t> next_row{0};
    std::atomic<bool>    all_finite{true};
    auto worker = [&]() {
        std::vector<float> weights((size_t) n_vocab);
        // rows handed out one at a time: an even split even when threads are descheduled
        for (int32_t row = next_row.fetch_add(1); row < n_rows; row = next_row.fetch_add(1)) {
            if (!process_row(args, row, weights)) {
                all_finite = false;
            }
        }
    };

    if (threads <= 1) {
        worker();
    } else {
        std::vector<std::thread> pool;
        pool.reserve((size_t) threads - 1);
        for (int32_t t = 1; t < threads; ++t) {
            pool.emplace_back(worker);
        }
        worker();
        for (auto & th : pool) {
            th.join();
        }
    }
    return all_finite ? 0 : 2;
}
