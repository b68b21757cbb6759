#pragma once
// Internal: the denoising step as one custom ggml op at the end of the decoder graph, where the
// logits are on the CPU (llama_model_diffusion_gemma::graph::build_step, diffusion-gemma-step-op.cpp).
// Its per-row arithmetic is dg_step_row (diffusion-gemma-step.h), shared with the host sampler.

#include "ggml.h"

// The settings of one graph's step op, read by every thread of the op.
struct dg_step_op_params {
    int32_t top_k       = 0;
    float   softcap     = 0.0f;  // 0: none
    bool    exact_tanh  = false;
    bool    keep_values = false; // leave softcap(logits) / t in the logits tensor for the caller
    float   probs_scale = 0.0f;  // not 0: leave softmax(values) * probs_scale there (the dense product's input)
};

// dst = the step's record, F32 [dg_step_record_width(top_k), n_rows]; sources: the logits F32
// [n_vocab, n_rows] (transformed in place), the temperatures F32 [1, n_rows], the uniforms F64 [n_rows];
// userdata: the graph's dg_step_op_params. A ggml_custom_op_t.
void dg_step_op(ggml_tensor * dst, int ith, int nth, void * userdata);

// The in-place view of the probabilities the step op leaves in the logits' rows (a ggml_custom_op_t
// that computes nothing).
void dg_after_step_op(ggml_tensor * dst, int ith, int nth, void * userdata);
