#pragma once
// Internal side channel between the dg_* C functions (diffusion-gemma-api.cpp) and the
// diffusion-gemma graph (models/diffusion-gemma.cpp). A dg_* call publishes its request for the
// duration of its llama_decode on the calling thread; graph building and input setting happen
// inside that call on the same thread, so no other context or thread can observe it.

#include "llama.h"

#include <cstdint>
#include <vector>

struct ggml_tensor;

// The denoising step at the end of the decoder graph (dg_denoise_step): per canvas position the
// sampler's results instead of the logits.
struct dg_step_request {
    bool           active      = false;
    int32_t        top_k       = 0;       // the next step's self-conditioning input in top-k form (0: none)
    bool           soft        = false;   // ... in dense form: the soft embedding, [rows, n_embd]
    bool           keep_values = false;   // also hand back softcap(logits) / t, [rows, n_vocab]
    bool           portable    = false;   // ggml ops only, even where the logits are on the CPU
    const float *  temperatures = nullptr; // [n_seqs]
    const double * uniforms     = nullptr; // [n_seqs*n_canvas], batch row order

    // Published by the step's graph input while the inputs are set (same thread, inside
    // llama_decode), read by the caller after the forward: the graph may be a reused one, so its
    // tensors are only known then.
    mutable ggml_tensor *        record = nullptr; // F32 [dg_step_record_width(top_k), n_rows]
    mutable ggml_tensor *        values = nullptr; // F32 [n_vocab, n_rows] when keep_values
    mutable ggml_tensor *        soft_embd = nullptr; // F32 [n_embd, n_rows] when soft
    mutable std::vector<int32_t> rows;             // the batch row of each graph row
};

// The form of a decoder forward's self-conditioning input (dg_self_cond in diffusion-gemma.h)
enum class dg_sc_form : int32_t {
    none  = 0, // a canvas's first step: no signal
    topk  = 1, // sc_ids + sc_values: k ids and their probabilities per row
    dense = 2, // sc_values: the whole distribution per row (n_vocab)
    soft  = 3, // sc_values: the soft embedding per row (n_embd)
};

struct dg_request {
    bool exact = false; // GELU composed from F32 ops instead of ggml's F16-table GELU; libm tanh in the step

    // decoder only: the previous step's self-conditioning input. Row
    // r = seq_index*n_canvas + (pos - pos0[seq_index]) holds sc_width values (and, in top-k form,
    // sc_width ids), [n_seqs*n_canvas, sc_width] row-major.
    dg_sc_form             sc_form   = dg_sc_form::none;
    const int32_t *        sc_ids    = nullptr;
    const float *          sc_values = nullptr;
    int32_t                sc_width  = 0; // k, n_vocab or n_embd
    int32_t                n_canvas  = 0;
    int32_t                n_vocab   = 0;
    std::vector<llama_pos> pos0; // first canvas position per sequence id

    dg_step_request step;

    // the batch row of a canvas token: sequence s, position pos
    int64_t row_of(llama_seq_id s, llama_pos pos) const { return (int64_t) s * n_canvas + (pos - pos0[s]); }
};

// The request of the dg_* call running on this thread, or null (plain llama_decode).
const dg_request * dg_active_request();
