#pragma once
// The native per-step pass of the DiffusionGemma block-diffusion sampler (dgcli/engine/sampler.py
// holds the numpy reference it must agree with). Called through ctypes on libllama.

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// For each of `n_rows` rows of `logits` [n_rows, n_vocab] (row-major float32), in place:
//   logits[r] /= temperature                      (the processed logits; self-conditioning input)
//   argmax_out[r]  = first index of the row maximum
//   entropy_out[r] = entropy (nats) of softmax(row)
//   sampled_out[r] = first i with cumsum(exp(row - max))[i] > uniforms[r] * sum(exp(row - max))
//                    (inverse-CDF multinomial sample; cumsum in double, in index order)
// `uniforms` are in [0, 1); when NULL, sampled_out is left untouched.
// Rows are split over `n_threads` threads (<= 0: all hardware threads).
// Returns 0 on success, 1 on bad arguments, 2 if a row held a non-finite value.
int dg_sampler_step(float * logits, int32_t n_rows, int32_t n_vocab, float temperature,
                    const double * uniforms, double * entropy_out, int32_t * argmax_out,
                    int32_t * sampled_out, int32_t n_threads);

// dg_sampler_step, and per row the self-conditioning input of the next step in top-k form:
//   topk_ids_out[r, :top_k]   = the top_k indices of softmax(logits[r] / temperature), most probable
//                               first (equal probabilities: the lower index first)
//   topk_probs_out[r, :top_k] = their softmax probabilities (float32 of a double quotient)
//   dropped_out[r]            = 1 - sum of those probabilities (the mass left out, >= 0)
// top_k in [0, n_vocab]; 0 = no top-k output (the out pointers may be NULL).
int dg_sampler_step_topk(float * logits, int32_t n_rows, int32_t n_vocab, float temperature,
                         const double * uniforms, double * entropy_out, int32_t * argmax_out,
                         int32_t * sampled_out, int32_t top_k, int32_t * topk_ids_out,
                         float * topk_probs_out, double * dropped_out, int32_t n_threads);

#ifdef __cplusplus
}
#endif
