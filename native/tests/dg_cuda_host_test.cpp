// Host checks of dg's CUDA kernels (native/patch/ggml/src/ggml-cuda/dg-*.cuh) that need no GPU:
//   layout  the compacted MoE grid's tile layout (dg-moe-layout.cuh) over random routings: every
//           routed row in exactly one tile of its own expert, at most J rows a tile, no empty tile
//           before the last, the tile count within dg_moe_tiles_max; and a MoE product computed
//           tile by tile as the MMQ kernel reads the layout equals the plain per-row product
//   step    the fused sampler pass's per-row algorithm (dg_step_row_chunked: chunk statistics,
//           merged; candidates by value per chunk, sorted by weight; the sample from one chunk)
//           against the CPU step's row routine (dg_step_row) on the same rows
// Built and run by tests/test_cuda_host_math.py; prints one line per failure and a summary, exits 1
// on any failure.

#include "dg-moe-layout.cuh"
#include "dg_step_cases.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

// -- layout ------------------------------------------------------------------------------------------

// Routing of n_tokens tokens to n_used distinct experts of n_experts, sorted by expert as
// ggml_cuda_launch_mm_ids_helper sorts them: expert_bounds and, per sorted row, (token, slot).
struct routing {
    std::vector<int32_t> bounds;
    std::vector<int32_t> row_token;
    std::vector<int32_t> row_expert;
};

static routing make_routing(std::mt19937 & rng, int n_tokens, int n_experts, int n_used, double skew) {
    routing r;
    std::vector<std::vector<int32_t>> by_expert(n_experts);
    std::vector<double> weight(n_experts);
    for (int e = 0; e < n_experts; ++e) {
        weight[e] = std::pow((double) (e + 1), -skew);  // skew > 0: a few experts take most tokens
    }
    for (int t = 0; t < n_tokens; ++t) {
        std::vector<double> w = weight;
        for (int u = 0; u < n_used; ++u) {
            std::discrete_distribution<int> pick(w.begin(), w.end());
            const int e = pick(rng);
            by_expert[e].push_back(t);
            w[e] = 0.0;
        }
    }
    r.bounds.push_back(0);
    for (int e = 0; e < n_experts; ++e) {
        for (int32_t t : by_expert[e]) {
            r.row_token.push_back(t);
            r.row_expert.push_back(e);
        }
        r.bounds.push_back((int32_t) r.row_token.size());
    }
    return r;
}

static void test_layout_case(std::mt19937 & rng, int n_tokens, int n_experts, int n_used, int J, double skew) {
    const routing r      = make_routing(rng, n_tokens, n_experts, n_used, skew);
    const int     n_rows = n_tokens * n_used;
    const int     n_max  = dg_moe_tiles_max(n_rows, n_experts, J);
    const std::string tag = "layout tokens=" + std::to_string(n_tokens) + " experts=" + std::to_string(n_experts) +
                            " used=" + std::to_string(n_used) + " J=" + std::to_string(J) + " skew=" + std::to_string(skew);

    std::vector<int32_t> tile_bounds(n_max + 1, -7);
    std::vector<int32_t> tile_expert(n_max, -7);
    const int count = dg_moe_tile_layout_host(r.bounds.data(), n_experts, J, n_max, tile_bounds.data(), tile_expert.data());

    int needed = 0;
    for (int e = 0; e < n_experts; ++e) {
        needed += (r.bounds[e + 1] - r.bounds[e] + J - 1) / J;
    }
    check(count == needed, tag + ": tile count " + std::to_string(count) + " != " + std::to_string(needed));
    check(count <= n_max, tag + ": " + std::to_string(count) + " tiles above the bound " + std::to_string(n_max));

    std::vector<int> covered(n_rows, 0);
    bool ok_rows = true, ok_width = true, ok_nonempty = true, ok_tail = true, ok_expert = true;
    for (int c = 0; c < n_max; ++c) {
        const int lo = tile_bounds[c];
        const int hi = tile_bounds[c + 1];
        if (c < count) {
            ok_nonempty = ok_nonempty && hi > lo;
            ok_width    = ok_width && hi - lo <= J;
            for (int row = lo; row < hi && row >= 0 && row < n_rows; ++row) {
                covered[row]++;
                ok_expert = ok_expert && r.row_expert[row] == tile_expert[c];
            }
        } else {
            ok_tail = ok_tail && lo == n_rows && hi == n_rows;
        }
    }
    for (int row = 0; row < n_rows; ++row) {
        ok_rows = ok_rows && covered[row] == 1;
    }
    check(ok_rows, tag + ": a routed row is not in exactly one tile");
    check(ok_width, tag + ": a tile holds more than J rows");
    check(ok_nonempty, tag + ": an empty tile before the last");
    check(ok_expert, tag + ": a tile holds another expert's row");
    check(ok_tail, tag + ": a tile past the count is not empty at the end");

    // the product as the compacted grid computes it: per tile, its expert's weights times its rows
    const int n_in = 8, n_out = 5;
    std::uniform_real_distribution<float> U(-1.0f, 1.0f);
    std::vector<float> w((size_t) n_experts * n_out * n_in), x((size_t) n_tokens * n_in);
    for (float & f : w) f = U(rng);
    for (float & f : x) f = U(rng);
    std::vector<float> want((size_t) n_rows * n_out), got((size_t) n_rows * n_out, NAN);
    for (int row = 0; row < n_rows; ++row) {
        const int e = r.row_expert[row], t = r.row_token[row];
        for (int o = 0; o < n_out; ++o) {
            float s = 0.0f;
            for (int i = 0; i < n_in; ++i) s += w[((size_t) e * n_out + o) * n_in + i] * x[(size_t) t * n_in + i];
            want[(size_t) row * n_out + o] = s;
        }
    }
    for (int c = 0; c < n_max; ++c) {
        const int lo = tile_bounds[c], hi = tile_bounds[c + 1];
        if (hi <= lo) {
            continue;  // the kernel returns before it reads any weight
        }
        const int e = tile_expert[c];
        for (int j = 0; j < J && lo + j < hi; ++j) {
            const int row = lo + j, t = r.row_token[row];
            for (int o = 0; o < n_out; ++o) {
                float s = 0.0f;
                for (int i = 0; i < n_in; ++i) s += w[((size_t) e * n_out + o) * n_in + i] * x[(size_t) t * n_in + i];
                got[(size_t) row * n_out + o] = s;
            }
        }
    }
    check(got == want, tag + ": the tiled product differs from the per-row product");
}

static void test_layout() {
    std::mt19937 rng(1);
    // the real canvas (256 tokens, top-8 of 128), decode-sized and prompt-sized batches, skewed
    // routing (some experts empty), and tile widths from 1 to 128
    for (int J : { 8, 16, 24, 32, 40, 64, 128 }) {
        test_layout_case(rng, 256, 128, 8, J, 0.0);
        test_layout_case(rng, 256, 128, 8, J, 1.5);
    }
    test_layout_case(rng, 1, 128, 8, 16, 0.0);
    test_layout_case(rng, 3, 8, 2, 1, 0.0);
    test_layout_case(rng, 2048, 128, 8, 24, 0.7);
    test_layout_case(rng, 16, 4, 4, 8, 0.0);  // every token to every expert
    test_layout_case(rng, 100, 300, 1, 16, 2.0);
    // the bound is reached: every expert one row over a multiple of J
    {
        const int J = 16, E = 8;
        std::vector<int32_t> bounds(E + 1, 0);
        for (int e = 0; e < E; ++e) bounds[e + 1] = bounds[e] + J + 1;
        const int n_rows = bounds[E];
        const int n_max  = dg_moe_tiles_max(n_rows, E, J);
        std::vector<int32_t> tb(n_max + 1), te(n_max);
        const int count = dg_moe_tile_layout_host(bounds.data(), E, J, n_max, tb.data(), te.data());
        check(count == 2 * E && count <= n_max, "layout: J + 1 rows per expert needs two tiles each, within the bound");
    }
}

static void test_step() {
    for (const row_case & rc : make_step_cases()) {
        std::vector<float> rec(DG_REC_TOPK + 2 * rc.top_k);
        std::vector<float> probs(rc.logits.size());
        const bool planned = dg_step_row_chunked(rc.logits.data(), (int32_t) rc.logits.size(), rc.softcap, rc.t, rc.u,
                                                 rc.top_k, rec.data(), DG_TEST_PROBS_SCALE, probs.data());
        check(planned, "step " + rc.name + ": no plan for these sizes");
        if (planned) {
            compare_record(rc, rec.data(), "step " + rc.name, probs.data());
        }
    }
    check_plans();
}

int main(int argc, char ** argv) {
    const std::string only = argc > 1 ? argv[1] : "";
    if (only.empty() || only == "layout") test_layout();
    if (only.empty() || only == "step") test_step();
    std::printf("%d checks, %d failures\n", g_checks, g_failures);
    return g_failures == 0 ? 0 : 1;
}
