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

    // decoder only: previous step's logits, row r = seq_index*n_canvas + (pos - pos0[seq_index]),
    // [n_seqs*n_canvas, n_vocab] row-major; null = zero self-conditioning signal
    const float *          sc_logits = nullptr;
    int32_t                n_canvas  = 0;
    int32_t                n_vocab   = 0;
    std::vector<llama_pos> pos0; // first canvas position per sequence id
};

// The request of the dg_* call running on this thread, or null (plain llama_decode).
const dg_request * dg_active_request();
