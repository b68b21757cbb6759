#include "diffusion-gemma-hparams-check.h"

#include "llama-hparams.h"
#include "llama-impl.h"
#include "llama-model-loader.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <unordered_set>

// the largest meaningful values (dgcli/params.py and dgcli/modelfile/hparams.py hold the same bounds)
static constexpr uint32_t DG_MAX_CANVAS_LENGTH  = 1024;
static constexpr uint32_t DG_MAX_SLIDING_WINDOW = 1u << 24;

// llama.cpp trusts these values: a bad one aborts the process later (GGML_ASSERT in the rope, the
// norms, grouped-query attention or the vocabulary) or, for a rope dimension of 0, loops forever.
// Refuse them here with the key's name. (block_count and the expert counts are asserted by the
// generic loader before this runs; dg checks those, and all of these, in Python first.)
static void dg_check(bool ok, const char * key, const std::string & value, const char * allowed) {
    if (!ok) {
        throw std::runtime_error(format("diffusion-gemma: %s = %s: must be %s", key, value.c_str(), allowed));
    }
}

void dg_check_hparams(const llama_hparams & hparams, uint32_t canvas_length, const llama_model_loader & ml) {
    for (uint32_t il = 0; il < hparams.n_layer(); ++il) {
        const bool        swa   = hparams.is_swa(il);
        const std::string layer = " (layer " + std::to_string(il) + ")";
        const uint32_t n_head    = hparams.n_head(il);
        const uint32_t n_head_kv = hparams.n_head_kv(il);
        dg_check(n_head > 0, "attention.head_count", std::to_string(n_head) + layer, "> 0");
        dg_check(n_head_kv > 0 && n_head % n_head_kv == 0, "attention.head_count_kv", std::to_string(n_head_kv) + layer,
                 "a divisor of attention.head_count");
        dg_check(hparams.n_ff(il) > 0, "feed_forward_length", std::to_string(hparams.n_ff(il)) + layer, "> 0");
        dg_check(hparams.n_expert_used(il) > 0, "expert_used_count", std::to_string(hparams.n_expert_used(il)) + layer,
                 "> 0");
        // every layer, not just the first: full and sliding layers have their own head sizes
        const uint32_t head = hparams.n_embd_head_k(il);
        const uint32_t n_rot = hparams.n_rot(il);
        dg_check(hparams.n_embd_head_v(il) == head, swa ? "attention.value_length_swa" : "attention.value_length",
                 std::to_string(hparams.n_embd_head_v(il)) + layer, "the key length of the layer");
        dg_check(head >= 2 && head % 2 == 0, swa ? "attention.key_length_swa" : "attention.key_length",
                 std::to_string(head) + layer, "even and >= 2");
        dg_check(n_rot >= 2 && n_rot <= head && n_rot % 2 == 0, swa ? "rope.dimension_count_swa" : "rope.dimension_count",
                 std::to_string(n_rot) + layer, "even, between 2 and the layer's head size");
    }
    const float eps = hparams.f_norm_rms_eps;
    dg_check(std::isfinite(eps) && eps > 0.0f && eps < 1.0f, "attention.layer_norm_rms_epsilon", std::to_string(eps),
             "finite, > 0 and < 1");
    dg_check(std::isfinite(hparams.rope_freq_base_train) && hparams.rope_freq_base_train > 0.0f, "rope.freq_base",
             std::to_string(hparams.rope_freq_base_train), "finite and > 0");
    dg_check(std::isfinite(hparams.rope_freq_base_train_swa) && hparams.rope_freq_base_train_swa > 0.0f,
             "rope.freq_base_swa", std::to_string(hparams.rope_freq_base_train_swa), "finite and > 0");
    dg_check(std::isfinite(hparams.f_final_logit_softcapping) && hparams.f_final_logit_softcapping >= 0.0f,
             "final_logit_softcapping", std::to_string(hparams.f_final_logit_softcapping), "finite and >= 0");
    dg_check(hparams.n_swa <= DG_MAX_SLIDING_WINDOW, "attention.sliding_window", std::to_string(hparams.n_swa),
             "at most 2^24");
    dg_check(canvas_length <= DG_MAX_CANVAS_LENGTH && canvas_length < hparams.n_ctx_train, "diffusion.canvas_length",
             std::to_string(canvas_length), "at most 1024 and less than the context length");

    // two entries with one text make the vocabulary's text -> id map smaller than its table (an
    // assert in llama_vocab::load); empty texts are renamed there as here
    const int tokens_key = gguf_find_key(ml.metadata, "tokenizer.ggml.tokens");
    if (tokens_key >= 0 && gguf_get_kv_type(ml.metadata, tokens_key) == GGUF_TYPE_ARRAY &&
            gguf_get_arr_type(ml.metadata, tokens_key) == GGUF_TYPE_STRING) {
        const size_t n_tokens = gguf_get_arr_n(ml.metadata, tokens_key);
        std::unordered_set<std::string> seen;
        seen.reserve(n_tokens);
        for (size_t i = 0; i < n_tokens; ++i) {
            std::string text = gguf_get_arr_str(ml.metadata, tokens_key, i);
            if (text.empty()) {
                text = "[EMPTY_" + std::to_string(i) + "]";
            }
            dg_check(seen.insert(std::move(text)).second, "tokenizer.ggml.tokens",
                     "a vocabulary with token " + std::to_string(i) + " repeated", "a vocabulary of distinct texts");
        }
    }
}
