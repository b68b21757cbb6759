// Native per-step pass of the DiffusionGemma sampler: see include/diffusion-gemma-sampler.h.
//
// Why native: the real model yields 256 x 262144 logits per denoising step; temperature, softmax
// entropy, argmax and a multinomial draw over that in numpy take about as long as a small model's
// forward. Here each row is read twice (divide + max, then exp + sums) and a third time only up to
// the sampled index, from a per-thread scratch row of exp values.

#include "diffusion-gemma-sampler.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

namespace {

struct step_args {
    float *        logits;
    int32_t        n_vocab;
    float          temperature;
    const double * uniforms;
    double *       entropy_out;
    int32_t *      argmax_out;
    int32_t *      sampled_out;
};

// Returns false if the row held a non-finite value.
bool process_row(const step_args & a, int32_t row, std::vector<float> & weights) {
    float * x = a.logits + (size_t) row * (size_t) a.n_vocab;
    const int32_t n = a.n_vocab;

    float   best     = -INFINITY;
    int32_t best_idx = 0;
    bool    finite   = true;
    for (int32_t i = 0; i < n; ++i) {
        // division, not multiplication by 1/t: bit-identical to the reference's `logits / t`
        const float v = x[i] / a.temperature;
        x[i] = v;
        finite = finite && std::isfinite(v);
        if (v > best) {
            best     = v;
            best_idx = i;
        }
    }
    if (!finite) {
        return false;
    }

    double total    = 0.0;
    double weighted = 0.0;
    for (int32_t i = 0; i < n; ++i) {
        const float shifted = x[i] - best;
        const float w       = std::exp(shifted);
        weights[i] = w;
        total    += (double) w;
        weighted += (double) w * (double) shifted;
    }
    const double entropy = std::log(total) - weighted / total;
    a.entropy_out[row] = entropy > 0.0 ? entropy : 0.0;
    a.argmax_out[row]  = best_idx;

    if (a.uniforms != nullptr) {
        const double target = a.uniforms[row] * total;
        double  cdf  = 0.0;
        int32_t pick = n - 1;
        for (int32_t i = 0; i < n; ++i) {
            cdf += (double) weights[i];
            if (cdf > target) {
                pick = i;
                break;
            }
        }
        a.sampled_out[row] = pick;
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
