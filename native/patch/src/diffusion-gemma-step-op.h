#pragma once
// Internal: the denoising step as one custom ggml op at the end of the decoder graph, where the
// logits are on the CPU, or on a GPU whose backend has its kernels (DG_CUDA_FUSED_STEP)
// (llama_model_diffusion_gemma::graph::build_step, diffusion-gemma-step-op.cpp).
// Its per-row arithmetic is dg_step_row (diffusion-gemma-step.h), shared with the host sampler.

#include "ggml.h"
#include "ggml-cuda-dg.h"

// The settings of one graph's step op are struct ggml_dg_step_params (ggml-cuda-dg.h: the CUDA
// kernels read them too), read by every thread of the op.

// DG_CUDA_FUSED_STEP=1: where the logits are on a GPU whose backend has the step's kernels
// (ggml-cuda: dg-step.cu), the step is the same custom op as on the CPU, run there in two kernels,
// instead of the ggml ops of build_step_ops. Read at each graph build and reuse check, so a process
// can time both.
bool dg_cuda_fused_step_wanted();

// dst = the step's record, F32 [dg_step_record_width(top_k), n_rows]; sources: the logits F32
// [n_vocab, n_rows] (values or probabilities written over them where asked), the temperatures F32 [1, n_rows], the uniforms F64 [n_rows];
// userdata: the graph's ggml_dg_step_params. A ggml_custom_op_t.
void dg_step_op(ggml_tensor * dst, int ith, int nth, void * userdata);

// The in-place view of the probabilities the step op leaves in the logits' rows (a ggml_custom_op_t
// that computes nothing).
void dg_after_step_op(ggml_tensor * dst, int ith, int nth, void * userdata);
