// Native per-step pass of the DiffusionGemma sampler: see include/diffusion-gemma-sampler.h. The
// row routine (dg_step_row, diffusion-gemma-step.h) also runs inside the decoder graph, as the
// step op that follows the LM head (diffusion-gemma-step-op.cpp).
//
// Why native: the real model yields 256 x 262144 logits per denoising step; temperature, softmax
// entropy, argmax and a multinomial draw over that in numpy take about as long as a small model's
// forward. Here a row is read twice: softcap + divide + max and its index (values), then exp + sums
// (weights), in vectors (diffusion-gemma-sampler-passes.inc, compiled for AVX-512, 16 wide, and AVX2
// and the baseline, 8 wide); the sample then walks a few hundred weights, not the row (sample_index). The reduction
// order differs from numpy's, which only moves the entropy in its last bits.
#include "diffusion-gemma-sampler.h"
#include "diffusion-gemma-step.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#if defined(__GNUC__) && !defined(__clang__)
// vectors only cross function boundaries inside one translation unit (inlined helpers)
#    pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace {

// (weight, index), ordered best first: larger weight, then the lower index (deterministic ties)
typedef std::pair<float, int32_t> candidate;

inline bool better(const candidate & a, const candidate & b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// weights summed per block of this many for the sample's walk (sample_index)
constexpr int32_t CDF_BLOCK = 256;

struct dg_sampler_passes {
    float (*transform_and_max)(const float * x, float * values, int32_t n, float softcap, bool exact_tanh, float t,
                               int32_t & best_idx, bool & finite);
    void (*exp_and_sums)(const float * x, float * weights, int32_t n, float best, double & total, double & weighted,
                         double * block_sums, const float * next_row);
    void (*select_top_k)(const float * w, int32_t n, int32_t k, std::vector<candidate> & heap);
};

}  // namespace

#define DG_SAMPLER_NS     dg_sampler_baseline
#define DG_SAMPLER_TARGET
#define DG_SAMPLER_LANES  8
#define DG_SAMPLER_ISA    0
#include "diffusion-gemma-sampler-passes.inc"
#undef DG_SAMPLER_NS
#undef DG_SAMPLER_TARGET

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#    include <immintrin.h>
#    define DG_SAMPLER_X86 1
#    define DG_SAMPLER_NS     dg_sampler_avx2
#    define DG_SAMPLER_TARGET __attribute__((target("avx2,fma")))
#    undef DG_SAMPLER_ISA
#    define DG_SAMPLER_ISA    256
#    include "diffusion-gemma-sampler-passes.inc"
#    undef DG_SAMPLER_NS
#    undef DG_SAMPLER_TARGET
#    define DG_SAMPLER_NS     dg_sampler_avx512
#    define DG_SAMPLER_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,fma")))
#    undef DG_SAMPLER_LANES
#    define DG_SAMPLER_LANES  16
#    undef DG_SAMPLER_ISA
#    define DG_SAMPLER_ISA    512
#    include "diffusion-gemma-sampler-passes.inc"
#    undef DG_SAMPLER_NS
#    undef DG_SAMPLER_TARGET
#endif

namespace {

// The widest copy this CPU runs; DG_CPU_KERNELS=avx2 (the kernel family switch, read at every row so
// that a benchmark may switch families between steps) asks for the AVX2 one on an AVX-512 CPU, so
// that one machine measures both families.
const dg_sampler_passes & passes_for_cpu() {
#ifdef DG_SAMPLER_X86
    static const int widest = [] {
        __builtin_cpu_init();
        const bool avx2   = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                            __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
        return avx512 ? 512 : avx2 ? 256 : 0;
    }();
    const char * family = std::getenv("DG_CPU_KERNELS");
    const bool   avx2_asked = family && !std::strcmp(family, "avx2");
    if (widest == 512 && !avx2_asked) {
        return dg_sampler_avx512::passes;
    }
    if (widest >= 256) {
        return dg_sampler_avx2::passes;
    }
#endif
    return dg_sampler_baseline::passes;
}

// The first i with cumsum(weights)[i] > target, the cumulative sum taken in double in index order, or
// -1 if it never gets there. That sum is sequential (each partial sum rounded in turn), so it is not
// vectorized; instead the block sums (any order) and a walk inside one block give an approximation A_i
// within E of it (both round at most n + 2 * CDF_BLOCK + n / CDF_BLOCK times, each by at most u * total);
// when the target is farther than E from A on both sides of the index found, the sequential sum crosses
// there too. Otherwise (rarely: the target within ~1e-10 of a partial sum) the sequential walk decides.
int32_t sample_index(const float * weights, const double * block_sums, int32_t n, double target, double total) {
    const double E = 2.0 * ((double) n + 4.0 * CDF_BLOCK) * (0.5 * 2.220446049250313e-16) * total;
    double       start = 0.0;
    int32_t      b     = 0;
    for (const int32_t n_blocks = (n + CDF_BLOCK - 1) / CDF_BLOCK; b < n_blocks - 1; ++b) {
        if (start + block_sums[b] > target - E) {
            break;
        }
        start += block_sums[b];
    }
    double a = start;
    for (int32_t i = b * CDF_BLOCK; i < n; ++i) {
        const double before = a;
        a += (double) weights[i];
        if (a > target) {
            if (before <= target - E && a > target + E) {
                return i;
            }
            break;
        }
    }
    double cdf = 0.0;  // the sequential sum itself
    for (int32_t i = 0; i < n; ++i) {
        cdf += (double) weights[i];
        if (cdf > target) {
            return i;
        }
    }
    return -1;
}

}  // namespace

bool dg_step_row(const dg_row_in & in, dg_row_out & out, dg_topk_heap & heap) {
    const int32_t              n      = in.n_vocab;
    const dg_sampler_passes &  passes = passes_for_cpu();

    bool        finite   = true;
    int32_t     best_idx = 0;  // the first index of the maximum, as numpy/torch argmax
    const float best     = passes.transform_and_max(in.logits, in.values, n, in.softcap, in.exact_tanh, in.temperature,
                                                    best_idx, finite);
    if (!finite) {
        return false;
    }

    thread_local std::vector<double> block_sums;
    block_sums.resize((size_t) (n / CDF_BLOCK + 1));
    double total    = 0.0;
    double weighted = 0.0;
    passes.exp_and_sums(in.values, in.weights, n, best, total, weighted, block_sums.data(), in.next_row);
    const double entropy = std::log(total) - weighted / total;
    out.entropy = entropy > 0.0 ? entropy : 0.0;
    out.argmax  = best_idx;
    out.total   = total;

    const float * weights = in.weights;
    if (in.top_k > 0) {
        // the self-conditioning input of the next step: softmax(values) at its k most probable
        // tokens, and the probability mass left out
        passes.select_top_k(weights, n, in.top_k, heap);
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
        const int32_t pick = sample_index(weights, block_sums.data(), n, *in.uniform * total, total);
        if (pick >= 0) {
            out.sampled = pick;
        } else {
            // `total` was summed blockwise, so the sequential cdf can end a hair below u * total: the
            // last index with a weight
            int32_t last_kept = best_idx;
            for (int32_t i = n - 1; i >= 0; --i) {
                if (weights[i] > 0.0f) {
                    last_kept = i;
                    break;
                }
            }
            out.sampled = last_kept;
        }
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
