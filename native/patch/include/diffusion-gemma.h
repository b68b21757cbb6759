#pragma once
// C functions for driving a diffusion-gemma model (see src/models/diffusion-gemma.cpp).
// Called through ctypes on libllama (dgcli/engine/native.py). Every function works on the KV
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

// Decoder: one forward over n_seqs canvases of n_canvas tokens; canvas s (tokens
// canvases[s*n_canvas ...]) belongs to sequence s and sits right after that sequence's cached
// tokens. Self-conditioning input, in top-k form: for every canvas position (row r of
// n_seqs*n_canvas), sc_k token ids sc_ids[r*sc_k ...] and their probabilities
// sc_probs[r*sc_k ...] under softmax(previous step's processed logits); the decoder input then uses
// soft = sum_j sc_probs[r, j] * E[sc_ids[r, j]] * sqrt(n_embd). With sc_k = n_vocab and every id
// once this is the reference's dense softmax(logits) @ E; a small sc_k drops the tail mass (not
// renormalised). sc_ids NULL = first step (zero self-conditioning signal). logits_out receives the
// softcapped logits [n_seqs*n_canvas, n_vocab]. The KV cache is unchanged on return.
// Returns 0, a llama_decode status, -1 for bad arguments (including sc_k outside [1, n_vocab] or
// an id outside the vocabulary), -2 if n_seqs*n_canvas > n_ubatch.
LLAMA_API int32_t dg_decode_canvases(struct llama_context * ctx, const llama_token * canvases, int32_t n_seqs,
                                     int32_t n_canvas, const int32_t * sc_ids, const float * sc_probs,
                                     int32_t sc_k, bool exact, float * logits_out);

#ifdef __cplusplus
}
#endif
