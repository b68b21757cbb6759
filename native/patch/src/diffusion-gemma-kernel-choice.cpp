// Which GEMM runs each of the decoder's weights on the CPU: our int8 GEMM on repacked weights
// (dg_lm_head), our K-quant tiles packed on the fly (dg_experts), or ggml's own matmul. Each choice
// is made once, on the first graph that needs it, and never where a GPU is in use (uses_gpu). The
// graph asks through build_mm, build_lm_head and build_mm_id (diffusion-gemma-matmul.cpp).

#include "models/models.h"
#include "llama-impl.h"
#include "diffusion-gemma-embd-t.h"
#include "diffusion-gemma-lm-head.h"

#include "ggml-backend.h"

#include <cstring>
#include <memory>
#include <vector>

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
// over, and ggml's repacked Q4_K / Q6_K GEMMs run at ~70% of the int8 rate here. The AVX2 family's
// tiles take them; the VNNI family's take them on AMX's tiles where the CPU has them (ggml's Q4_K and
// Q6_K matmuls run at ~25% of the VNNI rate there), else each group repacked on the fly for the span
// tiles of the repacked experts. Not where a GPU is in use, and only outside ggml's CPU repack buffers,
// which the loader keeps these tensors out of (dgcli.runtime.offload.tiled_weight_pattern) and which are
// off on AMX CPUs. DG_DENSE_GEMM=ggml keeps ggml's matmul.
const dg_experts * llama_model_diffusion_gemma::dense_tiled(const ggml_tensor * w) const {
    std::call_once(dense_tiled_once, [this] {
        const dg_lm_head_kernel kernel = dg_lm_head::kernel_for_cpu("DG_DENSE_GEMM");
        if ((kernel != dg_lm_head_kernel::avx2 && kernel != dg_lm_head_kernel::avx512_vnni) || uses_gpu()) {
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
            LLAMA_LOG_INFO("%s: %zu dense K-quant weights on the %s kernel%s\n", __func__, dense_tiled_gemm.size(),
                           dg_lm_head::kernel_name(kernel),
                           dense_tiled_gemm.begin()->second->amx_k_quant() ? " (AMX tiles)" : "");
        }
    });
    const auto it = dense_tiled_gemm.find(w);
    return it == dense_tiled_gemm.end() ? nullptr : it->second.get();
}
