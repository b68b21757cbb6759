// The MoE experts repacked once, while the model loads, through ggml-cpu's extra buffer type route
// (what its own CPU_REPACK does): a buffer type per kernel family (CPU_DG_EXPERTS_AVX2,
// CPU_DG_EXPERTS_VNNI; the CPU prefix reads as system memory in dg's load report) whose set_tensor
// writes an expert tensor's file rows in dg_experts' repacked layout (diffusion-gemma-lm-head.h),
// registered among ggml-cpu's extra buffer types, so that the CPU backend hands every MUL_MAT_ID on
// such a tensor to this file's tensor traits: the activations quantized as ggml quantizes them, then
// dg_experts' GEMM. The loader reads each tensor from the mapped file straight into the buffer; the
// file's copy of those pages is not kept (llama-model-loader.cpp, our diff).
//
// dg places the tensors there with a tensor buffer-type override (dgcli.engine.offload), not through
// llama.cpp's automatic choice: supports_op answers only for tensors already in such a buffer, so the
// loader's probe never picks it on its own.

#include "diffusion-gemma-lm-head.h"
#include "diffusion-gemma.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "traits.h" // ggml-cpu's extra buffer type interface (ggml/src/ggml-cpu)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#if defined(__linux__)
#    include <sys/mman.h>
#endif

namespace {

class expert_traits : public ggml::cpu::tensor_traits {
public:
    explicit expert_traits(dg_lm_head_kernel kernel) : kernel_(kernel) {}

    std::unique_ptr<dg_experts> experts(const ggml_tensor * w) const {
        return dg_experts::over_repacked(w->data, w->type, w->ne[0], w->ne[1], w->ne[2], kernel_);
    }

    bool work_size(int /* n_threads */, const ggml_tensor * op, size_t & size) override {
        if (op->op != GGML_OP_MUL_MAT_ID) {
            return false;
        }
        const auto gemm = experts(op->src[0]);
        GGML_ASSERT(gemm);
        size = (size_t) (gemm->act_bytes() * op->src[1]->ne[1] * op->src[1]->ne[2]) + 64;
        return true;
    }

    // MUL_MAT_ID: src0 the experts [n_in, n_out, n_expert], src1 F32 [n_in, 1 or n_used, n_tokens], src2 the
    // selected experts I32 [n_used, n_tokens] -> F32 [n_out, n_used, n_tokens]
    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        if (op->op != GGML_OP_MUL_MAT_ID) {
            return false;
        }
        const ggml_tensor * x   = op->src[1];
        const ggml_tensor * ids = op->src[2];
        GGML_ASSERT(x->type == GGML_TYPE_F32 && x->nb[0] == sizeof(float) && x->ne[3] == 1);
        GGML_ASSERT(ids->type == GGML_TYPE_I32 && ids->nb[0] == sizeof(int32_t) && ids->ne[1] == x->ne[2]);
        GGML_ASSERT(op->nb[0] == sizeof(float) && op->ne[1] == ids->ne[0] && op->ne[2] == ids->ne[1]);
        const auto gemm = experts(op->src[0]);
        GGML_ASSERT(gemm);

        const int     ith = params->ith, nth = params->nth;
        const int64_t n_slots = x->ne[1], n_rows = x->ne[1] * x->ne[2];
        const int64_t ab  = gemm->act_bytes();
        uint8_t *     act = (uint8_t *) params->wdata;
        // every row of x quantized once, the rows split over the threads
        for (int64_t r = n_rows * ith / nth; r < n_rows * (ith + 1) / nth; ++r) {
            const float * row = (const float *) ((const char *) x->data + (r % n_slots) * x->nb[1] + (r / n_slots) * x->nb[2]);
            gemm->quantize(row, 0, 0, 1, act + r * ab);
        }
        ggml_barrier(params->threadpool);
        gemm->gemm(act, n_slots, (const int32_t *) ids->data, ids->nb[1] / sizeof(int32_t), ids->ne[0], ids->ne[1],
                   (char *) op->data, op->nb[1], op->nb[2], ith, nth);
        return true;
    }

private:
    dg_lm_head_kernel kernel_;
};

// One per kernel family: the buffer type ggml sees, its extra-buffer interface and its tensors' traits.
struct expert_buffer_type;

class expert_extra : public ggml::cpu::extra_buffer_type {
public:
    explicit expert_extra(expert_buffer_type * owner) : owner_(owner) {}
    bool                       supports_op(ggml_backend_dev_t, const ggml_tensor * op) override;
    ggml::cpu::tensor_traits * get_tensor_traits(const ggml_tensor * op) override;
    expert_buffer_type *       owner() const { return owner_; }

private:
    expert_buffer_type * owner_;
};

struct expert_buffer_type {
    dg_lm_head_kernel          kernel;
    const char *               name;
    expert_traits              traits;
    expert_extra               extra;
    ggml_backend_buffer_type   buft;

    expert_buffer_type(dg_lm_head_kernel k, const char * n);

    // whether a tensor of this shape and type gets the repacked layout (else it is stored as it comes)
    bool takes(const ggml_tensor * t) const {
        return t->view_src == nullptr && ggml_n_dims(t) <= 3 && t->ne[3] == 1 &&
               dg_experts::repack_takes(t->type, t->ne[0], kernel);
    }
};

// the context is the extra-buffer interface, as ggml-cpu reads it
expert_buffer_type * owner_of(ggml_backend_buffer_type_t buft) {
    return static_cast<expert_extra *>((ggml::cpu::extra_buffer_type *) buft->context)->owner();
}

bool in_buffer_of(const ggml_tensor * t, const expert_buffer_type * owner) {
    return t && t->buffer && ggml_backend_buffer_get_type(t->buffer) == &owner->buft;
}

bool expert_extra::supports_op(ggml_backend_dev_t, const ggml_tensor * op) {
    // only tensors already repacked here: the loader's probe (a bare tensor in an empty buffer) is refused
    return op->op == GGML_OP_MUL_MAT_ID && in_buffer_of(op->src[0], owner_) && op->src[0]->extra == &owner_->traits &&
           op->src[1]->type == GGML_TYPE_F32 && op->src[2]->type == GGML_TYPE_I32 &&
           (op->src[1]->buffer == nullptr || ggml_backend_buft_is_host(ggml_backend_buffer_get_type(op->src[1]->buffer)));
}

ggml::cpu::tensor_traits * expert_extra::get_tensor_traits(const ggml_tensor * op) {
    if (op->op == GGML_OP_MUL_MAT_ID && in_buffer_of(op->src[0], owner_)) {
        return (ggml::cpu::tensor_traits *) op->src[0]->extra;
    }
    return nullptr;
}

ggml_status buffer_init_tensor(ggml_backend_buffer_t buffer, ggml_tensor * tensor) {
    expert_buffer_type * owner = owner_of(ggml_backend_buffer_get_type(buffer));
    tensor->extra = owner->takes(tensor) ? (void *) &owner->traits : nullptr;
    return GGML_STATUS_SUCCESS;
}

// The file's rows of a tensor into the repacked layout, the experts split over the hardware threads
// (a Q8_0 file's experts are ~24 GB).
void buffer_set_tensor(ggml_backend_buffer_t buffer, ggml_tensor * tensor, const void * data, size_t offset,
                       size_t size) {
    expert_buffer_type * owner = owner_of(ggml_backend_buffer_get_type(buffer));
    if (tensor->extra == nullptr) { // not ours to repack: stored as it comes
        std::memcpy((char *) tensor->data + offset, data, size);
        return;
    }
    GGML_ASSERT(offset == 0 && size == ggml_nbytes(tensor));
    const int64_t n_expert = tensor->ne[2];
    const int64_t n_threads =
        std::max<int64_t>(1, std::min<int64_t>(n_expert, (int64_t) std::thread::hardware_concurrency()));
    auto part = [&](int64_t i) {
        dg_experts::repack(tensor->type, tensor->ne[0], tensor->ne[1], n_expert * i / n_threads,
                           n_expert * (i + 1) / n_threads, owner->kernel, data, tensor->data);
    };
    std::vector<std::thread> pool;
    for (int64_t i = 1; i < n_threads; ++i) {
        pool.emplace_back(part, i);
    }
    part(0);
    for (auto & t : pool) {
        t.join();
    }
}

// Each step streams every selected expert's weights once, so the buffer is read start to end; on 4 KiB
// pages that read takes a TLB miss per page (benchmarks/expert_tile_probe.cpp: the stream ran ~1.3x
// faster on 2 MiB pages).
// Transparent huge pages are asked for before the loader writes a byte (Linux's default "madvise"
// mode gives them only where asked); DG_HUGE_PAGES=0 leaves the buffer on the system's default.
void advise_huge_pages(void * base, size_t size) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const char * env = getenv("DG_HUGE_PAGES");
    if (env && strcmp(env, "0") == 0) {
        return;
    }
    constexpr uintptr_t huge = (uintptr_t) 2 << 20;
    const uintptr_t     from = ((uintptr_t) base + huge - 1) & ~(huge - 1);
    const uintptr_t     to   = ((uintptr_t) base + size) & ~(huge - 1);
    if (to > from) {
        madvise((void *) from, to - from, MADV_HUGEPAGE); // advice only: a refusal leaves 4 KiB pages
    }
#else
    (void) base;
    (void) size;
#endif
}

const char * buft_get_name(ggml_backend_buffer_type_t buft) {
    return owner_of(buft)->name;
}

ggml_backend_buffer_t buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    ggml_backend_buffer_t buffer = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), size);
    if (buffer == nullptr) {
        return nullptr;
    }
    buffer->buft              = buft;
    buffer->iface.init_tensor = buffer_init_tensor;
    buffer->iface.set_tensor  = buffer_set_tensor;
    buffer->iface.get_tensor  = nullptr; // the repacked layout is not the tensor's type
    buffer->iface.cpy_tensor  = nullptr;
    advise_huge_pages(ggml_backend_buffer_get_base(buffer), size);
    return buffer;
}

size_t buft_get_alignment(ggml_backend_buffer_type_t) {
    return 64;
}

size_t buft_get_alloc_size(ggml_backend_buffer_type_t buft, const ggml_tensor * tensor) {
    const expert_buffer_type * owner = owner_of(buft);
    if (!owner->takes(tensor)) {
        return ggml_nbytes(tensor);
    }
    return dg_experts::repacked_bytes(tensor->type, tensor->ne[0], tensor->ne[1], tensor->ne[2], owner->kernel);
}

expert_buffer_type::expert_buffer_type(dg_lm_head_kernel k, const char * n) :
    kernel(k), name(n), traits(k), extra(this) {
    buft.iface = {
        /* .get_name       = */ buft_get_name,
        /* .alloc_buffer   = */ buft_alloc_buffer,
        /* .get_alignment  = */ buft_get_alignment,
        /* .get_max_size   = */ nullptr,
        /* .get_alloc_size = */ buft_get_alloc_size,
        /* .is_host        = */ nullptr, // ggml must not read these tensors as their type
    };
    buft.device  = ggml_backend_reg_dev_get(ggml_backend_cpu_reg(), 0);
    buft.context = static_cast<ggml::cpu::extra_buffer_type *>(&extra);
}

expert_buffer_type * family(dg_lm_head_kernel kernel) {
    static expert_buffer_type avx2(dg_lm_head_kernel::avx2, "CPU_DG_EXPERTS_AVX2");
    static expert_buffer_type vnni(dg_lm_head_kernel::avx512_vnni, "CPU_DG_EXPERTS_VNNI");
    static std::once_flag     registered;
    std::call_once(registered, [] {
        // among ggml-cpu's extra buffer types: the CPU backend then accepts the buffers and routes
        // MUL_MAT_ID on their tensors to get_tensor_traits
        auto & extras = ggml_backend_cpu_get_extra_buffer_types();
        extras.push_back(&avx2.buft);
        extras.push_back(&vnni.buft);
    });
    switch (kernel) {
        case dg_lm_head_kernel::avx2:        return &avx2;
        case dg_lm_head_kernel::avx512_vnni: return &vnni;
        default:                             return nullptr;
    }
}

}  // namespace

ggml_backend_buffer_type_t dg_expert_buffer_type(int32_t kernel) {
    const auto k = (dg_lm_head_kernel) kernel;
    if (!dg_experts::repack_takes(GGML_TYPE_Q8_0, 32, k)) { // not a family this CPU runs
        return nullptr;
    }
    expert_buffer_type * owner = family(k);
    return owner ? &owner->buft : nullptr;
}

int32_t dg_expert_repack_kernel(void) {
    return (int32_t) dg_experts::repack_kernel_for_cpu();
}

bool dg_expert_repack_takes(int32_t kernel, int32_t weight_type, int64_t n_in) {
    return dg_experts::repack_takes((ggml_type) weight_type, n_in, (dg_lm_head_kernel) kernel);
}

int64_t dg_expert_repacked_bytes(int32_t kernel, int32_t weight_type, int64_t n_in, int64_t n_out, int64_t n_expert) {
    if (!dg_expert_repack_takes(kernel, weight_type, n_in) || n_out <= 0 || n_expert <= 0) {
        return -1;
    }
    return (int64_t) dg_experts::repacked_bytes((ggml_type) weight_type, n_in, n_out, n_expert,
                                                (dg_lm_head_kernel) kernel);
}

bool dg_expert_tensor_repacked(const ggml_tensor * t) {
    if (t == nullptr || t->buffer == nullptr || t->extra == nullptr) {
        return false;
    }
    for (dg_lm_head_kernel k : { dg_lm_head_kernel::avx2, dg_lm_head_kernel::avx512_vnni }) {
        const expert_buffer_type * owner = family(k);
        if (in_buffer_of(t, owner) && t->extra == &owner->traits) {
            return true;
        }
    }
    return false;
}

// MUL_MAT_ID through the repacked buffer against ggml's own MUL_MAT_ID on the file's layout, in one CPU
// graph of n_threads threads: the experts loaded into each (ggml_backend_tensor_set, as the loader does)
// from the same random blocks, random routing with uneven shares (each token's experts drawn from the
// first half), one input row per token (gate and up) or per (token, expert) (down). *max_rel_diff: the
// largest |ours - ggml's| over the largest |ggml's|; infinite if either is not finite.
int32_t dg_expert_buffer_selftest(int32_t kernel, int32_t weight_type, int64_t n_in, int64_t n_out, int64_t n_expert,
                                  int64_t n_used, int64_t n_tokens, bool input_per_slot, int32_t n_threads,
                                  uint32_t seed, double * max_rel_diff) {
    const auto type = (ggml_type) weight_type;
    if (!max_rel_diff || n_out <= 0 || n_expert <= 0 || n_used <= 0 || n_used > n_expert || n_tokens <= 0 ||
        n_threads <= 0 || (kernel != 1 && kernel != 2) || n_in <= 0 || n_in % ggml_blck_size(type) != 0) {
        return -1;
    }
    ggml_backend_buffer_type_t ours = dg_expert_buffer_type(kernel);
    if (ours == nullptr) {
        return 1; // this CPU lacks the kernel
    }
    if (!dg_experts::repack_takes(type, n_in, (dg_lm_head_kernel) kernel)) {
        return -1;
    }

    std::mt19937                          rng(seed);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    // real weights: random floats quantized by ggml, so every field of the blocks is one ggml writes
    std::vector<float> values((size_t) (n_in * n_out * n_expert));
    for (auto & v : values) {
        v = unit(rng) * (0.5f + 0.5f * std::fabs(unit(rng)));
    }
    std::vector<uint8_t> w(ggml_row_size(type, n_in) * (size_t) (n_out * n_expert));
    ggml_quantize_chunk(type, values.data(), w.data(), 0, n_out * n_expert, n_in, nullptr);

    std::vector<int32_t> ids((size_t) (n_used * n_tokens));
    std::vector<int32_t> pool((size_t) n_expert);
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t e = 0; e < n_expert; ++e) {
            pool[(size_t) e] = (int32_t) e;
        }
        std::shuffle(pool.begin(), pool.begin() + std::max(n_used, n_expert / 2), rng);
        std::copy(pool.begin(), pool.begin() + n_used, ids.begin() + t * n_used);
    }
    const int64_t      n_slots = input_per_slot ? n_used : 1;
    std::vector<float> x((size_t) (n_in * n_slots * n_tokens));
    for (auto & v : x) {
        v = unit(rng) * 3.0f;
    }

    const ggml_init_params params = { 16 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context *         ctx_ours = ggml_init(params);
    ggml_context *         ctx      = ggml_init(params);
    ggml_tensor *          w_ours   = ggml_new_tensor_3d(ctx_ours, type, n_in, n_out, n_expert);
    ggml_tensor *          w_ggml   = ggml_new_tensor_3d(ctx, type, n_in, n_out, n_expert);
    ggml_tensor *          xt       = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_in, n_slots, n_tokens);
    ggml_tensor *          idt      = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_used, n_tokens);
    ggml_tensor *          y_ours   = ggml_mul_mat_id(ctx, w_ours, xt, idt);
    ggml_tensor *          y_ggml   = ggml_mul_mat_id(ctx, w_ggml, xt, idt);
    ggml_cgraph *          gf       = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y_ours);
    ggml_build_forward_expand(gf, y_ggml);

    ggml_backend_buffer_t buf_ours = ggml_backend_alloc_ctx_tensors_from_buft(ctx_ours, ours);
    ggml_backend_buffer_t buf      = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_cpu_buffer_type());
    ggml_backend_t        backend  = ggml_backend_cpu_init();
    int32_t               rc       = -1;
    if (buf_ours && buf && backend && dg_expert_tensor_repacked(w_ours)) {
        ggml_backend_tensor_set(w_ours, w.data(), 0, w.size());
        ggml_backend_tensor_set(w_ggml, w.data(), 0, w.size());
        ggml_backend_tensor_set(xt, x.data(), 0, x.size() * sizeof(float));
        ggml_backend_tensor_set(idt, ids.data(), 0, ids.size() * sizeof(int32_t));
        ggml_backend_cpu_set_n_threads(backend, n_threads);
        if (ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS) {
            std::vector<float> a((size_t) ggml_nelements(y_ours)), b(a.size());
            ggml_backend_tensor_get(y_ours, a.data(), 0, a.size() * sizeof(float));
            ggml_backend_tensor_get(y_ggml, b.data(), 0, b.size() * sizeof(float));
            double diff = 0.0, scale = 0.0;
            bool   finite = true;
            for (size_t i = 0; i < a.size(); ++i) {
                finite = finite && std::isfinite(a[i]) && std::isfinite(b[i]);
                diff  = std::max(diff, (double) std::fabs(a[i] - b[i]));
                scale = std::max(scale, (double) std::fabs(b[i]));
            }
            *max_rel_diff = finite && scale > 0.0 ? diff / scale : INFINITY;
            rc            = 0;
        }
    }
    ggml_backend_free(backend);
    ggml_backend_buffer_free(buf);
    ggml_backend_buffer_free(buf_ours);
    ggml_free(ctx);
    ggml_free(ctx_ours);
    return rc;
}
