// Native per-step pass of the DiffusionGemma sampler: see include/diffusion-gemma-sampler.h. The
// row routine (dg_step_row, diffusion-gemma-step.h) also runs inside the decoder graph, as the
// step op that follows the LM head (models/diffusion-gemma.cpp).
//
// Why native: the real model yields 256 x 262144 logits per denoising step; temperature, softmax
// entropy, argmax and a multinomial draw over that in numpy take about as long as a small model's
// forward. Here a row is read three times: softcap + divide + max (values), exp + sums (weights),
// then a walk over the weights up to the sampled index. The first two loops use 8-wide generic
// vectors (8 independent accumulators, branch-free exp and tanh), so their reduction order differs
// from numpy's, which only moves the entropy in its last bits.

#include "diffusion-gemma-sampler.h"
#include "diffusion-gemma-step.h"

#include <algorithm>
#include <atomic>
#include <utility>
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

inline v8i splat_int(int32_t value) {
    return v8i{ value, value, value, value, value, value, value, value };
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

// tanh(x) within ~2 ulp of tanhf: Cephes' tanhf, an odd polynomial below |x| = 0.625 and
// (1 - e) / (1 + e) with e = exp(-2|x|) above it (e <= 0.29 there, so no cancellation).
inline v8f tanh_approx(v8f x) {
    const v8i sign  = (v8i) x & splat_int(INT32_MIN);
    const v8f a     = (v8f) ((v8i) x & splat_int(INT32_MAX));
    const v8f z     = x * x;
    v8f       p     = splat(-5.70498872745e-3f);
    p               = p * z + splat(2.06390887954e-2f);
    p               = p * z + splat(-5.37397155531e-2f);
    p               = p * z + splat(1.33314422036e-1f);
    p               = p * z + splat(-3.33332819422e-1f);
    const v8f small = p * z * x + x;
    const v8f e     = exp_nonpositive(splat(-2.0f) * a);
    const v8f large = (v8f) ((v8i) ((splat(1.0f) - e) / (splat(1.0f) + e)) | sign);
    return a < splat(0.625f) ? small : large;
}

// (weight, index), ordered best first: larger weight, then the lower index (deterministic ties)
typedef std::pair<float, int32_t> candidate;

inline bool better(const candidate & a, const candidate & b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// The k largest weights of a row, best first, into `heap`. A min-heap (std heap with `better` as
// its "less": the front is the worst kept candidate) of k entries; a row is scanned 8 at a time
// and only a block holding a weight above the current k-th best goes through the heap, which after
// the first few thousand entries is almost never.
DG_SAMPLER_CLONES
void select_top_k(const float * w, int32_t n, int32_t k, std::vector<candidate> & heap) {
    heap.clear();
    for (int32_t i = 0; i < k; ++i) {
        heap.emplace_back(w[i], i);
    }
    std::make_heap(heap.begin(), heap.end(), better);
    float   worst = heap.front().first;
    int32_t i     = k;
    auto offer = [&](int32_t j) {
        // strictly above: an equal weight at a later index is the worse candidate
        if (w[j] > worst) {
            std::pop_heap(heap.begin(), heap.end(), better);
            heap.back() = candidate(w[j], j);
            std::push_heap(heap.begin(), heap.end(), better);
            worst = heap.front().first;
        }
    };
    for (; i + LANES <= n; i += LANES) {
        const v8i above = load8(w + i) > splat(worst);
        bool any = false;
        for (int32_t l = 0; l < LANES; ++l) {
            any = any || above[l] != 0;
        }
        if (any) {
            for (int32_t l = 0; l < LANES; ++l) {
                offer(i + l);
            }
        }
    }
    for (; i < n; ++i) {
        offer(i);
    }
    std::sort_heap(heap.begin(), heap.end(), better);  // ascending under `better`: best first
}

// values = softcap(logits) / t (division, not multiplication by 1/t: bit-identical to the
// reference's `logits / t`); returns the row maximum, and whether every value was finite.
// softcap(x) = tanh(x / cap) * cap, computed as ggml's scale, tanh, scale ops do (x * (1/cap)).
DG_SAMPLER_CLONES
float transform_and_max(const float * x, float * values, int32_t n, float softcap, bool exact_tanh, float t,
                        bool & finite) {
    const bool  capped  = softcap != 0.0f;
    const float inv_cap = capped ? 1.0f / softcap : 0.0f;
    const v8f   vt      = splat(t);
    v8f         vmax    = splat(-INFINITY);
    v8f         vbad    = splat(0.0f);
    int32_t     i       = 0;
    if (!capped || !exact_tanh) {
        for (; i + LANES <= n; i += LANES) {
            v8f v = load8(x + i);
            if (capped) {
                v = tanh_approx(v * splat(inv_cap)) * splat(softcap);
            }
            v = v / vt;
            store8(values + i, v);
            vmax = v > vmax ? v : vmax;
            vbad += v - v;  // 0 for finite values, NaN for inf/NaN: a branch-free finiteness test
        }
    }
    float best = -INFINITY;
    float bad  = 0.0f;
    for (; i < n; ++i) {
        float v = x[i];
        if (capped) {
            v = exact_tanh ? tanhf(v * inv_cap) * softcap : tanh_approx(splat(v * inv_cap))[0] * softcap;
        }
        v = v / t;
        values[i] = v;
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

}  // namespace

bool dg_step_row(const dg_row_in & in, dg_row_out & out, dg_topk_heap & heap) {
    const int32_t n = in.n_vocab;

    bool        finite = true;
    const float best   = transform_and_max(in.logits, in.values, n, in.softcap, in.exact_tanh, in.temperature, finite);
    if (!finite) {
        return false;
    }
    int32_t best_idx = 0;
    while (in.values[best_idx] != best) {  // the first index of the maximum, as numpy/torch argmax
        ++best_idx;
    }

    double total    = 0.0;
    double weighted = 0.0;
    exp_and_sums(in.values, in.weights, n, best, total, weighted);
    const double entropy = std::log(total) - weighted / total;
    out.entropy = entropy > 0.0 ? entropy : 0.0;
    out.argmax  = best_idx;
    out.total   = total;

    const float * weights = in.weights;
    if (in.top_k > 0) {
        // the self-conditioning input of the next step: softmax(values) at its k most probable
        // tokens, and the probability mass left out
        select_top_k(weights, n, in.top_k, heap);
        double kept = 0.0;
        for (int32_t j = 0; j < in.top_k; ++j) {
            const double p = (double) heap[j].first / total;
            in.topk_ids[j]   = heap[j].second;
            in.topk_probs[j] = (float) p;
            kept += p;
        }
        out.dropped = kept < 1.0 ? 1.0 - kept : 0.0;
    }

    if (in.uniform != nullptr) {
        // inverse CDF in index order, cumsum in double (numpy: searchsorted(cumsum, u * sum, 'right'))
        const double target    = *in.uniform * total;
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
        out.sampled = pick >= 0 ? pick : last_kept;
    }
    return true;
}


extern "C" int dg_sampler_step(float * logits, int32_t n_rows, int32_t n_vocab, float temperature,
                               const double * uniforms, double * entropy_out, int32_t * argmax_out,
                               int32_t * sampled_out, int32_t n_threads) {
    return dg_sampler_step_topk(logits, n_rows, n_vocab, temperature, uniforms, entropy_out, argmax_out, sampled_out,
                                0, nullptr, nullptr, nullptr, n_threads);
}

extern "C" int dg_sampler_step_topk(float * logits, int32_t n_rows, int32_t n_vocab, float temperature,
                                    const double * uniforms, double * entropy_out, int32_t * argmax_out,
                                    int32_t * sampled_out, int32_t top_k, int32_t * topk_ids_out,
                                    float * topk_probs_out, double * dropped_out, int32_t n_threads) {
    if (logits == nullptr || entropy_out == nullptr || argmax_out == nullptr || n_rows <= 0 || n_vocab <= 0 ||
        !(temperature > 0.0f) || !std::isfinite(temperature) || (uniforms != nullptr && sampled_out == nullptr) ||
        top_k < 0 || top_k > n_vocab ||
        (top_k > 0 && (topk_ids_out == nullptr || topk_probs_out == nullptr || dropped_out == nullptr))) {
        return 1;
    }
    int32_t threads = n_threads > 0 ? n_threads : (int32_t) std::max(1u, std::thread::hardware_concurrency());
    threads = std::min(threads, n_rows);

    std::atomic<int32_t> next_row{0};
    std::atomic<bool>    all_finite{true};
    auto worker = [&]() {
        std::vector<float> weights((size_t) n_vocab);
        dg_topk_heap       heap;
        heap.reserve((size_t) top_k);
        // rows handed out one at a time: an even split even when threads are descheduled
        for (int32_t row = next_row.fetch_add(1); row < n_rows; row = next_row.fetch_add(1)) {
            float *   x      = logits + (size_t) row * (size_t) n_vocab;
            dg_row_in in     = {};
            in.logits        = x;
            in.values        = x;  // logits / t in place: the processed logits the caller gets back
            in.weights       = weights.data();
            in.n_vocab       = n_vocab;
            in.temperature   = temperature;
            in.uniform       = uniforms != nullptr ? uniforms + row : nullptr;
            in.top_k         = top_k;
            in.topk_ids      = top_k > 0 ? topk_ids_out + (size_t) row * (size_t) top_k : nullptr;
            in.topk_probs    = top_k > 0 ? topk_probs_out + (size_t) row * (size_t) top_k : nullptr;
            dg_row_out out;
            if (!dg_step_row(in, out, heap)) {
                all_finite = false;
                continue;
            }
            entropy_out[row] = out.entropy;
            argmax_out[row]  = out.argmax;
            if (uniforms != nullptr) {
                sampled_out[row] = out.sampled;
            }
            if (top_k > 0) {
                dropped_out[row] = out.dropped;
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
