// The Q8_0 LM head on a repack of our own: see diffusion-gemma-lm-head.h.

#include "diffusion-gemma-lm-head.h"
#include "diffusion-gemma.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#    include <immintrin.h>
#    define DG_LMH_X86 1
#endif

#if defined(__GNUC__) && !defined(__clang__)
// 32- and 64-byte vectors only cross function boundaries inside this translation unit
#    pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace {

constexpr int64_t QK      = 32; // quants per Q8_0 block
constexpr int64_t PANEL   = 64; // activation columns kept hot in L2 while the row groups stream past

struct q8_0_block {
    uint16_t d;
    int8_t   qs[QK];
};
static_assert(sizeof(q8_0_block) == 34, "Q8_0 block layout");

// Q5_0 (what llama.cpp's K-quants fall back to for rows that are not whole 256-wide super-blocks,
// e.g. the dense FFN's and the experts' down projections of Q4_K_M files): value = d * (q - 16) with
// q in 0..31, so (q - 16) is an int8 quant under the same fp16 scale: a lossless Q8_0 block.
struct q5_0_block {
    uint16_t d;
    uint8_t  qh[4]; // bit j: the fifth bit of quant j
    uint8_t  qs[QK / 2]; // quant j in the low nibble of byte j, quant j + 16 in the high one
};
static_assert(sizeof(q5_0_block) == 22, "Q5_0 block layout");

q8_0_block q8_0_of(const q5_0_block & blk) {
    uint32_t high;
    std::memcpy(&high, blk.qh, sizeof(high));
    q8_0_block out;
    out.d = blk.d;
    for (int64_t j = 0; j < QK / 2; ++j) {
        out.qs[j]          = (int8_t) (((blk.qs[j] & 0x0F) | (((high >> j) & 1) << 4)) - 16);
        out.qs[j + QK / 2] = (int8_t) (((blk.qs[j] >> 4) | (((high >> (j + QK / 2)) & 1) << 4)) - 16);
    }
    return out;
}

// block b of row r as Q8_0, from rows of `type` (Q8_0 or Q5_0)
q8_0_block q8_0_block_at(const void * rows, ggml_type type, int64_t n_blocks, int64_t r, int64_t b) {
    if (type == GGML_TYPE_Q5_0) {
        return q8_0_of(((const q5_0_block *) rows)[r * n_blocks + b]);
    }
    return ((const q8_0_block *) rows)[r * n_blocks + b];
}

typedef float    v16f __attribute__((vector_size(64)));
typedef int32_t  v16i __attribute__((vector_size(64)));
typedef int16_t  v16s __attribute__((vector_size(32)));
typedef int8_t   v64s __attribute__((vector_size(64)));
typedef uint8_t  v64u __attribute__((vector_size(64)));

inline v16i dpbusd_portable(v16i acc, v64u a, v64s b) {
    for (int lane = 0; lane < 16; ++lane) {
        int32_t sum = 0;
        for (int k = 0; k < 4; ++k) {
            sum += (int32_t) a[4 * lane + k] * (int32_t) b[4 * lane + k];
        }
        acc[lane] += sum;
    }
    return acc;
}

inline v16f halves_portable(const uint8_t * p) {
    v16f out;
    for (int i = 0; i < 16; ++i) {
        ggml_fp16_t h;
        std::memcpy(&h, p + 2 * i, sizeof(h));
        out[i] = ggml_fp16_to_fp32(h);
    }
    return out;
}

// the emulated kernel: the VNNI tile in portable code
#define DG_LMH_TILE   tile_emulated
#define DG_LMH_TARGET
#define DG_LMH_DPBUSD dpbusd_portable
#define DG_LMH_HALVES halves_portable
#include "diffusion-gemma-lm-head-tile.inc"
#undef DG_LMH_TILE
#undef DG_LMH_TARGET
#undef DG_LMH_DPBUSD
#undef DG_LMH_HALVES

#ifdef DG_LMH_X86
#    define DG_LMH_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

DG_LMH_VNNI_TARGET inline v16i dpbusd_vnni(v16i acc, v64u a, v64s b) {
    return (v16i) _mm512_dpbusd_epi32((__m512i) acc, (__m512i) a, (__m512i) b);
}

DG_LMH_VNNI_TARGET inline v16f halves_vnni(const uint8_t * p) {
    return (v16f) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) p));
}

#    define DG_LMH_TILE   tile_vnni
#    define DG_LMH_TARGET DG_LMH_VNNI_TARGET
#    define DG_LMH_DPBUSD dpbusd_vnni
#    define DG_LMH_HALVES halves_vnni
#    include "diffusion-gemma-lm-head-tile.inc"
#    undef DG_LMH_TILE
#    undef DG_LMH_TARGET
#    undef DG_LMH_DPBUSD
#    undef DG_LMH_HALVES

// 8 rows x NC columns on AVX2: per 4 quants of the group, |quant| (u8) against the activation
// with the quant's sign (s8) in vpmaddubsw (the pair sums stay below 2^15), vpmaddwd to 32 bits.
template <int NC>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const uint8_t * group, const uint8_t * act, int64_t act_bytes,
                                                         int64_t n_blocks, float * out, int64_t ld_out) {
    constexpr int64_t G   = 8;
    constexpr int64_t GBB = 36 * G;
    const __m256i     ones = _mm256_set1_epi16(1);

    __m256 acc[NC];
    _Pragma("GCC unroll 8") for (int j = 0; j < NC; ++j) {
        acc[j] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < n_blocks; ++b) {
        const uint8_t * w  = group + b * GBB;
        const __m256    dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) w));
        __m256i         dot[NC];
        _Pragma("GCC unroll 8") for (int j = 0; j < NC; ++j) {
            dot[j] = _mm256_setzero_si256();
        }
        for (int q = 0; q < 8; ++q) {
            const __m256i quants = _mm256_loadu_si256((const __m256i *) (w + 4 * G + q * 4 * G));
            const __m256i mags   = _mm256_sign_epi8(quants, quants);
            _Pragma("GCC unroll 8") for (int j = 0; j < NC; ++j) {
                int32_t four;
                std::memcpy(&four, act + j * act_bytes + b * QK + 4 * q, sizeof(four));
                const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(four), quants);
                dot[j] = _mm256_add_epi32(dot[j], _mm256_madd_epi16(_mm256_maddubs_epi16(mags, x), ones));
            }
        }
        _Pragma("GCC unroll 8") for (int j = 0; j < NC; ++j) {
            float scale;
            std::memcpy(&scale, act + j * act_bytes + n_blocks * QK + b * 4, sizeof(scale));
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(scale)), _mm256_cvtepi32_ps(dot[j]), acc[j]);
        }
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < NC; ++j) {
        _mm256_storeu_ps(out + j * ld_out, acc[j]);
    }
}
#endif

typedef void (*tile_fn)(const uint8_t *, const uint8_t *, int64_t, int64_t, float *, int64_t);

// tile functions for 1..8 columns
#define DG_LMH_TILES(name)                                                                                   \
    const tile_fn name##_by_columns[9] = { nullptr,    name<1>, name<2>, name<3>, name<4>, name<5>, name<6>, \
                                           name<7>, name<8> };

DG_LMH_TILES(tile_emulated)
#ifdef DG_LMH_X86
DG_LMH_TILES(tile_vnni)
const tile_fn tile_avx2_by_columns[5] = { nullptr, tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4> };
#endif

bool cpu_has(const char * feature) {
#ifdef DG_LMH_X86
    __builtin_cpu_init();
    if (!std::strcmp(feature, "avx512vnni")) {
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
               __builtin_cpu_supports("f16c");
    }
    if (!std::strcmp(feature, "avx2")) {
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
#endif
    (void) feature;
    return false;
}

bool kernel_runs_here(dg_lm_head_kernel kernel) {
    switch (kernel) {
        case dg_lm_head_kernel::avx512_vnni: return cpu_has("avx512vnni");
        case dg_lm_head_kernel::avx2:        return cpu_has("avx2");
        case dg_lm_head_kernel::emulated:    return true;
        case dg_lm_head_kernel::none:        return false;
    }
    return false;
}

}  // namespace

dg_lm_head_kernel dg_lm_head::kernel_for_cpu(const char * env_name) {
    const char * env = env_name ? std::getenv(env_name) : nullptr;
    if (env && *env && std::strcmp(env, "auto") != 0) {
        if (!std::strcmp(env, "avx2") && kernel_runs_here(dg_lm_head_kernel::avx2)) {
            return dg_lm_head_kernel::avx2;
        }
        if (!std::strcmp(env, "emulated")) {
            return dg_lm_head_kernel::emulated;
        }
        return dg_lm_head_kernel::none; // "ggml", or a kernel this CPU lacks
    }
    if (kernel_runs_here(dg_lm_head_kernel::avx512_vnni)) {
        return dg_lm_head_kernel::avx512_vnni;
    }
    if (kernel_runs_here(dg_lm_head_kernel::avx2)) {
        return dg_lm_head_kernel::avx2;
    }
    return dg_lm_head_kernel::none;
}

const char * dg_lm_head::kernel_name(dg_lm_head_kernel kernel) {
    switch (kernel) {
        case dg_lm_head_kernel::avx512_vnni: return "avx512-vnni";
        case dg_lm_head_kernel::avx2:        return "avx2";
        case dg_lm_head_kernel::emulated:    return "emulated";
        case dg_lm_head_kernel::none:        return "ggml";
    }
    return "ggml";
}

dg_lm_head::dg_lm_head(dg_lm_head_kernel kernel, int64_t n_embd, int64_t n_vocab) :
    kernel_(kernel), n_embd_(n_embd), n_vocab_(n_vocab), n_blocks_(n_embd / QK),
    group_(kernel == dg_lm_head_kernel::avx2 ? 8 : 16) {}

bool dg_lm_head::qualifies(const ggml_tensor * w) {
    // tensor->extra is set by the CPU extra buffer types (repack, AMX): their own layout, not Q8_0
    return w && (w->type == GGML_TYPE_Q8_0 || w->type == GGML_TYPE_Q5_0) && w->extra == nullptr && w->buffer &&
           ggml_backend_buffer_is_host(w->buffer) && ggml_is_contiguous(w) && ggml_n_dims(w) == 2 && w->ne[0] % QK == 0;
}

std::unique_ptr<dg_lm_head> dg_lm_head::repack(const ggml_tensor * w, dg_lm_head_kernel kernel) {
    return qualifies(w) ? repack(w->data, w->type, w->ne[0], w->ne[1], kernel) : nullptr;
}

std::unique_ptr<dg_lm_head> dg_lm_head::repack(const void * rows, ggml_type type, int64_t n_embd, int64_t n_vocab,
                                               dg_lm_head_kernel kernel) {
    if (!rows || (type != GGML_TYPE_Q8_0 && type != GGML_TYPE_Q5_0) || n_embd <= 0 || n_embd % QK != 0 ||
        n_vocab <= 0 || !kernel_runs_here(kernel)) {
        return nullptr;
    }
    std::unique_ptr<dg_lm_head> h(new dg_lm_head(kernel, n_embd, n_vocab));
    const int64_t G   = h->group_;
    const int64_t GBB = dg_lm_head_group_block_bytes(G);
    const int64_t nb  = h->n_blocks_;
    h->data_.assign((size_t) (h->n_groups() * nb * GBB + 64), 0);
    h->base_ = (uint8_t *) (((uintptr_t) h->data_.data() + 63) & ~(uintptr_t) 63);

    for (int64_t g = 0; g < h->n_groups(); ++g) {
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t * out = h->base_ + (g * nb + b) * GBB;
            // rows past the vocabulary stay zero (scale 0): the last group is padded
            for (int64_t r = 0; r < G && g * G + r < n_vocab; ++r) {
                const q8_0_block blk = q8_0_block_at(rows, type, nb, g * G + r, b);
                int16_t sum = 0;
                for (int64_t k = 0; k < QK; ++k) {
                    sum = (int16_t) (sum + blk.qs[k]);
                }
                std::memcpy(out + 2 * r, &blk.d, 2);
                std::memcpy(out + 2 * G + 2 * r, &sum, 2);
                for (int64_t q = 0; q < QK / 4; ++q) {
                    std::memcpy(out + 4 * G + q * 4 * G + 4 * r, blk.qs + 4 * q, 4);
                }
            }
        }
    }
    return h;
}

int64_t dg_lm_head::bytes() const {
    return n_groups() * n_blocks_ * dg_lm_head_group_block_bytes(group_);
}

int64_t dg_lm_head::act_bytes() const {
    return n_blocks_ * (QK + 4);
}

void dg_lm_head::quantize(const float * x, int64_t ld_x, int64_t c0, int64_t c1, uint8_t * act) const {
    // the VNNI layout's operand is unsigned: the activation + 128
    const int8_t offset = kernel_ == dg_lm_head_kernel::avx2 ? 0 : -128;
    for (int64_t c = c0; c < c1; ++c) {
        const float * col    = x + c * ld_x;
        uint8_t *     quants = act + c * act_bytes();
        uint8_t *     scales = quants + n_blocks_ * QK;
        for (int64_t b = 0; b < n_blocks_; ++b) {
            float amax = 0.0f;
            for (int64_t k = 0; k < QK; ++k) {
                amax = std::max(amax, std::fabs(col[b * QK + k]));
            }
            // as ggml-cpu's quantize_row_q8_0: the scale rounded to fp16, quants round-to-even of x * 127 / amax
            const float id    = amax != 0.0f ? 127.0f / amax : 0.0f;
            const float scale = ggml_fp16_to_fp32(ggml_fp32_to_fp16(amax / 127.0f));
            for (int64_t k = 0; k < QK; ++k) {
                const int8_t q = (int8_t) std::nearbyint(col[b * QK + k] * id);
                quants[b * QK + k] = (uint8_t) (q ^ offset);
            }
            std::memcpy(scales + b * 4, &scale, sizeof(scale));
        }
    }
}

void dg_lm_head::gemm(const uint8_t * act, int64_t n_cols, float * out, int64_t ld_out, int64_t g0, int64_t g1) const {
    const int64_t G      = group_;
    const int64_t GBB    = dg_lm_head_group_block_bytes(G);
    const int64_t ab     = act_bytes();
    const int64_t n_wide = kernel_ == dg_lm_head_kernel::avx2 ? 4 : 8; // columns per tile

    const tile_fn * tiles = tile_emulated_by_columns;
#ifdef DG_LMH_X86
    if (kernel_ == dg_lm_head_kernel::avx512_vnni) {
        tiles = tile_vnni_by_columns;
    } else if (kernel_ == dg_lm_head_kernel::avx2) {
        tiles = tile_avx2_by_columns;
    }
#endif
    float partial[16 * 8]; // the last group's tile, when the vocabulary does not fill it
    for (int64_t p0 = 0; p0 < n_cols; p0 += PANEL) {
        const int64_t p1 = std::min(p0 + PANEL, n_cols);
        for (int64_t g = g0; g < g1; ++g) {
            const uint8_t * group = base_ + g * n_blocks_ * GBB;
            const int64_t   rows  = std::min(G, n_vocab_ - g * G);
            for (int64_t c = p0; c < p1; c += n_wide) {
                const int64_t nc = std::min(n_wide, p1 - c);
                if (rows == G) {
                    tiles[nc](group, act + c * ab, ab, n_blocks_, out + c * ld_out + g * G, ld_out);
                    continue;
                }
                tiles[nc](group, act + c * ab, ab, n_blocks_, partial, G);
                for (int64_t j = 0; j < nc; ++j) {
                    std::memcpy(out + (c + j) * ld_out + g * G, partial + j * G, (size_t) rows * sizeof(float));
                }
            }
        }
    }
}

void dg_lm_head_quantize_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto &        head = *(const dg_lm_head *) userdata;
    const ggml_tensor * x    = dst->src[0]; // F32 [n_embd, n_cols], contiguous rows
    const int64_t       n    = x->ne[1];
    head.quantize((const float *) x->data, x->nb[1] / sizeof(float), ith * n / nth, (ith + 1) * n / nth,
                  (uint8_t *) dst->data);
}

void dg_lm_head_gemm_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto &        head = *(const dg_lm_head *) userdata;
    const ggml_tensor * act  = dst->src[0];
    const int64_t       ng   = head.n_groups();
    head.gemm((const uint8_t *) act->data, act->ne[1], (float *) dst->data, dst->nb[1] / sizeof(float),
              ith * ng / nth, (ith + 1) * ng / nth);
}

// Checks a kernel against a double-precision sum over the same quantized operands, on random
// weights of `weight_type` (GGML_TYPE_Q8_0 or GGML_TYPE_Q5_0) decoded by ggml's own dequantizer:
// the largest error relative to the row's magnitude. 0: done, 1: the CPU lacks the kernel, -1: bad
// arguments.
int32_t dg_lm_head_selftest(int32_t kernel, int32_t weight_type, int64_t n_embd, int64_t n_vocab, int64_t n_cols,
                            uint32_t seed, double * max_rel_error) {
    const auto type = (ggml_type) weight_type;
    if (n_embd <= 0 || n_embd % QK || n_vocab <= 0 || n_cols <= 0 || !max_rel_error || kernel < 1 || kernel > 3 ||
        (type != GGML_TYPE_Q8_0 && type != GGML_TYPE_Q5_0)) {
        return -1;
    }
    const auto k = (dg_lm_head_kernel) kernel;
    if (!kernel_runs_here(k)) {
        return 1;
    }
    const int64_t nb = n_embd / QK;
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> byte(0, 255), q8(-127, 127);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    // random blocks: a positive fp16 scale, then random quant bytes (Q8_0: -127..127, as ggml's
    // quantizer writes them)
    const size_t block_bytes = ggml_type_size(type);
    std::vector<uint8_t> w((size_t) (n_vocab * nb) * block_bytes);
    for (size_t off = 0; off < w.size(); off += block_bytes) {
        const ggml_fp16_t d = ggml_fp32_to_fp16(0.001f + 0.01f * std::fabs(unit(rng)));
        std::memcpy(&w[off], &d, 2);
        for (size_t i = 2; i < block_bytes; ++i) {
            w[off + i] = type == GGML_TYPE_Q8_0 ? (uint8_t) (int8_t) q8(rng) : (uint8_t) byte(rng);
        }
    }
    std::vector<float> decoded((size_t) (n_vocab * n_embd));
    ggml_get_type_traits(type)->to_float(w.data(), decoded.data(), n_vocab * n_embd);

    std::vector<float> x((size_t) (n_embd * n_cols));
    for (auto & v : x) {
        v = unit(rng) * 3.0f;
    }
    auto head = dg_lm_head::repack(w.data(), type, n_embd, n_vocab, k);
    if (!head) {
        return -1;
    }
    std::vector<uint8_t> act((size_t) (head->act_bytes() * n_cols));
    head->quantize(x.data(), n_embd, 0, n_cols, act.data());
    std::vector<float> out((size_t) (n_vocab * n_cols), NAN);
    head->gemm(act.data(), n_cols, out.data(), n_vocab, 0, head->n_groups());

    const int8_t offset = k == dg_lm_head_kernel::avx2 ? 0 : -128;
    double worst = 0.0;
    for (int64_t c = 0; c < n_cols; ++c) {
        const uint8_t * quants = act.data() + c * head->act_bytes();
        const float *   scales = (const float *) (quants + nb * QK);
        for (int64_t v = 0; v < n_vocab; ++v) {
            const float * row = decoded.data() + v * n_embd;
            double sum = 0.0, magnitude = 0.0;
            for (int64_t b = 0; b < nb; ++b) {
                double dot = 0.0;
                for (int64_t i = 0; i < QK; ++i) {
                    dot += (double) row[b * QK + i] * (int8_t) (quants[b * QK + i] ^ offset);
                }
                const double term = scales[b] * dot;
                sum += term;
                magnitude += std::fabs(term);
            }
            const double err = std::fabs(sum - out[(size_t) (c * n_vocab + v)]) / (magnitude + 1e-30);
            worst = std::isfinite(err) ? std::max(worst, err) : INFINITY;
        }
    }
    *max_rel_error = worst;
    return 0;
}
