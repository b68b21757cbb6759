#include "models.h"
#include "llama-impl.h"
#include "../diffusion-gemma-api.h"
#include "../diffusion-gemma-embd-t.h"
#include "../diffusion-gemma-lm-head.h"
#include "../diffusion-gemma-step.h"

#include "ggml-backend.h"

#include <cmath>
#include <cstring>
#include <string>
#include <unordered_set>

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

// Whether the model uses a GPU: llama.cpp's scheduler then runs a large batch's matmuls on host
// weights there too (each weight copied over per op; a canvas is 256 rows), far faster than any CPU
// kernel, and our custom ops would pin them to the CPU. So our CPU GEMMs (LM head, dense
// projections, experts) stand aside. RPC devices (other machines' backends) take no such offload.
bool llama_model_diffusion_gemma::uses_gpu() const {
    for (const auto & d : devices) {
        const enum ggml_backend_dev_type type = ggml_backend_dev_type(d.dev);
        const char * reg = ggml_backend_reg_name(ggml_backend_dev_backend_reg(d.dev));
        if ((type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) &&
            std::strcmp(reg, "RPC") != 0) {
            return true;
        }
    }
    return false;
}

// The decoder's dense weights our GEMMs may take (dense(), dense_tiled()): each layer's attention
// projections and dense FFN, and the self-conditioning MLP; the router stays with ggml
static std::vector<const ggml_tensor *> dg_dense_weights(const llama_model_diffusion_gemma & model) {
    std::vector<const ggml_tensor *> out;
    for (const auto & layer : model.layers) {
        out.insert(out.end(), { layer.wq, layer.wk, layer.wv, layer.wo, layer.ffn_gate, layer.ffn_up, layer.ffn_down });
    }
    out.insert(out.end(), { model.self_cond_gate, model.self_cond_up, model.self_cond_down });
    return out;
}

// The LM head repacked for this CPU's int8 kernels (diffusion-gemma-lm-head.h), made once, on the
// first graph that needs it; null where ggml's matmul stays (no kernel, a GPU in use, or output
// weights that are not Q8_0 or Q5_0 in host memory).
const dg_lm_head * llama_model_diffusion_gemma::lm_head() const {
    std::call_once(lm_head_once, [this] {
        const dg_lm_head_kernel kernel = dg_lm_head::kernel_for_cpu();
        if (kernel == dg_lm_head_kernel::none || uses_gpu() || !dg_lm_head::qualifies(output)) {
            return;
        }
        std::shared_ptr<const dg_lm_head> head = dg_lm_head::repack(output, kernel);
        if (head) {
            LLAMA_LOG_INFO("%s: LM head repacked for the %s kernel (%.1f MiB)\n", __func__,
                           dg_lm_head::kernel_name(kernel),
                           head->n_groups() * (head->n_embd() / 32) * dg_lm_head_group_block_bytes(head->group_rows()) / 1048576.0);
        }
        lm_head_repacked = std::move(head);
    });
    return lm_head_repacked.get();
}

// How the dense self-conditioning product's transposed embeddings are held (diffusion-gemma-embd-t.h):
// F32 in exact mode or where the vocabulary is not whole 32-token blocks, else Q8_0; in the output
// layer's memory where that is a device's that can multiply it (the product then runs there, next to
// the logits), else in host memory, where a CPU with a kernel for the LM head's GEMM gets it repacked
// for that GEMM (unless a GPU is in use, which llama.cpp then runs host weights' products on, or
// DG_LM_HEAD says otherwise).
dg_embd_t_plan llama_model_diffusion_gemma::embd_t_plan(bool exact) const {
    dg_embd_t_plan plan;
    plan.type = exact || tok_embd->ne[1] % 32 != 0 ? GGML_TYPE_F32 : GGML_TYPE_Q8_0;
    plan.buft = ggml_backend_cpu_buffer_type();
    if (output && output->buffer && !ggml_backend_buffer_is_host(output->buffer)) {
        ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(output->buffer);
        ggml_backend_dev_t         dev  = ggml_backend_buft_get_device(buft);
        // ask the device about the product it would run: E^T [n_vocab, n_embd] x probabilities [n_vocab, 1]
        ggml_init_params params = { 3 * ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
        ggml_context *   ctx    = ggml_init(params);
        ggml_tensor *    a      = ggml_new_tensor_2d(ctx, plan.type, tok_embd->ne[1], tok_embd->ne[0]);
        ggml_tensor *    b      = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, tok_embd->ne[1], 1);
        if (dev && ggml_backend_dev_supports_op(dev, ggml_mul_mat(ctx, a, b))) {
            plan.buft = buft;
        }
        ggml_free(ctx);
    }
    if (plan.type == GGML_TYPE_Q8_0 && ggml_backend_buft_is_host(plan.buft) && !uses_gpu()) {
        plan.kernel = dg_lm_head::kernel_for_cpu();
    }
    return plan;
}

// The transposed embeddings of the dense self-conditioning product, made once per mode, on the first
// graph that needs them (at real widths ~0.8 GB as Q8_0, 3 GB as exact mode's F32): a model that only
// ever runs the top-k form never holds them.
const dg_embd_transposed * llama_model_diffusion_gemma::embd_t(bool exact) const {
    const int i = exact ? 1 : 0;
    std::call_once(embd_t_once[i], [&] {
        const dg_embd_t_plan plan = embd_t_plan(exact);
        std::shared_ptr<const dg_embd_transposed> made = dg_embd_transposed::make(tok_embd, plan);
        if (made) {
            LLAMA_LOG_INFO("%s: transposed embeddings for dense self-conditioning: %s, %s, %.1f MiB\n", __func__,
                           ggml_type_name(plan.type), made->packed() ? made->path() : ggml_backend_buft_name(plan.buft),
                           made->bytes() / 1048576.0);
        } else {
            LLAMA_LOG_ERROR("%s: cannot make the transposed embeddings (%s as %s)\n", __func__,
                            ggml_type_name(tok_embd->type), ggml_type_name(plan.type));
        }
        embd_t_made[i] = std::move(made);
    });
    return embd_t_made[i].get();
}

// The decoder's other dense Q8_0 and Q5_0 weights through the LM head's int8 GEMM: ggml's matmul
// runs them at about half (Q8_0) and 40% (Q5_0, the down projections of Q4_K_M files) of the
// core's int8 rate (benchmarks/step_profile.py), the repack at ~80%. Made
// once, on the first graph; not where a GPU is in use (uses_gpu); the router stays with ggml, the
// MoE experts have experts(). DG_DENSE_GEMM=ggml keeps ggml's matmul for them (A/B runs).
const dg_lm_head * llama_model_diffusion_gemma::dense(const ggml_tensor * w) const {
    std::call_once(dense_once, [this] {
        const dg_lm_head_kernel kernel = dg_lm_head::kernel_for_cpu("DG_DENSE_GEMM");
        if (kernel == dg_lm_head_kernel::none || uses_gpu()) {
            return;
        }
        int64_t bytes = 0;
        auto    add   = [&](const ggml_tensor * t) {
            if (t == nullptr || dense_repacked.count(t) || !dg_lm_head::qualifies(t)) {
                return;
            }
            std::shared_ptr<const dg_lm_head> packed = dg_lm_head::repack(t, kernel);
            if (packed) {
                bytes += packed->bytes();
                dense_repacked.emplace(t, std::move(packed));
            }
        };
        for (const ggml_tensor * t : dg_dense_weights(*this)) {
            add(t);
        }
        if (!dense_repacked.empty()) {
            LLAMA_LOG_INFO("%s: %zu dense weights repacked for the %s kernel (%.1f MiB)\n", __func__,
                           dense_repacked.size(), dg_lm_head::kernel_name(kernel), bytes / 1048576.0);
        }
    });
    const auto it = dense_repacked.find(w);
    return it == dense_repacked.end() ? nullptr : it->second.get();
}

// The MoE experts of Q8_0, Q5_0 and (AVX2) Q4_K type (all of a Q8_0 or a Q4_K_M file's but Q6_K
// ones) through the same tiles, packed on the fly (dg_experts): ggml's MUL_MAT_ID runs them at 44-64%
// of the core's int8 rate here. Q4_K experts qualify only outside ggml's CPU repack buffers, which
// the loader keeps them out of where this runs (dg_plain_cpu_buffer_type, dgcli.runtime.offload).
// Not where a GPU is in use (uses_gpu: e.g. --n-cpu-moe's host experts then run on the GPU).
// Decided once, on the first graph; DG_EXPERT_GEMM=ggml keeps ggml's MUL_MAT_ID (A/B runs).
const dg_experts * llama_model_diffusion_gemma::experts(const ggml_tensor * w) const {
    std::call_once(experts_once, [this] {
        const dg_lm_head_kernel kernel = dg_experts::kernel_for_cpu();
        if (kernel == dg_lm_head_kernel::none || uses_gpu()) {
            return;
        }
        for (const auto & layer : layers) {
            for (const ggml_tensor * t : { layer.ffn_gate_up_exps, layer.ffn_down_exps }) {
                std::shared_ptr<const dg_experts> gemm = dg_experts::make(t, kernel);
                if (gemm) {
                    experts_gemm.emplace(t, std::move(gemm));
                }
            }
        }
        if (!experts_gemm.empty()) {
            LLAMA_LOG_INFO("%s: %zu expert tensors on the %s kernel\n", __func__, experts_gemm.size(),
                           dg_lm_head::kernel_name(kernel));
        }
    });
    const auto it = experts_gemm.find(w);
    return it == experts_gemm.end() ? nullptr : it->second.get();
}

// The decoder's dense Q4_K and Q6_K weights (a Q4_K_M file's attention projections, dense FFN gate and
// up, self-conditioning MLP, and its Q6_K LM head) on the experts' K-quant tiles as one expert that every
// token is routed to, packed on the fly: a canvas's 256 columns pay for a group's packing many times
// over, and ggml's repacked Q4_K / Q6_K GEMMs run at ~70% of the int8 rate here. AVX2 only (the tiles'
// only form), not where a GPU is in use, and only outside ggml's CPU repack buffers, which the loader
// keeps these tensors out of where this runs (dgcli.runtime.offload.tiled_weight_pattern).
// DG_DENSE_GEMM=ggml keeps ggml's matmul.
const dg_experts * llama_model_diffusion_gemma::dense_tiled(const ggml_tensor * w) const {
    std::call_once(dense_tiled_once, [this] {
        const dg_lm_head_kernel kernel = dg_lm_head::kernel_for_cpu("DG_DENSE_GEMM");
        if (kernel != dg_lm_head_kernel::avx2 || uses_gpu()) {
            return;
        }
        auto add = [&](const ggml_tensor * t) {
            if (t == nullptr || (t->type != GGML_TYPE_Q4_K && t->type != GGML_TYPE_Q6_K) || ggml_n_dims(t) != 2 ||
                !dg_experts::qualifies(t)) {
                return;
            }
            std::shared_ptr<const dg_experts> gemm = dg_experts::make(t, kernel);
            if (gemm) {
                dense_tiled_gemm.emplace(t, std::move(gemm));
            }
        };
        for (const ggml_tensor * t : dg_dense_weights(*this)) {
            add(t);
        }
        // the tied Q6_K LM head: ggml's CPU repack does not take it, so its copy is the mapped file's
        add(output);
        if (!dense_tiled_gemm.empty()) {
            LLAMA_LOG_INFO("%s: %zu dense K-quant weights on the avx2 kernel\n", __func__, dense_tiled_gemm.size());
        }
    });
    const auto it = dense_tiled_gemm.find(w);
    return it == dense_tiled_gemm.end() ? nullptr : it->second.get();
}

// gelu_tanh from F32 ops: ggml's CPU gelu/geglu read an F16 lookup table (~1e-3 relative error)
static ggml_tensor * dg_gelu_tanh_f32(ggml_context * ctx, ggml_tensor * x) {
    x = ggml_cont(ctx, x);
    ggml_tensor * x3    = ggml_mul(ctx, ggml_sqr(ctx, x), x);
    ggml_tensor * inner = ggml_add(ctx, x, ggml_scale(ctx, x3, 0.044715f));
    ggml_tensor * t     = ggml_tanh(ctx, ggml_scale(ctx, inner, sqrtf(2.0f / (float) M_PI)));
    return ggml_mul(ctx, x, ggml_scale_bias(ctx, t, 0.5f, 0.5f));
}

// What a graph was built for, beyond what llama.cpp itself compares: a graph built with another
// self-conditioning form (or none), another top-k width, exact GELU or another step is never reused
// for a request that differs.
struct dg_graph_key {
    bool       exact     = false;
    dg_sc_form sc_form   = dg_sc_form::none;
    int32_t    sc_width  = 0;
    bool       step      = false;
    int32_t    step_k    = 0;
    bool       step_soft = false;
    bool       keep      = false;
    bool       portable  = false;

    explicit dg_graph_key(const dg_request * req) {
        if (!req) {
            return;
        }
        exact     = req->exact;
        sc_form   = req->sc_form;
        sc_width  = req->sc_width;
        step      = req->step.active;
        step_k    = step ? req->step.top_k : 0;
        step_soft = step && req->step.soft;
        keep      = step && req->step.keep_values;
        portable  = step && req->step.portable;
    }

    bool operator==(const dg_graph_key & o) const {
        return exact == o.exact && sc_form == o.sc_form && sc_width == o.sc_width && step == o.step &&
               step_k == o.step_k && step_soft == o.step_soft && keep == o.keep && portable == o.portable;
    }
};

class llm_graph_input_dg_mode : public llm_graph_input_i {
public:
    explicit llm_graph_input_dg_mode(const dg_graph_key & key) : key(key) {}

    void set_input(const llama_ubatch *) override {}

    bool can_reuse(const llm_graph_params &) override {
        return dg_graph_key(dg_active_request()) == key;
    }

    const dg_graph_key key;
};

// ubatch order may differ from batch order: a canvas token's batch row, by (sequence, position)
static int64_t dg_batch_row(const dg_request & req, const llama_ubatch & ubatch, uint32_t i) {
    const llama_seq_id seq = ubatch.seq_id[i][0];
    GGML_ASSERT(seq >= 0 && (size_t) seq < req.pos0.size());
    const int64_t row = req.row_of(seq, ubatch.pos[i]);
    GGML_ASSERT(row >= (int64_t) seq * req.n_canvas && row < (int64_t) (seq + 1) * req.n_canvas);
    return row;
}

// The previous step's self-conditioning input, one row per canvas position (dg_sc_form): top-k ids
// and their probabilities, the whole distribution, or the soft embedding itself.
class llm_graph_input_dg_self_cond : public llm_graph_input_i {
public:
    llm_graph_input_dg_self_cond(dg_sc_form form, int32_t width) : form(form), width(width) {}

    void set_input(const llama_ubatch * ubatch) override {
        const dg_request * req = dg_active_request();
        GGML_ASSERT(req && req->sc_form == form && req->sc_width == width && req->sc_values);
        GGML_ASSERT((ids != nullptr) == (req->sc_ids != nullptr));

        const size_t ids_bytes    = (size_t) width * sizeof(int32_t);
        const size_t values_bytes = (size_t) width * sizeof(float);
        for (uint32_t i = 0; i < ubatch->n_tokens; ++i) {
            const size_t row = (size_t) dg_batch_row(*req, *ubatch, i) * (size_t) width;
            if (ids) {
                ggml_backend_tensor_set(ids, req->sc_ids + row, i * ids_bytes, ids_bytes);
            }
            ggml_backend_tensor_set(values, req->sc_values + row, i * values_bytes, values_bytes);
        }
    }

    bool can_reuse(const llm_graph_params & params) override {
        return values->ne[1] == params.ubatch.n_tokens;
    }

    const dg_sc_form form;
    const int32_t    width;          // k, n_vocab or n_embd
    ggml_tensor *    ids    = nullptr; // top-k: I32 [k * n_tokens], k token ids per canvas position
    ggml_tensor *    values = nullptr; // F32 [width, n_tokens]: probabilities, or the soft embedding
};

// The settings of one graph's step op, read by every thread of the op.
struct dg_step_op_params {
    int32_t top_k       = 0;
    float   softcap     = 0.0f;  // 0: none
    bool    exact_tanh  = false;
    bool    keep_values = false; // leave softcap(logits) / t in the logits tensor for the caller
    float   probs_scale = 0.0f;  // not 0: leave softmax(values) * probs_scale there (the dense product's input)
};

// The denoising step over the LM head's output, one row per canvas position (rows split over
// the op's threads): softcap, / temperature, max, exp, entropy, argmax, top-k, inverse-CDF sample
// (dg_step_row, shared with the host sampler). The step adds no logits-sized buffer: values and then
// weights go to a per-thread row kept across steps (so the logits are read from memory once and not
// written back, half the traffic of transforming them in place), or, where the caller wants the
// values, the values over the raw logits and the weights to that row. With probs_scale the weights,
// normalised, are then written over the row: it holds the next step's probabilities.
static void dg_step_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto & p       = *(const dg_step_op_params *) userdata;
    ggml_tensor * logits = dst->src[0];                        // F32 [n_vocab, n_rows]
    const auto *  temps  = (const float *)  dst->src[1]->data; // [n_rows]
    const auto *  unif   = (const double *) dst->src[2]->data; // [n_rows]
    const int32_t n_vocab = (int32_t) logits->ne[0];
    const int64_t n_rows  = logits->ne[1];

    thread_local std::vector<float>   weights_row;
    thread_local std::vector<int32_t> ids;
    thread_local dg_topk_heap         heap;
    if (weights_row.size() < (size_t) n_vocab) {
        weights_row.resize((size_t) n_vocab);
    }
    ids.resize((size_t) p.top_k);
    for (int64_t r = ith; r < n_rows; r += nth) {
        float * row    = (float *) ((char *) logits->data + r * logits->nb[1]);
        float * record = (float *) ((char *) dst->data + r * dst->nb[1]);

        dg_row_in in   = {};
        in.logits      = row;
        in.values      = p.keep_values ? row : weights_row.data();
        in.weights     = weights_row.data();
        in.n_vocab     = n_vocab;
        in.softcap     = p.softcap;
        in.exact_tanh  = p.exact_tanh;
        in.temperature = temps[r];
        in.uniform     = unif + r;
        in.top_k       = p.top_k;
        in.topk_ids    = ids.data();
        in.topk_probs  = record + DG_STEP_TOPK + p.top_k;
        in.next_row    = r + nth < n_rows ? (const float *) ((char *) logits->data + (r + nth) * logits->nb[1]) : nullptr;
        dg_row_out out;
        if (!dg_step_row(in, out, heap)) {
            record[DG_STEP_ENTROPY] = NAN;
            continue;
        }
        record[DG_STEP_ENTROPY] = (float) out.entropy;
        record[DG_STEP_ARGMAX]  = (float) out.argmax;
        record[DG_STEP_SAMPLED] = (float) out.sampled;
        record[DG_STEP_DROPPED] = (float) out.dropped;
        for (int32_t j = 0; j < p.top_k; ++j) {
            record[DG_STEP_TOPK + j] = (float) ids[j];
        }
        if (p.probs_scale != 0.0f) {
            const float to_probs = (float) ((double) p.probs_scale / out.total);
            for (int32_t i = 0; i < n_vocab; ++i) {
                row[i] = in.weights[i] * to_probs;
            }
        }
    }
}

// Nothing to compute: the step op left the probabilities in the logits' rows. This in-place view of
// them has the step's record as a source, so the graph runs whatever reads it after the step op.
static void dg_after_step_op(ggml_tensor *, int, int, void *) {}

// The step's per-row inputs (temperature of the row's canvas, its uniform) and, once the inputs
// are set, where the caller finds the results (published into the request: the graph may be
// reused, so its tensors are only known then).
class llm_graph_input_dg_step : public llm_graph_input_i {
public:
    void set_input(const llama_ubatch * ubatch) override {
        const dg_request * req = dg_active_request();
        GGML_ASSERT(req && req->step.active);
        const dg_step_request & step = req->step;

        std::vector<float>  temps(ubatch->n_tokens);
        std::vector<double> unif(ubatch->n_tokens);
        step.rows.resize(ubatch->n_tokens);
        for (uint32_t i = 0; i < ubatch->n_tokens; ++i) {
            const int64_t row = dg_batch_row(*req, *ubatch, i);
            step.rows[i] = (int32_t) row;
            temps[i]     = step.temperatures[ubatch->seq_id[i][0]];
            unif[i]      = step.uniforms[row];
        }
        ggml_backend_tensor_set(temperatures, temps.data(), 0, temps.size() * sizeof(float));
        if (uniforms->type == GGML_TYPE_F64) {
            ggml_backend_tensor_set(uniforms, unif.data(), 0, unif.size() * sizeof(double));
        } else {
            std::vector<float> unif32(unif.begin(), unif.end());
            ggml_backend_tensor_set(uniforms, unif32.data(), 0, unif32.size() * sizeof(float));
        }
        step.record    = record;
        step.values    = values;
        step.soft_embd = soft_embd;
    }

    bool can_reuse(const llm_graph_params & params) override {
        return temperatures->ne[1] == params.ubatch.n_tokens;
    }

    dg_step_op_params op;
    ggml_tensor * temperatures = nullptr; // F32 [1, n_rows]
    ggml_tensor * uniforms     = nullptr; // F64 [n_rows] (the step op) or F32 [1, n_rows] (ggml ops)
    ggml_tensor * record       = nullptr; // F32 [dg_step_record_width(top_k), n_rows]
    ggml_tensor * values       = nullptr; // F32 [n_vocab, n_rows], when the caller keeps them
    ggml_tensor * soft_embd    = nullptr; // F32 [n_embd, n_rows]: the next step's dense self-conditioning input
};

// logits (LM head output, before the softcap) -> the step's record, and with step.soft the next
// step's soft embedding (the dense self-conditioning input: this step's probabilities times E, in
// the same graph). Where the logits are on the CPU the record is one op of ours (dg_step_op); on any
// other backend (or when asked, to test that path) ggml ops that every backend has, so the logits
// never leave the device.
void llama_model_diffusion_gemma::graph::build_step(const llama_model_diffusion_gemma & model, ggml_tensor * logits) {
    const dg_request &      req   = *dg_active_request();
    const dg_step_request & step  = req.step;
    const int64_t           n_rows = logits->ne[1];
    const int32_t           k      = step.top_k;
    const float             cap    = hparams.f_final_logit_softcapping;
    GGML_ASSERT(n_rows == n_tokens); // every canvas position is an output
    GGML_ASSERT(!(step.soft && step.keep_values)); // the probabilities take the values' place

    auto inp = std::make_unique<llm_graph_input_dg_step>();
    inp->temperatures = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, 1, n_rows);
    ggml_set_input(inp->temperatures);

    ggml_backend_dev_t dev_out = model.dev_output();
    const bool on_cpu = !dev_out || ggml_backend_dev_type(dev_out) == GGML_BACKEND_DEVICE_TYPE_CPU;

    ggml_tensor * record;
    ggml_tensor * values = nullptr;
    ggml_tensor * probs  = nullptr; // softmax(values) * DG_SC_PROBS_SCALE, [n_vocab, n_rows], with step.soft
    if (on_cpu && !step.portable) {
        inp->op.top_k       = k;
        inp->op.softcap     = cap;
        inp->op.exact_tanh  = req.exact;
        inp->op.keep_values = step.keep_values;
        inp->op.probs_scale = step.soft ? DG_SC_PROBS_SCALE : 0.0f;
        inp->uniforms = ggml_new_tensor_1d(ctx0, GGML_TYPE_F64, n_rows);
        ggml_set_input(inp->uniforms);
        ggml_tensor * args[] = { logits, inp->temperatures, inp->uniforms };
        record = ggml_custom_4d(ctx0, GGML_TYPE_F32, dg_step_record_width(k), n_rows, 1, 1, args, 3, dg_step_op,
                                GGML_N_TASKS_MAX, &inp->op);
        values = step.keep_values ? logits : nullptr; // the op leaves the values there
        if (step.soft) {
            probs = ggml_custom_inplace(ctx0, logits, &record, 1, dg_after_step_op, 1, nullptr);
        }
    } else {
        inp->uniforms = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, 1, n_rows);
        ggml_set_input(inp->uniforms);
        ggml_tensor * softmax = nullptr;
        record = build_step_ops(logits, inp->temperatures, inp->uniforms, k, values, softmax);
        values = step.keep_values ? values : nullptr;
        if (step.soft) {
            probs = ggml_scale(ctx0, softmax, DG_SC_PROBS_SCALE);
        }
    }
    cb(record, "dg_step", -1);
    ggml_set_output(record);
    ggml_build_forward_expand(gf, record);
    if (values) {
        ggml_set_output(values);
        ggml_build_forward_expand(gf, values);
    }
    if (probs) {
        cb(probs, "sc_next_probs", -1);
        ggml_tensor * soft = build_soft_embd_dense(model, probs, DG_SC_PROBS_SCALE, req.exact);
        cb(soft, "sc_next_soft_embd", -1);
        ggml_set_output(soft);
        ggml_build_forward_expand(gf, soft);
        inp->soft_embd = soft;
    }
    inp->record = record;
    inp->values = values;
    res->add_input(std::move(inp));
}

// The step from ggml ops, for backends without our op: the same record in float arithmetic
// (softmax, cumulative sum and the sample's comparison in F32, where the op accumulates in double;
// the top-k sorted by probability, ties in the backend's order; the argmax's ties to the lowest id,
// as the op, where a top-k is asked for).
ggml_tensor * llama_model_diffusion_gemma::graph::build_step_ops(ggml_tensor * logits, ggml_tensor * temperatures,
                                                                  ggml_tensor * uniforms, int32_t k, ggml_tensor *& values,
                                                                  ggml_tensor *& probs) {
    const int64_t n_vocab = logits->ne[0];
    const int64_t n_rows  = logits->ne[1];
    const float   cap     = hparams.f_final_logit_softcapping;

    ggml_tensor * x = logits;
    if (cap) {
        x = ggml_scale(ctx0, x, 1.0f / cap);
        x = ggml_tanh(ctx0, x);
        x = ggml_scale(ctx0, x, cap);
    }
    values = ggml_div(ctx0, x, temperatures);                                   // [V, N]
    probs  = ggml_soft_max(ctx0, values);                                       // [V, N]

    // a row's value and probability at one index per row: get_rows over [1, V, N]
    auto at = [&](ggml_tensor * t, ggml_tensor * idx /* I32 [m, N] */) {
        ggml_tensor * picked = ggml_get_rows(ctx0, ggml_reshape_3d(ctx0, t, 1, n_vocab, n_rows), idx);
        return ggml_reshape_2d(ctx0, picked, idx->ne[0], n_rows);              // [m, N]
    };
    ggml_tensor * argmax = ggml_reshape_2d(ctx0, ggml_argmax(ctx0, values), 1, n_rows);
    ggml_tensor * v_max  = at(values, argmax);
    ggml_tensor * p_max  = at(probs, argmax);

    // H = log Z - sum p (v - max), with log Z = -log p_max; every term of the sum is <= 0
    ggml_tensor * shifted = ggml_sub(ctx0, values, v_max);
    ggml_tensor * entropy = ggml_neg(ctx0, ggml_add(ctx0, ggml_log(ctx0, p_max),
                                                    ggml_sum_rows(ctx0, ggml_mul(ctx0, probs, shifted))));

    // inverse CDF: the number of entries whose cumulative probability stays below u
    ggml_tensor * below   = ggml_step(ctx0, ggml_neg(ctx0, ggml_sub(ctx0, ggml_cumsum(ctx0, probs), uniforms)));
    ggml_tensor * sampled = ggml_clamp(ctx0, ggml_sum_rows(ctx0, below), 0.0f, (float) (n_vocab - 1));

    if (k == 0) {
        ggml_tensor * record = ggml_concat(ctx0, entropy, ggml_cast(ctx0, argmax, GGML_TYPE_F32), 0);
        record = ggml_concat(ctx0, record, sampled, 0);
        return ggml_concat(ctx0, record, ggml_scale(ctx0, entropy, 0.0f), 0); // dropped: 0
    }
    ggml_tensor * ids     = ggml_top_k(ctx0, probs, k);                         // I32 [k, N], any order
    ggml_tensor * ids_f   = ggml_cast(ctx0, ids, GGML_TYPE_F32);                // exact below 2^24

    // Equal maxima: ggml's argmax keeps its backend's own one (the CPU the last index, GPUs one by
    // thread order); the reference and the step op the lowest id. Every maximum is among the top k
    // (unless more than k tie): the lowest id there whose value equals the maximum, by an argmax over
    // k entries of (value == max) * (V - id).
    ggml_tensor * is_max  = ggml_scale_bias(ctx0, ggml_step(ctx0, ggml_neg(ctx0, ggml_sub(ctx0, at(values, ids), v_max))),
                                            -1.0f, 1.0f);                       // [k, N]: 1 where equal
    ggml_tensor * score   = ggml_mul(ctx0, is_max, ggml_scale_bias(ctx0, ids_f, -1.0f, (float) n_vocab));
    ggml_tensor * first   = ggml_reshape_2d(ctx0, ggml_argmax(ctx0, score), 1, n_rows);
    ggml_tensor * lowest  = ggml_reshape_2d(ctx0, ggml_get_rows(ctx0, ggml_reshape_3d(ctx0, ids_f, 1, k, n_rows), first),
                                            1, n_rows);                         // F32 [1, N]

    ggml_tensor * record  = ggml_concat(ctx0, entropy, lowest, 0);
    record = ggml_concat(ctx0, record, sampled, 0);
    ggml_tensor * kept    = at(probs, ids);                                     // [k, N]
    ggml_tensor * order   = ggml_argsort(ctx0, kept, GGML_SORT_ORDER_DESC);      // most probable first
    ggml_tensor * ids_out = ggml_reshape_2d(ctx0, ggml_get_rows(ctx0, ggml_reshape_3d(ctx0, ids_f, 1, k, n_rows), order),
                                            k, n_rows);
    ggml_tensor * p_out   = ggml_reshape_2d(ctx0, ggml_get_rows(ctx0, ggml_reshape_3d(ctx0, kept, 1, k, n_rows), order),
                                            k, n_rows);
    ggml_tensor * dropped = ggml_scale_bias(ctx0, ggml_sum_rows(ctx0, p_out), -1.0f, 1.0f);
    dropped = ggml_clamp(ctx0, dropped, 0.0f, 1.0f);
    record = ggml_concat(ctx0, record, dropped, 0);
    record = ggml_concat(ctx0, record, ids_out, 0);
    return ggml_concat(ctx0, record, p_out, 0);
}

// logits = output weights x hidden states: our repacked int8 GEMM (Q8_0, Q5_0) or K-quant tile
// (Q4_K, Q6_K) where the CPU has a kernel for it, else ggml's matmul
ggml_tensor * llama_model_diffusion_gemma::graph::build_lm_head(const llama_model_diffusion_gemma & model, ggml_tensor * cur) {
    const dg_lm_head * head = (loras == nullptr || loras->empty()) ? model.lm_head() : nullptr;
    return head ? build_repacked_mm(head, cur) : build_mm(model, model.output, cur);
}

// w x cur for the decoder's dense weights: the repacked GEMM where `w` has one, else ggml's matmul
ggml_tensor * llama_model_diffusion_gemma::graph::build_mm(const llama_model_diffusion_gemma & model, ggml_tensor * w,
                                                           ggml_tensor * cur) {
    const bool         no_lora = loras == nullptr || loras->empty();
    const dg_lm_head * packed  = no_lora ? model.dense(w) : nullptr;
    if (packed) {
        return build_repacked_mm(packed, cur);
    }
    // as the experts: a group's packing costs about three columns, so a one-token decode keeps ggml's
    const dg_experts * tiled = no_lora ? model.dense_tiled(w) : nullptr;
    if (tiled && ggml_n_dims(cur) == 2 && cur->ne[1] >= 4) {
        return build_tiled_mm(tiled, cur);
    }
    return build_lora_mm(w, cur);
}

// the same two ops over a K-quant tile (dg_experts with one expert)
ggml_tensor * llama_model_diffusion_gemma::graph::build_tiled_mm(const dg_experts * gemm, ggml_tensor * cur) {
    void * userdata = const_cast<dg_experts *>(gemm); // the ops only read it
    cur = ggml_cont(ctx0, cur);
    cb(cur, "tiled_in", -1);
    ggml_tensor * act = ggml_custom_4d(ctx0, GGML_TYPE_I8, gemm->act_bytes(), cur->ne[1], 1, 1, &cur, 1,
                                       dg_experts_quantize_op, GGML_N_TASKS_MAX, userdata);
    cb(act, "tiled_act", -1);
    return ggml_custom_4d(ctx0, GGML_TYPE_F32, gemm->n_out(), cur->ne[1], 1, 1, &act, 1, dg_experts_dense_op,
                          GGML_N_TASKS_MAX, userdata);
}

// two ops: quantize the activations once, then the GEMM, so that every thread of the second sees
// all of them
ggml_tensor * llama_model_diffusion_gemma::graph::build_repacked_mm(const dg_lm_head * packed, ggml_tensor * cur) {
    void * userdata = const_cast<dg_lm_head *>(packed); // the ops only read it
    if (!ggml_is_contiguous(cur)) {
        cur = ggml_cont(ctx0, cur);
    }
    ggml_tensor * act = ggml_custom_4d(ctx0, GGML_TYPE_I8, packed->act_bytes(), cur->ne[1], 1, 1, &cur, 1,
                                       dg_lm_head_quantize_op, GGML_N_TASKS_MAX, userdata);
    cb(act, "repacked_act", -1);
    return ggml_custom_4d(ctx0, GGML_TYPE_F32, packed->n_vocab(), cur->ne[1], 1, 1, &act, 1, dg_lm_head_gemm_op,
                          GGML_N_TASKS_MAX, userdata);
}

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

// a x b, [K, M] x [K, N] -> [M, N], as K / chunk products of `chunk`-long rows (one batched MUL_MAT
// over views of a and b) whose partial sums are added in double (sum_rows). Exact mode's F32 product
// over the 262144-token vocabulary: in one MUL_MAT each of ggml's accumulators adds ~4096 terms, whose
// rounding moved the real-width logits by 7e-5 (against 1e-4 for the whole small-model budget).
ggml_tensor * llama_model_diffusion_gemma::graph::build_chunked_mul_mat(ggml_tensor * a, ggml_tensor * b, int64_t chunk) {
    const int64_t n_chunks = a->ne[0] / chunk;
    GGML_ASSERT(a->ne[0] == b->ne[0] && n_chunks * chunk == a->ne[0]);
    ggml_tensor * a3 = ggml_view_3d(ctx0, a, chunk, a->ne[1], n_chunks, a->nb[1], chunk * a->nb[0], 0);
    ggml_tensor * b3 = ggml_view_3d(ctx0, b, chunk, b->ne[1], n_chunks, b->nb[1], chunk * b->nb[0], 0);
    ggml_tensor * parts = ggml_mul_mat(ctx0, a3, b3);                            // [M, N, n_chunks]
    parts = ggml_cont(ctx0, ggml_permute(ctx0, parts, 1, 2, 0, 3));              // [n_chunks, M, N]
    return ggml_reshape_2d(ctx0, ggml_sum_rows(ctx0, parts), a->ne[1], b->ne[1]);
}

// The top-k form: soft[:, c] = sum_j probs[j, c] * E[:, ids[j, c]] * sqrt(n_embd), the k rows of E of
// each position gathered and contracted over k. MUL_MAT contracts along rows, so the gathered rows
// [n_embd, k, C] are transposed to [k, n_embd, C] first (a copy of k x C x n_embd floats, far less than
// the product of the dense form).
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
    rows = ggml_cont(ctx0, ggml_permute(ctx0, rows, 1, 0, 2, 3));                // [k, n_embd, C]
    cb(rows, "sc_rows_t", -1);
    ggml_tensor * weights = ggml_reshape_3d(ctx0, probs, k, 1, n_tokens);        // [k, 1, C]
    ggml_tensor * soft    = ggml_mul_mat(ctx0, rows, weights);                   // [n_embd, 1, C]
    cb(soft, "sc_topk_product", -1);
    soft = ggml_reshape_2d(ctx0, soft, n_embd, n_tokens);
    return ggml_scale(ctx0, soft, sqrtf((float) n_embd));
}

// build_ffn's GELU with a parallel gate, with the projections through build_mm; exact: an F32 GELU
ggml_tensor * llama_model_diffusion_gemma::graph::build_gelu_ffn(const llama_model_diffusion_gemma & model, ggml_tensor * cur,
                                                                   ggml_tensor * up, ggml_tensor * gate, ggml_tensor * down,
                                                                   bool exact, int il) {
    const bool    sc = il < 0; // the self-conditioning MLP: its own names in a profile
    ggml_tensor * u  = build_mm(model, up, cur);
    cb(u, sc ? "sc_ffn_up" : "ffn_up", il);
    ggml_tensor * g = build_mm(model, gate, cur);
    cb(g, sc ? "sc_ffn_gate" : "ffn_gate", il);
    cur = exact ? ggml_mul(ctx0, dg_gelu_tanh_f32(ctx0, g), u) : ggml_geglu_split(ctx0, g, u);
    cb(cur, sc ? "sc_ffn_geglu" : "ffn_geglu", il);
    cur = build_mm(model, down, cur);
    cb(cur, sc ? "sc_ffn_down" : "ffn_down", il);
    return cur;
}

// The experts' tiles for `w` at this batch (n_tokens tokens routed to n_used experts each), or null
// for ggml's MUL_MAT_ID: packing a row group costs about three columns of tile work, which pays off
// from about four tokens per expert on average (a canvas gives 16 on the real model, a one-token
// decode 1/16, where ggml's per-row dot products read each weight once and are cheaper).
const dg_experts * llama_model_diffusion_gemma::graph::experts_at(const llama_model_diffusion_gemma & model,
                                                                  const ggml_tensor * w, int64_t n_tokens,
                                                                  int64_t n_used) const {
    const dg_experts * gemm = (loras == nullptr || loras->empty()) ? model.experts(w) : nullptr;
    return gemm && n_tokens * n_used >= 4 * gemm->n_expert() ? gemm : nullptr;
}

// w x cur for the experts `ids` of each token (MUL_MAT_ID): our tiles where `w` has them at this
// batch, else ggml's; then w_s, the per-expert output scale, as build_lora_mm_id applies it
ggml_tensor * llama_model_diffusion_gemma::graph::build_mm_id(const llama_model_diffusion_gemma & model, ggml_tensor * w,
                                                              ggml_tensor * cur, ggml_tensor * ids, ggml_tensor * w_s) {
    const dg_experts * gemm = experts_at(model, w, ids->ne[1], ids->ne[0]);
    if (gemm == nullptr) {
        return build_lora_mm_id(w, cur, ids, w_s);
    }
    void * userdata = const_cast<dg_experts *>(gemm); // the ops only read it
    // cur [n_in, 1 or n_used, n_tokens]: quantized once, every thread of the GEMM then reads all rows
    ggml_tensor * rows = ggml_reshape_2d(ctx0, ggml_is_contiguous(cur) ? cur : ggml_cont(ctx0, cur), cur->ne[0],
                                         cur->ne[1] * cur->ne[2]);
    ggml_tensor * act  = ggml_custom_4d(ctx0, GGML_TYPE_I8, gemm->act_bytes(), rows->ne[1], 1, 1, &rows, 1,
                                        dg_experts_quantize_op, GGML_N_TASKS_MAX, userdata);
    cb(act, "experts_act", -1);
    ggml_tensor * args[] = { act, ids };
    ggml_tensor * res = ggml_custom_4d(ctx0, GGML_TYPE_F32, gemm->n_out(), ids->ne[0], ids->ne[1], 1, args, 2,
                                       dg_experts_gemm_op, GGML_N_TASKS_MAX, userdata);
    cb(res, "experts_gemm", -1);
    if (w_s) {
        ggml_tensor * s = ggml_reshape_3d(ctx0, w_s, 1, w_s->ne[0], 1);
        s = ggml_repeat_4d(ctx0, s, 1, w_s->ne[0], ids->ne[1], 1);
        res = ggml_mul(ctx0, res, ggml_get_rows(ctx0, s, ids));
    }
    return res;
}

// The routed experts (softmax router, top-k, renormalised weights, per-expert scale on the output):
// build_moe_ffn's computation for Gemma 4, built here where it must differ: an F32 GELU (exact), or
// experts on our tiles (build_mm_id). Otherwise build_moe_ffn itself, which a GPU backend fuses.
ggml_tensor * llama_model_diffusion_gemma::graph::build_moe(const llama_model_diffusion_gemma & model, ggml_tensor * cur,
                                                            ggml_tensor * router_logits, const llama_layer & layer,
                                                            bool exact, int il) {
    const int64_t n_expert      = hparams.n_expert;
    const int64_t n_expert_used = hparams.n_expert_used(il);
    const int64_t n_tokens      = cur->ne[1]; // the last layer keeps only the output rows

    const bool ours = experts_at(model, layer.ffn_gate_up_exps, n_tokens, n_expert_used) ||
                      experts_at(model, layer.ffn_down_exps, n_tokens, n_expert_used);
    if (!exact && !ours) {
        return build_moe_ffn(cur, nullptr, nullptr, nullptr, layer.ffn_down_exps, nullptr,
                             n_expert, n_expert_used, LLM_FFN_GELU, true, 1.0f, LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX,
                             il, router_logits, layer.ffn_gate_up_exps, nullptr, nullptr, layer.ffn_down_exps_s);
    }

    ggml_tensor * probs    = ggml_soft_max(ctx0, router_logits);                // [n_expert, n_tokens]
    ggml_tensor * selected = ggml_argsort_top_k(ctx0, probs, n_expert_used);    // [n_expert_used, n_tokens]
    cb(selected, "ffn_moe_topk", il);
    ggml_tensor * weights  = ggml_get_rows(ctx0, ggml_reshape_3d(ctx0, probs, 1, n_expert, n_tokens), selected);
    weights = ggml_reshape_2d(ctx0, weights, n_expert_used, n_tokens);
    weights = ggml_div(ctx0, weights, ggml_sum_rows(ctx0, weights));
    weights = ggml_reshape_3d(ctx0, weights, 1, n_expert_used, n_tokens);
    cb(weights, "ffn_moe_weights_norm", il);

    cur = ggml_reshape_3d(ctx0, cur, n_embd, 1, n_tokens);
    ggml_tensor * gate_up = build_mm_id(model, layer.ffn_gate_up_exps, cur, selected, nullptr); // [2*n_ff, n_expert_used, n_tokens]
    cb(gate_up, "ffn_moe_gate_up", il);
    const int64_t n_ff = gate_up->ne[0] / 2;
    ggml_tensor * gate = ggml_view_3d(ctx0, gate_up, n_ff, gate_up->ne[1], gate_up->ne[2], gate_up->nb[1], gate_up->nb[2], 0);
    ggml_tensor * up   = ggml_view_3d(ctx0, gate_up, n_ff, gate_up->ne[1], gate_up->ne[2], gate_up->nb[1], gate_up->nb[2], n_ff * gate_up->nb[0]);

    ggml_tensor * act = exact ? ggml_mul(ctx0, dg_gelu_tanh_f32(ctx0, gate), ggml_cont(ctx0, up)) : ggml_geglu_split(ctx0, gate, up);
    cb(act, "ffn_moe_geglu", il);
    ggml_tensor * experts = build_mm_id(model, layer.ffn_down_exps, act, selected, layer.ffn_down_exps_s); // [n_embd, n_expert_used, n_tokens]
    cb(experts, layer.ffn_down_exps_s ? "ffn_moe_down_scaled" : "ffn_moe_down", il); // build_moe_ffn's names
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
