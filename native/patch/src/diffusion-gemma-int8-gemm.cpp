// dg's int8 GEMMs (the LM head, the dense projections, the MoE experts) on repacks of their own: see
// diffusion-gemma-lm-head.h. The SIMD kernels per family are in diffusion-gemma-int8-kernels.inc, the
// self-tests in diffusion-gemma-int8-selftest.inc.

#include "diffusion-gemma-lm-head.h"
#include "diffusion-gemma.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <random>

#if defined(__unix__) || defined(__APPLE__)
#    include <unistd.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#    include <cpuid.h>
#    include <immintrin.h>
#    define DG_LMH_X86 1
#endif

#if defined(__linux__)
#    include <sys/syscall.h>
#endif

#if defined(__GNUC__) && !defined(__clang__)
// 32- and 64-byte vectors only cross function boundaries inside this translation unit
#    pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace {

constexpr int64_t QK      = 32; // quants per Q8_0 block

// Activation columns kept hot in L2 while the row groups stream past (dg_lm_head::gemm): as many as
// fill half this core's L2 with one K chunk of their activations, in steps of 8 from 16 to 256 (a
// 256-token canvas; 64 where the size is unknown). The weights stream from memory once per panel, so
// the fewer panels the better while the columns stay in L2: on a 2 MiB L2 the LM head's whole canvas
// is one panel.
int64_t panel_columns(int64_t act_bytes) {
    static const long l2 = [] {
#if defined(_SC_LEVEL2_CACHE_SIZE)
        return sysconf(_SC_LEVEL2_CACHE_SIZE);
#else
        return 0L;
#endif
    }();
    if (l2 <= 0 || act_bytes <= 0) {
        return 64;
    }
    return std::clamp<int64_t>(l2 / 2 / act_bytes / 16 * 16, 16, 256); // whole AMX tiles
}

// Rows longer than 2 x this many blocks (the transposed embeddings: 8192 blocks) are multiplied a chunk of
// this many blocks at a time, partial sums added: a group's chunk (16 rows: 144 KiB) and a panel's
// activations for it (at most half of L2) stay in L2, where a whole row group (4.5 MiB) and a column's
// activations (288 KiB) would come from L3 for every tile.
constexpr int64_t K_CHUNK = 256;

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

// Q4_K (most matrices of Q4_K_M files, the experts' gate+up among them): super-blocks of 256 values,
// 8 sub-blocks of 32; value = d * sc_j * q - dmin * m_j with q in 0..15 and 6-bit sc_j, m_j.
constexpr int64_t QK_K = 256;

struct q4_K_block {
    uint16_t d;
    uint16_t dmin;
    uint8_t  scales[12]; // sc_j and m_j, 6 bits each (q4_K_scale_min)
    uint8_t  qs[QK_K / 2]; // sub-block 2i in the low nibbles of bytes 32i..32i+31, 2i+1 in the high ones
};
static_assert(sizeof(q4_K_block) == 144, "Q4_K block layout");

// sc_j and m_j of sub-block j, unpacked as ggml packs them
void q4_K_scale_min(const uint8_t * s, int j, int & sc, int & m) {
    if (j < 4) {
        sc = s[j] & 63;
        m  = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        m  = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// A Q4_K row group of 8 in the tiles' layout, per super-block: the rows' d (float [row]); the 8
// sub-blocks' 6-bit scales sc_j as int16 pairs (sc of row r at 2r and 2r + 1, for vpmaddwd: the
// super-block's products summed in int32 as ggml's vec_dot_q4_K_q8_K sums them, one float step per
// super-block); their offsets dmin * m_j (float [sub-block][row], exact: an fp16 times a 6-bit
// integer); then per sub-block 8 x (8 x 4) quants as unsigned bytes.
constexpr int64_t Q4_K_GROUP  = 8;
constexpr int64_t q4_K_sb_bytes(int64_t G) {
    return G * 4 + 2 * 8 * G * 4 + 8 * 8 * G * 4;
}
constexpr int64_t Q4_K_SB_BYTES = q4_K_sb_bytes(Q4_K_GROUP);

// Activations against Q4_K, per super-block: ggml's Q8_K (its quants; d = 1 / iscale), then the
// 8 sub-blocks' d * (sum of their quants), which the offsets multiply.
constexpr int64_t Q8_K_BYTES = QK_K + 4 + 8 * 4;

// Q6_K (a Q4_K_M file's LM head and its attn_v / ffn_down of some layers): super-blocks of 256 values,
// 16 sub-blocks of 16; value = d * sc_j * (q - 32) with q in 0..63 and int8 sc_j.
struct q6_K_block {
    uint8_t  ql[QK_K / 2];     // the quants' low 4 bits
    uint8_t  qh[QK_K / 4];     // their high 2 bits
    int8_t   scales[QK_K / 16];
    uint16_t d;
};
static_assert(sizeof(q6_K_block) == 210, "Q6_K block layout");

// quant i of a Q6_K block, minus 32, as ggml's dequantize_row_q6_K reads it: per 128, 32 low bytes hold
// quants l and l + 64 (nibbles), 32 more l + 32 and l + 96, and 32 qh bytes their high bits 2 at a time
int8_t q6_K_quant(const q6_K_block & blk, int64_t i) {
    const int64_t h = i / 128, k = (i % 128) / 32, l = i % 32;
    const int     low  = (blk.ql[64 * h + l + 32 * (k & 1)] >> (4 * (k >> 1))) & 0x0F;
    const int     high = (blk.qh[32 * h + l] >> (2 * k)) & 3;
    return (int8_t) ((low | (high << 4)) - 32);
}

// A Q6_K row group of 8 in the tiles' layout, per super-block: the rows' d (float [row]); their
// corrections 128 * sum_j sc_j * (sum of sub-block j's quants) (int32 [row]), which undo the +128 that
// makes the activations unsigned for vpmaddubsw; per sub-block the scales as int16 pairs (sc of row r
// at 2r and 2r + 1, for vpmaddwd); then the quants minus 32 as int8, 64 x (8 x 4).
constexpr int64_t Q6_K_SB_BYTES = 8 * 4 + 8 * 4 + 16 * 32 + 64 * 32;

// rows [0, n_rows) of a Q4_K group of G rows (row r at rows + r * row_bytes) in that layout; rows past
// n_rows are zero (scales and offsets 0), so a partial last group computes zeros
void pack_group_q4_K(const uint8_t * rows, size_t row_bytes, int64_t n_super, int64_t n_rows, int64_t G, uint8_t * out) {
    const int64_t sb_bytes = q4_K_sb_bytes(G);
    for (int64_t s = 0; s < n_super; ++s) {
        uint8_t * o = out + s * sb_bytes;
        std::memset(o, 0, (size_t) sb_bytes);
        float *   d_rows  = (float *) o;
        int16_t * scales  = (int16_t *) (d_rows + G);
        float *   offsets = (float *) (scales + 2 * 8 * G);
        uint8_t * quants  = (uint8_t *) (offsets + 8 * G);
        for (int64_t r = 0; r < n_rows; ++r) {
            const q4_K_block & blk = ((const q4_K_block *) (rows + r * row_bytes))[s];
            const float dmin = ggml_fp16_to_fp32(blk.dmin);
            d_rows[r]        = ggml_fp16_to_fp32(blk.d);
            for (int j = 0; j < 8; ++j) {
                int sc, m;
                q4_K_scale_min(blk.scales, j, sc, m);
                scales[j * 2 * G + 2 * r]     = (int16_t) sc;
                scales[j * 2 * G + 2 * r + 1] = (int16_t) sc;
                offsets[j * G + r]            = dmin * (float) m;
                for (int k = 0; k < QK; ++k) {
                    const uint8_t byte = blk.qs[(j / 2) * QK + k];
                    quants[j * 8 * 4 * G + (k / 4) * 4 * G + 4 * r + k % 4] = j % 2 ? byte >> 4 : byte & 0x0F;
                }
            }
        }
    }
}

// A Q6_K row group of 16 for AMX's tiles, per super-block: the rows' d (float [row]), then per 64 quants
// two AMX B tiles (16 steps x (16 rows x 4)): the high and the low byte of each weight's sc_j * (q - 32),
// w = 256 hi + lo with lo the signed low byte (|w| <= 4096, so hi is within +-16). The scales inside the
// integers let one TDPBSSD take 64 quants, where a float scale per 16-wide sub-block would cap it at 16
// (a TDP costs the same at any K), and the super-block's products need one float step, not sixteen.
constexpr int64_t Q6_K_AMX_SB_BYTES = 16 * 4 + 4 * 2 * 16 * 16 * 4;

// where quant i's high byte lies in a super-block of that layout (its low byte 1 KB further)
constexpr int64_t q6_K_amx_high_byte(int64_t i, int64_t r) {
    return 16 * 4 + (i / 64) * 2 * 1024 + ((i % 64) / 4) * 64 + 4 * r + i % 4;
}

// rows [0, n_rows) of a Q6_K group of 16 in that layout (portable: any n_rows; rows past it are zero)
void pack_group_q6_K_amx(const uint8_t * rows, size_t row_bytes, int64_t n_super, int64_t n_rows, uint8_t * out) {
    for (int64_t s = 0; s < n_super; ++s) {
        uint8_t * o = out + s * Q6_K_AMX_SB_BYTES;
        std::memset(o, 0, (size_t) Q6_K_AMX_SB_BYTES);
        float * d = (float *) o;
        for (int64_t r = 0; r < n_rows; ++r) {
            const q6_K_block & blk = ((const q6_K_block *) (rows + r * row_bytes))[s];
            d[r] = ggml_fp16_to_fp32(blk.d);
            for (int64_t i = 0; i < QK_K; ++i) {
                const int32_t w  = blk.scales[i / 16] * q6_K_quant(blk, i);
                const int8_t  lo = (int8_t) (uint8_t) (w & 0xFF);
                o[q6_K_amx_high_byte(i, r)]        = (uint8_t) (int8_t) ((w - lo) / 256);
                o[q6_K_amx_high_byte(i, r) + 1024] = (uint8_t) lo;
            }
        }
    }
}

// A Q4_K row group of 16 for AMX's tiles, per super-block: the rows' d and their offsets dmin * m_j
// (float [row], [sub-block][row]), then per 64 quants (sub-blocks 2k and 2k + 1) two AMX B tiles (16 steps
// x (16 rows x 4)): the high and the low byte of each weight's sc_j * q (0..945, both unsigned), as Q6_K's
// layout above splits its weights.
constexpr int64_t Q4_K_AMX_SB_BYTES = 16 * 4 + 8 * 16 * 4 + 4 * 2 * 16 * 16 * 4;

// where quant i's high byte lies in a super-block of that layout (its low byte 1 KB further)
constexpr int64_t q4_K_amx_high_byte(int64_t i, int64_t r) {
    return 16 * 4 + 8 * 16 * 4 + (i / 64) * 2 * 1024 + ((i % 64) / 4) * 64 + 4 * r + i % 4;
}

// rows [0, n_rows) of a Q4_K group of 16 in that layout (portable: any n_rows; rows past it are zero)
void pack_group_q4_K_amx(const uint8_t * rows, size_t row_bytes, int64_t n_super, int64_t n_rows, uint8_t * out) {
    for (int64_t s = 0; s < n_super; ++s) {
        uint8_t * o = out + s * Q4_K_AMX_SB_BYTES;
        std::memset(o, 0, (size_t) Q4_K_AMX_SB_BYTES);
        float * d       = (float *) o;
        float * offsets = d + 16;
        for (int64_t r = 0; r < n_rows; ++r) {
            const q4_K_block & blk = ((const q4_K_block *) (rows + r * row_bytes))[s];
            d[r]                   = ggml_fp16_to_fp32(blk.d);
            for (int j = 0; j < 8; ++j) {
                int sc, m;
                q4_K_scale_min(blk.scales, j, sc, m);
                offsets[j * 16 + r] = ggml_fp16_to_fp32(blk.dmin) * (float) m;
                for (int k = 0; k < QK; ++k) {
                    const uint8_t byte = blk.qs[(j / 2) * QK + k];
                    const int     w    = sc * (j % 2 ? byte >> 4 : byte & 0x0F);
                    const int64_t i    = j * QK + k;
                    o[q4_K_amx_high_byte(i, r)]        = (uint8_t) (w >> 8);
                    o[q4_K_amx_high_byte(i, r) + 1024] = (uint8_t) (w & 0xFF);
                }
            }
        }
    }
}

// rows [0, n_rows) of a Q6_K group in that layout; rows past n_rows are zero, so they compute zeros
void pack_group_q6_K(const uint8_t * rows, size_t row_bytes, int64_t n_super, int64_t n_rows, uint8_t * out) {
    constexpr int64_t G = 8;
    for (int64_t s = 0; s < n_super; ++s) {
        uint8_t * o = out + s * Q6_K_SB_BYTES;
        std::memset(o, 0, (size_t) Q6_K_SB_BYTES);
        float *   d      = (float *) o;
        int32_t * corr   = (int32_t *) (o + 32);
        int16_t * scales = (int16_t *) (o + 64);
        int8_t *  quants = (int8_t *) (o + 64 + 16 * 32);
        for (int64_t r = 0; r < n_rows; ++r) {
            const q6_K_block & blk = ((const q6_K_block *) (rows + r * row_bytes))[s];
            d[r] = ggml_fp16_to_fp32(blk.d);
            int32_t sum = 0;
            for (int64_t j = 0; j < 16; ++j) {
                scales[j * 16 + 2 * r] = scales[j * 16 + 2 * r + 1] = blk.scales[j];
                int32_t quant_sum = 0;
                for (int64_t k = 0; k < 16; ++k) {
                    const int64_t i = 16 * j + k;
                    quants[(i / 4) * 4 * G + 4 * r + i % 4] = q6_K_quant(blk, i);
                    quant_sum += q6_K_quant(blk, i);
                }
                sum += blk.scales[j] * quant_sum;
            }
            corr[r] = 128 * sum;
        }
    }
}

// Activations against the VNNI Q6_K tile, per super-block: the Q8_K quants and d, then per 16-wide
// sub-block -32 * (sum of its quants) as int32, the tile's starting value for the sub-block's dot
// product of the unsigned quants 0..63 (which takes their -32 back).
constexpr int64_t Q8_K_BYTES_SUMS16 = QK_K + 4 + 16 * 4;

// the bytes after a super-block's quants: d, then per 32-wide sub-block d x its quant sum, or with
// `sums16` per 16-wide one -32 x its quant sum as int32
void store_q8_K_sums(uint8_t * o, float d, const int32_t * sums_32, const int32_t * sums_16, bool sums16) {
    std::memcpy(o + QK_K, &d, sizeof(d));
    if (sums16) {
        for (int j = 0; j < 16; ++j) {
            const int32_t start = -32 * sums_16[j];
            std::memcpy(o + QK_K + 4 + 4 * j, &start, sizeof(start));
        }
        return;
    }
    for (int j = 0; j < 8; ++j) {
        const float b = d * (float) sums_32[j];
        std::memcpy(o + QK_K + 4 + 4 * j, &b, sizeof(b));
    }
}

void quantize_super_block_q8_K(const float * v, uint8_t * o, uint8_t flip, bool sums16) {
    float max = 0.0f, amax = 0.0f;
    for (int64_t k = 0; k < QK_K; ++k) {
        if (std::fabs(v[k]) > amax) {
            amax = std::fabs(v[k]);
            max  = v[k];
        }
    }
    float   d = 0.0f;
    int32_t sums_32[8] = {}, sums_16[16] = {};
    if (amax != 0.0f) {
        const float iscale = -127.0f / max;
        for (int64_t k = 0; k < QK_K; ++k) {
            const int8_t q = (int8_t) std::min(127, (int) std::nearbyint(iscale * v[k]));
            o[k] = (uint8_t) q ^ flip;
            sums_32[k / QK] += q;
            sums_16[k / 16] += q;
        }
        d = 1.0f / iscale;
    } else {
        std::memset(o, flip, QK_K);
    }
    store_q8_K_sums(o, d, sums_32, sums_16, sums16);
}

#ifdef DG_LMH_X86
__attribute__((target("avx2"))) inline int32_t sum_epi32_avx2(__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h         = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h         = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    return _mm_cvtsi128_si32(h);
}

// The same, 8 lanes at a time, byte for byte: the largest magnitude found as the scalar loop finds it
// (NaNs passed over), the same products, rounded by cvtps2dq under the default rounding mode (to
// nearest even, as nearbyint), packed to bytes in order (the packs interleave 4-byte groups, the
// permute puts them back). A NaN value's own quant differs from the scalar loop's, whose cast of a NaN
// is undefined.
__attribute__((target("avx2"))) void quantize_super_block_q8_K_avx2(const float * v, uint8_t * o, uint8_t flip,
                                                                    bool sums16) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256       m    = _mm256_setzero_ps();
    for (int i = 0; i < QK_K / 8; ++i) {
        m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * i)), m); // a NaN lane keeps m
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h        = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h        = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    if (amax == 0.0f) {
        quantize_super_block_q8_K(v, o, flip, sums16);
        return;
    }
    int64_t first = -1; // the first value of that magnitude: its sign maps to -127
    for (int i = 0; i < QK_K / 8 && first < 0; ++i) {
        const int hit = _mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * i)), _mm256_set1_ps(amax), _CMP_EQ_OQ));
        if (hit) {
            first = 8 * i + __builtin_ctz((unsigned) hit);
        }
    }
    if (first < 0) { // not reached: amax is one of the values' magnitudes
        quantize_super_block_q8_K(v, o, flip, sums16);
        return;
    }
    const float   iscale = -127.0f / v[first];
    const __m256  vis    = _mm256_set1_ps(iscale);
    const __m256i top    = _mm256_set1_epi32(127);
    int32_t       sums_32[8], sums_16[16];
    for (int b = 0; b < QK_K / QK; ++b) {
        __m256i q[4];
        for (int i = 0; i < 4; ++i) {
            q[i] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + QK * b + 8 * i), vis)), top);
        }
        sums_16[2 * b]     = sum_epi32_avx2(_mm256_add_epi32(q[0], q[1]));
        sums_16[2 * b + 1] = sum_epi32_avx2(_mm256_add_epi32(q[2], q[3]));
        sums_32[b]         = sums_16[2 * b] + sums_16[2 * b + 1];
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        bytes         = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *) (o + QK * b), _mm256_xor_si256(bytes, _mm256_set1_epi8((char) flip)));
    }
    store_q8_K_sums(o, 1.0f / iscale, sums_32, sums_16, sums16);
}
#endif

bool cpu_has(const char * feature);

// Columns [c0, c1) of x (n_super * 256 values each) as ggml's quantize_row_q8_K_ref writes them
// (per 256: the value of largest magnitude, first of equals, maps to -127; round-to-even), into
// the layout above; `flip` 0x80 stores each quant + 128 as an unsigned byte (the AVX2 Q6_K tile's
// operand); `sums16` writes the VNNI Q6_K tile's layout instead (Q8_K_BYTES_SUMS16); `scalar`: the
// portable loop even where the CPU has AVX2 (the self-test compares the two).
void quantize_columns_q8_K(int64_t n_super, const float * x, int64_t ld_x, int64_t c0, int64_t c1, uint8_t * act,
                          uint8_t flip = 0, bool sums16 = false, bool scalar = false) {
    const int64_t     bytes = sums16 ? Q8_K_BYTES_SUMS16 : Q8_K_BYTES;
    static const bool avx2  = cpu_has("avx2");
    for (int64_t c = c0; c < c1; ++c) {
        for (int64_t s = 0; s < n_super; ++s) {
            const float * v = x + c * ld_x + s * QK_K;
            uint8_t *     o = act + (c * n_super + s) * bytes;
#ifdef DG_LMH_X86
            if (avx2 && !scalar) {
                quantize_super_block_q8_K_avx2(v, o, flip, sums16);
                continue;
            }
#endif
            quantize_super_block_q8_K(v, o, flip, sums16);
        }
    }
    (void) avx2;
}

// rows [0, n_rows) of a group of G (row r at rows + r * row_bytes, `type` Q8_0 or Q5_0) in the tiles'
// layout: per block, G fp16 scales, G int16 quant sums, then 8 x (G x 4) quants; rows past n_rows
// are zero (scale 0), so a partial last group computes zeros
void pack_group(const uint8_t * rows, size_t row_bytes, ggml_type type, int64_t n_blocks, int64_t n_rows, int64_t G,
                uint8_t * out) {
    const int64_t GBB = 36 * G;
    for (int64_t b = 0; b < n_blocks; ++b) {
        uint8_t * o = out + b * GBB;
        std::memset(o, 0, (size_t) GBB);
        for (int64_t r = 0; r < n_rows; ++r) {
            const q8_0_block blk = q8_0_block_at(rows + r * row_bytes, type, n_blocks, 0, b);
            int16_t sum = 0;
            for (int64_t k = 0; k < QK; ++k) {
                sum = (int16_t) (sum + blk.qs[k]);
            }
            std::memcpy(o + 2 * r, &blk.d, 2);
            std::memcpy(o + 2 * G + 2 * r, &sum, 2);
            for (int64_t q = 0; q < QK / 4; ++q) {
                std::memcpy(o + 4 * G + q * 4 * G + 4 * r, blk.qs + 4 * q, 4);
            }
        }
    }
}

#include "diffusion-gemma-int8-kernels.inc"

// the first 64-byte boundary at or after p (buffers sized 64 bytes over what they hold)
inline uint8_t * align_64(uint8_t * p) {
    return (uint8_t *) (((uintptr_t) p + 63) & ~(uintptr_t) 63);
}

typedef void (*tile_fn)(const uint8_t *, const uint8_t *, int64_t, int64_t, float *, int64_t);
// (group, act, act bytes, n_blocks, b0, b1, out, ld_out): adds blocks [b0, b1)'s products to out
typedef void (*span_tile_fn)(const uint8_t *, const uint8_t *, int64_t, int64_t, int64_t, int64_t, float *, int64_t);

// tile functions for 1..8 columns
#define DG_LMH_TILES(name)                                                                                   \
    const tile_fn name##_by_columns[9] = { nullptr,    name<1>, name<2>, name<3>, name<4>, name<5>, name<6>, \
                                           name<7>, name<8> };

DG_LMH_TILES(tile_emulated)
#ifdef DG_LMH_X86
DG_LMH_TILES(tile_vnni)
const tile_fn tile_avx2_by_columns[5] = { nullptr, tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4> };
const tile_fn tile_q5_0_avx2_by_columns[5] = { nullptr, tile_q5_0_avx2<1>, tile_q5_0_avx2<2>, tile_q5_0_avx2<3>,
                                              tile_q5_0_avx2<4> };
const tile_fn tile_q4_K_avx2_by_columns[5] = { nullptr, tile_q4_K_avx2<1>, tile_q4_K_avx2<2>, tile_q4_K_avx2<3>,
                                              tile_q4_K_avx2<4> };
const tile_fn tile_q6_K_avx2_by_columns[5] = { nullptr, tile_q6_K_avx2<1>, tile_q6_K_avx2<2>, tile_q6_K_avx2<3>,
                                              tile_q6_K_avx2<4> };
const tile_fn tile_q8_0_avxvnni_by_columns[5] = { nullptr, tile_q8_0_avxvnni<1>, tile_q8_0_avxvnni<2>,
                                                 tile_q8_0_avxvnni<3>, tile_q8_0_avxvnni<4> };
const tile_fn tile_q6_K_avxvnni_by_columns[5] = { nullptr, tile_q6_K_avxvnni<1>, tile_q6_K_avxvnni<2>,
                                                 tile_q6_K_avxvnni<3>, tile_q6_K_avxvnni<4> };
const tile_fn tile_q4_K_avxvnni_by_columns[5] = { nullptr, tile_q4_K_avxvnni<1>, tile_q4_K_avxvnni<2>,
                                                 tile_q4_K_avxvnni<3>, tile_q4_K_avxvnni<4> };
// the repacked experts' VNNI tiles (spans of blocks, accumulating), by column count
#    define DG_LMH_SPAN_TILES(name)                                                                         \
        const span_tile_fn name##_by_columns[9] = { nullptr, name<1>, name<2>, name<3>, name<4>, name<5>, \
                                                    name<6>, name<7>, name<8> };
DG_LMH_SPAN_TILES(tile_q8_0_vnni)
DG_LMH_SPAN_TILES(tile_q5_0_vnni)
DG_LMH_SPAN_TILES(tile_q4_K_vnni)
DG_LMH_SPAN_TILES(tile_q6_K_vnni)
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

// Whether this process may use AMX's int8 tiles: the CPU has them (CPUID leaf 7: AMX-TILE, AMX-INT8) and
// Linux grants the tile state (ARCH_REQ_XCOMP_PERM for XTILEDATA, once per process).
bool amx_usable() {
    static const bool usable = [] {
#if defined(DG_LMH_X86) && defined(__linux__)
        unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
        if (!cpu_has("avx512vnni") || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) ||
            !(edx & (1u << 25))) {
            return false;
        }
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
        return false;
#endif
    }();
    return usable;
}

// The VNNI layout's GEMM takes AMX's tiles for 16 columns at a time where the process may use them,
// unless DG_AMX=0 (A/B runs)
bool amx_wanted() {
    const char * env = std::getenv("DG_AMX");
    return !(env && !std::strcmp(env, "0")) && amx_usable();
}

// Whether the repacked experts' GEMM prefetches the next row group's weights span by span: on AMD's
// cores the hardware prefetcher left the span tiles waiting on memory (a streamed model of them 140 ->
// 300 G MAC/s, benchmarks/expert_tile_probe.cpp); on Sapphire Rapids a prefetch of the same stream made
// it slower. DG_EXPERT_PREFETCH=1 / 0 forces it (A/B runs).
bool expert_prefetch_wanted() {
    const char * env = std::getenv("DG_EXPERT_PREFETCH");
    if (env && (!std::strcmp(env, "0") || !std::strcmp(env, "1"))) {
        return env[0] == '1';
    }
#ifdef DG_LMH_X86
    __builtin_cpu_init();
    return __builtin_cpu_is("amd");
#else
    return false;
#endif
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

// One block of 32 activations as ggml-cpu's quantize_row_q8_0 quantizes it: the scale amax / 127
// rounded to fp16, the quants round-to-even of x * 127 / amax; stored ^ offset (VNNI: + 128).
void quantize_block(const float * x, uint8_t * quants, float * scale, int8_t offset) {
    float amax = 0.0f;
    for (int64_t k = 0; k < QK; ++k) {
        amax = std::max(amax, std::fabs(x[k]));
    }
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    *scale = ggml_fp16_to_fp32(ggml_fp32_to_fp16(amax / 127.0f));
    for (int64_t k = 0; k < QK; ++k) {
        const int8_t q = (int8_t) std::nearbyint(x[k] * id);
        quants[k] = (uint8_t) (q ^ offset);
    }
}

#ifdef DG_LMH_X86
// The same, 8 lanes at a time: the same products, rounded by cvtps2dq under the default rounding mode
// (to nearest even, as nearbyint), packed to bytes in order (the packs interleave 4-byte groups, the
// permute puts them back). The dense self-conditioning product quantizes 256 x 262144 activations a
// step: 0.19 s of a 4.2 s step on one thread with the scalar loop.
__attribute__((target("avx2,f16c"))) void quantize_block_avx2(const float * x, uint8_t * quants, float * scale,
                                                              int8_t offset) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256       v[4];
    __m256       m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        m    = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float id   = amax != 0.0f ? 127.0f / amax : 0.0f;
    *scale = ggml_fp16_to_fp32(ggml_fp32_to_fp16(amax / 127.0f));
    const __m256 vid = _mm256_set1_ps(id);
    __m256i      q[4];
    for (int i = 0; i < 4; ++i) {
        q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
    }
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    bytes = _mm256_xor_si256(bytes, _mm256_set1_epi8(offset));
    _mm256_storeu_si256((__m256i *) quants, bytes);
}
#endif

// Columns [c0, c1) of x, n_blocks blocks each, into act: column c at act + c * act_stride holds its
// quants, then their scales (a chunked layout calls this once per chunk, act and x at the chunk's
// start). `scalar`: the portable loop even where the CPU has AVX2 (the selftest compares the two).
// `plus_128`: the activation + 128 for AVX2 too (its Q5_0 expert tile's unsigned operand); `signed_quants`:
// for VNNI too, the quants as they are.
void quantize_columns(dg_lm_head_kernel kernel, int64_t n_blocks, const float * x, int64_t ld_x, int64_t c0, int64_t c1,
                      uint8_t * act, int64_t act_stride, bool scalar = false, bool plus_128 = false,
                      bool signed_quants = false) {
    // the VNNI layout's operand is unsigned: the activation + 128 (not for the VNNI span tiles of the
    // repacked Q8_0 / Q5_0 experts: `signed_quants`)
    const int8_t offset = signed_quants || (kernel == dg_lm_head_kernel::avx2 && !plus_128) ? 0 : -128;
    static const bool avx2 = cpu_has("avx2");
    for (int64_t c = c0; c < c1; ++c) {
        const float * col    = x + c * ld_x;
        uint8_t *     quants = act + c * act_stride;
        uint8_t *     scales = quants + n_blocks * QK;
        for (int64_t b = 0; b < n_blocks; ++b) {
            float scale;
#ifdef DG_LMH_X86
            if (avx2 && !scalar) {
                quantize_block_avx2(col + b * QK, quants + b * QK, &scale, offset);
            } else
#endif
            {
                quantize_block(col + b * QK, quants + b * QK, &scale, offset);
            }
            std::memcpy(scales + b * 4, &scale, sizeof(scale));
        }
    }
    (void) avx2;
}

void quantize_columns(dg_lm_head_kernel kernel, int64_t n_blocks, const float * x, int64_t ld_x, int64_t c0, int64_t c1,
                      uint8_t * act) {
    quantize_columns(kernel, n_blocks, x, ld_x, c0, c1, act, n_blocks * (QK + 4));
}


// Whether the AVX2 family's layouts run on AVX-VNNI's tiles: where the CPU has AVX-VNNI, unless
// DG_AVX_VNNI=0 (A/B runs, and the plain AVX2 tiles' tests on such a CPU). Read when a GEMM is made.
bool avx_vnni_wanted() {
#ifdef DG_LMH_X86
    __builtin_cpu_init();
    const char * env = std::getenv("DG_AVX_VNNI");
    return !(env && !std::strcmp(env, "0")) && cpu_has("avx2") && __builtin_cpu_supports("avxvnni");
#else
    return false;
#endif
}

// Whether AVX2's staged tile for Q8_0 / Q5_0 weights (`type`) reads the activations + 128: Q5_0's
// (tile_q5_0_avx2) and AVX-VNNI's for both (vpdpbusd's unsigned operand); tile_avx2's sign trick reads
// them signed. The VNNI family's operands follow their own rule (quantize_columns).
bool avx2_tile_plus_128(ggml_type type, dg_lm_head_kernel kernel, bool avx_vnni) {
    return kernel == dg_lm_head_kernel::avx2 && (type == GGML_TYPE_Q5_0 || (type == GGML_TYPE_Q8_0 && avx_vnni));
}

// this kernel's tiles for weights of `type` by column count, and the widest (Q4_K, Q6_K: AVX2's only,
// which dg_experts::make ensures); `avx_vnni`: the AVX2 family's on AVX-VNNI (avx_vnni_wanted)
const tile_fn * tiles_for(dg_lm_head_kernel kernel, int64_t * n_wide, ggml_type type, bool avx_vnni) {
    *n_wide = kernel == dg_lm_head_kernel::avx2 ? 4 : 8;
#ifdef DG_LMH_X86
    if (type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K) {
        GGML_ASSERT(kernel == dg_lm_head_kernel::avx2);
        if (type == GGML_TYPE_Q6_K) {
            return avx_vnni ? tile_q6_K_avxvnni_by_columns : tile_q6_K_avx2_by_columns;
        }
        return avx_vnni ? tile_q4_K_avxvnni_by_columns : tile_q4_K_avx2_by_columns;
    }
    if (kernel == dg_lm_head_kernel::avx512_vnni) {
        return tile_vnni_by_columns;
    }
    if (kernel == dg_lm_head_kernel::avx2) {
        if (avx_vnni) {
            return tile_q8_0_avxvnni_by_columns; // Q8_0 and Q5_0: the same staged layout
        }
        return type == GGML_TYPE_Q5_0 ? tile_q5_0_avx2_by_columns : tile_avx2_by_columns;
    }
#endif
    (void) type;
    (void) avx_vnni;
    return tile_emulated_by_columns;
}

// the repacked experts' span tiles of `type` by column count (VNNI; null: the staged AVX2 route)
const span_tile_fn * span_tiles_for(dg_lm_head_kernel kernel, ggml_type type) {
#ifdef DG_LMH_X86
    if (kernel == dg_lm_head_kernel::avx512_vnni) {
        switch (type) {
            case GGML_TYPE_Q8_0: return tile_q8_0_vnni_by_columns;
            case GGML_TYPE_Q5_0: return tile_q5_0_vnni_by_columns;
            case GGML_TYPE_Q4_K: return tile_q4_K_vnni_by_columns;
            case GGML_TYPE_Q6_K: return tile_q6_K_vnni_by_columns;
            default:             break;
        }
    }
#endif
    (void) kernel;
    (void) type;
    return nullptr;
}

}  // namespace

dg_lm_head_kernel dg_lm_head::kernel_for_cpu(const char * env_name) {
    const char * env = env_name ? std::getenv(env_name) : nullptr;
    if (!env || !*env || !std::strcmp(env, "auto")) {
        env = std::getenv("DG_CPU_KERNELS"); // the family for every component not named on its own
    }
    if (env && *env && std::strcmp(env, "auto") != 0) {
        if (!std::strcmp(env, "avx2") && kernel_runs_here(dg_lm_head_kernel::avx2)) {
            return dg_lm_head_kernel::avx2;
        }
        if (!std::strcmp(env, "avx512-vnni") && kernel_runs_here(dg_lm_head_kernel::avx512_vnni)) {
            return dg_lm_head_kernel::avx512_vnni;
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
    group_(kernel == dg_lm_head_kernel::avx2 ? 8 : 16), amx_(kernel == dg_lm_head_kernel::avx512_vnni && amx_wanted()),
    avx_vnni_(kernel == dg_lm_head_kernel::avx2 && avx_vnni_wanted()) {}

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
    h->type_          = type;
    const int64_t G   = h->group_;
    const int64_t GBB = dg_lm_head_group_block_bytes(G);
    const int64_t nb  = h->n_blocks_;
    h->data_.assign((size_t) (h->n_groups() * nb * GBB + 64), 0);
    h->base_ = (uint8_t *) (((uintptr_t) h->data_.data() + 63) & ~(uintptr_t) 63);

    const size_t row_bytes = (size_t) nb * ggml_type_size(type);
    for (int64_t g = 0; g < h->n_groups(); ++g) {
        // the last group is padded with zero rows past the vocabulary
        pack_group((const uint8_t *) rows + g * G * row_bytes, row_bytes, type, nb, std::min(G, n_vocab - g * G), G,
                   h->base_ + g * nb * GBB);
    }
    return h;
}

std::unique_ptr<dg_lm_head> dg_lm_head::zeros(int64_t n_embd, int64_t n_vocab, dg_lm_head_kernel kernel) {
    if (n_embd <= 0 || n_embd % QK != 0 || n_vocab <= 0 || !kernel_runs_here(kernel)) {
        return nullptr;
    }
    std::unique_ptr<dg_lm_head> h(new dg_lm_head(kernel, n_embd, n_vocab));
    h->data_.assign((size_t) (h->n_groups() * h->n_blocks_ * dg_lm_head_group_block_bytes(h->group_) + 64), 0);
    h->base_ = (uint8_t *) (((uintptr_t) h->data_.data() + 63) & ~(uintptr_t) 63);
    return h;
}

void dg_lm_head::pack_blocks(const void * rows, size_t row_bytes, int64_t b0, int64_t n_blocks) {
    GGML_ASSERT(b0 >= 0 && n_blocks >= 0 && b0 + n_blocks <= n_blocks_);
    const int64_t G   = group_;
    const int64_t GBB = dg_lm_head_group_block_bytes(G);
    for (int64_t g = 0; g < n_groups(); ++g) {
        // a group's blocks follow each other: block b of group g at (g * n_blocks_ + b) * GBB
        pack_group((const uint8_t *) rows + g * G * row_bytes, row_bytes, GGML_TYPE_Q8_0, n_blocks,
                   std::min(G, n_vocab_ - g * G), G, base_ + (g * n_blocks_ + b0) * GBB);
    }
}

int64_t dg_lm_head::bytes() const {
    return n_groups() * n_blocks_ * dg_lm_head_group_block_bytes(group_);
}

int64_t dg_lm_head::act_bytes() const {
    return n_blocks_ * (QK + 4);
}

bool dg_lm_head::activations_plus_128() const {
    return kernel_ != dg_lm_head_kernel::avx2 || avx2_tile_plus_128(type_, kernel_, avx_vnni_);
}

int64_t dg_lm_head::chunk_blocks() const {
    return n_blocks_ > 2 * K_CHUNK ? K_CHUNK : n_blocks_;
}

void dg_lm_head::quantize(const float * x, int64_t ld_x, int64_t c0, int64_t c1, uint8_t * act) const {
    // chunk by chunk: each chunk's quants then its scales, as the tiles read a row of that many blocks
    const int64_t chunk = chunk_blocks();
    for (int64_t k0 = 0; k0 < n_blocks_; k0 += chunk) {
        quantize_columns(kernel_, std::min(chunk, n_blocks_ - k0), x + k0 * QK, ld_x, c0, c1, act + k0 * (QK + 4),
                         act_bytes(), /*scalar =*/ false, /*plus_128 =*/ activations_plus_128());
    }
}

#ifdef DG_LMH_X86
// A group's 16 rows of n columns (src, 16 floats each) into the result, column j's at dst(j) (64-byte
// aligned), with streaming stores: for a result far larger than the caches (the LM head's logits, 1 MB a
// column) each 64-byte piece would otherwise read its line in first and push out one the next group
// needs. The caller fences (_mm_sfence) before the result is read.
template <typename Destination>
static __attribute__((target("avx512f"))) void stream_group_rows(int64_t n, const float * src, Destination dst) {
    for (int64_t j = 0; j < n; ++j) {
        _mm512_stream_ps(dst(j), _mm512_loadu_ps(src + j * 16));
    }
}
#else
template <typename Destination> static void stream_group_rows(int64_t n, const float * src, Destination dst) {
    for (int64_t j = 0; j < n; ++j) {
        std::memcpy(dst(j), src + j * 16, 16 * sizeof(float));
    }
}
#endif

// whether a GEMM's result of this many bytes is written with streaming stores (x86-64: AVX-512's): one
// larger than a server CPU's last-level cache, where it cannot be read back from there anyway.
// DG_STREAM_RESULTS=0 turns them off, =1 on at any size (tests); read per call, for A/B runs within one
// process.
static bool streamed_result(double bytes) {
#ifdef DG_LMH_X86
    static const bool avx512 = __builtin_cpu_supports("avx512f"); // the stores' (the portable kernel runs anywhere)
    if (!avx512) {
        return false;
    }
    const char * env = std::getenv("DG_STREAM_RESULTS");
    if (env && (!std::strcmp(env, "0") || !std::strcmp(env, "1"))) {
        return env[0] == '1';
    }
    return bytes > 64e6;
#else
    (void) bytes;
    return false;
#endif
}

void dg_lm_head::gemm(const uint8_t * act, int64_t n_cols, float * out, int64_t ld_out, int64_t g0, int64_t g1) const {
    const int64_t G      = group_;
    const int64_t GBB    = dg_lm_head_group_block_bytes(G);
    const int64_t ab     = act_bytes();
    const int64_t chunk  = chunk_blocks();
    int64_t         n_wide; // columns per tile
    const tile_fn * tiles = tiles_for(kernel_, &n_wide, type_, avx_vnni_);
#ifdef DG_LMH_X86
    const tile_fn amx = amx_ && n_cols >= 16 ? tile_amx : nullptr; // 16 columns a tile, the rest on VNNI's
    if (amx) {
        amx_configure();
    }
#else
    const tile_fn amx = nullptr;
#endif
    alignas(64) float partial[16 * 16]; // a tile computed aside: the last group's (a partial group), a later
                                        // chunk's, or one streamed to the result
    // whole groups into 64-byte aligned pieces of a result larger than this machine's caches, in one chunk
    const bool stream_out = G == 16 && chunk == n_blocks_ && (uintptr_t) out % 64 == 0 && ld_out % 16 == 0 &&
                            streamed_result((double) n_vocab_ * n_cols * sizeof(float));
    const int64_t panel = panel_columns(ab * chunk / n_blocks_); // one chunk's activations per column
    for (int64_t p0 = 0; p0 < n_cols; p0 += panel) {
        const int64_t p1 = std::min(p0 + panel, n_cols);
        for (int64_t k0 = 0; k0 < n_blocks_; k0 += chunk) {
            const int64_t   nk    = std::min(chunk, n_blocks_ - k0);
            const uint8_t * act_k = act + k0 * (QK + 4); // the chunk's quants and scales (quantize)
            for (int64_t g = g0; g < g1; ++g) {
                const uint8_t * group = base_ + (g * n_blocks_ + k0) * GBB;
                const int64_t   rows  = std::min(G, n_vocab_ - g * G);
                for (int64_t c = p0, nc; c < p1; c += nc) {
                    nc                 = amx && p1 - c >= 16 ? 16 : std::min(n_wide, p1 - c);
                    const tile_fn tile = nc == 16 ? amx : tiles[nc];
                    if (rows == G && k0 == 0 && stream_out) {
                        tile(group, act_k + c * ab, ab, nk, partial, G);
                        stream_group_rows(nc, partial, [&](int64_t j) { return out + (c + j) * ld_out + g * G; });
                        continue;
                    }
                    if (rows == G && k0 == 0) {
                        tile(group, act_k + c * ab, ab, nk, out + c * ld_out + g * G, ld_out);
                        continue;
                    }
                    tile(group, act_k + c * ab, ab, nk, partial, G);
                    for (int64_t j = 0; j < nc; ++j) {
                        float * o = out + (c + j) * ld_out + g * G;
                        for (int64_t r = 0; r < rows; ++r) {
                            o[r] = k0 == 0 ? partial[j * G + r] : o[r] + partial[j * G + r];
                        }
                    }
                }
            }
        }
    }
#ifdef DG_LMH_X86
    if (amx) {
        amx_release();
    }
    if (stream_out) {
        _mm_sfence();
    }
#endif
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

int32_t dg_amx_in_use(void) {
    return amx_wanted() ? 1 : 0;
}

int32_t dg_avx_vnni_in_use(void) {
    return avx_vnni_wanted() ? 1 : 0;
}

// ---- MoE experts --------------------------------------------------------------------------------

namespace {

bool is_k_quant(ggml_type type) {
    return type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K;
}

// DG_Q4_K_TILE=0 / DG_Q6_K_TILE=0 leave that type's weights to ggml (A/B runs), wherever they sit
bool k_quant_switched_off(ggml_type type) {
    const char * off_switch = type == GGML_TYPE_Q4_K ? "DG_Q4_K_TILE" : type == GGML_TYPE_Q6_K ? "DG_Q6_K_TILE" : nullptr;
    const char * env        = off_switch ? std::getenv(off_switch) : nullptr;
    return env && !std::strcmp(env, "0");
}

bool expert_type_fits(ggml_type type, int64_t n_in, dg_lm_head_kernel kernel) {
    if (k_quant_switched_off(type)) {
        return false;
    }
    if (is_k_quant(type)) { // packed on the fly: AVX2's tiles; the VNNI family's AMX tiles, else its span tiles
        return n_in % QK_K == 0 && (kernel == dg_lm_head_kernel::avx2 || kernel == dg_lm_head_kernel::avx512_vnni);
    }
    return (type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q5_0) && n_in % QK == 0;
}

// The repacked layouts (described above the kernels), written from the file's rows: rows [0, n_rows) of
// a group of G at `rows` (row r at rows + r * row_bytes) into `out`; rows past n_rows are zeros (their
// scales 0, so they compute zeros).
void repack_group_q5_0_avx2(const uint8_t * rows, size_t row_bytes, int64_t n_blocks, int64_t n_rows, uint8_t * out) {
    constexpr int64_t G = 8;
    for (int64_t b = 0; b < n_blocks; ++b) {
        uint8_t * o = out + b * Q5_0_STORED * G;
        std::memset(o, 0, (size_t) (Q5_0_STORED * G));
        uint8_t * nibbles = o + 4 * G;
        uint8_t * fifth   = o + 20 * G;
        for (int64_t r = 0; r < n_rows; ++r) {
            const q5_0_block & blk = ((const q5_0_block *) (rows + r * row_bytes))[b];
            const q8_0_block   q8  = q8_0_of(blk);
            int16_t            sum = 0;
            for (int64_t k = 0; k < QK; ++k) {
                sum = (int16_t) (sum + q8.qs[k]);
            }
            std::memcpy(o + 2 * r, &blk.d, 2);
            std::memcpy(o + 2 * G + 2 * r, &sum, 2);
            for (int64_t q = 0; q < 4; ++q) {
                std::memcpy(nibbles + q * 4 * G + 4 * r, blk.qs + 4 * q, 4);
            }
            uint32_t high;
            std::memcpy(&high, blk.qh, sizeof(high));
            for (int64_t q = 0; q < 8; ++q) {
                for (int64_t k = 0; k < 4; ++k) {
                    fifth[4 * r + k] |= (uint8_t) (((high >> (4 * q + k)) & 1) << q);
                }
            }
        }
    }
}

// VNNI's Q8_0 and Q5_0 groups: the scales of every block first, then the blocks of quant_bytes x 16
// bytes, each row's share of a block written by write(block of the file, the group's block, row); the
// whole group zeroed first (rows past n_rows have scale 0)
template <typename Block, typename WriteQuants>
void repack_group_vnni(const uint8_t * rows, size_t row_bytes, int64_t n_blocks, int64_t n_rows, int64_t quant_bytes,
                       uint8_t * out, WriteQuants write) {
    constexpr int64_t G      = 16;
    uint8_t *         blocks = out + vnni_group_scales_bytes(n_blocks);
    std::memset(out, 0, (size_t) (vnni_group_scales_bytes(n_blocks) + n_blocks * quant_bytes * G));
    for (int64_t r = 0; r < n_rows; ++r) {
        for (int64_t b = 0; b < n_blocks; ++b) {
            const Block & blk = ((const Block *) (rows + r * row_bytes))[b];
            std::memcpy(out + (b * G + r) * 2, &blk.d, 2);
            write(blk, blocks + b * quant_bytes * G, r);
        }
    }
}

void repack_group_q8_0_vnni(const uint8_t * rows, size_t row_bytes, int64_t n_blocks, int64_t n_rows, uint8_t * out) {
    constexpr int64_t G = 16;
    repack_group_vnni<q8_0_block>(rows, row_bytes, n_blocks, n_rows, Q8_0_VNNI_QUANTS, out,
                                  [](const q8_0_block & blk, uint8_t * block, int64_t r) {
        for (int64_t q = 0; q < QK / 4; ++q) { // + 128: vpdpbusd's unsigned operand
            uint32_t four;
            std::memcpy(&four, blk.qs + 4 * q, 4);
            four ^= 0x80808080u;
            std::memcpy(block + q * 4 * G + 4 * r, &four, 4);
        }
    });
}

void repack_group_q5_0_vnni(const uint8_t * rows, size_t row_bytes, int64_t n_blocks, int64_t n_rows, uint8_t * out) {
    constexpr int64_t G = 16;
    repack_group_vnni<q5_0_block>(rows, row_bytes, n_blocks, n_rows, Q5_0_VNNI_QUANTS, out,
                                  [](const q5_0_block & blk, uint8_t * block, int64_t r) {
        uint8_t * fifth = block + 16 * G;
        for (int64_t q = 0; q < 4; ++q) {
            std::memcpy(block + q * 4 * G + 4 * r, blk.qs + 4 * q, 4);
        }
        uint32_t high;
        std::memcpy(&high, blk.qh, sizeof(high));
        for (int64_t i = 0; i < QK; ++i) { // mask q = i / 4: the bytes 16 is added to
            if ((high >> i) & 1) {
                fifth[8 * (i / 4) + (4 * r + i % 4) / 8] |= (uint8_t) (1u << ((4 * r + i % 4) % 8));
            }
        }
    });
}

void repack_group_q4_K(const uint8_t * rows, size_t row_bytes, int64_t n_super, int64_t n_rows, int64_t G,
                       uint8_t * out) {
    for (int64_t s = 0; s < n_super; ++s) {
        uint8_t * o = out + s * Q4_K_STORED * G;
        std::memset(o, 0, (size_t) (Q4_K_STORED * G));
        for (int64_t r = 0; r < n_rows; ++r) {
            const q4_K_block & blk = ((const q4_K_block *) (rows + r * row_bytes))[s];
            std::memcpy(o + 2 * r, &blk.d, 2);
            std::memcpy(o + 2 * G + 2 * r, &blk.dmin, 2);
            for (int j = 0; j < 8; ++j) {
                int sc, m;
                q4_K_scale_min(blk.scales, j, sc, m);
                o[4 * G + j * G + r]  = (uint8_t) sc;
                o[12 * G + j * G + r] = (uint8_t) m;
            }
            for (int64_t v = 0; v < 32; ++v) { // pair v / 8, step v % 8: the file's bytes 32 (v / 8) + 4 (v % 8)
                std::memcpy(o + 20 * G + v * 4 * G + 4 * r, blk.qs + 32 * (v / 8) + 4 * (v % 8), 4);
            }
        }
    }
}

void repack_group_q6_K(const uint8_t * rows, size_t row_bytes, int64_t n_super, int64_t n_rows, int64_t G,
                       bool correction, uint8_t * out) {
    const int64_t stored = correction ? Q6_K_STORED_AVX2 : Q6_K_STORED;
    const int64_t at_sc  = correction ? 6 * G : 2 * G;
    for (int64_t s = 0; s < n_super; ++s) {
        uint8_t * o = out + s * stored * G;
        std::memset(o, 0, (size_t) (stored * G));
        for (int64_t r = 0; r < n_rows; ++r) {
            const q6_K_block & blk = ((const q6_K_block *) (rows + r * row_bytes))[s];
            std::memcpy(o + 2 * r, &blk.d, 2);
            if (correction) { // 128 x the row's scaled quant sums: the AVX2 tile's +128 on the activations
                int32_t sum = 0;
                for (int64_t i = 0; i < QK_K; ++i) {
                    sum += blk.scales[i / 16] * q6_K_quant(blk, i);
                }
                const int32_t corr = 128 * sum;
                std::memcpy(o + 2 * G + 4 * r, &corr, 4);
            }
            for (int64_t j = 0; j < 16; ++j) {
                o[at_sc + j * G + r] = (uint8_t) blk.scales[j];
            }
            for (int64_t v = 0; v < 32; ++v) {
                std::memcpy(o + at_sc + 16 * G + v * 4 * G + 4 * r, blk.ql + 4 * v, 4);
            }
            for (int64_t u = 0; u < 16; ++u) {
                std::memcpy(o + at_sc + 144 * G + u * 4 * G + 4 * r, blk.qh + 4 * u, 4);
            }
        }
    }
}

}  // namespace

dg_lm_head_kernel dg_experts::kernel_for_cpu() {
    const dg_lm_head_kernel kernel = dg_lm_head::kernel_for_cpu("DG_EXPERT_GEMM");
    return kernel == dg_lm_head_kernel::avx512_vnni ? dg_lm_head_kernel::none : kernel;
}

dg_lm_head_kernel dg_experts::repack_kernel_for_cpu() {
    const dg_lm_head_kernel kernel = dg_lm_head::kernel_for_cpu("DG_EXPERT_GEMM");
    return kernel == dg_lm_head_kernel::avx2 || kernel == dg_lm_head_kernel::avx512_vnni ? kernel
                                                                                         : dg_lm_head_kernel::none;
}

bool dg_experts::repack_takes(ggml_type type, int64_t n_in, dg_lm_head_kernel kernel) {
    if ((kernel != dg_lm_head_kernel::avx2 && kernel != dg_lm_head_kernel::avx512_vnni) || !kernel_runs_here(kernel) ||
        n_in <= 0) {
        return false;
    }
    if (k_quant_switched_off(type)) {
        return false;
    }
    if (is_k_quant(type)) {
        return n_in % QK_K == 0;
    }
    return (type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q5_0) && n_in % QK == 0;
}

int64_t dg_experts::stored_group_bytes(ggml_type type, int64_t n_in, dg_lm_head_kernel kernel) {
    const int64_t G = kernel == dg_lm_head_kernel::avx2 ? 8 : 16;
    switch (type) {
        case GGML_TYPE_Q8_0:
            return G == 16 ? vnni_group_scales_bytes(n_in / QK) + n_in / QK * Q8_0_VNNI_QUANTS * G
                           : n_in / QK * dg_lm_head_group_block_bytes(G);
        case GGML_TYPE_Q5_0:
            return G == 16 ? vnni_group_scales_bytes(n_in / QK) + n_in / QK * Q5_0_VNNI_QUANTS * G
                           : n_in / QK * Q5_0_STORED * G;
        case GGML_TYPE_Q4_K: return n_in / QK_K * Q4_K_STORED * G;
        case GGML_TYPE_Q6_K:
            return n_in / QK_K * (kernel == dg_lm_head_kernel::avx2 ? Q6_K_STORED_AVX2 : Q6_K_STORED) * G;
        default: return 0;
    }
}

size_t dg_experts::repacked_bytes(ggml_type type, int64_t n_in, int64_t n_out, int64_t n_expert,
                                  dg_lm_head_kernel kernel) {
    const int64_t G = kernel == dg_lm_head_kernel::avx2 ? 8 : 16;
    return (size_t) (n_expert * ((n_out + G - 1) / G) * stored_group_bytes(type, n_in, kernel));
}

void dg_experts::repack(ggml_type type, int64_t n_in, int64_t n_out, int64_t e0, int64_t e1, dg_lm_head_kernel kernel,
                        const void * src, void * dst) {
    const int64_t G         = kernel == dg_lm_head_kernel::avx2 ? 8 : 16;
    const int64_t n_groups  = (n_out + G - 1) / G;
    const int64_t stored    = stored_group_bytes(type, n_in, kernel);
    const size_t  row_bytes = ggml_row_size(type, n_in);
    for (int64_t e = e0; e < e1; ++e) {
        for (int64_t g = 0; g < n_groups; ++g) {
            const uint8_t * rows   = (const uint8_t *) src + (e * n_out + g * G) * row_bytes;
            const int64_t   n_rows = std::min(G, n_out - g * G);
            uint8_t *       out    = (uint8_t *) dst + (e * n_groups + g) * stored;
            switch (type) {
                case GGML_TYPE_Q8_0:
                    if (G == 16) {
                        repack_group_q8_0_vnni(rows, row_bytes, n_in / QK, n_rows, out);
                    } else {
                        pack_group(rows, row_bytes, type, n_in / QK, n_rows, G, out);
                    }
                    break;
                case GGML_TYPE_Q5_0:
                    if (G == 16) {
                        repack_group_q5_0_vnni(rows, row_bytes, n_in / QK, n_rows, out);
                    } else {
                        repack_group_q5_0_avx2(rows, row_bytes, n_in / QK, n_rows, out);
                    }
                    break;
                case GGML_TYPE_Q4_K: repack_group_q4_K(rows, row_bytes, n_in / QK_K, n_rows, G, out); break;
                case GGML_TYPE_Q6_K:
                    repack_group_q6_K(rows, row_bytes, n_in / QK_K, n_rows, G, kernel == dg_lm_head_kernel::avx2, out);
                    break;
                default: GGML_ABORT("dg_experts::repack: type %s has no repacked layout", ggml_type_name(type));
            }
        }
    }
}

std::unique_ptr<dg_experts> dg_experts::over_repacked(const void * data, ggml_type type, int64_t n_in, int64_t n_out,
                                                      int64_t n_expert, dg_lm_head_kernel kernel) {
    if (!data || !repack_takes(type, n_in, kernel) || n_out <= 0 || n_expert <= 0) {
        return nullptr;
    }
    std::unique_ptr<dg_experts> experts(new dg_experts(kernel, data, type, n_in, n_out, n_expert));
    experts->repacked_ = true;
    return experts;
}

bool dg_experts::qualifies(const ggml_tensor * w) {
    return w && (w->type == GGML_TYPE_Q8_0 || w->type == GGML_TYPE_Q5_0 || is_k_quant(w->type)) &&
           w->extra == nullptr && w->buffer && ggml_backend_buffer_is_host(w->buffer) && ggml_is_contiguous(w) &&
           ggml_n_dims(w) <= 3 && w->ne[3] == 1 && w->ne[0] % ggml_blck_size(w->type) == 0;
}

std::unique_ptr<dg_experts> dg_experts::make(const ggml_tensor * w, dg_lm_head_kernel kernel) {
    return qualifies(w) ? make(w->data, w->type, w->ne[0], w->ne[1], w->ne[2], kernel) : nullptr;
}

std::unique_ptr<dg_experts> dg_experts::make(const void * data, ggml_type type, int64_t n_in, int64_t n_out,
                                             int64_t n_expert, dg_lm_head_kernel kernel) {
    if (!data || n_in <= 0 || !expert_type_fits(type, n_in, kernel) || n_out <= 0 || n_expert <= 0 ||
        !kernel_runs_here(kernel)) {
        return nullptr;
    }
    return std::unique_ptr<dg_experts>(new dg_experts(kernel, data, type, n_in, n_out, n_expert));
}

dg_experts::dg_experts(dg_lm_head_kernel kernel, const void * data, ggml_type type, int64_t n_in, int64_t n_out,
                       int64_t n_expert) :
    kernel_(kernel), data_((const uint8_t *) data), type_(type), n_in_(n_in), n_out_(n_out), n_expert_(n_expert),
    n_blocks_(n_in / QK), group_(kernel == dg_lm_head_kernel::avx2 ? 8 : 16), row_bytes_(ggml_row_size(type, n_in)),
    amx_(amx_wanted()), avx_vnni_(kernel == dg_lm_head_kernel::avx2 && avx_vnni_wanted()) {}

int64_t dg_experts::act_bytes() const {
    if (type_ == GGML_TYPE_Q6_K && kernel_ == dg_lm_head_kernel::avx512_vnni && !amx_k_quant()) {
        return n_in_ / QK_K * Q8_K_BYTES_SUMS16;
    }
    if (signed_activations()) {
        return n_blocks_ * (QK + 8);
    }
    return is_k_quant(type_) ? n_in_ / QK_K * Q8_K_BYTES : n_blocks_ * (QK + 4);
}

bool dg_experts::signed_activations() const {
    return repacked_ && kernel_ == dg_lm_head_kernel::avx512_vnni && (type_ == GGML_TYPE_Q8_0 || type_ == GGML_TYPE_Q5_0);
}

bool dg_experts::avx2_activations_plus_128() const {
    return avx2_tile_plus_128(type_, kernel_, avx_vnni_);
}

int64_t dg_experts::group_bytes() const {
    if (repacked_ && kernel_ == dg_lm_head_kernel::avx512_vnni) {
        return 0; // its tiles read the repacked layout
    }
    if (amx_k_quant()) {
        return n_in_ / QK_K * (type_ == GGML_TYPE_Q4_K ? Q4_K_AMX_SB_BYTES : Q6_K_AMX_SB_BYTES);
    }
    if (vnni_k_quant_on_the_fly()) {
        return stored_group_bytes(type_, n_in_, kernel_);
    }
    if (is_k_quant(type_)) {
        return n_in_ / QK_K * (type_ == GGML_TYPE_Q4_K ? Q4_K_SB_BYTES : Q6_K_SB_BYTES);
    }
    return n_blocks_ * dg_lm_head_group_block_bytes(group_);
}

void dg_experts::quantize(const float * x, int64_t ld_x, int64_t r0, int64_t r1, uint8_t * act, bool scalar) const {
    if (type_ == GGML_TYPE_Q6_K && kernel_ == dg_lm_head_kernel::avx512_vnni && !amx_k_quant()) {
        quantize_columns_q8_K(n_in_ / QK_K, x, ld_x, r0, r1, act, 0, /*sums16 =*/ true, scalar);
    } else if (is_k_quant(type_)) {
        // AVX2's Q6_K tile takes them + 128 (vpmaddubsw's unsigned operand); AMX's signed
        quantize_columns_q8_K(n_in_ / QK_K, x, ld_x, r0, r1, act,
                              type_ == GGML_TYPE_Q6_K && kernel_ == dg_lm_head_kernel::avx2 ? 0x80 : 0, false, scalar);
    } else if (signed_activations()) {
        // the quants signed (offset 0), then after the scales each block's start: -(the weights' offset) x
        // the sum of its quants
        const int32_t weight_offset = type_ == GGML_TYPE_Q8_0 ? 128 : 16;
        const int64_t row_bytes     = act_bytes();
        quantize_columns(kernel_, n_blocks_, x, ld_x, r0, r1, act, row_bytes, scalar, false, /*signed_quants =*/ true);
        for (int64_t r = r0; r < r1; ++r) {
            uint8_t * row = act + r * row_bytes;
            for (int64_t b = 0; b < n_blocks_; ++b) {
                int32_t sum = 0;
                for (int64_t k = 0; k < QK; ++k) {
                    sum += (int8_t) row[b * QK + k];
                }
                const int32_t start = -weight_offset * sum;
                std::memcpy(row + n_blocks_ * (QK + 4) + b * 4, &start, sizeof(start));
            }
        }
    } else {
        quantize_columns(kernel_, n_blocks_, x, ld_x, r0, r1, act, n_blocks_ * (QK + 4), scalar,
                         avx2_activations_plus_128());
    }
}

bool dg_experts::amx_k_quant() const {
    return is_k_quant(type_) && kernel_ == dg_lm_head_kernel::avx512_vnni && !repacked_ && amx_;
}

bool dg_experts::vnni_k_quant_on_the_fly() const {
    return is_k_quant(type_) && kernel_ == dg_lm_head_kernel::avx512_vnni && !repacked_ && !amx_;
}

void dg_experts::pack(const uint8_t * first_row, int64_t rows, uint8_t * group) const {
    if (vnni_k_quant_on_the_fly()) { // the repacked layout, which the span tiles read
#ifdef DG_LMH_X86
        if (rows == 16 && row_bytes_ * 15 <= INT32_MAX) {
            (type_ == GGML_TYPE_Q4_K ? repack_group_q4_K_vnni16 : repack_group_q6_K_vnni16)(first_row, (int32_t) row_bytes_,
                                                                                        n_in_ / QK_K, group);
            return;
        }
#endif
        if (type_ == GGML_TYPE_Q4_K) {
            repack_group_q4_K(first_row, row_bytes_, n_in_ / QK_K, rows, 16, group);
        } else {
            repack_group_q6_K(first_row, row_bytes_, n_in_ / QK_K, rows, 16, false, group);
        }
        return;
    }
    if (amx_k_quant()) {
        const bool q4_K = type_ == GGML_TYPE_Q4_K;
#ifdef DG_LMH_X86
        static const bool vbmi = __builtin_cpu_supports("avx512vbmi"); // Q4_K's vector packer
        if (rows == 16 && row_bytes_ * 15 <= INT32_MAX && (vbmi || !q4_K)) {
            (q4_K ? pack_group_q4_K_amx16 : pack_group_q6_K_amx16)(first_row, (int32_t) row_bytes_, n_in_ / QK_K, group);
            return;
        }
#endif
        if (q4_K) {
            pack_group_q4_K_amx(first_row, row_bytes_, n_in_ / QK_K, rows, group);
        } else {
            pack_group_q6_K_amx(first_row, row_bytes_, n_in_ / QK_K, rows, group);
        }
        return;
    }
    if (type_ == GGML_TYPE_Q4_K) {
#ifdef DG_LMH_X86
        if (rows == Q4_K_GROUP) {
            pack_group_q4_K_avx2(first_row, row_bytes_, n_in_ / QK_K, group);
            return;
        }
#endif
        pack_group_q4_K(first_row, row_bytes_, n_in_ / QK_K, rows, Q4_K_GROUP, group);
        return;
    }
    if (type_ == GGML_TYPE_Q6_K) {
#ifdef DG_LMH_X86
        if (rows == 8) {
            pack_group_q6_K_avx2(first_row, row_bytes_, n_in_ / QK_K, group);
            return;
        }
#endif
        pack_group_q6_K(first_row, row_bytes_, n_in_ / QK_K, rows, group);
        return;
    }
#ifdef DG_LMH_X86
    if (kernel_ == dg_lm_head_kernel::avx2 && rows == group_) {
        pack_group_avx2(first_row, row_bytes_, type_, n_blocks_, group);
        return;
    }
#endif
    pack_group(first_row, row_bytes_, type_, n_blocks_, rows, group_, group);
}

const uint8_t * dg_experts::stage(int64_t e, int64_t g, uint8_t * buffer) const {
    const int64_t G = group_;
    if (!repacked_) {
        pack(data_ + (e * n_out_ + g * G) * row_bytes_, std::min(G, n_out_ - g * G), buffer);
        return buffer;
    }
    const int64_t   n_groups = (n_out_ + G - 1) / G;
    const uint8_t * stored   = data_ + (e * n_groups + g) * stored_group_bytes(type_, n_in_, kernel_);
    if (type_ == GGML_TYPE_Q8_0 || kernel_ == dg_lm_head_kernel::avx512_vnni) {
        return stored; // the tiles read it as it is
    }
#ifdef DG_LMH_X86
    switch (type_) {
        case GGML_TYPE_Q5_0: unpack_q5_0_avx2(stored, n_blocks_, buffer); return buffer;
        case GGML_TYPE_Q4_K: unpack_q4_K_avx2(stored, n_in_ / QK_K, buffer); return buffer;
        case GGML_TYPE_Q6_K: unpack_q6_K_avx2(stored, n_in_ / QK_K, buffer); return buffer;
        default:             break;
    }
#endif
    GGML_ABORT("dg_experts::stage: no repacked layout for %s", ggml_type_name(type_));
}

// one output column's rows of a group: a whole group in a fixed-size copy the compiler inlines (a call
// per column and group cost as much as a few percent of a step)
static inline void copy_group_rows(char * dst, const float * src, int64_t rows) {
    if (rows == 16) {
        std::memcpy(dst, src, 16 * sizeof(float));
    } else if (rows == 8) {
        std::memcpy(dst, src, 8 * sizeof(float));
    } else {
        std::memcpy(dst, src, (size_t) rows * sizeof(float));
    }
}

// bytes [from, to) of p prefetched into the caches (p null: none); addresses past a tensor's end do not fault
static inline void prefetch_range(const uint8_t * p, int64_t from, int64_t to) {
    for (int64_t i = from; p && i < to; i += 64) {
        __builtin_prefetch(p + i, 0, 3);
    }
}

void dg_experts::gemm(const uint8_t * act, int64_t n_act_slots, const int32_t * ids, int64_t ld_ids, int64_t n_used,
                      int64_t n_tokens, char * out, size_t nb_slot, size_t nb_token, int ith, int nth) const {
    const int64_t G        = group_;
    const int64_t n_groups = (n_out_ + G - 1) / G;
    const int64_t ab       = act_bytes();
    int64_t         n_wide     = 8;
    // the repacked experts on VNNI, and its K-quants packed on the fly into that layout where AMX does not
    // run: tiles over spans of blocks of the repacked layout itself
    const span_tile_fn * spans = repacked_ || vnni_k_quant_on_the_fly() ? span_tiles_for(kernel_, type_) : nullptr;
    const bool           amx   = amx_k_quant(); // 16 columns a tile, the last tile's padded with zero columns
    // whole 16-row groups into 64-byte aligned pieces of a result larger than this machine's caches. AMX's
    // route only: the span tiles' (the K-quants packed on the fly where AMX does not run) gained at 1 thread
    // and lost at 2 (docs/performance.md)
    const bool stream_out = amx && n_out_ % 16 == 0 && (uintptr_t) out % 64 == 0 && nb_slot % 64 == 0 &&
                            nb_token % 64 == 0 && streamed_result((double) n_out_ * n_used * n_tokens * sizeof(float));
    const tile_fn *      tiles = spans || amx ? nullptr : tiles_for(kernel_, &n_wide, type_, avx_vnni_);
    // where row r0 of (slot, token) pair p lies in the result
    const auto destination = [&](int64_t p, int64_t r0) {
        return out + (p % n_used) * nb_slot + (p / n_used) * nb_token + r0 * (int64_t) sizeof(float);
    };
    // a group's rows of n columns (src: G floats each), column j's to pair pairs_of[j]'s rows
    const auto write_group = [&](const int64_t * pairs_of, int64_t n, const float * src, int64_t g, int64_t rows) {
        if (stream_out) {
            stream_group_rows(n, src, [&](int64_t j) { return (float *) destination(pairs_of[j], g * G); });
            return;
        }
        for (int64_t j = 0; j < n; ++j) {
            copy_group_rows(destination(pairs_of[j], g * G), src + j * G, rows);
        }
    };
#ifdef DG_LMH_X86
    if (amx) {
        amx_configure(64); // the quants a TDP takes; this thread's, for the call
    }
#endif

    // the (slot, token) pairs routed to each expert, in token order; every thread builds the same lists
    thread_local std::vector<int64_t> first, routed;
    first.assign((size_t) n_expert_ + 1, 0);
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t u = 0; u < n_used; ++u) {
            const int32_t e = ids[u + t * ld_ids];
            GGML_ASSERT(e >= 0 && e < n_expert_);
            ++first[(size_t) e + 1];
        }
    }
    for (int64_t e = 0; e < n_expert_; ++e) {
        first[(size_t) e + 1] += first[(size_t) e];
    }
    routed.resize((size_t) (n_used * n_tokens));
    {
        thread_local std::vector<int64_t> next;
        next.assign(first.begin(), first.end() - 1);
        for (int64_t t = 0; t < n_tokens; ++t) {
            for (int64_t u = 0; u < n_used; ++u) {
                routed[(size_t) next[(size_t) ids[u + t * ld_ids]]++] = u + t * n_used;
            }
        }
    }

    // This thread's share of the (expert, group) pairs, by cost: a group's packing from the file's
    // layout costs about as much as running it against three columns (AMX's sixteen, a K-quant's repacking
    // for VNNI's span tiles eight), its unpacking from the repacked one about one (nothing where the tiles
    // read it as stored: Q8_0, and every type on VNNI).
    const int64_t PACK_COST = amx                         ? 16
                              : vnni_k_quant_on_the_fly() ? 8
                              : !repacked_                ? 3
                              : type_ == GGML_TYPE_Q8_0 || kernel_ == dg_lm_head_kernel::avx512_vnni ? 0
                                                                                                      : 1;
    int64_t           total     = 0;
    for (int64_t e = 0; e < n_expert_; ++e) {
        const int64_t n = first[(size_t) e + 1] - first[(size_t) e];
        total += n ? n_groups * (n + PACK_COST) : 0;
    }
    const int64_t lo = total * ith / nth, hi = total * (ith + 1) / nth;

    thread_local std::vector<uint8_t> packed, gathered;
    thread_local std::vector<float>   sums;
    const bool        prefetch     = repacked_ && expert_prefetch_wanted();
    const bool        file_prefetch = !repacked_ && !amx && expert_prefetch_wanted(); // groups packed from the file
    const int64_t     stored_bytes = repacked_ ? stored_group_bytes(type_, n_in_, kernel_) : 0;
    packed.resize((size_t) (group_bytes() + 64));
    uint8_t * group = align_64(packed.data());
    float     tile_out[16 * 8];

    for (int64_t e = 0, start = 0; e < n_expert_ && start < hi; ++e) {
        const int64_t n = first[(size_t) e + 1] - first[(size_t) e];
        if (n == 0) {
            continue;
        }
        const int64_t cost = n + PACK_COST; // per group
        // groups g with start + g * cost in [lo, hi)
        const int64_t g0 = std::max<int64_t>(0, (lo - start + cost - 1) / cost);
        const int64_t g1 = std::min<int64_t>(n_groups, std::max<int64_t>(0, (hi - start + cost - 1) / cost));
        start += n_groups * cost;
        if (g0 >= g1) {
            continue;
        }
        const int64_t * pairs = routed.data() + first[(size_t) e];
        // the expert's activation rows, contiguous for the tiles (AMX's: whole tiles of 16, zeros past n)
        gathered.resize((size_t) ((amx ? (n + 15) / 16 * 16 : n) * ab));
        if (amx) {
            std::memset(gathered.data() + n * ab, 0, gathered.size() - (size_t) (n * ab));
        }
        for (int64_t j = 0; j < n; ++j) {
            const int64_t u = pairs[j] % n_used, t = pairs[j] / n_used;
            std::memcpy(gathered.data() + j * ab, act + ((u % n_act_slots) + t * n_act_slots) * ab, (size_t) ab);
        }
        // the columns in tiles of near-equal widths (19: 7 + 6 + 6, not 8 + 8 + 3: a narrow tile reloads
        // the weights for few columns)
        const int64_t n_tiles = (n + n_wide - 1) / n_wide;
        for (int64_t g = g0; g < g1; ++g) {
            const int64_t   rows   = std::min(G, n_out_ - g * G);
            const uint8_t * staged = stage(e, g, group);
            if (spans && !repacked_) {
                // a group packed here: each column tile over all its blocks (their weights stay in L1); the
                // next group's rows in the file prefetched meanwhile, a share after each tile
                const int64_t   rows_bytes = G * (int64_t) row_bytes_;
                const uint8_t * next = file_prefetch && g + 1 < g1 ? data_ + (e * n_out_ + (g + 1) * G) * row_bytes_ : nullptr;
                for (int64_t c = 0, tile = 0; c < n; ++tile) {
                    const int64_t nc = n / n_tiles + (tile < n % n_tiles ? 1 : 0);
                    std::memset(tile_out, 0, sizeof(tile_out));
                    spans[nc](staged, gathered.data() + c * ab, ab, n_blocks_, 0, n_blocks_, tile_out, G);
                    prefetch_range(next, rows_bytes * tile / n_tiles, rows_bytes * (tile + 1) / n_tiles);
                    write_group(pairs + c, nc, tile_out, g, rows);
                    c += nc;
                }
                continue;
            }
            if (spans) {
                // the expert's rows [g0 G, g1 G) of every column are summed here and copied out once the
                // expert is done: one contiguous row per column, where a group's 64-byte piece per column
                // would land in a line and page far from the last one (the result's rows are n_used x
                // n_out floats apart)
                const int64_t width = (g1 - g0) * G;
                if (g == g0) {
                    sums.assign((size_t) (n * width), 0.0f);
                }
                float * at = sums.data() + (g - g0) * G;
                // every column tile over a span of blocks (8: ~2.3-4.6 KB of weights, kept in L1) before the
                // next span, so that the group's weights stream from memory once, without pauses; where
                // wanted, the next group's same span is prefetched meanwhile
                const uint8_t * next = prefetch && g + 1 < g1 ? staged + stored_bytes : nullptr;
                for (int64_t b0 = 0; b0 < n_blocks_; b0 += 8) {
                    prefetch_range(next, b0 * stored_bytes / n_blocks_, std::min(b0 + 8, n_blocks_) * stored_bytes / n_blocks_);
                    for (int64_t c = 0, tile = 0; c < n; ++tile) {
                        const int64_t nc = n / n_tiles + (tile < n % n_tiles ? 1 : 0);
                        spans[nc](staged, gathered.data() + c * ab, ab, n_blocks_, b0, std::min(b0 + 8, n_blocks_),
                                  at + c * width, width);
                        c += nc;
                    }
                }
                if (g + 1 == g1) {
                    const int64_t r0 = g0 * G, r1 = std::min(g1 * G, n_out_);
                    for (int64_t j = 0; j < n; ++j) {
                        std::memcpy(destination(pairs[j], r0), sums.data() + j * width, (size_t) (r1 - r0) * sizeof(float));
                    }
                }
                continue;
            }
#ifdef DG_LMH_X86
            if (amx) {
                const int64_t n_cols = (n + 15) / 16 * 16, n_super = n_in_ / QK_K;
                thread_local std::vector<float>   columns;
                thread_local std::vector<uint8_t> tiled;
                columns.resize((size_t) (n_cols * 16));
                if (g == g0) { // the expert's activations, once
                    tiled.resize((size_t) (n_cols / 16 * n_super * K_QUANT_AMX_ACT_BYTES + 64));
                    tile_activations_amx(gathered.data(), ab, n_super, n_cols, align_64(tiled.data()));
                }
                (type_ == GGML_TYPE_Q4_K ? gemm_split_amx<true> : gemm_split_amx<false>)(staged, align_64(tiled.data()), n_super,
                                                                                         n_cols, columns.data());
                write_group(pairs, n, columns.data(), g, rows);
                continue;
            }
#endif
            // the groups unpacked or packed here (AVX2): the next group's stored bytes or file rows prefetched
            // where wanted, a share after each column tile
            const int64_t   next_bytes = repacked_ ? stored_bytes : G * (int64_t) row_bytes_;
            const uint8_t * next       = g + 1 >= g1                 ? nullptr
                                         : prefetch                  ? data_ + (e * n_groups + g + 1) * stored_bytes
                                         : file_prefetch             ? data_ + (e * n_out_ + (g + 1) * G) * row_bytes_
                                                                     : nullptr;
            for (int64_t c = 0, tile = 0; c < n; ++tile) {
                const int64_t nc = n / n_tiles + (tile < n % n_tiles ? 1 : 0);
                tiles[nc](staged, gathered.data() + c * ab, ab, n_blocks_, tile_out, G);
                prefetch_range(next, next_bytes * tile / n_tiles, next_bytes * (tile + 1) / n_tiles);
                write_group(pairs + c, nc, tile_out, g, rows);
                c += nc;
            }
        }
    }
#ifdef DG_LMH_X86
    if (amx) {
        amx_release();
    }
    if (stream_out) {
        _mm_sfence(); // the streamed stores ordered before the graph's barrier releases the result
    }
#endif
}

void dg_experts_quantize_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto &        experts = *(const dg_experts *) userdata;
    const ggml_tensor * x       = dst->src[0]; // F32 [n_in, rows], contiguous rows
    const int64_t       n       = x->ne[1];
    experts.quantize((const float *) x->data, x->nb[1] / sizeof(float), ith * n / nth, (ith + 1) * n / nth,
                     (uint8_t *) dst->data);
}

void dg_experts_gemm_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto &        experts = *(const dg_experts *) userdata;
    const ggml_tensor * act     = dst->src[0]; // I8 [act_bytes, n_act_slots * n_tokens]
    const ggml_tensor * ids     = dst->src[1]; // I32 [n_used, n_tokens]
    const int64_t       n_used = ids->ne[0], n_tokens = ids->ne[1];
    experts.gemm((const uint8_t *) act->data, act->ne[1] / n_tokens, (const int32_t *) ids->data,
                 ids->nb[1] / sizeof(int32_t), n_used, n_tokens, (char *) dst->data, dst->nb[1], dst->nb[2], ith, nth);
}

void dg_experts_dense_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto &        experts  = *(const dg_experts *) userdata;
    const ggml_tensor * act      = dst->src[0]; // I8 [act_bytes, n_tokens]
    const int64_t       n_tokens = act->ne[1];
    // every token routed to the one expert
    thread_local std::vector<int32_t> expert_0;
    expert_0.assign((size_t) n_tokens, 0);
    experts.gemm((const uint8_t *) act->data, 1, expert_0.data(), 1, 1, n_tokens, (char *) dst->data, 0, dst->nb[1],
                 ith, nth);
}

#include "diffusion-gemma-int8-selftest.inc"
