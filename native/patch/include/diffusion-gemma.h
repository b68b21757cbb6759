#pragma once
// C functions for driving a diffusion-gemma model (see src/models/diffusion-gemma.cpp).
// Called through ctypes on libllama (dgcli/runtime/native.py). Every function works on the KV
// cache of the context's sequences; the caller owns model and context (llama.h API).
//
// Context requirements: n_ubatch >= n_seqs*canvas_length (a canvas is one non-causal micro-batch),
// n_batch >= n_ubatch. Exact mode additionally wants an F32 KV cache and flash attention off;
// those are context parameters, chosen by the caller.

#include "llama.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// diffusion.canvas_length of a diffusion-gemma model; 0 for any other model
LLAMA_API int32_t dg_canvas_length(const struct llama_model * model);

// Encoder: causal forward over `tokens`, appended to sequence `seq_id` after its last cached
// position (the prompt, or a committed canvas). Longer inputs are split into n_batch chunks.
// last_logits_out (nullable, n_vocab floats) receives the softcapped logits of the last token.
// `exact`: GELU from F32 ops. Returns 0, a llama_decode status, or -1 for bad arguments.
LLAMA_API int32_t dg_encode(struct llama_context * ctx, const llama_token * tokens, int32_t n_tokens,
                            llama_seq_id seq_id, bool exact, float * last_logits_out);

// The self-conditioning input of a decoder forward, per canvas position (row r = s*n_canvas + c of
// n_seqs*n_canvas), in one of three forms (the others' pointers NULL):
//   top-k  topk_ids[r*k ...], topk_probs[r*k ...]: the k most probable tokens under softmax(previous
//          step's processed logits) and their probabilities; the soft embedding is
//          sum_j topk_probs[r, j] * E[topk_ids[r, j]] * sqrt(n_embd) (the tail mass is dropped, not
//          renormalised)
//   dense  probs[r*n_vocab ...]: the whole distribution; the soft embedding is the reference's
//          softmax(logits) @ E * sqrt(n_embd), one product of the probabilities and a transposed copy of
//          E made on first use (Q8_0; F32 in exact mode, or where n_vocab is not a multiple of 32)
//   soft   soft[r*n_embd ...]: the soft embedding itself, as a dense step hands it back (dg_step_outputs)
// A row of zeros (probabilities or soft embedding) gives exactly no signal, as a canvas's first step.
struct dg_self_cond {
    const int32_t * topk_ids;   // [rows, k]
    const float *   topk_probs; // [rows, k]
    int32_t         k;          // 1..n_vocab with topk_ids, else 0
    const float *   probs;      // [rows, n_vocab]
    const float *   soft;       // [rows, n_embd]
};

// Decoder: one forward over n_seqs canvases of n_canvas tokens; canvas s (tokens
// canvases[s*n_canvas ...]) belongs to sequence s and sits right after that sequence's cached
// tokens. `sc` (nullable: a canvas's first step, zero self-conditioning signal) is the
// self-conditioning input. logits_out receives the softcapped logits [n_seqs*n_canvas, n_vocab].
// The KV cache is unchanged on return.
// Returns 0, a llama_decode status, -1 for bad arguments (including more than one form in `sc`, k
// outside [1, n_vocab] or an id outside the vocabulary), -2 if n_seqs*n_canvas > n_ubatch.
LLAMA_API int32_t dg_decode_canvases(struct llama_context * ctx, const llama_token * canvases, int32_t n_seqs,
                                     int32_t n_canvas, const struct dg_self_cond * sc, bool exact,
                                     float * logits_out);

// One denoising step in one graph: the decoder forward of dg_decode_canvases (same canvases,
// sequences and self-conditioning input), then, where the logits are, per canvas position
// (row r = s*n_canvas + c) the sampler's pass over softmax(softcap(logits) / t_s):
//   entropy[r]  (nats), argmax[r] (first index of the maximum),
//   sampled[r]  = first i with cumsum(p)[i] > uniforms[r] (inverse CDF; cumsum in double on the CPU),
//   with top_k > 0 the next step's self-conditioning input in top-k form: topk_ids[r, :top_k] most
//   probable first (ties: the lower id), topk_probs[r, :top_k] their probabilities, dropped[r] = 1 - their sum;
//   with soft (nullable) the next step's input in dense form: soft[r, :n_embd] = p @ E * sqrt(n_embd),
//   the product of the whole distribution and the transposed embeddings inside the same graph.
// temperatures[s] is canvas s's temperature (> 0); uniforms [n_seqs*n_canvas] in [0, 1).
// Only these leave the graph; values (nullable, not with soft) additionally receives
// softcap(logits) / t, [n_seqs*n_canvas, n_vocab] (debugging; a host-side dense input).
// flags: DG_STEP_EXACT (F32 GELU, libm tanh, F32 transposed embeddings), DG_STEP_PORTABLE_OPS (the
// ggml-ops form of the step, which non-CPU backends use, also where the logits are on the CPU: for tests).
// Returns 0, a llama_decode status, -1 for bad arguments, -2 if n_seqs*n_canvas > n_ubatch,
// -3 if a row held a non-finite logit. The KV cache is unchanged on return.
#define DG_STEP_EXACT        1u
#define DG_STEP_PORTABLE_OPS 2u

struct dg_step_outputs {
    float *   entropy;    // [rows]
    int32_t * argmax;     // [rows]
    int32_t * sampled;    // [rows]
    int32_t * topk_ids;   // [rows, top_k]  (top_k > 0)
    float *   topk_probs; // [rows, top_k]  (top_k > 0)
    float *   dropped;    // [rows]         (top_k > 0)
    float *   values;     // nullable: [rows, n_vocab]
    float *   soft;       // nullable: [rows, n_embd], the next step's dense self-conditioning input
};

LLAMA_API int32_t dg_denoise_step(struct llama_context * ctx, const llama_token * canvases, int32_t n_seqs,
                                  int32_t n_canvas, const struct dg_self_cond * sc, const float * temperatures,
                                  const double * uniforms, int32_t top_k, uint32_t flags,
                                  struct dg_step_outputs * out);

// Which kernel multiplies the dense self-conditioning product (the transposed embeddings) on the CPU:
// "avx512-vnni", "avx2", "emulated" (the LM head's repacked int8 GEMM: a Q8_0 copy), or "ggml" (ggml's
// MUL_MAT: a GPU in use, DG_LM_HEAD=ggml, no kernel for this CPU, or an F32 copy). `exact` asks about
// exact mode's copy. Decides without making the copy.
LLAMA_API const char * dg_self_cond_path(const struct llama_model * model, bool exact);

// Bytes of that copy as it is held (0 before any dense self-conditioning).
LLAMA_API int64_t dg_self_cond_bytes(const struct llama_model * model, bool exact);

// Which kernel runs this model's LM head on the CPU: "avx512-vnni", "avx2" or "emulated" (our
// repacked int8 GEMM of Q8_0 / Q5_0 heads, src/diffusion-gemma-lm-head.h), "avx2 K-quant tile",
// "AMX K-quant tile" or "avx512-vnni K-quant tile" (a Q4_K / Q6_K head packed on the fly, DG_DENSE_GEMM's
// family; the last where the CPU has no AMX: the repacked experts' span tiles), or "ggml" (ggml's
// matmul: no kernel for this CPU, DG_LM_HEAD=ggml, a GPU in use, other types).
LLAMA_API const char * dg_lm_head_path(const struct llama_model * model);

// How many of the decoder's other dense weights (attention, dense FFN, self-conditioning MLP) run on
// the same repacked int8 GEMM (0: all on ggml's matmul: not Q8_0 or Q5_0, not in host memory, a GPU in
// use, no kernel for this CPU, or DG_DENSE_GEMM=ggml). Repacks them if no graph has yet.
LLAMA_API int32_t dg_dense_repacked_count(const struct llama_model * model);

// A kernel of that GEMM (1 avx2, 2 avx512-vnni, 3 emulated) on random weights of `weight_type`
// (GGML_TYPE_Q8_0 or GGML_TYPE_Q5_0) against a double-precision sum of the same operands, the weights
// decoded by ggml's dequantizer: *max_rel_error relative to each output's magnitude.
// Returns 0, 1 if this CPU lacks the kernel, -1 for bad arguments.
LLAMA_API int32_t dg_lm_head_selftest(int32_t kernel, int32_t weight_type, int64_t n_embd, int64_t n_vocab,
                                      int64_t n_cols, uint32_t seed, double * max_rel_error);

// How many of the decoder's MoE expert tensors (gate+up, down; per layer) run on that GEMM's tiles,
// packed on the fly (0: all on ggml's MUL_MAT_ID: not Q8_0, Q5_0, Q4_K or Q6_K (the K-quants: AVX2 only), not in plain
// host memory, a GPU in use, no kernel for this CPU, or DG_EXPERT_GEMM=ggml). Decides it if no graph
// has yet.
LLAMA_API int32_t dg_expert_gemm_count(const struct llama_model * model);

// The kernel the experts' GEMM would take on this CPU where no GPU is in use (0: ggml's MUL_MAT_ID;
// 1 avx2, which alone runs Q4_K and Q6_K experts; 3 emulated), DG_EXPERT_GEMM included. Asked before
// loading: such experts must then stay out of ggml's CPU repack buffers, whose layout the tiles do not read.
LLAMA_API int32_t dg_expert_kernel(void);

// The same for the decoder's dense weights (DG_DENSE_GEMM; 2 avx512-vnni): on 1 (avx2) their Q4_K and
// Q6_K ones (the LM head too) run on the experts' K-quant tiles, and must stay out of the CPU repack
// buffers too (on 2 they run on AMX's tiles where the CPU has them, whose CPUs keep the repack off).
LLAMA_API int32_t dg_dense_kernel(void);

// How many dense weights run on the K-quant tiles: Q4_K and Q6_K ones, the LM head among them (0: none:
// no such type, in a repack buffer, a GPU in use, neither AVX2's tiles nor AMX's). Decides it if no graph
// has yet.
LLAMA_API int32_t dg_dense_tiled_count(const struct llama_model * model);

// A twin of ggml_backend_cpu_buffer_type() at another address, for tensor buffer-type overrides:
// llama.cpp's loader reads an override to the CPU type itself as leave to place the tensor in a CPU
// repack buffer (CPU_REPACK), and uses this one as it is: plain host memory, the file's layout.
LLAMA_API ggml_backend_buffer_type_t dg_plain_cpu_buffer_type(void);

// The experts' GEMM of a kernel (as dg_lm_head_selftest) on random experts [n_in, n_out, n_expert]
// and random routing of n_tokens tokens to n_used experts each, one input row per token
// (input_per_slot false: gate and up) or per (token, expert) (down), the work split as nth threads
// split it, against a double-precision sum: *max_rel_error, infinite if an output was not written.
LLAMA_API int32_t dg_experts_selftest(int32_t kernel, int32_t weight_type, int64_t n_in, int64_t n_out,
                                      int64_t n_expert, int64_t n_used, int64_t n_tokens, bool input_per_slot,
                                      int32_t nth, uint32_t seed, double * max_rel_error);

// The MoE experts repacked while loading (src/diffusion-gemma-experts.cpp): a CPU extra buffer type per
// kernel family whose tensors hold the experts in a layout of dg's GEMM (about the file's size; the
// file's copy is not kept), MUL_MAT_ID on them running that GEMM.
// The family the repacked route takes on this CPU: 1 avx2, 2 avx512-vnni, 0 none (ggml's MUL_MAT_ID);
// DG_EXPERT_GEMM, else DG_CPU_KERNELS, choose (ggml | avx2 | avx512-vnni | auto).
LLAMA_API int32_t dg_expert_repack_kernel(void);
// The buffer type of `kernel`'s family, for a tensor buffer-type override of the expert tensors; NULL
// where this CPU lacks the kernel.
LLAMA_API ggml_backend_buffer_type_t dg_expert_buffer_type(int32_t kernel);
// Whether experts of `weight_type` (a ggml_type) with rows n_in wide get the repacked layout of `kernel`
// (Q8_0, Q5_0, Q4_K, Q6_K); others put in that buffer are stored as they come and stay ggml's.
LLAMA_API bool dg_expert_repack_takes(int32_t kernel, int32_t weight_type, int64_t n_in);
// Bytes of [n_in, n_out, n_expert] experts in that layout (-1 if it does not take them).
LLAMA_API int64_t dg_expert_repacked_bytes(int32_t kernel, int32_t weight_type, int64_t n_in, int64_t n_out,
                                           int64_t n_expert);
// The repacked GEMM's tiles as dg_experts_selftest checks the on-the-fly one (kernel 1 or 2 only).
LLAMA_API int32_t dg_experts_repacked_selftest(int32_t kernel, int32_t weight_type, int64_t n_in, int64_t n_out,
                                               int64_t n_expert, int64_t n_used, int64_t n_tokens,
                                               bool input_per_slot, int32_t nth, uint32_t seed,
                                               double * max_rel_error);
// MUL_MAT_ID on experts loaded into that buffer against ggml's own MUL_MAT_ID on the same experts in
// plain memory, in one CPU graph of n_threads threads (random experts quantized by ggml, random
// routing): *max_rel_diff = max |difference| / max |ggml's|. 0, 1 if this CPU lacks the kernel, -1 for
// bad arguments or a type the layout does not take.
LLAMA_API int32_t dg_expert_buffer_selftest(int32_t kernel, int32_t weight_type, int64_t n_in, int64_t n_out,
                                            int64_t n_expert, int64_t n_used, int64_t n_tokens, bool input_per_slot,
                                            int32_t n_threads, uint32_t seed, double * max_rel_diff);

// ggml-cpu's MUL_MAT of an F16 [k, m, heads_kv] (a permuted view, as the KV cache's keys) by an F32
// [k, n, heads] (a permuted view as the queries where `permuted`, else contiguous) in one CPU graph of
// n_threads threads, against a float64 sum of the same values: *max_rel_err = max |difference| / max
// |sum|. dg's kernel runs where dg_f16_gemm_runs says so (DG_F16_GEMM=0: ggml's, which rounds the F32
// operand to F16). 0, or -1 for bad arguments.
LLAMA_API int32_t dg_f16_matmul_selftest(int64_t m, int64_t n, int64_t k, int64_t heads, int64_t heads_kv, bool permuted,
                                         int32_t n_threads, uint32_t seed, double * max_rel_err);
// which of dg's kernels ggml-cpu's MUL_MAT of an F16 m x k by an F32 k x n runs on, as now set: 512
// (AVX-512), 256 (AVX2), or 0 (ggml's own)
LLAMA_API int32_t dg_f16_gemm_runs(int64_t m, int64_t n, int64_t k);

// This CPU's single-thread multiply-add peak in G MAC/s for `kind`, from register-resident
// instruction chains run for about `seconds` of the thread's CPU time, the fastest of five rounds
// (CPU time, so that other processes on a shared machine do not lower it). DG_PEAK_INT8: the widest int8 dot-product instruction the CPU has (AVX-512 VNNI,
// AVX-VNNI, else AVX2 vpmaddubsw + vpmaddwd); DG_PEAK_BF16: AVX-512 BF16, else the fp32 FMA rate
// (what a bf16 GEMM runs at without bf16 instructions); DG_PEAK_F32: fp32 FMA. name_out
// (nullable) receives which instructions were measured.
#define DG_PEAK_INT8 0
#define DG_PEAK_BF16 1
#define DG_PEAK_F32  2
// the int8 chain of dg's AVX2 kernels whatever wider instructions the CPU has: AVX-VNNI's vpdpbusd ymm
// where their tiles run on it (dg_avx_vnni_in_use), else vpmaddubsw + vpmaddwd; the peak of that
// family where it is forced on an AVX-512 CPU (DG_CPU_KERNELS=avx2)
#define DG_PEAK_INT8_AVX2 3

LLAMA_API double dg_peak_gmacs(int32_t kind, double seconds, char * name_out, int32_t name_len);

// Whether dg's int8 GEMM of the VNNI layout (Q8_0 / Q5_0 LM head, dense projections, transposed
// embeddings) runs 16 columns at a time on AMX's tiles here (1): the CPU has AMX-INT8, Linux grants
// the tile state, and DG_AMX is not 0.
LLAMA_API int32_t dg_amx_in_use(void);

// Whether the AVX2 family's tiles (Q8_0, Q5_0, Q4_K, Q6_K) run on AVX-VNNI's vpdpbusd / vpdpwssd here
// (1): the CPU has AVX-VNNI and DG_AVX_VNNI is not 0. The family's peak (DG_PEAK_INT8_AVX2) is then
// vpdpbusd ymm's.
LLAMA_API int32_t dg_avx_vnni_in_use(void);

// Per-node timing of graph computes (benchmarks/step_profile.py): pass dg_profile_eval as the
// context's cb_eval with a dg_profile as its user data; while enabled, every node computed is
// recorded (name, op, its and its first three sources' shapes [4][4], the first source's type,
// wall seconds, and the process's CPU seconds over all threads). The graph then runs one node at a time: for finding where time goes, not for
// end-to-end numbers. Disabled (the default) it declines every node: the graph runs as usual.
struct dg_profile;
struct ggml_tensor;

LLAMA_API struct dg_profile * dg_profile_new(void);
LLAMA_API void    dg_profile_free(struct dg_profile * p);
LLAMA_API void    dg_profile_reset(struct dg_profile * p);
LLAMA_API void    dg_profile_enable(struct dg_profile * p, bool enabled);
LLAMA_API bool    dg_profile_enabled(const struct dg_profile * p);
LLAMA_API bool    dg_profile_eval(struct ggml_tensor * t, bool ask, void * user_data);
LLAMA_API int32_t dg_profile_count(const struct dg_profile * p);
LLAMA_API int32_t dg_profile_node(const struct dg_profile * p, int32_t i, char * name, int32_t name_len, char * op,
                                  int32_t op_len, char * src0_type, int32_t type_len, int64_t * ne, double * seconds,
                                  double * cpu_seconds);

#ifdef __cplusplus
}
#endif
