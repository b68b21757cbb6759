// The denoising step at the end of the decoder graph (dg_denoise_step): what follows the LM head when
// the caller asks for the sampler's results instead of the logits. Where the logits are on the CPU the
// step is one op of ours (dg_step_op); on a GPU whose backend has its kernels the same op when
// DG_CUDA_FUSED_STEP asks for it; on any other backend the same record from ggml ops.

#include "models/models.h"
#include "diffusion-gemma-api.h"
#include "diffusion-gemma-embd-t.h"
#include "diffusion-gemma-graph-inputs.h"
#include "diffusion-gemma-step-op.h"
#include "diffusion-gemma-step.h"

#include "ggml-backend.h"
#include "ggml-cuda-dg.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

bool dg_cuda_fused_step_wanted() {
    const char * v = getenv("DG_CUDA_FUSED_STEP");
    return v != nullptr && *v != '\0' && strcmp(v, "0") != 0;
}

// The denoising step over the LM head's output, one row per canvas position (rows split over
// the op's threads): softcap, / temperature, max, exp, entropy, argmax, top-k, inverse-CDF sample
// (dg_step_row, shared with the host sampler). The step adds no logits-sized buffer: values and then
// weights go to a per-thread row kept across steps (so the logits are read from memory once and not
// written back, half the traffic of transforming them in place), or, where the caller wants the
// values, the values over the raw logits and the weights to that row. With probs_scale the weights,
// normalised, are then written over the row: it holds the next step's probabilities.
void dg_step_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto & p       = *(const ggml_dg_step_params *) userdata;
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
        in.exact_tanh  = p.exact_tanh != 0;
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
void dg_after_step_op(ggml_tensor *, int, int, void *) {}

// Whether the backend of `dev` runs dg_step_op (and the view after it) itself: ggml-cuda with dg's
// kernels is told which functions they are, and answers for these sizes.
static bool dg_gpu_takes_step_op(ggml_backend_dev_t dev, int64_t n_vocab, int32_t top_k) {
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto take = reg ? (ggml_cuda_dg_step_register_t) ggml_backend_reg_get_proc_address(reg, GGML_CUDA_DG_STEP_REGISTER)
                    : nullptr;
    return take != nullptr && take(dg_step_op, dg_after_step_op, n_vocab, top_k);
}

// logits (LM head output, before the softcap) -> the step's record, and with step.soft the next
// step's soft embedding (the dense self-conditioning input: this step's probabilities times E, in
// the same graph). Where the logits are on the CPU the record is one op of ours (dg_step_op); on a
// GPU whose backend has its kernels, the same op when DG_CUDA_FUSED_STEP asks for it; on any other
// backend (or when asked, to test that path) ggml ops that every backend has, so the logits never
// leave the device.
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
    const bool fused  = !on_cpu && !step.portable && dg_cuda_fused_step_wanted() &&
                        dg_gpu_takes_step_op(dev_out, logits->ne[0], k);

    ggml_tensor * record;
    ggml_tensor * values = nullptr;
    ggml_tensor * probs  = nullptr; // softmax(values) * DG_SC_PROBS_SCALE, [n_vocab, n_rows], with step.soft
    if ((on_cpu && !step.portable) || fused) {
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
