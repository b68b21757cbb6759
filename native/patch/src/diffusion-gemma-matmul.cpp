// The decoder's products and the FFN blocks built on them: each weight's product runs on the GEMM
// that llama_model_diffusion_gemma chose for it (diffusion-gemma-kernel-choice.cpp) as two custom ops
// (quantize the activations, then the GEMM), else on ggml's matmul; the MoE block is build_moe_ffn's
// computation, rebuilt where our experts' GEMM or exact mode's F32 GELU must replace parts of it.

#include "models/models.h"
#include "diffusion-gemma-lm-head.h"

#include <cmath>

// gelu_tanh from F32 ops: ggml's CPU gelu/geglu read an F16 lookup table (~1e-3 relative error)
static ggml_tensor * dg_gelu_tanh_f32(ggml_context * ctx, ggml_tensor * x) {
    x = ggml_cont(ctx, x);
    ggml_tensor * x3    = ggml_mul(ctx, ggml_sqr(ctx, x), x);
    ggml_tensor * inner = ggml_add(ctx, x, ggml_scale(ctx, x3, 0.044715f));
    ggml_tensor * t     = ggml_tanh(ctx, ggml_scale(ctx, inner, sqrtf(2.0f / (float) M_PI)));
    return ggml_mul(ctx, x, ggml_scale_bias(ctx, t, 0.5f, 0.5f));
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
    // as the experts: a group's packing costs several columns, so a one-token decode keeps ggml's
    const dg_experts * tiled = no_lora ? model.dense_tiled(w) : nullptr;
    if (tiled && ggml_n_dims(cur) == 2 && cur->ne[1] >= tiled->min_dense_tokens()) {
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
