#pragma once
// Internal: the token embeddings transposed, the first operand of the dense self-conditioning
// product soft = softmax(previous processed logits) @ E * sqrt(n_embd) (models/diffusion-gemma.cpp).
//
// ggml's MUL_MAT contracts along rows (ne0) of both operands: the probabilities are rows over the
// vocabulary, so E must be too, E^T [n_vocab, n_embd]: row h holds dimension h of every token's
// embedding. The copy is made once, on the first graph that needs it, from the model's tok_embd (any
// type ggml dequantizes), chunks of 256 tokens shared out among the cores (no whole-size intermediate):
//   Q8_0   blocks of 32 tokens along each row, scaled by a power of two so that the largest |E| is near
//          2^14 (the block scales are fp16: an embedding of small values would otherwise fall into fp16's
//          subnormals); on the CPU repacked for the LM head's int8 GEMM (dg_lm_head), else a ggml tensor
//          in the output layer's buffer type (a GPU's memory where the output layer is offloaded)
//   F32    exact mode, and vocabularies that are not whole 32-token blocks: E^T itself, unscaled
// The product's caller scales the probabilities by DG_SC_PROBS_SCALE before it (they are quantized as
// ggml quantizes a matmul's activations, with fp16 block scales too) and divides both scales out after.

#include "diffusion-gemma-lm-head.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <memory>

// 2^15: a probability of 1 quantizes to a block scale of 258 (fp16 holds up to 65504, and a CUDA q8_1
// block's sum of at most 2^15 stays finite in fp16), 2^-22 of it still has a normal fp16 scale
constexpr float DG_SC_PROBS_SCALE = 32768.0f;

// How a transposed copy is (or would be) held: its type, where, and through which kernel.
struct dg_embd_t_plan {
    ggml_type                  type   = GGML_TYPE_F32;
    ggml_backend_buffer_type_t buft   = nullptr;                 // for the ggml tensor (unused when packed)
    dg_lm_head_kernel          kernel = dg_lm_head_kernel::none; // not none: repacked for the LM head's GEMM

    int64_t bytes(int64_t n_vocab, int64_t n_embd) const;
};

class dg_embd_transposed {
public:
    // E^T of `embd` ([n_embd, n_vocab], read with ggml_backend_tensor_get) as `plan` says; null if ggml
    // cannot dequantize embd's type, the type does not fit the vocabulary, or the buffer cannot be made.
    static std::unique_ptr<dg_embd_transposed> make(const ggml_tensor * embd, const dg_embd_t_plan & plan);
    ~dg_embd_transposed();

    ggml_tensor *      tensor() const { return tensor_; }       // [n_vocab, n_embd] for MUL_MAT; null when packed
    const dg_lm_head * packed() const { return packed_.get(); } // our GEMM's repack; null otherwise
    float              scale() const { return scale_; }         // the copy holds E^T * scale
    int64_t            bytes() const;
    const char *       path() const;                            // the kernel's name, or "ggml"

private:
    dg_embd_transposed() = default;

    ggml_context *              ctx_    = nullptr;
    ggml_backend_buffer_t       buf_    = nullptr;
    ggml_tensor *               tensor_ = nullptr;
    std::unique_ptr<dg_lm_head> packed_;
    float                       scale_  = 1.0f;
};
