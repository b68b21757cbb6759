#pragma once
// Shared by native/tests/dg_cuda_host_test.cpp (the fused step's algorithm emulated on the CPU) and
// dg_cuda_kernel_test.cu (the kernels on a GPU): the rows, and the comparison of a row's record with
// the CPU step's row routine (dg_step_row).

#include "dg-step-algo.cuh"
#include "diffusion-gemma-step.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

static int g_failures = 0;
static int g_checks   = 0;

static void check(bool ok, const std::string & what) {
    ++g_checks;
    if (!ok) {
        ++g_failures;
        if (g_failures <= 40) {
            std::printf("FAIL %s\n", what.c_str());
        }
    }
}


struct row_case {
    std::string        name;
    std::vector<float> logits;
    float              softcap;
    float              t;
    double             u;
    int32_t            top_k;
};

// probability of the token sampled at u within `margin` of a CDF edge (numpy-free check of a
// disagreement: both are right to within rounding)
static bool near_cdf_edge(const std::vector<float> & values, double u, int32_t a, int32_t b) {
    double m = -INFINITY;
    for (float v : values) m = std::max(m, (double) v);
    double total = 0.0;
    for (float v : values) total += std::exp((double) v - m);
    double cdf = 0.0;
    for (int32_t i = 0; i <= std::max(a, b); ++i) {
        cdf += std::exp((double) values[i] - m) / total;
        if (i == std::min(a, b) || i == std::max(a, b) - 1) {
            if (std::fabs(cdf - u) < 1e-5) return true;
        }
    }
    return false;
}

// The scale the step gives the probabilities it leaves for the dense self-conditioning product
// (DG_SC_PROBS_SCALE in native/patch/src/diffusion-gemma-embd-t.h).
constexpr float DG_TEST_PROBS_SCALE = 32768.0f;

// One row's record (emulated or from the GPU) against the CPU step's row routine on the same row;
// with `probs`, the probabilities left over the row against the CPU op's (its weights times
// (float) (scale / total), diffusion-gemma-step-op.cpp: dg_step_op).
static void compare_record(const row_case & rc, const float * record, const std::string & tag,
                           const float * left_probs = nullptr) {
    const int32_t n = (int32_t) rc.logits.size();
    const int32_t k = rc.top_k;

    // the CPU step (fast tanh, as the GPU)
    std::vector<float>   values(n), weights(n);
    std::vector<int32_t> ids(k);
    std::vector<float>   probs(k);
    dg_topk_heap         heap;
    dg_row_in in  = {};
    in.logits     = rc.logits.data();
    in.values     = values.data();
    in.weights    = weights.data();
    in.n_vocab    = n;
    in.softcap    = rc.softcap;
    in.exact_tanh = false;
    in.temperature = rc.t;
    in.uniform    = &rc.u;
    in.top_k      = k;
    in.topk_ids   = ids.data();
    in.topk_probs = probs.data();
    dg_row_out out;
    const bool finite = dg_step_row(in, out, heap);
    // dg_step_row leaves `values` as the weights when they share a buffer; here they do not
    std::vector<float> vals(n);
    for (int32_t i = 0; i < n; ++i) vals[i] = dg_step_value(rc.logits[i], rc.softcap, rc.t);

    const float * rec = record;

    if (!finite) {
        check(std::isnan(rec[DG_REC_ENTROPY]), tag + ": a row with a non-finite value has a finite entropy");
        return;
    }
    check(!std::isnan(rec[DG_REC_ENTROPY]), tag + ": NaN entropy for a finite row");
    if (left_probs != nullptr) {
        const float to_probs = (float) ((double) DG_TEST_PROBS_SCALE / out.total);
        int wrong = 0;
        double sum = 0.0;
        for (int32_t i = 0; i < n; ++i) {
            const float want = weights[i] * to_probs;
            wrong += std::fabs(left_probs[i] - want) > 2e-5f * want + 1e-30f;
            sum += left_probs[i];
        }
        check(wrong == 0, tag + ": " + std::to_string(wrong) + " probabilities differ from the CPU op's");
        check(std::fabs(sum / DG_TEST_PROBS_SCALE - 1.0) < 1e-4, tag + ": probabilities sum to " +
                                                                  std::to_string(sum / DG_TEST_PROBS_SCALE));
    }

    // argmax: equal unless the two best values are within rounding of each other
    const int32_t am = (int32_t) rec[DG_REC_ARGMAX];
    check(am == out.argmax || std::fabs(vals[am] - vals[out.argmax]) <= 1e-6f * std::fabs(vals[out.argmax]),
          tag + ": argmax " + std::to_string(am) + " vs " + std::to_string(out.argmax));
    const double e = rec[DG_REC_ENTROPY];
    check(std::fabs(e - out.entropy) <= 2e-5 * std::max(1.0, out.entropy),
          tag + ": entropy " + std::to_string(e) + " vs " + std::to_string(out.entropy));
    const int32_t s = (int32_t) rec[DG_REC_SAMPLED];
    check(s == out.sampled || near_cdf_edge(vals, rc.u, s, out.sampled),
          tag + ": sampled " + std::to_string(s) + " vs " + std::to_string(out.sampled));
    if (k > 0) {
        check(std::fabs(rec[DG_REC_DROPPED] - out.dropped) <= 1e-5,
              tag + ": dropped " + std::to_string(rec[DG_REC_DROPPED]) + " vs " + std::to_string(out.dropped));
        int id_mismatch = 0, prob_mismatch = 0;
        for (int32_t j = 0; j < k; ++j) {
            const float p_got = rec[DG_REC_TOPK + k + j];
            if (std::fabs(p_got - probs[j]) > 1e-5f * std::max(1e-3f, probs[j]) + 1e-12f) ++prob_mismatch;
            // an id may differ only where the probability ties with a neighbour (then the CPU takes
            // the lower index among equal weights, the kernels among equal ones in their candidates)
            const bool tie = (j > 0 && probs[j - 1] == probs[j]) || (j + 1 < k && probs[j + 1] == probs[j]);
            if ((int32_t) rec[DG_REC_TOPK + j] != ids[j] && !tie && probs[j] > 0.0f) ++id_mismatch;
        }
        check(prob_mismatch == 0, tag + ": " + std::to_string(prob_mismatch) + " top-k probabilities differ");
        check(id_mismatch == 0, tag + ": " + std::to_string(id_mismatch) + " top-k ids differ (untied)");
    }
}

// The rows both tests run: the real vocabulary at several k, small vocabularies, ties, peaked and
// non-finite rows, the sample at the ends of [0, 1).
static std::vector<row_case> make_step_cases() {
    std::mt19937 rng(7);
    std::normal_distribution<float>       N(0.0f, 1.0f);
    std::uniform_real_distribution<double> U(0.0, 1.0);
    auto normal_row = [&](int n, float sigma) {
        std::vector<float> r(n);
        for (float & f : r) f = N(rng) * sigma;
        return r;
    };
    std::vector<row_case> cases;
    // the real vocabulary: k = 64 (dg's), wider and narrower k, chunk-limit k (32 chunks x 256)
    for (int32_t k : { 0, 1, 8, 64, 256 }) {
        for (float sigma : { 0.5f, 3.0f, 12.0f }) {
            cases.push_back({ "V=262144 k=" + std::to_string(k) + " sigma=" + std::to_string(sigma),
                              normal_row(262144, sigma), 30.0f, 0.7f, U(rng), k });
        }
    }
    // k = 512 needs 16384-column chunks
    cases.push_back({ "V=262144 k=512", normal_row(262144, 4.0f), 30.0f, 1.0f, U(rng), 512 });
    // small vocabularies: one chunk, k up to the whole row (the dense self-conditioning of tiny models)
    cases.push_back({ "V=100 k=100", normal_row(100, 2.0f), 30.0f, 0.5f, U(rng), 100 });
    cases.push_back({ "V=4096 k=4096", normal_row(4096, 2.0f), 0.0f, 0.9f, U(rng), 4096 });
    cases.push_back({ "V=4096 k=64 no softcap", normal_row(4096, 5.0f), 0.0f, 0.3f, U(rng), 64 });
    // a partial last chunk
    cases.push_back({ "V=8199 k=16", normal_row(8199, 3.0f), 30.0f, 0.6f, U(rng), 16 });
    cases.push_back({ "V=40000 k=64", normal_row(40000, 3.0f), 30.0f, 0.6f, U(rng), 64 });
    // ties: values on a coarse grid (equal values within and across chunks)
    {
        std::vector<float> r = normal_row(262144, 2.0f);
        for (float & f : r) f = std::round(f * 2.0f) / 2.0f;
        cases.push_back({ "V=262144 k=64 coarse ties", r, 0.0f, 1.0f, U(rng), 64 });
        std::vector<float> flat(262144, 1.25f);
        cases.push_back({ "V=262144 k=64 all equal", flat, 30.0f, 1.0f, 0.5, 64 });
    }
    // peaked: one huge logit, most weights underflow to exactly 0 (without softcap)
    {
        std::vector<float> r = normal_row(262144, 1.0f);
        r[123457] = 200.0f;
        cases.push_back({ "V=262144 k=64 peaked", r, 0.0f, 1.0f, 0.999, 64 });
        cases.push_back({ "V=262144 k=64 peaked u=0", r, 0.0f, 1.0f, 0.0, 64 });
    }
    // u at the ends
    cases.push_back({ "V=262144 k=8 u~1", normal_row(262144, 2.0f), 30.0f, 0.7f, 0.9999999, 8 });
    cases.push_back({ "V=262144 k=8 u=0", normal_row(262144, 2.0f), 30.0f, 0.7f, 0.0, 8 });
    // the maximum in the last chunk and at column 0
    {
        std::vector<float> r = normal_row(262144, 1.0f);
        r[262143] = 9.0f;
        cases.push_back({ "V=262144 max at the end", r, 30.0f, 1.0f, U(rng), 8 });
        std::vector<float> r0 = normal_row(262144, 1.0f);
        r0[0] = 9.0f;
        cases.push_back({ "V=262144 max at 0", r0, 30.0f, 1.0f, U(rng), 8 });
    }
    // non-finite rows: NaN anywhere; -inf without a softcap
    {
        std::vector<float> r = normal_row(262144, 1.0f);
        r[200000] = NAN;
        cases.push_back({ "V=262144 NaN", r, 30.0f, 1.0f, 0.5, 8 });
        std::vector<float> r2 = normal_row(9000, 1.0f);
        r2[8500] = -INFINITY;
        cases.push_back({ "V=9000 -inf no softcap", r2, 0.0f, 1.0f, 0.5, 8 });
    }
    return cases;
}

static void check_plans() {
    // the plan: what the kernels accept
    check(dg_step_make_plan(262144, 64).ok && dg_step_make_plan(262144, 64).chunk == 8192, "plan: V=262144 k=64");
    check(dg_step_make_plan(262144, 512).ok && dg_step_make_plan(262144, 512).chunk == 16384, "plan: V=262144 k=512");
    check(!dg_step_make_plan(262144, 1024).ok, "plan: V=262144 k=1024 is refused");
    check(!dg_step_make_plan(100, 101).ok, "plan: k above the vocabulary is refused");
}

