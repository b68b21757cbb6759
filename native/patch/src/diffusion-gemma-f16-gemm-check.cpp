// A check of ggml-cpu's F16 x F32 MUL_MAT as the attention uses it (dg's AVX-512 kernel in
// ggml-cpu/dg-f16-gemm.cpp, or ggml's own with DG_F16_GEMM=0) against a float64 sum, through a real
// CPU graph: the F16 operand a permuted view (as the cache's keys are), the F32 one a permuted view or
// contiguous, heads broadcast over grouped key/value heads.

#include "diffusion-gemma.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

extern "C" int dg_f16_gemm_takes(int64_t m, int64_t n, int64_t k); // ggml-cpu/dg-f16-gemm.cpp

int32_t dg_f16_matmul_selftest(int64_t m, int64_t n, int64_t k, int64_t heads, int64_t heads_kv, bool permuted,
                               int32_t n_threads, uint32_t seed, double * max_rel_err) {
    if (!max_rel_err || m <= 0 || n <= 0 || k <= 0 || heads_kv <= 0 || heads <= 0 || heads % heads_kv != 0 ||
        n_threads <= 0 || m * k * heads_kv > (1 << 26) || n * k * heads > (1 << 26)) {
        return -1;
    }
    const ggml_init_params params = { 16 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context *         ctx    = ggml_init(params);
    // a: [k, m, heads_kv] viewed from [k, heads_kv, m] (rows k x heads_kv apart, as the cache's keys)
    ggml_tensor * a_base = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, k, heads_kv, m);
    ggml_tensor * a      = ggml_permute(ctx, a_base, 0, 2, 1, 3);
    // b: [k, n, heads], from [k, heads, n] where permuted (as the queries)
    ggml_tensor * b_base = permuted ? ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, heads, n) :
                                      ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, n, heads);
    ggml_tensor * b      = permuted ? ggml_permute(ctx, b_base, 0, 2, 1, 3) : b_base;
    ggml_tensor * y      = ggml_mul_mat(ctx, a, b); // [m, n, heads]
    ggml_cgraph * gf     = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);

    ggml_backend_buffer_t buf     = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_cpu_buffer_type());
    ggml_backend_t        backend = ggml_backend_cpu_init();
    int32_t               rc      = -1;
    if (buf && backend) {
        std::mt19937                          rng(seed);
        std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
        std::vector<ggml_fp16_t>              av((size_t) ggml_nelements(a_base));
        std::vector<float>                    bv((size_t) ggml_nelements(b_base));
        for (auto & v : av) {
            v = ggml_fp32_to_fp16(unit(rng));
        }
        for (auto & v : bv) {
            v = unit(rng) * 2.0f;
        }
        ggml_backend_tensor_set(a_base, av.data(), 0, av.size() * sizeof(ggml_fp16_t));
        ggml_backend_tensor_set(b_base, bv.data(), 0, bv.size() * sizeof(float));
        ggml_backend_cpu_set_n_threads(backend, n_threads);
        if (ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS) {
            std::vector<float> out((size_t) ggml_nelements(y));
            ggml_backend_tensor_get(y, out.data(), 0, out.size() * sizeof(float));
            double diff = 0.0, scale = 0.0;
            bool   finite = true;
            for (int64_t h = 0; h < heads; ++h) {
                const int64_t hk = h / (heads / heads_kv);
                for (int64_t j = 0; j < n; ++j) {
                    for (int64_t i = 0; i < m; ++i) {
                        double sum = 0.0;
                        for (int64_t l = 0; l < k; ++l) {
                            const float  x = ggml_fp16_to_fp32(av[(size_t) ((i * heads_kv + hk) * k + l)]);
                            const double z = permuted ? bv[(size_t) ((j * heads + h) * k + l)] : bv[(size_t) ((h * n + j) * k + l)];
                            sum += (double) x * z;
                        }
                        const float got = out[(size_t) ((h * n + j) * m + i)];
                        finite          = finite && std::isfinite(got);
                        diff            = std::max(diff, std::fabs(got - sum));
                        scale           = std::max(scale, std::fabs(sum));
                    }
                }
            }
            *max_rel_err = finite && scale > 0.0 ? diff / scale : INFINITY;
            rc           = 0;
        }
    }
    ggml_backend_free(backend);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return rc;
}

int32_t dg_f16_gemm_runs(int64_t m, int64_t n, int64_t k) {
    return dg_f16_gemm_takes(m, n, k);
}
