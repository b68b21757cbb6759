#include "models.h"
#include "llama-impl.h"
#include "../diffusion-gemma-api.h"

#include <cmath>
#include <string>
#include <unordered_set>

// DiffusionGemma: one set of Gemma 4 (26B-A4B MoE) weights, two ways of running it.
//   encoder (cparams.causal_attn = true):  causal prefill of prompt / committed canvas into the
//       KV cache, each layer's output times the ENCODER scalar (blk.N.enc_layer_output_scale)
//   decoder (cparams.causal_attn = false): one forward over a canvas, bidirectional inside it,
//       reading the cache (full layers: all of it; sliding layers: the last W-1 tokens, for every
//       canvas query: LLAMA_NON_CAUSAL_TYPE_BLOCK), self-conditioned input, DECODER scalars
//       (blk.N.layer_output_scale), softcapped logits for every position.
// The dg_* functions (diffusion-gemma-api.cpp) remove the canvas from the cache after a decoder
// forward, so from the outside the decoder never changes the cache.

// the largest meaningful values (dgcli/engine/types.py and hparams.py hold the same bounds)
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

static void dg_check_hparams(const llama_hparams & hparams, uint32_t canvas_length, const llama_model_loader & ml) {
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

void llama_model_diffusion_gemma::load_arch_hparams(llama_model_loader & ml) {
    hparams.swa_type = LLAMA_SWA_TYPE_STANDARD;
    ml.get_arr(LLM_KV_ATTENTION_SLIDING_WINDOW_PATTERN, hparams.is_swa_impl);

    uint32_t n_kv_shared_layers = 0;
    ml.get_key(LLM_KV_ATTENTION_SHARED_KV_LAYERS, n_kv_shared_layers, false);
    if (n_kv_shared_layers != 0) {
        throw std::runtime_error(format("diffusion-gemma: attention.shared_kv_layers = %u is not supported (must be 0)", n_kv_shared_layers));
    }
    hparams.n_layer_kv_from_start = hparams.n_layer_all;
    hparams.f_attention_scale     = 1.0f; // q/k are rms-normed; no 1/sqrt(d) scaling

    ml.get_key(LLM_KV_ROPE_FREQ_BASE_SWA,          hparams.rope_freq_base_train_swa, false);
    ml.get_key_or_arr(LLM_KV_EXPERT_FEED_FORWARD_LENGTH, hparams.n_ff_exp_arr, hparams.n_layer_all, false);
    ml.get_key(LLM_KV_ATTENTION_SLIDING_WINDOW,    hparams.n_swa);
    ml.get_key(LLM_KV_ATTENTION_LAYERNORM_RMS_EPS, hparams.f_norm_rms_eps);
    ml.get_key(LLM_KV_ATTENTION_KEY_LENGTH_SWA,    hparams.n_embd_head_k_swa);
    ml.get_key(LLM_KV_ATTENTION_VALUE_LENGTH_SWA,  hparams.n_embd_head_v_swa);
    ml.get_key(LLM_KV_FINAL_LOGIT_SOFTCAPPING,     hparams.f_final_logit_softcapping, false);

    uint32_t n_embd_per_layer = 0;
    ml.get_key(LLM_KV_EMBEDDING_LENGTH_PER_LAYER, n_embd_per_layer, false);
    if (n_embd_per_layer != 0) {
        throw std::runtime_error("diffusion-gemma: per-layer embeddings are not supported (embedding_length_per_layer_input must be 0)");
    }
    bool any_swa = false;
    for (uint32_t il = 0; il < hparams.n_layer(); ++il) {
        any_swa = any_swa || hparams.is_swa(il);
    }
    // the KV cache is the sliding + full pair (iSWA); a model without sliding layers has no use for it
    if (!any_swa) {
        throw std::runtime_error("diffusion-gemma: attention.sliding_window_pattern has no sliding layer (at least one is required)");
    }
    if (hparams.n_swa == 0) {
        throw std::runtime_error("diffusion-gemma: attention.sliding_window must be > 0");
    }

    // the diffusion keys are not prefixed by the architecture (like Dream's diffusion.shift_logits)
    ml.get_key(std::string("diffusion.canvas_length"), canvas_length, true);
    if (canvas_length == 0) {
        throw std::runtime_error("diffusion-gemma: diffusion.canvas_length must be > 0");
    }

    hparams.non_causal_type = LLAMA_NON_CAUSAL_TYPE_BLOCK;

    dg_check_hparams(hparams, canvas_length, ml);

    switch (hparams.n_layer()) {
        case 30: type = LLM_TYPE_26B_A4B; break;
        default: type = LLM_TYPE_UNKNOWN;
    }
}

void llama_model_diffusion_gemma::load_arch_tensors(llama_model_loader &) {
    LLAMA_LOAD_LOCALS;

    const int64_t n_ff_exp = hparams.n_ff_exp();

    if (n_embd_head_k != n_embd_head_v || hparams.n_embd_head_k_swa != hparams.n_embd_head_v_swa) {
        throw std::runtime_error("diffusion-gemma: key and value head sizes must be equal");
    }
    if (n_expert == 0 || n_expert_used == 0 || n_ff_exp == 0) {
        throw std::runtime_error("diffusion-gemma: expert_count, expert_used_count and expert_feed_forward_length must be > 0");
    }

    tok_embd = create_tensor(tn(LLM_TENSOR_TOKEN_EMBD, "weight"), {n_embd, n_vocab}, 0);

    // the LM head is tied to the token embedding
    output = create_tensor(tn(LLM_TENSOR_OUTPUT, "weight"), {n_embd, n_vocab}, TENSOR_NOT_REQUIRED);
    if (output == NULL) {
        output = create_tensor(tn(LLM_TENSOR_TOKEN_EMBD, "weight"), {n_embd, n_vocab}, TENSOR_DUPLICATED);
    }
    output_norm = create_tensor(tn(LLM_TENSOR_OUTPUT_NORM, "weight"), {n_embd}, 0);

    self_cond_pre_norm = create_tensor(tn(LLM_TENSOR_SELF_COND_PRE_NORM, "weight"), {n_embd},       0);
    self_cond_gate     = create_tensor(tn(LLM_TENSOR_SELF_COND_GATE,     "weight"), {n_embd, n_ff}, 0);
    self_cond_up       = create_tensor(tn(LLM_TENSOR_SELF_COND_UP,       "weight"), {n_embd, n_ff}, 0);
    self_cond_down     = create_tensor(tn(LLM_TENSOR_SELF_COND_DOWN,     "weight"), {n_ff, n_embd}, 0);

    enc_out_scale.assign(n_layer, nullptr);

    int rope_freqs_flag = 0;

    for (int i = 0; i < n_layer; ++i) {
        auto & layer = layers[i];
        const int64_t n_head      = hparams.n_head(i);
        const int64_t n_embd_head = hparams.n_embd_head_k(i);
        const int64_t n_embd_k    = hparams.n_embd_k_gqa(i);
        const int64_t n_embd_v    = hparams.n_embd_v_gqa(i);
        const int64_t n_ff_cur    = hparams.n_ff(i);

        layer.attn_norm = create_tensor(tn(LLM_TENSOR_ATTN_NORM, "weight", i), {n_embd}, 0);

        layer.wq = create_tensor(tn(LLM_TENSOR_ATTN_Q, "weight", i), {n_embd, n_embd_head * n_head}, 0);
        layer.wk = create_tensor(tn(LLM_TENSOR_ATTN_K, "weight", i), {n_embd, n_embd_k}, 0);
        // full layers have no v_proj: V = K (before the norms)
        layer.wv = create_tensor(tn(LLM_TENSOR_ATTN_V, "weight", i), {n_embd, n_embd_v}, hparams.is_swa(i) ? 0 : TENSOR_NOT_REQUIRED);
        layer.wo = create_tensor(tn(LLM_TENSOR_ATTN_OUT, "weight", i), {n_embd_head * n_head, n_embd}, 0);

        layer.attn_q_norm    = create_tensor(tn(LLM_TENSOR_ATTN_Q_NORM,    "weight", i), {n_embd_head}, 0);
        layer.attn_k_norm    = create_tensor(tn(LLM_TENSOR_ATTN_K_NORM,    "weight", i), {n_embd_head}, 0);
        layer.attn_post_norm = create_tensor(tn(LLM_TENSOR_ATTN_POST_NORM, "weight", i), {n_embd}, 0);

        layer.out_scale  = create_tensor(tn(LLM_TENSOR_LAYER_OUT_SCALE,     "weight", i), {1u}, 0);
        enc_out_scale[i] = create_tensor(tn(LLM_TENSOR_ENC_LAYER_OUT_SCALE, "weight", i), {1u}, 0);

        if (!hparams.is_swa(i)) {
            // full layers: proportional rope as frequency factors
            layer.rope_freqs = create_tensor(tn(LLM_TENSOR_ROPE_FREQS, "weight", i), {n_embd_head/2}, rope_freqs_flag);
            rope_freqs_flag = TENSOR_DUPLICATED;
        }

        // shared dense FFN
        layer.ffn_norm      = create_tensor(tn(LLM_TENSOR_FFN_NORM,      "weight", i), {n_embd}, 0);
        layer.ffn_gate      = create_tensor(tn(LLM_TENSOR_FFN_GATE,      "weight", i), {n_embd,   n_ff_cur}, 0);
        layer.ffn_up        = create_tensor(tn(LLM_TENSOR_FFN_UP,        "weight", i), {n_embd,   n_ff_cur}, 0);
        layer.ffn_down      = create_tensor(tn(LLM_TENSOR_FFN_DOWN,      "weight", i), {n_ff_cur, n_embd}, 0);
        layer.ffn_post_norm = create_tensor(tn(LLM_TENSOR_FFN_POST_NORM, "weight", i), {n_embd}, 0);

        // experts: every layer is MoE
        layer.ffn_gate_inp    = create_tensor(tn(LLM_TENSOR_FFN_GATE_INP,    "weight", i), {n_embd, n_expert}, 0);
        layer.ffn_gate_inp_s  = create_tensor(tn(LLM_TENSOR_FFN_GATE_INP,    "scale",  i), {n_embd}, 0);
        layer.ffn_pre_norm_2  = create_tensor(tn(LLM_TENSOR_FFN_PRE_NORM_2,  "weight", i), {n_embd}, 0);
        layer.ffn_post_norm_1 = create_tensor(tn(LLM_TENSOR_FFN_POST_NORM_1, "weight", i), {n_embd}, 0);
        layer.ffn_post_norm_2 = create_tensor(tn(LLM_TENSOR_FFN_POST_NORM_2, "weight", i), {n_embd}, 0);

        layer.ffn_gate_up_exps = create_tensor(tn(LLM_TENSOR_FFN_GATE_UP_EXPS, "weight", i), {n_embd, n_ff_exp * 2, n_expert}, 0);
        layer.ffn_down_exps    = create_tensor(tn(LLM_TENSOR_FFN_DOWN_EXPS,    "weight", i), {n_ff_exp, n_embd, n_expert}, 0);
        // the per-expert scale (ffn_down_exps.scale) is picked up by the generic loader after this
    }
}

std::unique_ptr<llm_graph_context> llama_model_diffusion_gemma::build_arch_graph(const llm_graph_params & params) const {
    return std::make_unique<graph>(*this, params);
}

// gelu_tanh from F32 ops: ggml's CPU gelu/geglu read an F16 lookup table (~1e-3 relative error)
static ggml_tensor * dg_gelu_tanh_f32(ggml_context * ctx, ggml_tensor * x) {
    x = ggml_cont(ctx, x);
    ggml_tensor * x3    = ggml_mul(ctx, ggml_sqr(ctx, x), x);
    ggml_tensor * inner = ggml_add(ctx, x, ggml_scale(ctx, x3, 0.044715f));
    ggml_tensor * t     = ggml_tanh(ctx, ggml_scale(ctx, inner, sqrtf(2.0f / (float) M_PI)));
    return ggml_mul(ctx, x, ggml_scale_bias(ctx, t, 0.5f, 0.5f));
}

// Graph inputs of ours. Both compare the request they were built for with the current one, so a
// graph built with (or without) self-conditioning, with another top-k width, or with(out) exact
// GELU is never reused for the other.
class llm_graph_input_dg_mode : public llm_graph_input_i {
public:
    llm_graph_input_dg_mode(bool exact, bool has_sc, int32_t sc_k) : exact(exact), has_sc(has_sc), sc_k(sc_k) {}

    void set_input(const llama_ubatch *) override {}

    bool can_reuse(const llm_graph_params &) override {
        const dg_request * req = dg_active_request();
        const bool    cur_exact  = req && req->exact;
        const bool    cur_has_sc = req && req->sc_ids;
        const int32_t cur_k      = cur_has_sc ? req->sc_k : 0;
        return cur_exact == exact && cur_has_sc == has_sc && cur_k == sc_k;
    }

    const bool    exact;
    const bool    has_sc;
    const int32_t sc_k;
};

class llm_graph_input_dg_self_cond : public llm_graph_input_i {
public:
    llm_graph_input_dg_self_cond(int32_t k) : k(k) {}

    void set_input(const llama_ubatch * ubatch) override {
        const dg_request * req = dg_active_request();
        GGML_ASSERT(req && req->sc_ids && req->sc_probs && req->sc_k == k);

        const size_t ids_bytes   = (size_t) k * sizeof(int32_t);
        const size_t probs_bytes = (size_t) k * sizeof(float);
        for (uint32_t i = 0; i < ubatch->n_tokens; ++i) {
            // ubatch order may differ from batch order: locate the row by (sequence, position)
            const llama_seq_id seq = ubatch->seq_id[i][0];
            GGML_ASSERT(seq >= 0 && (size_t) seq < req->pos0.size());
            const int64_t c = ubatch->pos[i] - req->pos0[seq];
            GGML_ASSERT(c >= 0 && c < req->n_canvas);
            const size_t row = ((size_t) seq * req->n_canvas + (size_t) c) * (size_t) k;
            ggml_backend_tensor_set(ids,   req->sc_ids   + row, i * ids_bytes,   ids_bytes);
            ggml_backend_tensor_set(probs, req->sc_probs + row, i * probs_bytes, probs_bytes);
        }
    }

    bool can_reuse(const llm_graph_params & params) override {
        return probs->ne[1] == params.ubatch.n_tokens;
    }

    const int32_t k;
    ggml_tensor * ids   = nullptr; // I32 [k * n_tokens]: token ids, k per canvas position
    ggml_tensor * probs = nullptr; // F32 [k, n_tokens]: their probabilities under softmax(prev logits)
};

// e + sc, where sc is the self-conditioning block on the previous step's soft embeddings
ggml_tensor * llama_model_diffusion_gemma::graph::build_self_cond_input(const llama_model_diffusion_gemma & model, ggml_tensor * inp_embd) {
    const dg_request * req = dg_active_request();
    const bool    exact = req && req->exact;
    const int32_t k     = req->sc_k;

    auto inp = std::make_unique<llm_graph_input_dg_self_cond>(k);
    inp->ids   = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, (int64_t) k * n_tokens);
    inp->probs = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, k, n_tokens);
    ggml_set_input(inp->ids);
    ggml_set_input(inp->probs);
    cb(inp->probs, "sc_probs", -1);

    // soft[:, c] = sum_j probs[j, c] * E[:, ids[j, c]]. The dense product softmax(logits) @ E is
    // ~190 G multiply-adds per 256-token step on the real vocabulary (and ggml's quantized
    // out_prod dequantizes all of E once per canvas row); the probability mass sits on a few
    // tokens, so the caller keeps the top k per position (k = n_vocab reproduces the dense sum).
    // get_rows dequantizes only the k rows of E needed (F32 out); the batched out_prod then
    // contracts over the k rows of each position: [n_embd, k, C] x [1, k, C] -> [n_embd, 1, C].
    // note: tok_embd, not the tied output: the output copy may sit in a repacked CPU buffer
    ggml_tensor * rows = ggml_get_rows(ctx0, model.tok_embd, inp->ids);      // [n_embd, k*C]
    rows = ggml_reshape_3d(ctx0, rows, n_embd, k, n_tokens);
    ggml_tensor * weights = ggml_reshape_3d(ctx0, inp->probs, 1, k, n_tokens);
    res->add_input(std::move(inp));

    ggml_tensor * soft = ggml_out_prod(ctx0, rows, weights);                 // [n_embd, 1, C]
    soft = ggml_reshape_2d(ctx0, soft, n_embd, n_tokens);
    soft = ggml_scale(ctx0, soft, sqrtf((float) n_embd));
    cb(soft, "sc_soft_embd", -1);

    ggml_tensor * cur = build_norm(soft, model.self_cond_pre_norm, nullptr, LLM_NORM_RMS, -1);
    cur = build_gelu_ffn(cur, model.self_cond_up, model.self_cond_gate, model.self_cond_down, exact, -1);
    cb(cur, "sc_signal", -1);

    return ggml_add(ctx0, inp_embd, cur);
}

ggml_tensor * llama_model_diffusion_gemma::graph::build_gelu_ffn(ggml_tensor * cur, ggml_tensor * up, ggml_tensor * gate,
                                                                   ggml_tensor * down, bool exact, int il) {
    if (!exact) {
        return build_ffn(cur, up, nullptr, nullptr, gate, nullptr, nullptr, down, nullptr, nullptr, nullptr,
                         LLM_FFN_GELU, LLM_FFN_PAR, il);
    }
    ggml_tensor * g = build_lora_mm(gate, cur);
    ggml_tensor * u = build_lora_mm(up,   cur);
    return build_lora_mm(down, ggml_mul(ctx0, dg_gelu_tanh_f32(ctx0, g), u));
}

// The routed experts with an F32 GELU; otherwise the same computation as build_moe_ffn for
// Gemma 4 (softmax router, top-k, renormalised weights, per-expert scale on the output).
ggml_tensor * llama_model_diffusion_gemma::graph::build_moe_exact(ggml_tensor * cur, ggml_tensor * router_logits,
                                                                    const llama_layer & layer, int il) {
    const int64_t n_expert      = hparams.n_expert;
    const int64_t n_expert_used = hparams.n_expert_used(il);
    const int64_t n_tokens      = cur->ne[1]; // the last layer keeps only the output rows

    ggml_tensor * probs    = ggml_soft_max(ctx0, router_logits);                // [n_expert, n_tokens]
    ggml_tensor * selected = ggml_argsort_top_k(ctx0, probs, n_expert_used);    // [n_expert_used, n_tokens]
    ggml_tensor * weights  = ggml_get_rows(ctx0, ggml_reshape_3d(ctx0, probs, 1, n_expert, n_tokens), selected);
    weights = ggml_reshape_2d(ctx0, weights, n_expert_used, n_tokens);
    weights = ggml_div(ctx0, weights, ggml_sum_rows(ctx0, weights));
    weights = ggml_reshape_3d(ctx0, weights, 1, n_expert_used, n_tokens);
    cb(weights, "ffn_moe_weights_norm", il);

    cur = ggml_reshape_3d(ctx0, cur, n_embd, 1, n_tokens);
    ggml_tensor * gate_up = build_lora_mm_id(layer.ffn_gate_up_exps, cur, selected, nullptr); // [2*n_ff, n_expert_used, n_tokens]
    const int64_t n_ff = gate_up->ne[0] / 2;
    ggml_tensor * gate = ggml_view_3d(ctx0, gate_up, n_ff, gate_up->ne[1], gate_up->ne[2], gate_up->nb[1], gate_up->nb[2], 0);
    ggml_tensor * up   = ggml_view_3d(ctx0, gate_up, n_ff, gate_up->ne[1], gate_up->ne[2], gate_up->nb[1], gate_up->nb[2], n_ff * gate_up->nb[0]);

    ggml_tensor * act = ggml_mul(ctx0, dg_gelu_tanh_f32(ctx0, gate), ggml_cont(ctx0, up));
    ggml_tensor * experts = build_lora_mm_id(layer.ffn_down_exps, act, selected, layer.ffn_down_exps_s); // [n_embd, n_expert_used, n_tokens]
    experts = ggml_mul(ctx0, experts, weights);

    ggml_tensor * moe_out = nullptr;
    for (int64_t i = 0; i < n_expert_used; ++i) {
        ggml_tensor * e = ggml_view_2d(ctx0, experts, n_embd, n_tokens, experts->nb[2], i*experts->nb[1]);
        moe_out = moe_out ? ggml_add(ctx0, moe_out, e) : ggml_cont(ctx0, e);
    }
    return moe_out;
}

llama_model_diffusion_gemma::graph::graph(const llama_model & model_base, const llm_graph_params & params) :
        llm_graph_context(params) {
    const auto & model = static_cast<const llama_model_diffusion_gemma &>(model_base);

    const dg_request * req = dg_active_request();
    const bool decoder = !cparams.causal_attn;
    const bool exact   = req && req->exact;
    const bool has_sc  = decoder && req && req->sc_ids;

    res->add_input(std::make_unique<llm_graph_input_dg_mode>(exact, has_sc, has_sc ? req->sc_k : 0));

    ggml_tensor * cur;
    ggml_tensor * inpL = build_inp_embd(model.tok_embd);
    inpL = ggml_scale(ctx0, inpL, sqrtf((float) n_embd));
    cb(inpL, "inp_scaled", -1);

    if (decoder) {
        // layer-0 input: rms_norm(e + sc) without a weight; sc is exactly 0 without a previous step
        if (has_sc) {
            inpL = build_self_cond_input(model, inpL);
        }
        inpL = ggml_rms_norm(ctx0, inpL, hparams.f_norm_rms_eps);
        cb(inpL, "inp_self_cond", -1);
    }

    ggml_tensor * inp_pos     = build_inp_pos();
    auto        * inp_attn    = build_attn_inp_kv_iswa();
    ggml_tensor * inp_out_ids = build_inp_out_ids();

    for (int il = 0; il < n_layer; ++il) {
        const auto &  layer       = model.layers[il];
        const int64_t n_embd_head = hparams.n_embd_head_k(il);
        const int64_t n_head      = hparams.n_head(il);
        const int64_t n_head_kv   = hparams.n_head_kv(il);

        const float freq_base_l  = model.get_rope_freq_base(cparams, il);
        const float freq_scale_l = model.get_rope_freq_scale(cparams, il);
        const int   n_rot_l      = hparams.n_rot(il);

        // full layers: proportional rope via frequency factors
        ggml_tensor * freq_factors = hparams.is_swa(il) ? nullptr : layer.rope_freqs;

        cur = build_norm(inpL, layer.attn_norm, nullptr, LLM_NORM_RMS, il);
        cb(cur, "attn_norm", il);

        ggml_tensor * Qcur = build_lora_mm(layer.wq, cur);
        ggml_tensor * Kcur = build_lora_mm(layer.wk, cur);
        ggml_tensor * Vcur = layer.wv ? build_lora_mm(layer.wv, cur) : Kcur;

        Qcur = ggml_reshape_3d(ctx0, Qcur, n_embd_head, n_head,    n_tokens);
        Kcur = ggml_reshape_3d(ctx0, Kcur, n_embd_head, n_head_kv, n_tokens);
        Vcur = ggml_reshape_3d(ctx0, Vcur, n_embd_head, n_head_kv, n_tokens);

        Qcur = build_norm(Qcur, layer.attn_q_norm, nullptr, LLM_NORM_RMS, il);
        Kcur = build_norm(Kcur, layer.attn_k_norm, nullptr, LLM_NORM_RMS, il);
        Vcur = ggml_rms_norm(ctx0, Vcur, hparams.f_norm_rms_eps);

        Qcur = ggml_rope_ext(ctx0, Qcur, inp_pos, freq_factors, n_rot_l, rope_type, n_ctx_orig, freq_base_l, freq_scale_l,
                             ext_factor, attn_factor, beta_fast, beta_slow);
        Kcur = ggml_rope_ext(ctx0, Kcur, inp_pos, freq_factors, n_rot_l, rope_type, n_ctx_orig, freq_base_l, freq_scale_l,
                             ext_factor, attn_factor, beta_fast, beta_slow);
        cb(Qcur, "Qcur_pos", il);
        cb(Kcur, "Kcur_pos", il);
        cb(Vcur, "Vcur_normed", il);

        cur = build_attn(inp_attn, layer.wo, nullptr, nullptr, Qcur, Kcur, Vcur, nullptr, nullptr, nullptr,
                         hparams.f_attention_scale, il);

        if (il == n_layer - 1 && inp_out_ids) {
            cur  = ggml_get_rows(ctx0,  cur, inp_out_ids);
            inpL = ggml_get_rows(ctx0, inpL, inp_out_ids);
        }

        cur = build_norm(cur, layer.attn_post_norm, nullptr, LLM_NORM_RMS, il);
        ggml_tensor * attn_out = ggml_add(ctx0, cur, inpL);
        cb(attn_out, "attn_out", il);

        // shared dense FFN
        ggml_tensor * cur_mlp = build_norm(attn_out, layer.ffn_norm, nullptr, LLM_NORM_RMS, il);
        cur_mlp = build_gelu_ffn(cur_mlp, layer.ffn_up, layer.ffn_gate, layer.ffn_down, exact, il);
        cur_mlp = build_norm(cur_mlp, layer.ffn_post_norm_1, nullptr, LLM_NORM_RMS, il);
        cb(cur_mlp, "ffn_mlp", il);

        // routed experts: the router reads the un-normed residual
        ggml_tensor * cur_moe = build_norm(attn_out, layer.ffn_pre_norm_2, nullptr, LLM_NORM_RMS, il);
        ggml_tensor * router  = ggml_rms_norm(ctx0, attn_out, hparams.f_norm_rms_eps);
        router = ggml_scale(ctx0, router, 1.0f / sqrtf((float) n_embd));
        router = ggml_mul(ctx0, router, layer.ffn_gate_inp_s);
        ggml_tensor * router_logits = build_lora_mm(layer.ffn_gate_inp, router); // [n_expert, n_tokens]
        cb(router_logits, "ffn_moe_logits", il);

        if (exact) {
            cur_moe = build_moe_exact(cur_moe, router_logits, layer, il);
        } else {
            cur_moe = build_moe_ffn(cur_moe, nullptr, nullptr, nullptr, layer.ffn_down_exps, nullptr,
                    n_expert, n_expert_used, LLM_FFN_GELU, true, 1.0f, LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX,
                    il, router_logits, layer.ffn_gate_up_exps, nullptr, nullptr, layer.ffn_down_exps_s);
        }
        cur_moe = build_norm(cur_moe, layer.ffn_post_norm_2, nullptr, LLM_NORM_RMS, il);
        cb(cur_moe, "ffn_moe", il);

        cur = build_norm(ggml_add(ctx0, cur_mlp, cur_moe), layer.ffn_post_norm, nullptr, LLM_NORM_RMS, il);
        cur = ggml_add(ctx0, cur, attn_out);

        // the one per-layer difference between the two passes
        cur = ggml_mul(ctx0, cur, decoder ? layer.out_scale : model.enc_out_scale[il]);
        cur = build_cvec(cur, il);
        cb(cur, "l_out", il);

        inpL = cur;
    }

    cur = build_norm(inpL, model.output_norm, nullptr, LLM_NORM_RMS, -1);
    cb(cur, "result_norm", -1);
    res->t_embd = cur;

    cur = build_lora_mm(model.output, cur);
    if (hparams.f_final_logit_softcapping) {
        cur = ggml_scale(ctx0, cur, 1.0f / hparams.f_final_logit_softcapping);
        cur = ggml_tanh(ctx0, cur);
        cur = ggml_scale(ctx0, cur, hparams.f_final_logit_softcapping);
    }
    cb(cur, "result_output", -1);
    res->t_logits = cur;

    ggml_build_forward_expand(gf, cur);
}
