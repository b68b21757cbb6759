#pragma once
// dg: what libllama's diffusion-gemma step and ggml-cuda share about the step's custom op
// (ggml/src/ggml-cuda/dg-step.cu runs it on the GPU).

#include "ggml.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The step op's userdata: read by the CPU op and by the CUDA kernels.
struct ggml_dg_step_params {
    int32_t top_k;        // the next step's self-conditioning width (0: none)
    float   softcap;      // 0: the logits are final
    int32_t exact_tanh;   // CPU: the C library's tanhf (the GPU always uses the CPU's fast tanh)
    int32_t keep_values;  // leave softcap(logits) / t in the logits tensor for the caller
    float   probs_scale;  // not 0: leave softmax(values) * probs_scale there (the dense self-conditioning
                          // product's input; excludes keep_values)
};

// ggml_backend_reg_get_proc_address(<the CUDA backend's reg>, GGML_CUDA_DG_STEP_REGISTER): tells the
// CUDA backend that custom ops calling `step` are the step (userdata: struct ggml_dg_step_params) and
// in-place custom ops calling `after` the view of its probabilities that orders what reads them after
// it (nothing to compute); returns whether its kernels take rows of n_vocab columns with top_k
// candidates.
typedef bool (*ggml_cuda_dg_step_register_t)(ggml_custom_op_t step, ggml_custom_op_t after, int64_t n_vocab,
                                             int32_t top_k);
#define GGML_CUDA_DG_STEP_REGISTER "ggml_cuda_dg_step_register"

#ifdef __cplusplus
}
#endif
