#pragma once
// Internal side channel between the dg_* C functions (diffusion-gemma-api.cpp) and the
// diffusion-gemma graph (models/diffusion-gemma.cpp). A dg_* call publishes its request for the
// duration of its llama_decode on the calling thread; graph building and input setting happen
// inside that call on the same thread, so no other context or thread can observe it.

#include "llama.h"

#include <cstdint>
#include <vector>

struct dg_request {
    bool exact = false; // GELU composed from F32 ops instead of ggml's F16-table GELU

    // decoder only: the previous step's self-conditioning input in top-k form. Row
    // r = seq_index*n_canvas + (pos - pos0[seq_index]) holds sc_k token ids (sc_ids) and their
    // softmax probabilities (sc_probs), [n_seqs*n_canvas, sc_k] row-major each; the graph forms
    // sum_j sc_probs[r, j] * E[sc_ids[r, j]]. Null ids = zero self-conditioning signal.
    const int32_t *        sc_ids    = nullptr;
    const float *          sc_probs  = nullptr;
    int32_t                sc_k      = 0;
    int32_t                n_canvas  = 0;
    int32_t                n_vocab   = 0;
    std::vector<llama_pos> pos0; // first canvas position per sequence id
};

// The request of the dg_* call running on this thread, or null (plain llama_decode).
const dg_request * dg_active_request();
