#include "models.h"
#include "llama-impl.h"
#include "../diffusion-gemma-api.h"
#include "../diffusion-gemma-embd-t.h"
#include "../diffusion-gemma-graph-inputs.h"
#include "../diffusion-gemma-hparams-check.h"
#include "../diffusion-gemma-lm-head.h"

#include "ggml-backend.h"

#include <cmath>
#include <string>

// DiffusionGemma: one set of Gemma 4 (26B-A4B MoE) weights, two ways of running it.
//   encoder (cparams.causal_attn = true):  causal prefill of prompt / committed canvas into the
//       KV cache, each layer's output times the ENCODER scalar (blk.N.enc_layer_output_scale)
//   decoder (cparams.causal_attn = false): one forward over a canvas, bidirectional inside it,
//       reading the cache (full layers: all of it; sliding layers: the last W-1 tokens, for every
//       canvas query: LLAMA_NON_CAUSAL_TYPE_BLOCK), self-conditioned input, DECODER scalars
//       (blk.N.layer_output_scale), softcapped logits for every position, or (dg_denoise_step) the
//       denoising step right after the LM head: per position only the sampler's results leave.
// The dg_* functions (diffusion-gemma-api.cpp) remove the canvas from the cache after a decoder
// forward, so from the outside the decoder never changes the cache.
//
// The graph is built here; which GEMM runs each weight is diffusion-gemma-kernel-choice.cpp, the
// products and FFN blocks on those GEMMs diffusion-gemma-matmul.cpp, the denoising step after the LM
// head diffusion-gemma-step-op.cpp, and the inputs a request sets diffusion-gemma-graph-inputs.cpp.

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

llama_model_diffusion_gemma::graph::graph(const llama_model & model_base, const llm_graph_params & params) :
        llm_graph_context(params) {
    const auto & model = static_cast<const llama_model_diffusion_gemma &>(model_base);

    const dg_request * req = dg_active_request();
    const bool decoder = !cparams.causal_attn;
    const bool exact   = req && req->exact;
    const bool has_sc  = decoder && req && req->sc_form != dg_sc_form::none;

    // a worst-case graph llama.cpp reserves mid-call (after a memory update: a sequence's stream
    // copied) has fewer outputs than tokens: it gets the plain logits, the request's step is not its
    const bool has_step = decoder && req && req->step.active && n_outputs == n_tokens;

    res->add_input(std::make_unique<llm_graph_input_dg_mode>(dg_graph_key(req)));

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

        ggml_tensor * Qcur = build_mm(model, layer.wq, cur);
        cb(Qcur, "Qcur", il);
        ggml_tensor * Kcur = build_mm(model, layer.wk, cur);
        cb(Kcur, "Kcur", il);
        ggml_tensor * Vcur = Kcur; // full-attention layers have no V projection: V = K
        if (layer.wv) {
            Vcur = build_mm(model, layer.wv, cur);
            cb(Vcur, "Vcur", il);
        }

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

        // the output projection is ours (build_mm), so build_attn stops at the heads' output
        cur = build_attn(inp_attn, nullptr, nullptr, nullptr, Qcur, Kcur, Vcur, nullptr, nullptr, nullptr,
                         hparams.f_attention_scale, il);
        cur = build_mm(model, layer.wo, cur);
        cb(cur, "attn_output", il);

        if (il == n_layer - 1 && inp_out_ids) {
            cur  = ggml_get_rows(ctx0,  cur, inp_out_ids);
            inpL = ggml_get_rows(ctx0, inpL, inp_out_ids);
        }

        cur = build_norm(cur, layer.attn_post_norm, nullptr, LLM_NORM_RMS, il);
        ggml_tensor * attn_out = ggml_add(ctx0, cur, inpL);
        cb(attn_out, "attn_out", il);

        // shared dense FFN
        ggml_tensor * cur_mlp = build_norm(attn_out, layer.ffn_norm, nullptr, LLM_NORM_RMS, il);
        cur_mlp = build_gelu_ffn(model, cur_mlp, layer.ffn_up, layer.ffn_gate, layer.ffn_down, exact, il);
        cur_mlp = build_norm(cur_mlp, layer.ffn_post_norm_1, nullptr, LLM_NORM_RMS, il);
        cb(cur_mlp, "ffn_mlp", il);

        // routed experts: the router reads the un-normed residual
        ggml_tensor * cur_moe = build_norm(attn_out, layer.ffn_pre_norm_2, nullptr, LLM_NORM_RMS, il);
        ggml_tensor * router  = ggml_rms_norm(ctx0, attn_out, hparams.f_norm_rms_eps);
        router = ggml_scale(ctx0, router, 1.0f / sqrtf((float) n_embd));
        router = ggml_mul(ctx0, router, layer.ffn_gate_inp_s);
        ggml_tensor * router_logits = build_lora_mm(layer.ffn_gate_inp, router); // [n_expert, n_tokens]
        cb(router_logits, "ffn_moe_logits", il);

        cur_moe = build_moe(model, cur_moe, router_logits, layer, exact, il);
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

    cur = build_lm_head(model, cur);
    cb(cur, "lm_head", -1);
    if (has_step) {
        // the logits stay in the graph (res->t_logits unset: llama_decode copies nothing out)
        build_step(model, cur);
        return;
    }
    if (hparams.f_final_logit_softcapping) {
        cur = ggml_scale(ctx0, cur, 1.0f / hparams.f_final_logit_softcapping);
        cur = ggml_tanh(ctx0, cur);
        cur = ggml_scale(ctx0, cur, hparams.f_final_logit_softcapping);
    }
    cb(cur, "result_output", -1);
    res->t_logits = cur;

    ggml_build_forward_expand(gf, cur);
}

// The self-conditioning block: the previous step's distribution as a soft embedding (top-k rows of E,
// or the dense product over the whole vocabulary), through its own RMS norm and GELU MLP, added to the
// token embeddings of the canvas.

// tokens per partial sum of exact mode's F32 dense product (build_chunked_mul_mat)
static constexpr int64_t DG_SC_F32_CHUNK = 8192;

// e + sc, where sc is the self-conditioning block on the previous step's soft embeddings
ggml_tensor * llama_model_diffusion_gemma::graph::build_self_cond_input(const llama_model_diffusion_gemma & model, ggml_tensor * inp_embd) {
    const dg_request * req   = dg_active_request();
    const bool         exact = req->exact;

    auto inp = std::make_unique<llm_graph_input_dg_self_cond>(req->sc_form, req->sc_width);
    inp->values = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, req->sc_width, n_tokens);
    ggml_set_input(inp->values);
    cb(inp->values, "sc_input", -1);

    ggml_tensor * soft = nullptr; // [n_embd, n_tokens]
    switch (req->sc_form) {
        case dg_sc_form::topk:
            inp->ids = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, (int64_t) req->sc_width * n_tokens);
            ggml_set_input(inp->ids);
            soft = build_soft_embd_topk(model, inp->ids, inp->values);
            break;
        case dg_sc_form::dense:
            soft = build_soft_embd_dense(model, ggml_scale(ctx0, inp->values, DG_SC_PROBS_SCALE), DG_SC_PROBS_SCALE,
                                         exact);
            break;
        case dg_sc_form::soft:
            soft = inp->values; // a dense step's product, handed back
            break;
        case dg_sc_form::none:
            GGML_ABORT("no self-conditioning input");
    }
    res->add_input(std::move(inp));
    cb(soft, "sc_soft_embd", -1);

    ggml_tensor * cur = build_norm(soft, model.self_cond_pre_norm, nullptr, LLM_NORM_RMS, -1);
    cur = build_gelu_ffn(model, cur, model.self_cond_up, model.self_cond_gate, model.self_cond_down, exact, -1);
    cb(cur, "sc_signal", -1);

    return ggml_add(ctx0, inp_embd, cur);
}

// The reference's soft embedding softmax(logits) @ E * sqrt(n_embd) as one product: the transposed
// embeddings (model.embd_t: E^T times a power of two, Q8_0 or F32) times the probabilities, which
// the caller scaled by probs_scale, [n_vocab, N] -> [n_embd, N]. On the CPU the product runs on the
// LM head's repacked int8 GEMM where the copy was repacked for it, else it is ggml's MUL_MAT (a GPU's
// tensor cores where the output layer is offloaded).
ggml_tensor * llama_model_diffusion_gemma::graph::build_soft_embd_dense(const llama_model_diffusion_gemma & model,
                                                                        ggml_tensor * probs, float probs_scale,
                                                                        bool exact) {
    const dg_embd_transposed * et = model.embd_t(exact);
    if (et == nullptr) {
        throw std::runtime_error("diffusion-gemma: cannot make the transposed embeddings of the dense self-conditioning");
    }
    ggml_tensor * soft;
    if (et->packed()) {
        soft = build_repacked_mm(et->packed(), probs);
    } else if (et->tensor()->type == GGML_TYPE_F32 && probs->ne[0] > DG_SC_F32_CHUNK && probs->ne[0] % DG_SC_F32_CHUNK == 0) {
        soft = build_chunked_mul_mat(et->tensor(), probs, DG_SC_F32_CHUNK);
    } else {
        soft = ggml_mul_mat(ctx0, et->tensor(), probs);
    }
    cb(soft, "sc_dense_product", -1);
    return ggml_scale(ctx0, soft, sqrtf((float) n_embd) / (probs_scale * et->scale()));
}

// The top-k form: soft[:, c] = sum_j probs[j, c] * E[:, ids[j, c]] * sqrt(n_embd), the k rows of E of
// each position gathered and contracted over k. On the CPU an OUT_PROD contracts the gathered rows
// [n_embd, k, C] over k as they lie (each row added times its probability); other backends (the
// portable ops' form) get a MUL_MAT, which contracts along rows, over the rows transposed to
// [k, n_embd, C] (a copy of k x C x n_embd floats: on a CPU twice the gather's time).
// The rows come from the tied output copy where it sits in a device's memory: llama.cpp keeps
// tok_embd in host memory, and the gathered rows (k x C x n_embd floats: 176 MiB for a real
// canvas at k = 64) then crossed to the GPU every step, 40% of an H200's step. Not from a host
// buffer: the output copy may be repacked there (CPU_REPACK), which get_rows cannot read.
ggml_tensor * llama_model_diffusion_gemma::graph::build_soft_embd_topk(const llama_model_diffusion_gemma & model,
                                                                       ggml_tensor * ids, ggml_tensor * probs) {
    const int64_t k = probs->ne[0];
    ggml_tensor * rows = nullptr;
    if (model.output && model.output->buffer && !ggml_backend_buffer_is_host(model.output->buffer)) {
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(model.output->buffer));
        rows = ggml_get_rows(ctx0, model.output, ids);
        if (!dev || !ggml_backend_dev_supports_op(dev, rows)) {
            rows = nullptr; // that device cannot gather this type: the host copy does
        }
    }
    if (!rows) {
        rows = ggml_get_rows(ctx0, model.tok_embd, ids);
    }
    cb(rows, "sc_rows", -1);                                                     // [n_embd, k*C]
    rows = ggml_reshape_3d(ctx0, rows, n_embd, k, n_tokens);
    ggml_tensor * soft = nullptr;
    const dg_step_request & step = dg_active_request()->step;
    if (!model.uses_gpu() && !(step.active && step.portable)) { // the graph key holds both
        soft = ggml_out_prod(ctx0, rows, ggml_reshape_3d(ctx0, probs, 1, k, n_tokens)); // [n_embd, 1, C]
    } else {
        rows = ggml_cont(ctx0, ggml_permute(ctx0, rows, 1, 0, 2, 3));            // [k, n_embd, C]
        cb(rows, "sc_rows_t", -1);
        soft = ggml_mul_mat(ctx0, rows, ggml_reshape_3d(ctx0, probs, k, 1, n_tokens)); // [n_embd, 1, C]
    }
    cb(soft, "sc_topk_product", -1);
    soft = ggml_reshape_2d(ctx0, soft, n_embd, n_tokens);
    return ggml_scale(ctx0, soft, sqrtf((float) n_embd));
}
