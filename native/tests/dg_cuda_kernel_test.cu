// dg's CUDA kernels alone on a GPU, without ggml (built here by benchmarks/gpu_bundle.py with nvcc,
// run on the device by benchmarks/gpu_check.py):
//   step    the fused sampler pass (dg-step-kernels.cuh) on the rows of dg_step_cases.h, each record
//           against the CPU step's row routine; the values it leaves when asked against the host's;
//           then its time on a real canvas (256 rows of 262144 columns, top-64)
//   layout  the compacted MoE tile layout kernel (dg-moe-layout-kernel.cuh) against the host layout
// Prints one line per failure, a summary, and `step_ms` (the timing) as JSON on the last line; exits 1
// on any failure, 2 without a usable GPU.

#include "dg-moe-layout-kernel.cuh"
#include "dg-step-kernels.cuh"
#include "dg_step_cases.h"

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define DG_CHECK_CUDA(call)                                                                        \
    do {                                                                                           \
        cudaError_t err_ = (call);                                                                 \
        if (err_ != cudaSuccess) {                                                                 \
            std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(err_), __FILE__, __LINE__); \
            std::exit(2);                                                                          \
        }                                                                                          \
    } while (0)

template <typename T> static T * to_device(const std::vector<T> & v) {
    T * d = nullptr;
    DG_CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(1, v.size()) * sizeof(T)));
    if (!v.empty()) {
        DG_CHECK_CUDA(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    }
    return d;
}

template <typename T> static std::vector<T> to_host(const T * d, size_t n) {
    std::vector<T> v(n);
    DG_CHECK_CUDA(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
}

struct scratch {
    dg_chunk_stats * stats  = nullptr;
    float *          cand_v = nullptr;
    int32_t *        cand_i = nullptr;
    scratch(const dg_step_plan & plan, int n_rows) {
        const dg_step_scratch_size s = dg_step_scratch(plan, n_rows);
        DG_CHECK_CUDA(cudaMalloc(&stats, s.stats * sizeof(dg_chunk_stats)));
        DG_CHECK_CUDA(cudaMalloc(&cand_v, s.cand * sizeof(float)));
        DG_CHECK_CUDA(cudaMalloc(&cand_i, s.cand * sizeof(int32_t)));
    }
    ~scratch() {
        cudaFree(stats);
        cudaFree(cand_v);
        cudaFree(cand_i);
    }
};

// One row through the kernels three times (the values kept; not; the probabilities left for the
// dense self-conditioning product), each compared with the CPU step.
static void run_case(const row_case & rc) {
    const int          n    = (int) rc.logits.size();
    const dg_step_plan plan = dg_step_make_plan(n, rc.top_k);
    check(plan.ok, "kernel " + rc.name + ": no plan");
    if (!plan.ok) {
        return;
    }
    const int width = DG_REC_TOPK + 2 * rc.top_k;
    for (int mode = 0; mode < 3; ++mode) {
        const bool  keep        = mode == 1;
        const float probs_scale = mode == 2 ? DG_TEST_PROBS_SCALE : 0.0f;
        float *  d_logits = to_device(rc.logits);
        float *  d_t      = to_device(std::vector<float>{ rc.t });
        double * d_u      = to_device(std::vector<double>{ rc.u });
        float *  d_rec    = to_device(std::vector<float>(width, -12345.0f));
        scratch  s(plan, 1);
        DG_CHECK_CUDA(dg_step_launch(d_logits, keep, probs_scale, n, n, 1, d_t, d_u, rc.softcap, rc.top_k, d_rec, width,
                                     s.stats, s.cand_v, s.cand_i, 0));
        DG_CHECK_CUDA(cudaDeviceSynchronize());
        const std::vector<float> rec   = to_host(d_rec, width);
        const std::vector<float> after = to_host(d_logits, n);
        const std::string tag = "kernel " + rc.name + (keep ? " (values kept)" : mode == 2 ? " (probabilities)" : "");
        compare_record(rc, rec.data(), tag, mode == 2 ? after.data() : nullptr);
        if (mode == 2) {
            cudaFree(d_logits);
            cudaFree(d_t);
            cudaFree(d_u);
            cudaFree(d_rec);
            continue;
        }
        int changed = 0, wrong = 0;
        for (int i = 0; i < n; ++i) {
            const float want = dg_step_value(rc.logits[i], rc.softcap, rc.t);
            changed += !(after[i] == rc.logits[i] || (std::isnan(after[i]) && std::isnan(rc.logits[i])));
            const bool same = after[i] == want || std::fabs(after[i] - want) <= 2e-6f * std::fabs(want) ||
                              (std::isnan(after[i]) && std::isnan(want));
            wrong += !same;
        }
        if (keep) {
            check(wrong == 0, tag + ": " + std::to_string(wrong) + " values left differ from softcap(x) / t");
        } else {
            check(changed == 0, tag + ": the logits were changed though the values were not asked for");
        }
        cudaFree(d_logits);
        cudaFree(d_t);
        cudaFree(d_u);
        cudaFree(d_rec);
    }
}

// The real canvas: 256 rows of 262144 columns; the kernels' time (min and median of 20) with top_k
// candidates, or (probs) the probabilities left for the dense self-conditioning product.
static void time_canvas(double & min_ms, double & median_ms, int top_k, bool probs = false) {
    const int n_vocab = 262144, n_rows = 256;
    std::mt19937                    rng(3);
    std::normal_distribution<float> N(0.0f, 3.0f);
    std::vector<float>              logits((size_t) n_vocab * n_rows);
    for (float & f : logits) f = N(rng);
    std::vector<double> u(n_rows);
    for (int r = 0; r < n_rows; ++r) u[r] = (r + 0.5) / n_rows;
    float *  d_logits = to_device(logits);
    float *  d_copy   = probs ? to_device(logits) : nullptr;
    float *  d_t      = to_device(std::vector<float>(n_rows, 0.7f));
    double * d_u      = to_device(u);
    const int width   = DG_REC_TOPK + 2 * top_k;
    float *  d_rec    = to_device(std::vector<float>((size_t) width * n_rows));
    const dg_step_plan plan = dg_step_make_plan(n_vocab, top_k);
    scratch  s(plan, n_rows);
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    std::vector<double> ms;
    for (int it = 0; it < 22; ++it) {
        cudaEventRecord(a);
        if (probs) {  // the probabilities overwrite the logits: each run on the same logits
            DG_CHECK_CUDA(cudaMemcpyAsync(d_logits, d_copy, logits.size() * sizeof(float), cudaMemcpyDeviceToDevice));
            cudaEventRecord(a);
        }
        DG_CHECK_CUDA(dg_step_launch(d_logits, false, probs ? DG_TEST_PROBS_SCALE : 0.0f, n_vocab, n_vocab, n_rows, d_t,
                                     d_u, 30.0f, top_k, d_rec, width, s.stats, s.cand_v, s.cand_i, 0));
        cudaEventRecord(b);
        DG_CHECK_CUDA(cudaEventSynchronize(b));
        float t = 0.0f;
        cudaEventElapsedTime(&t, a, b);
        if (it >= 2) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    min_ms    = ms.front();
    median_ms = ms[ms.size() / 2];
    // the last run's records, spot-checked against the CPU step
    const std::vector<float> rec = to_host(d_rec, (size_t) width * n_rows);
    for (int r = 0; r < n_rows; r += 51) {
        row_case rc{ "canvas row " + std::to_string(r),
                     std::vector<float>(logits.begin() + (size_t) r * n_vocab, logits.begin() + (size_t) (r + 1) * n_vocab),
                     30.0f, 0.7f, u[r], top_k };
        compare_record(rc, rec.data() + (size_t) r * width, "kernel " + rc.name);
    }
    cudaFree(d_copy);
    cudaFree(d_logits);
    cudaFree(d_t);
    cudaFree(d_u);
    cudaFree(d_rec);
}

static void test_layout_kernel() {
    std::mt19937 rng(5);
    for (int trial = 0; trial < 40; ++trial) {
        const int n_experts = trial % 4 == 0 ? 300 : 128;
        const int J         = 8 * (1 + trial % 16);
        std::vector<int32_t> bounds(n_experts + 1, 0);
        std::geometric_distribution<int> G(trial % 3 == 0 ? 0.02 : 0.06);
        for (int e = 0; e < n_experts; ++e) {
            bounds[e + 1] = bounds[e] + (trial % 5 == 0 && e % 3 == 0 ? 0 : G(rng));
        }
        const int n_rows = bounds[n_experts];
        const int n_max  = dg_moe_tiles_max(n_rows, n_experts, J);
        std::vector<int32_t> tb(n_max + 1), te(n_max);
        dg_moe_tile_layout_host(bounds.data(), n_experts, J, n_max, tb.data(), te.data());
        int32_t * d_bounds = to_device(bounds);
        int32_t * d_tb     = to_device(std::vector<int32_t>(n_max + 1, -9));
        int32_t * d_te     = to_device(std::vector<int32_t>(n_max, -9));
        dg_moe_tile_layout_kernel<<<1, DG_LAYOUT_THREADS>>>(d_bounds, n_experts, J, n_max, d_tb, d_te);
        DG_CHECK_CUDA(cudaGetLastError());
        DG_CHECK_CUDA(cudaDeviceSynchronize());
        check(to_host(d_tb, n_max + 1) == tb && to_host(d_te, n_max) == te,
              "layout kernel: experts=" + std::to_string(n_experts) + " J=" + std::to_string(J) +
                  " rows=" + std::to_string(n_rows) + " differs from the host layout");
        cudaFree(d_bounds);
        cudaFree(d_tb);
        cudaFree(d_te);
    }
}

int main() {
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        std::printf("no CUDA device\n");
        return 2;
    }
    cudaDeviceProp prop;
    DG_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);

    for (const row_case & rc : make_step_cases()) {
        run_case(rc);
    }
    test_layout_kernel();
    double min64 = 0, med64 = 0, min0 = 0, med0 = 0, minp = 0, medp = 0;
    time_canvas(min64, med64, 64);
    time_canvas(min0, med0, 0);
    time_canvas(minp, medp, 0, true);
    std::printf("%d checks, %d failures\n", g_checks, g_failures);
    std::printf("{\"step_ms_top64\": {\"min\": %.4f, \"median\": %.4f}, \"step_ms_top0\": {\"min\": %.4f, \"median\": %.4f}, "
                "\"step_ms_probs\": {\"min\": %.4f, \"median\": %.4f}}\n", min64, med64, min0, med0, minp, medp);
    return g_failures == 0 ? 0 : 1;
}
