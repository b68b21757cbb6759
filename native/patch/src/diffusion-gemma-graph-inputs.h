#pragma once
// Internal: the diffusion-gemma graph's inputs beyond llama.cpp's own (diffusion-gemma-graph-inputs.cpp):
// what a dg_* request sets into a graph before each compute, and when a built graph may be reused
// for the next request (llama.cpp reuses a graph when every input's can_reuse agrees).

#include "llama-graph.h"
#include "diffusion-gemma-api.h"
#include "diffusion-gemma-step-op.h"

#include <cstdint>

// What a graph was built for, beyond what llama.cpp itself compares: a graph built with another
// self-conditioning form (or none), another top-k width, exact GELU or another step is never reused
// for a request that differs.
struct dg_graph_key {
    bool       exact     = false;
    dg_sc_form sc_form   = dg_sc_form::none;
    int32_t    sc_width  = 0;
    bool       step      = false;
    int32_t    step_k    = 0;
    bool       step_soft = false;
    bool       keep      = false;
    bool       portable  = false;
    bool       fused     = false; // DG_CUDA_FUSED_STEP: the step op on a GPU that has its kernels

    explicit dg_graph_key(const dg_request * req) {
        if (!req) {
            return;
        }
        exact     = req->exact;
        sc_form   = req->sc_form;
        sc_width  = req->sc_width;
        step      = req->step.active;
        step_k    = step ? req->step.top_k : 0;
        step_soft = step && req->step.soft;
        keep      = step && req->step.keep_values;
        portable  = step && req->step.portable;
        fused     = step && dg_cuda_fused_step_wanted();
    }

    bool operator==(const dg_graph_key & o) const {
        return exact == o.exact && sc_form == o.sc_form && sc_width == o.sc_width && step == o.step &&
               step_k == o.step_k && step_soft == o.step_soft && keep == o.keep && portable == o.portable &&
               fused == o.fused;
    }
};

// The request's mode (dg_graph_key): no tensor, only the reuse check.
class llm_graph_input_dg_mode : public llm_graph_input_i {
public:
    explicit llm_graph_input_dg_mode(const dg_graph_key & key) : key(key) {}

    void set_input(const llama_ubatch *) override {}

    bool can_reuse(const llm_graph_params &) override;

    const dg_graph_key key;
};

// The previous step's self-conditioning input, one row per canvas position (dg_sc_form): top-k ids
// and their probabilities, the whole distribution, or the soft embedding itself.
class llm_graph_input_dg_self_cond : public llm_graph_input_i {
public:
    llm_graph_input_dg_self_cond(dg_sc_form form, int32_t width) : form(form), width(width) {}

    void set_input(const llama_ubatch * ubatch) override;

    bool can_reuse(const llm_graph_params & params) override;

    const dg_sc_form form;
    const int32_t    width;          // k, n_vocab or n_embd
    ggml_tensor *    ids    = nullptr; // top-k: I32 [k * n_tokens], k token ids per canvas position
    ggml_tensor *    values = nullptr; // F32 [width, n_tokens]: probabilities, or the soft embedding
};

// The step's per-row inputs (temperature of the row's canvas, its uniform) and, once the inputs
// are set, where the caller finds the results (published into the request: the graph may be
// reused, so its tensors are only known then).
class llm_graph_input_dg_step : public llm_graph_input_i {
public:
    void set_input(const llama_ubatch * ubatch) override;

    bool can_reuse(const llm_graph_params & params) override;

    ggml_dg_step_params op = {};
    ggml_tensor * temperatures = nullptr; // F32 [1, n_rows]
    ggml_tensor * uniforms     = nullptr; // F64 [n_rows] (the step op) or F32 [1, n_rows] (ggml ops)
    ggml_tensor * record       = nullptr; // F32 [dg_step_record_width(top_k), n_rows]
    ggml_tensor * values       = nullptr; // F32 [n_vocab, n_rows], when the caller keeps them
    ggml_tensor * soft_embd    = nullptr; // F32 [n_embd, n_rows]: the next step's dense self-conditioning input
};
