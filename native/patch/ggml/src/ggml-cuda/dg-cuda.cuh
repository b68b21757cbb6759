#pragma once
// dg's additions to ggml-cuda (native/README.md, "CUDA kernels"): the A/B switches of its kernel
// choices, the compacted MoE grid and the fused sampler pass of the denoising step.
//
// Every change is off unless its environment variable asks for it. The variables are read again
// at each graph compute (dg_cuda_switches_refresh), and a CUDA graph captured under other values
// is captured anew, so one process can time each setting against the others.
//   DG_CUDA_MOE_TILE     MMQ MUL_MAT_ID tile width: unset or 0, from all the tokens (llama.cpp on
//                        NVIDIA); "mean", from the mean tokens per expert; "mean:F", F times that;
//                        N, N columns (1..128)
//   DG_CUDA_MOE_COMPACT  1: the MMQ MUL_MAT_ID grid has one channel per tile of an expert's tokens
//                        (dg-moe-layout.cuh) instead of the same number of column tiles per expert
//   DG_CUDA_MOE_MMF      1: F16/BF16 (and F32) experts through mmf's MUL_MAT_ID kernel at any batch,
//                        not the per-expert loop that synchronizes the stream and turns CUDA graphs off
//   DG_CUDA_TOPK         "radix": TOP_K by a radix select (4 histogram passes and a gather) instead
//                        of a full segmented sort
//   DG_CUDA_DENSE        "bf16": quantized dense MUL_MAT of 64 or more columns as a BF16 cuBLAS GEMM
//                        on the dequantized weight; "bf16:MxK,MxK,...": only for those weight shapes
//                        (M rows of K); anything else: ggml's choice (MMQ)
// The fused step (dg-step.cu) is chosen when the graph is built (DG_CUDA_FUSED_STEP, read by libllama).

#include "ggml.h"
#include "dg-moe-layout.cuh"

#include <cstdint>

struct ggml_backend_cuda_context;

constexpr int DG_DENSE_SHAPES_MAX = 32;

struct dg_cuda_switches {
    int   moe_tile        = 0;     // 0: llama.cpp's; -1: mean tokens per expert (times moe_tile_factor); N: N columns
    float moe_tile_factor = 1.0f;
    bool  moe_compact     = false;
    bool  moe_mmf         = false;
    bool  topk_radix      = false;
    int   dense           = 0;     // 0: ggml's choice; 1: BF16 for every quantized product of >= 64 columns; 2: listed shapes
    int   n_dense_shapes  = 0;
    int64_t dense_shapes[DG_DENSE_SHAPES_MAX][2] = {};  // (M, K)
};

// The values of the last refresh.
const dg_cuda_switches & dg_cuda_switches_get();

// Reads the environment again; returns a signature of the values (equal values, equal signature).
uint64_t dg_cuda_switches_refresh();

// The signature of the last refresh.
uint64_t dg_cuda_switches_signature();

// MMQ's MUL_MAT_ID tile width hint for ne12 tokens, n_used experts each, of n_experts; 0: keep llama.cpp's.
int64_t dg_moe_ncols_opt(int64_t ne12, int64_t n_used, int64_t n_experts);

// Whether this quantized dense product (src0 [K, M] x src1 [K, N]) goes to the BF16 cuBLAS path.
bool dg_dense_bf16(const ggml_tensor * src0, const ggml_tensor * src1);

// The compacted MoE layout of dg-moe-layout.cuh on the device, from MMQ's expert_bounds (device,
// n_experts + 1 entries): tile_bounds[n_tiles_max + 1], tile_expert[n_tiles_max]. One block; no sync.
void dg_moe_tile_layout_cuda(const int32_t * expert_bounds, int n_experts, int J, int n_tiles_max,
                             int32_t * tile_bounds, int32_t * tile_expert, cudaStream_t stream);

// The fused step: GGML_OP_CUSTOM nodes whose function libllama registered (ggml-cuda-dg.h): the step,
// and the no-op view of its probabilities after it.
bool dg_cuda_step_supports_op(const ggml_tensor * op);
void dg_cuda_step_compute(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool dg_cuda_step_register(ggml_custom_op_t step, ggml_custom_op_t after, int64_t n_vocab, int32_t top_k);
