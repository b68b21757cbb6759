// The dg_* C functions (include/diffusion-gemma.h) and the request side channel they share with
// the diffusion-gemma graph (diffusion-gemma-api.h).

#include "diffusion-gemma.h"
#include "diffusion-gemma-api.h"
#include "diffusion-gemma-embd-t.h"
#include "diffusion-gemma-lm-head.h"
#include "diffusion-gemma-step.h"

#include "llama-model.h"
#include "models/models.h"

#include "ggml-backend.h"
#include "../ggml/src/ggml-backend-impl.h" // struct ggml_backend_buffer_type, to copy the CPU one

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

static thread_local const dg_request * dg_current = nullptr;

const dg_request * dg_active_request() {
    return dg_current;
}

namespace {

// publishes a request for the duration of one dg_* call, and restores the causal flag after it
struct dg_call_scope {
    llama_context * ctx;
    bool            causal_before;

    dg_call_scope(llama_context * ctx, const dg_request & req, bool causal) : ctx(ctx), causal_before(llama_get_causal_attn(ctx)) {
        dg_current = &req;
        llama_set_causal_attn(ctx, causal);
    }
    ~dg_call_scope() {
        dg_current = nullptr;
        llama_set_causal_attn(ctx, causal_before);
    }
};

struct dg_batch {
    llama_batch batch;
    explicit dg_batch(int32_t n) : batch(llama_batch_init(n, 0, 1)) {}
    ~dg_batch() { llama_batch_free(batch); }
    void add(llama_token token, llama_pos pos, llama_seq_id seq, bool logits) {
        const int32_t i = batch.n_tokens++;
        batch.token[i]     = token;
        batch.pos[i]       = pos;
        batch.n_seq_id[i]  = 1;
        batch.seq_id[i][0] = seq;
        batch.logits[i]    = logits;
    }
};

const llama_model_diffusion_gemma * dg_model_of(const llama_model * model) {
    return model && model->arch == LLM_ARCH_DIFFUSION_GEMMA ? static_cast<const llama_model_diffusion_gemma *>(model) : nullptr;
}

bool dg_tokens_valid(const llama_context * ctx, const llama_token * tokens, int32_t n) {
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    return std::all_of(tokens, tokens + n, [n_vocab](llama_token t) { return t >= 0 && t < n_vocab; });
}

}  // namespace

int32_t dg_canvas_length(const llama_model * model) {
    const auto * dg = dg_model_of(model);
    return dg ? (int32_t) dg->canvas_length : 0;
}

const char * dg_lm_head_path(const llama_model * model) {
    const auto * dg = dg_model_of(model);
    if (!dg) {
        return "ggml";
    }
    if (const dg_lm_head * head = dg->lm_head()) { // the kernel the model took when it repacked its head
        return dg_lm_head::kernel_name(head->kernel());
    }
    if (const dg_experts * tiled = dg->dense_tiled(dg->output)) {
        return tiled->kernel() == dg_lm_head_kernel::avx2 ? "avx2 K-quant tile"
               : tiled->amx_k_quant()                     ? "AMX K-quant tile"
                                                          : "avx512-vnni K-quant tile";
    }
    return "ggml";
}

const char * dg_self_cond_path(const llama_model * model, bool exact) {
    const auto * dg = dg_model_of(model);
    if (!dg) {
        return "ggml";
    }
    const dg_embd_t_plan plan = dg->embd_t_plan(exact);
    return dg_lm_head::kernel_name(plan.kernel);
}

int64_t dg_self_cond_bytes(const llama_model * model, bool exact) {
    const auto * dg = dg_model_of(model);
    const int    i  = exact ? 1 : 0;
    return dg && dg->embd_t_made[i] ? dg->embd_t_made[i]->bytes() : 0;
}

// How many weights one of the model's CPU GEMMs took: `decide` makes its choice on first use (a null
// tensor asks nothing else), `taken` is the map it fills.
template <typename Decide, typename Taken>
static int32_t dg_count_taken(const llama_model * model, Decide decide, Taken taken) {
    const auto * dg = dg_model_of(model);
    if (!dg) {
        return 0;
    }
    (dg->*decide)(nullptr);
    return (int32_t) (dg->*taken).size();
}

int32_t dg_dense_repacked_count(const llama_model * model) {
    return dg_count_taken(model, &llama_model_diffusion_gemma::dense, &llama_model_diffusion_gemma::dense_repacked);
}

int32_t dg_expert_gemm_count(const llama_model * model) {
    int32_t count = dg_count_taken(model, &llama_model_diffusion_gemma::experts, &llama_model_diffusion_gemma::experts_gemm);
    if (const auto * dg = dg_model_of(model)) { // and those repacked while loading (dg_expert_buffer_type)
        for (const auto & layer : dg->layers) {
            count += (int32_t) dg_expert_tensor_repacked(layer.ffn_gate_up_exps) +
                     (int32_t) dg_expert_tensor_repacked(layer.ffn_down_exps);
        }
    }
    return count;
}

int32_t dg_dense_tiled_count(const llama_model * model) {
    return dg_count_taken(model, &llama_model_diffusion_gemma::dense_tiled,
                          &llama_model_diffusion_gemma::dense_tiled_gemm);
}

int32_t dg_expert_kernel(void) {
    return (int32_t) dg_experts::kernel_for_cpu();
}

int32_t dg_dense_kernel(void) {
    return (int32_t) dg_lm_head::kernel_for_cpu("DG_DENSE_GEMM");
}

ggml_backend_buffer_type_t dg_plain_cpu_buffer_type(void) {
    // the CPU type's functions and (null) device: its buffers are CPU buffers, only the address differs
    static ggml_backend_buffer_type plain = *ggml_backend_cpu_buffer_type();
    return &plain;
}

int32_t dg_encode(llama_context * ctx, const llama_token * tokens, int32_t n_tokens, llama_seq_id seq_id, bool exact,
                  float * last_logits_out) {
    if (!ctx || !tokens || n_tokens <= 0 || seq_id < 0 || seq_id >= (llama_seq_id) llama_n_seq_max(ctx) ||
        !dg_tokens_valid(ctx, tokens, n_tokens)) {
        return -1;
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    const int32_t n_chunk = (int32_t) llama_n_batch(ctx);

    dg_request req;
    req.exact = exact;
    dg_call_scope scope(ctx, req, /*causal =*/ true);

    llama_memory_t mem = llama_get_memory(ctx);
    for (int32_t start = 0; start < n_tokens; start += n_chunk) {
        const int32_t   n    = std::min(n_chunk, n_tokens - start);
        const llama_pos pos0 = llama_memory_seq_pos_max(mem, seq_id) + 1;
        const bool      last = start + n == n_tokens;

        dg_batch b(n);
        for (int32_t i = 0; i < n; ++i) {
            b.add(tokens[start + i], pos0 + i, seq_id, last && i == n - 1);
        }
        const int32_t rc = llama_decode(ctx, b.batch);
        if (rc != 0) {
            return rc;
        }
        if (last && last_logits_out) {
            const float * logits = llama_get_logits_ith(ctx, n - 1);
            if (!logits) {
                return -1;
            }
            std::memcpy(last_logits_out, logits, (size_t) n_vocab * sizeof(float));
        }
    }
    return 0;
}

namespace {

// The checks every decoder forward makes: 0, -1 (bad arguments) or -2 (too many tokens for one
// micro-batch).
int32_t dg_check_decoder_args(llama_context * ctx, const llama_token * canvases, int32_t n_seqs, int32_t n_canvas,
                              const dg_self_cond * sc) {
    if (!ctx || !canvases || n_seqs <= 0 || n_canvas <= 0 || n_seqs > (int32_t) llama_n_seq_max(ctx) ||
        !dg_tokens_valid(ctx, canvases, n_seqs * n_canvas)) {
        return -1;
    }
    const int32_t n_total = n_seqs * n_canvas;
    if (sc) {
        const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
        const int     n_forms = (sc->topk_ids != nullptr) + (sc->probs != nullptr) + (sc->soft != nullptr);
        if (n_forms > 1 || (sc->topk_ids == nullptr) != (sc->topk_probs == nullptr) ||
            (sc->topk_ids == nullptr) != (sc->k == 0)) {
            return -1;
        }
        // get_rows reads E at these ids without a bounds check of its own
        if (sc->topk_ids && (sc->k < 0 || sc->k > n_vocab || !dg_tokens_valid(ctx, sc->topk_ids, n_total * sc->k))) {
            return -1;
        }
    }
    if (n_total > (int32_t) llama_n_ubatch(ctx) || n_total > (int32_t) llama_n_batch(ctx)) {
        return -2;
    }
    return 0;
}

// One decoder forward over the canvases, each right after its sequence's cached tokens, as
// described by `req` (its pos0 is filled here). `extract(n_total)` reads the results after a
// successful llama_decode, before the canvases leave the cache; returns 0 or an error status.
template <typename Extract>
int32_t dg_run_decoder(llama_context * ctx, dg_request & req, const llama_token * canvases, int32_t n_seqs,
                       int32_t n_canvas, Extract extract) {
    llama_memory_t mem     = llama_get_memory(ctx);
    const int32_t  n_total = n_seqs * n_canvas;

    req.n_canvas = n_canvas;
    req.n_vocab  = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    req.pos0.resize(n_seqs);

    dg_batch b(n_total);
    for (int32_t s = 0; s < n_seqs; ++s) {
        req.pos0[s] = llama_memory_seq_pos_max(mem, s) + 1;
        for (int32_t k = 0; k < n_canvas; ++k) {
            b.add(canvases[s * n_canvas + k], req.pos0[s] + k, s, true);
        }
    }

    int32_t rc;
    {
        dg_call_scope scope(ctx, req, /*causal =*/ false);
        rc = llama_decode(ctx, b.batch);
    }
    if (rc == 0) {
        rc = extract(n_total);
    }

    // the canvas went through the cache only to be attended to: take it out again. Sliding-window
    // cells it displaced held positions <= pos0 - W, which no later query can see.
    for (int32_t s = 0; s < n_seqs; ++s) {
        llama_memory_seq_rm(mem, s, req.pos0[s], -1);
    }
    return rc;
}

void dg_set_self_cond(dg_request & req, const llama_context * ctx, const dg_self_cond * sc) {
    if (!sc) {
        return;
    }
    if (sc->topk_ids) {
        req.sc_form   = dg_sc_form::topk;
        req.sc_ids    = sc->topk_ids;
        req.sc_values = sc->topk_probs;
        req.sc_width  = sc->k;
    } else if (sc->probs) {
        req.sc_form   = dg_sc_form::dense;
        req.sc_values = sc->probs;
        req.sc_width  = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    } else if (sc->soft) {
        req.sc_form   = dg_sc_form::soft;
        req.sc_values = sc->soft;
        req.sc_width  = llama_model_n_embd(llama_get_model(ctx));
    }
}

}  // namespace

int32_t dg_decode_canvases(llama_context * ctx, const llama_token * canvases, int32_t n_seqs, int32_t n_canvas,
                           const dg_self_cond * sc, bool exact, float * logits_out) {
    const int32_t bad = dg_check_decoder_args(ctx, canvases, n_seqs, n_canvas, sc);
    if (bad != 0 || !logits_out) {
        return bad != 0 ? bad : -1;
    }
    dg_request req;
    req.exact = exact;
    dg_set_self_cond(req, ctx, sc);

    return dg_run_decoder(ctx, req, canvases, n_seqs, n_canvas, [&](int32_t n_total) -> int32_t {
        for (int32_t i = 0; i < n_total; ++i) {
            const float * logits = llama_get_logits_ith(ctx, i);
            if (!logits) {
                return -1;
            }
            std::memcpy(logits_out + (size_t) i * req.n_vocab, logits, (size_t) req.n_vocab * sizeof(float));
        }
        return 0;
    });
}

int32_t dg_denoise_step(llama_context * ctx, const llama_token * canvases, int32_t n_seqs, int32_t n_canvas,
                        const dg_self_cond * sc, const float * temperatures, const double * uniforms, int32_t top_k,
                        uint32_t flags, struct dg_step_outputs * out) {
    const int32_t bad = dg_check_decoder_args(ctx, canvases, n_seqs, n_canvas, sc);
    if (bad != 0) {
        return bad;
    }
    const int32_t n_total = n_seqs * n_canvas;
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    if (!temperatures || !uniforms || !out || !out->entropy || !out->argmax || !out->sampled ||
        top_k < 0 || top_k > n_vocab || n_vocab > DG_STEP_MAX_VOCAB ||
        (top_k > 0 && (!out->topk_ids || !out->topk_probs || !out->dropped)) || (out->values && out->soft) ||
        (flags & ~(DG_STEP_EXACT | DG_STEP_PORTABLE_OPS)) != 0) {
        return -1;
    }
    for (int32_t s = 0; s < n_seqs; ++s) {
        if (!(temperatures[s] > 0.0f) || !std::isfinite(temperatures[s])) {
            return -1;
        }
    }
    for (int32_t r = 0; r < n_total; ++r) {
        if (!(uniforms[r] >= 0.0 && uniforms[r] < 1.0)) {
            return -1;
        }
    }

    dg_request req;
    req.exact = (flags & DG_STEP_EXACT) != 0;
    dg_set_self_cond(req, ctx, sc);
    req.step.active       = true;
    req.step.top_k        = top_k;
    req.step.soft         = out->soft != nullptr;
    req.step.keep_values  = out->values != nullptr;
    req.step.portable     = (flags & DG_STEP_PORTABLE_OPS) != 0;
    req.step.temperatures = temperatures;
    req.step.uniforms     = uniforms;

    return dg_run_decoder(ctx, req, canvases, n_seqs, n_canvas, [&](int32_t n_rows) -> int32_t {
        const dg_step_request & step = req.step;
        if (!step.record || (int32_t) step.rows.size() != n_rows || step.record->ne[1] != n_rows ||
            step.record->ne[0] != dg_step_record_width(top_k) || (out->values && !step.values) ||
            (out->soft && !step.soft_embd)) {
            return -1;
        }
        const int64_t n_embd = llama_model_n_embd(llama_get_model(ctx));
        llama_synchronize(ctx);
        const int64_t      width = step.record->ne[0];
        std::vector<float> records((size_t) width * n_rows);
        ggml_backend_tensor_get(step.record, records.data(), 0, records.size() * sizeof(float));

        int32_t status = 0;
        for (int32_t i = 0; i < n_rows; ++i) {
            const float * rec = records.data() + (size_t) i * width;
            const size_t  r   = (size_t) step.rows[i];
            if (!std::isfinite(rec[DG_STEP_ENTROPY])) {
                status = -3; // a non-finite logit
            }
            out->entropy[r] = rec[DG_STEP_ENTROPY];
            out->argmax[r]  = (int32_t) rec[DG_STEP_ARGMAX];
            out->sampled[r] = (int32_t) rec[DG_STEP_SAMPLED];
            if (top_k > 0) {
                out->dropped[r] = rec[DG_STEP_DROPPED];
                for (int32_t j = 0; j < top_k; ++j) {
                    out->topk_ids[r * top_k + j]   = (int32_t) rec[DG_STEP_TOPK + j];
                    out->topk_probs[r * top_k + j] = rec[DG_STEP_TOPK + top_k + j];
                }
            }
            if (out->values) {
                ggml_backend_tensor_get(step.values, out->values + r * n_vocab, (size_t) i * step.values->nb[1],
                                        (size_t) n_vocab * sizeof(float));
            }
            if (out->soft) {
                ggml_backend_tensor_get(step.soft_embd, out->soft + r * n_embd, (size_t) i * step.soft_embd->nb[1],
                                        (size_t) n_embd * sizeof(float));
            }
        }
        return status;
    });
}
