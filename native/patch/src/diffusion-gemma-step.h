#pragma once
// Internal: the per-row pass of the denoising step, shared by the host sampler
// (dg_sampler_step_topk, diffusion-gemma-sampler.cpp) and the step op at the end of the decoder
// graph (diffusion-gemma-step-op.cpp), so both compute the same numbers.

#include <cstdint>
#include <utility>
#include <vector>

// What the step graph hands back per canvas position, one float row of
// dg_step_record_width(top_k): entropy, argmax, sampled, dropped mass, then top_k ids and top_k
// probabilities. Ids are whole numbers below 2^24 (the vocabulary is checked), so exact as floats;
// a non-finite logit in the row makes the entropy NaN.
enum dg_step_field : int32_t {
    DG_STEP_ENTROPY = 0,
    DG_STEP_ARGMAX  = 1,
    DG_STEP_SAMPLED = 2,
    DG_STEP_DROPPED = 3,
    DG_STEP_TOPK    = 4, // ids at DG_STEP_TOPK .. +top_k, probabilities right after them
};

inline int64_t dg_step_record_width(int32_t top_k) {
    return DG_STEP_TOPK + 2 * (int64_t) top_k;
}

// the largest vocabulary whose ids a float row holds exactly
constexpr int32_t DG_STEP_MAX_VOCAB = 1 << 24;

struct dg_row_in {
    const float *  logits;      // the row as the LM head left it
    float *        values;      // receives softcap(logits) / temperature (may be `logits` itself)
    float *        weights;     // receives exp(values - max) (may be `values` itself)
    int32_t        n_vocab;
    float          softcap;     // 0: the logits are already final (no softcap)
    bool           exact_tanh;  // softcap with the C library's tanhf (bit-identical to ggml's op)
    float          temperature;
    const double * uniform;     // null: no sample
    int32_t        top_k;       // 0: no top-k
    int32_t *      topk_ids;    // [top_k], most probable first (ties: the lower id)
    float *        topk_probs;  // [top_k]
    const float *  next_row = nullptr; // the row this thread does next (nullable): fetched from memory
                                       // while this one is worked on
};

struct dg_row_out {
    double  entropy = 0.0;  // nats, of softmax(values)
    int32_t argmax  = 0;    // first index of the maximum
    int32_t sampled = 0;    // first i with cumsum(weights)[i] > u * sum(weights)
    double  dropped = 0.0;  // 1 - sum(topk_probs)
    double  total   = 0.0;  // sum(weights): the softmax's denominator
};

// (weight, index) candidates of the top-k selection, reused between rows
using dg_topk_heap = std::vector<std::pair<float, int32_t>>;

// One row of the step. Returns false if the row held a non-finite value (out is then unset).
bool dg_step_row(const dg_row_in & in, dg_row_out & out, dg_topk_heap & heap);
