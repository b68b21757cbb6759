// The transposed token embeddings of the dense self-conditioning product: see diffusion-gemma-embd-t.h.

#include "diffusion-gemma-embd-t.h"

#include "ggml-alloc.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int64_t CHUNK = 256; // tokens per pass: whole Q8_0 blocks, a few MiB of floats at real widths

// A power of two that takes the largest |E| into [2^14, 2^15)
float q8_0_scale(float amax) {
    if (!(amax > 0.0f) || !std::isfinite(amax)) {
        return 1.0f;
    }
    return std::ldexp(1.0f, 14 - std::ilogb(amax));
}

// Tokens [v0, v0 + n) of `embd` as floats, [n][n_embd]
void read_rows(const ggml_tensor * embd, int64_t v0, int64_t n, std::vector<uint8_t> & raw, std::vector<float> & out) {
    const int64_t n_embd    = embd->ne[0];
    const size_t  row_bytes = ggml_row_size(embd->type, n_embd);
    raw.resize((size_t) n * row_bytes);
    ggml_backend_tensor_get(embd, raw.data(), (size_t) v0 * embd->nb[1], raw.size());
    out.resize((size_t) (n * n_embd));
    if (embd->type == GGML_TYPE_F32) {
        std::memcpy(out.data(), raw.data(), raw.size());
        return;
    }
    const auto to_float = ggml_get_type_traits(embd->type)->to_float;
    for (int64_t i = 0; i < n; ++i) {
        to_float(raw.data() + i * row_bytes, out.data() + i * n_embd, n_embd);
    }
}

// What one worker reuses from chunk to chunk
struct chunk_scratch {
    std::vector<uint8_t> raw;    // the chunk's rows as stored
    std::vector<float>   rows;   // ... as floats, [n][n_embd]
    std::vector<float>   col;    // ... transposed and scaled, [n_embd][n]
    std::vector<uint8_t> quants; // ... quantized, n_embd rows of n / 32 Q8_0 blocks
};

// fn(v0, n, scratch, worker) for every chunk of CHUNK tokens [v0, v0 + n), shared out among the
// machine's cores (worker: 0 .. workers - 1). At real widths the copy is 738 M values to dequantize,
// transpose and quantize: ~6 s of one core.
template <typename Fn>
void for_each_chunk(int64_t n_vocab, int workers, Fn fn) {
    const int64_t        n_chunks = (n_vocab + CHUNK - 1) / CHUNK;
    std::atomic<int64_t> next{0};
    auto work = [&](int worker) {
        chunk_scratch scratch;
        for (int64_t c = next.fetch_add(1); c < n_chunks; c = next.fetch_add(1)) {
            fn(c * CHUNK, std::min(CHUNK, n_vocab - c * CHUNK), scratch, worker);
        }
    };
    std::vector<std::thread> pool;
    for (int w = 1; w < workers; ++w) {
        pool.emplace_back(work, w);
    }
    work(0);
    for (auto & t : pool) {
        t.join();
    }
}

int worker_count(int64_t n_vocab) {
    const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
    return (int) std::min<int64_t>(cores, (n_vocab + CHUNK - 1) / CHUNK);
}

}  // namespace

int64_t dg_embd_t_plan::bytes(int64_t n_vocab, int64_t n_embd) const {
    if (kernel != dg_lm_head_kernel::none) { // the repack: per 16 (VNNI) or 8 (AVX2) rows x 32 values
        const int64_t group = kernel == dg_lm_head_kernel::avx2 ? 8 : 16;
        return (n_embd + group - 1) / group * (n_vocab / 32) * dg_lm_head_group_block_bytes(group);
    }
    return (int64_t) ggml_row_size(type, n_vocab) * n_embd;
}

std::unique_ptr<dg_embd_transposed> dg_embd_transposed::make(const ggml_tensor * embd, const dg_embd_t_plan & plan) {
    const int64_t n_embd  = embd->ne[0];
    const int64_t n_vocab = embd->ne[1];
    const bool    q8      = plan.type == GGML_TYPE_Q8_0;
    if ((plan.type != GGML_TYPE_F32 && !q8) || (q8 && n_vocab % 32 != 0) || (!q8 && plan.kernel != dg_lm_head_kernel::none) ||
        (embd->type != GGML_TYPE_F32 && ggml_get_type_traits(embd->type)->to_float == nullptr) || ggml_n_dims(embd) != 2) {
        return nullptr;
    }
    std::unique_ptr<dg_embd_transposed> t(new dg_embd_transposed());
    const int workers = worker_count(n_vocab);

    if (q8) {
        std::vector<float> amax((size_t) workers, 0.0f);
        for_each_chunk(n_vocab, workers, [&](int64_t v0, int64_t n, chunk_scratch & s, int worker) {
            read_rows(embd, v0, n, s.raw, s.rows);
            for (float x : s.rows) {
                amax[worker] = std::max(amax[worker], std::fabs(x));
            }
        });
        t->scale_ = q8_0_scale(*std::max_element(amax.begin(), amax.end()));
    }

    uint8_t * host = nullptr; // where the rows of a host tensor live
    std::vector<uint8_t> staging; // the whole copy, for a device buffer: one upload at the end
    if (plan.kernel != dg_lm_head_kernel::none) {
        t->packed_ = dg_lm_head::zeros(n_vocab, n_embd, plan.kernel); // K = the vocabulary, N = n_embd
        if (!t->packed_) {
            return nullptr;
        }
    } else {
        ggml_init_params params = { ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
        t->ctx_    = ggml_init(params);
        t->tensor_ = ggml_new_tensor_2d(t->ctx_, plan.type, n_vocab, n_embd);
        ggml_set_name(t->tensor_, "token_embd_t");
        ggml_backend_buffer_type_t buft = plan.buft ? plan.buft : ggml_backend_cpu_buffer_type();
        t->buf_ = ggml_backend_alloc_ctx_tensors_from_buft(t->ctx_, buft);
        if (!t->buf_) {
            return nullptr;
        }
        // weights: the scheduler may run the product where the rest of the graph runs, copying them over
        ggml_backend_buffer_set_usage(t->buf_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        if (ggml_backend_buffer_is_host(t->buf_)) {
            host = (uint8_t *) t->tensor_->data;
        } else {
            staging.resize(ggml_nbytes(t->tensor_));
            host = staging.data();
        }
    }

    // per chunk of tokens: dequantize, transpose (row h = dimension h of each token), then store the
    // chunk's part of every row: as floats, or quantized as Q8_0 (in the tensor, or into the repack).
    // Chunks write disjoint parts of the copy.
    const float scale = t->scale_;
    for_each_chunk(n_vocab, workers, [&](int64_t v0, int64_t n, chunk_scratch & s, int) {
        read_rows(embd, v0, n, s.raw, s.rows);
        s.col.resize((size_t) (n * n_embd));
        for (int64_t h0 = 0; h0 < n_embd; h0 += 16) { // 16 dimensions at a time: one cache line of a row
            const int64_t h1 = std::min(h0 + 16, n_embd);
            for (int64_t i = 0; i < n; ++i) {
                for (int64_t h = h0; h < h1; ++h) {
                    s.col[(size_t) (h * n + i)] = s.rows[(size_t) (i * n_embd + h)] * scale;
                }
            }
        }
        if (!q8) {
            for (int64_t h = 0; h < n_embd; ++h) {
                std::memcpy(host + h * t->tensor_->nb[1] + v0 * sizeof(float), s.col.data() + h * n,
                            (size_t) n * sizeof(float));
            }
            return;
        }
        const size_t row_bytes = ggml_row_size(GGML_TYPE_Q8_0, n);
        s.quants.resize(row_bytes * (size_t) n_embd);
        ggml_quantize_chunk(GGML_TYPE_Q8_0, s.col.data(), s.quants.data(), 0, n_embd, n, nullptr);
        if (t->packed_) {
            t->packed_->pack_blocks(s.quants.data(), row_bytes, v0 / 32, n / 32);
            return;
        }
        const size_t offset = ggml_row_size(GGML_TYPE_Q8_0, v0);
        for (int64_t h = 0; h < n_embd; ++h) {
            std::memcpy(host + h * t->tensor_->nb[1] + offset, s.quants.data() + h * row_bytes, row_bytes);
        }
    });
    if (!staging.empty()) {
        ggml_backend_tensor_set(t->tensor_, staging.data(), 0, staging.size());
    }
    return t;
}

dg_embd_transposed::~dg_embd_transposed() {
    if (buf_) {
        ggml_backend_buffer_free(buf_);
    }
    if (ctx_) {
        ggml_free(ctx_);
    }
}

int64_t dg_embd_transposed::bytes() const {
    return packed_ ? packed_->bytes() : (int64_t) ggml_nbytes(tensor_);
}

const char * dg_embd_transposed::path() const {
    return packed_ ? dg_lm_head::kernel_name(packed_->kernel()) : "ggml";
}
