// dg: the sampler's pass of the denoising step over the LM head's logits in two kernels, for the
// custom op libllama puts after the LM head (models/diffusion-gemma.cpp: dg_step_op). The ggml ops
// that form the same record elsewhere (build_step_ops) read the [n_vocab, n_rows] logits about 13
// times; here pass 1 reads them once and pass 2 one chunk per row. The algorithm and its host twin:
// dg-step-algo.cuh.

#include "common.cuh"
#include "dg-cuda.cuh"
#include "dg-step-kernels.cuh"
#include "ggml-cuda-dg.h"

#include <mutex>

// -- the custom op ------------------------------------------------------------------------------

// The functions libllama registered: its step op, and the in-place view after it (the probabilities
// the dense self-conditioning product reads, ordered after the step).
struct dg_step_funs {
    ggml_custom_op_t step;
    ggml_custom_op_t after;
};

static std::mutex   dg_step_mutex;
static dg_step_funs dg_step_registry[8];
static int          dg_step_n_registered = 0;

// 1: a registered step, 2: a registered view after it, 0: neither
static int dg_step_kind(ggml_custom_op_t fun) {
    std::lock_guard<std::mutex> lock(dg_step_mutex);
    for (int i = 0; i < dg_step_n_registered; ++i) {
        if (dg_step_registry[i].step == fun) {
            return 1;
        }
        if (dg_step_registry[i].after == fun) {
            return 2;
        }
    }
    return 0;
}

bool dg_cuda_step_register(ggml_custom_op_t step, ggml_custom_op_t after, int64_t n_vocab, int32_t top_k) {
    if (step == nullptr || after == nullptr || step == after) {
        return false;
    }
    {
        std::lock_guard<std::mutex> lock(dg_step_mutex);
        bool known = false;
        for (int i = 0; i < dg_step_n_registered; ++i) {
            known = known || (dg_step_registry[i].step == step && dg_step_registry[i].after == after);
        }
        if (!known) {
            if (dg_step_n_registered == (int) (sizeof(dg_step_registry) / sizeof(dg_step_registry[0]))) {
                return false;
            }
            dg_step_registry[dg_step_n_registered++] = { step, after };
        }
    }
    return dg_step_make_plan(n_vocab, top_k).ok;
}

struct dg_step_op_view {
    const ggml_tensor *         logits;
    const ggml_tensor *         temps;
    const ggml_tensor *         unif;
    const ggml_dg_step_params * params;
};

static bool dg_step_view(const ggml_tensor * op, dg_step_op_view & v) {
    const ggml_custom_op_params * cp = (const ggml_custom_op_params *) op->op_params;
    if (op->op != GGML_OP_CUSTOM || dg_step_kind(cp->fun) != 1 || cp->userdata == nullptr) {
        return false;
    }
    v.logits = op->src[0];
    v.temps  = op->src[1];
    v.unif   = op->src[2];
    v.params = (const ggml_dg_step_params *) cp->userdata;
    if (!v.logits || !v.temps || !v.unif || op->src[3]) {
        return false;
    }
    const int64_t n_rows = v.logits->ne[1];
    const int32_t k      = v.params->top_k;
    return v.logits->type == GGML_TYPE_F32 && v.logits->nb[0] == sizeof(float) && v.logits->ne[2] == 1 &&
           v.logits->ne[3] == 1 && v.temps->type == GGML_TYPE_F32 && ggml_is_contiguous(v.temps) &&
           ggml_nelements(v.temps) == n_rows && v.unif->type == GGML_TYPE_F64 && ggml_is_contiguous(v.unif) &&
           ggml_nelements(v.unif) == n_rows && op->type == GGML_TYPE_F32 && op->nb[0] == sizeof(float) &&
           op->ne[0] == DG_REC_TOPK + 2 * (int64_t) k && op->ne[1] == n_rows && n_rows <= 65535 &&
           !(v.params->keep_values && v.params->probs_scale != 0.0f) && dg_step_make_plan(v.logits->ne[0], k).ok;
}

// The view after the step: the step's logits, in place, with the step's record as a source.
static bool dg_after_view(const ggml_tensor * op) {
    if (op->op != GGML_OP_CUSTOM || op->view_src == nullptr || op->src[0] == nullptr || op->src[1] == nullptr) {
        return false;
    }
    const ggml_custom_op_params * cp = (const ggml_custom_op_params *) op->op_params;
    dg_step_op_view               step;
    return dg_step_kind(cp->fun) == 2 && dg_step_view(op->src[1], step);
}

bool dg_cuda_step_supports_op(const ggml_tensor * op) {
    dg_step_op_view v;
    return dg_step_view(op, v) || dg_after_view(op);
}

void dg_cuda_step_compute(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (dg_after_view(dst)) {
        return;  // the step left the probabilities in place; this view only orders what reads them
    }
    dg_step_op_view v;
    GGML_ASSERT(dg_step_view(dst, v));
    const int          n_vocab = (int) v.logits->ne[0];
    const int          n_rows  = (int) v.logits->ne[1];
    const int          top_k   = v.params->top_k;
    const dg_step_plan plan    = dg_step_make_plan(n_vocab, top_k);

    const dg_step_scratch_size size = dg_step_scratch(plan, n_rows);
    ggml_cuda_pool_alloc<dg_chunk_stats> stats(ctx.pool(), size.stats);
    ggml_cuda_pool_alloc<float>          cand_v(ctx.pool(), size.cand);
    ggml_cuda_pool_alloc<int32_t>        cand_i(ctx.pool(), size.cand);

    float * logits = (float *) v.logits->data;
    CUDA_CHECK(dg_step_launch(logits, v.params->keep_values != 0, v.params->probs_scale, v.logits->nb[1] / sizeof(float),
                              n_vocab, n_rows, (const float *) v.temps->data, (const double *) v.unif->data,
                              v.params->softcap, top_k, (float *) dst->data, dst->nb[1] / sizeof(float), stats.get(),
                              cand_v.get(), cand_i.get(), ctx.stream()));
}
