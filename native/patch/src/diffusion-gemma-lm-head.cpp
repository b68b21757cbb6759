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

#if defined(__unix__) || defined(__APPLE__)
#    include <unistd.h>
#endif

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
    return std::clamp<int64_t>(l2 / 2 / act_bytes / 8 * 8, 16, 256);
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

// A Q4_K row group of 8 in the tiles' layout, per super-block: the 8 sub-blocks' scales d * sc_j
// (float [sub-block][row]), their offsets dmin * m_j (the same), then per sub-block 8 x (8 x 4) quants
// as unsigned bytes. Both products of an fp16 and a 6-bit integer are exact in float.
constexpr int64_t Q4_K_GROUP  = 8;
constexpr int64_t Q4_K_SB_BYTES = 2 * 8 * Q4_K_GROUP * 4 + 8 * 8 * Q4_K_GROUP * 4;

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

// rows [0, n_rows) of a Q4_K group (row r at rows + r * row_bytes) in that layout; rows past n_rows
// are zero (scales and offsets 0), so a partial last group computes zeros
void pack_group_q4_K(const uint8_t * rows, size_t row_bytes, int64_t n_super, int64_t n_rows, uint8_t * out) {
    constexpr int64_t G = Q4_K_GROUP;
    for (int64_t s = 0; s < n_super; ++s) {
        uint8_t * o = out + s * Q4_K_SB_BYTES;
        std::memset(o, 0, (size_t) Q4_K_SB_BYTES);
        float * scales  = (float *) o;
        float * offsets = scales + 8 * G;
        uint8_t * quants = o + 2 * 8 * G * 4;
        for (int64_t r = 0; r < n_rows; ++r) {
            const q4_K_block & blk = ((const q4_K_block *) (rows + r * row_bytes))[s];
            const float d = ggml_fp16_to_fp32(blk.d), dmin = ggml_fp16_to_fp32(blk.dmin);
            for (int j = 0; j < 8; ++j) {
                int sc, m;
                q4_K_scale_min(blk.scales, j, sc, m);
                scales[j * G + r]  = d * (float) sc;
                offsets[j * G + r] = dmin * (float) m;
                for (int k = 0; k < QK; ++k) {
                    const uint8_t byte = blk.qs[(j / 2) * QK + k];
                    quants[j * 8 * 4 * G + (k / 4) * 4 * G + 4 * r + k % 4] = j % 2 ? byte >> 4 : byte & 0x0F;
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

// Columns [c0, c1) of x (n_super * 256 values each) as ggml's quantize_row_q8_K_ref writes them
// (per 256: the value of largest magnitude, first of equals, maps to -127; round-to-even), into
// the layout above; `flip` 0x80 stores each quant + 128 as an unsigned byte (the AVX2 Q6_K tile's
// operand); `sums16` writes the VNNI Q6_K tile's layout instead (Q8_K_BYTES_SUMS16).
void quantize_columns_q8_K(int64_t n_super, const float * x, int64_t ld_x, int64_t c0, int64_t c1, uint8_t * act,
                          uint8_t flip = 0, bool sums16 = false) {
    const int64_t bytes = sums16 ? Q8_K_BYTES_SUMS16 : Q8_K_BYTES;
    for (int64_t c = c0; c < c1; ++c) {
        for (int64_t s = 0; s < n_super; ++s) {
            const float * v = x + c * ld_x + s * QK_K;
            uint8_t *     o = act + (c * n_super + s) * bytes;
            float max = 0.0f, amax = 0.0f;
            for (int64_t k = 0; k < QK_K; ++k) {
                if (std::fabs(v[k]) > amax) {
                    amax = std::fabs(v[k]);
                    max  = v[k];
                }
            }
            float   d = 0.0f, sums[8] = {};
            int32_t sums_16[16] = {};
            if (amax != 0.0f) {
                const float iscale = -127.0f / max;
                for (int64_t k = 0; k < QK_K; ++k) {
                    const int8_t q = (int8_t) std::min(127, (int) std::nearbyint(iscale * v[k]));
                    o[k] = (uint8_t) q ^ flip;
                    sums[k / QK] += q;
                    sums_16[k / 16] += q;
                }
                d = 1.0f / iscale;
            } else {
                std::memset(o, flip, QK_K);
            }
            std::memcpy(o + QK_K, &d, sizeof(d));
            if (sums16) {
                for (int j = 0; j < 16; ++j) {
                    const int32_t start = -32 * sums_16[j];
                    std::memcpy(o + QK_K + 4 + 4 * j, &start, sizeof(start));
                }
                continue;
            }
            for (int j = 0; j < 8; ++j) {
                const float b = d * sums[j];
                std::memcpy(o + QK_K + 4 + 4 * j, &b, sizeof(b));
            }
        }
    }
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

// The 32 int8 quants of a Q8_0 or Q5_0 block (Q5_0: the nibbles, the fifth bits spread to bytes, minus 16).
__attribute__((target("avx2"))) inline __m256i quants_avx2(const uint8_t * block, ggml_type type) {
    if (type == GGML_TYPE_Q8_0) {
        return _mm256_loadu_si256((const __m256i *) (block + 2));
    }
    const __m128i packed = _mm_loadu_si128((const __m128i *) (block + 6));
    const __m256i nibbles =
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
    uint32_t high;
    std::memcpy(&high, block + 2, sizeof(high));
    // byte j of the vector: byte j / 8 of `high`, then all ones where bit j % 8 of it is set
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int) high),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0x0000000000000000));
    const __m256i bits = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                           _mm256_set1_epi64x(-1));
    return _mm256_sub_epi8(_mm256_or_si256(nibbles, _mm256_and_si256(bits, _mm256_set1_epi8(0x10))),
                           _mm256_set1_epi8(16));
}

// rows[i] holds 32 quants of row i: stored as 8 words of the tiles' layout, word q = quants
// 4q..4q+3 of every row (an 8 x 8 transpose of 4-quant words)
__attribute__((target("avx2"))) inline void store_interleaved_avx2(const __m256i * r, uint8_t * out) {
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    // q < 4 from the low lanes, q >= 4 from the high ones
    __m256i * words = (__m256i *) out;
    const __m256i lo[4] = { u0, u1, u2, u3 }, hi[4] = { u4, u5, u6, u7 };
    for (int q = 0; q < 4; ++q) {
        _mm256_storeu_si256(words + q, _mm256_permute2x128_si256(lo[q], hi[q], 0x20));
        _mm256_storeu_si256(words + q + 4, _mm256_permute2x128_si256(lo[q], hi[q], 0x31));
    }
}

// pack_group for a whole 8-row group of the AVX2 layout, vectorized. The quant sums are left out:
// the AVX2 tile does not read them.
__attribute__((target("avx2"))) void pack_group_avx2(const uint8_t * rows, size_t row_bytes, ggml_type type,
                                                      int64_t n_blocks, uint8_t * out) {
    constexpr int64_t G   = 8;
    const size_t      blk = ggml_type_size(type);
    for (int64_t b = 0; b < n_blocks; ++b) {
        uint8_t * o = out + b * 36 * G;
        __m256i   r[G];
        for (int64_t i = 0; i < G; ++i) {
            const uint8_t * block = rows + i * row_bytes + b * blk;
            std::memcpy(o + 2 * i, block, 2); // the fp16 scale
            r[i] = quants_avx2(block, type);
        }
        store_interleaved_avx2(r, o + 4 * G);
    }
}

// pack_group_q4_K for a whole group, the nibbles spread and interleaved in registers
__attribute__((target("avx2"))) void pack_group_q4_K_avx2(const uint8_t * rows, size_t row_bytes, int64_t n_super,
                                                            uint8_t * out) {
    constexpr int64_t G = Q4_K_GROUP;
    const __m256i     low = _mm256_set1_epi8(0x0F);
    for (int64_t s = 0; s < n_super; ++s) {
        uint8_t * o       = out + s * Q4_K_SB_BYTES;
        float *   scales  = (float *) o;
        float *   offsets = scales + 8 * G;
        const q4_K_block * blk[G];
        for (int64_t r = 0; r < G; ++r) {
            blk[r] = (const q4_K_block *) (rows + r * row_bytes) + s;
            const float d = ggml_fp16_to_fp32(blk[r]->d), dmin = ggml_fp16_to_fp32(blk[r]->dmin);
            for (int j = 0; j < 8; ++j) {
                int sc, m;
                q4_K_scale_min(blk[r]->scales, j, sc, m);
                scales[j * G + r]  = d * (float) sc;
                offsets[j * G + r] = dmin * (float) m;
            }
        }
        for (int j = 0; j < 8; ++j) {
            __m256i q[G];
            for (int64_t r = 0; r < G; ++r) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *) (blk[r]->qs + (j / 2) * QK));
                q[r] = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, low);
            }
            store_interleaved_avx2(q, o + 2 * 8 * G * 4 + j * 8 * 4 * G);
        }
    }
}

// 8 Q4_K rows x NC columns on AVX2: per 4 quants of the group, vpmaddubsw of the unsigned quants
// against the activation's; a sub-block's 8 such pair sums stay within int16 (8 x 2 x 15 x 128),
// then vpmaddwd, and per sub-block the scale and the offset times the activation's sum.
template <int NC>
__attribute__((target("avx2,fma"))) void tile_q4_K_avx2(const uint8_t * group, const uint8_t * act,
                                                         int64_t act_bytes, int64_t n_blocks, float * out,
                                                         int64_t ld_out) {
    constexpr int64_t G       = Q4_K_GROUP;
    const int64_t     n_super = n_blocks / 8;
    const __m256i     ones    = _mm256_set1_epi16(1);

    __m256 acc[NC];
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
        acc[c] = _mm256_setzero_ps();
    }
    for (int64_t s = 0; s < n_super; ++s) {
        const uint8_t * w = group + s * Q4_K_SB_BYTES;
        const uint8_t * a = act + s * Q8_K_BYTES;
        for (int j = 0; j < 8; ++j) {
            const uint8_t * quants = w + 2 * 8 * G * 4 + j * 8 * 4 * G;
            __m256i         sum[NC];
            _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
                sum[c] = _mm256_setzero_si256();
            }
            _Pragma("GCC unroll 8") for (int q = 0; q < 8; ++q) {
                const __m256i wq = _mm256_loadu_si256((const __m256i *) (quants + q * 4 * G));
                _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
                    int32_t four;
                    std::memcpy(&four, a + c * act_bytes + j * QK + 4 * q, sizeof(four));
                    sum[c] = _mm256_add_epi16(sum[c], _mm256_maddubs_epi16(wq, _mm256_set1_epi32(four)));
                }
            }
            const __m256 scale  = _mm256_loadu_ps((const float *) w + j * G);
            const __m256 offset = _mm256_loadu_ps((const float *) w + 8 * G + j * G);
            _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
                float d, b;
                std::memcpy(&d, a + c * act_bytes + QK_K, sizeof(d));
                std::memcpy(&b, a + c * act_bytes + QK_K + 4 + 4 * j, sizeof(b));
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[c], ones));
                acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(scale, dot), _mm256_set1_ps(d), acc[c]);
                acc[c] = _mm256_fnmadd_ps(offset, _mm256_set1_ps(b), acc[c]);
            }
        }
    }
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
        _mm256_storeu_ps(out + c * ld_out, acc[c]);
    }
}

// pack_group_q6_K for a whole group: the 6-bit quants assembled, the scales paired and the corrections
// summed in registers
__attribute__((target("avx2"))) void pack_group_q6_K_avx2(const uint8_t * rows, size_t row_bytes, int64_t n_super,
                                                            uint8_t * out) {
    constexpr int64_t G    = 8;
    const __m256i     low  = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
    const __m256i     ones = _mm256_set1_epi8(1);
    for (int64_t s = 0; s < n_super; ++s) {
        uint8_t * o      = out + s * Q6_K_SB_BYTES;
        float *   d      = (float *) o;
        int32_t * corr   = (int32_t *) (o + 32);
        uint8_t * quants = o + 64 + 16 * 32;
        const q6_K_block * blk[G];
        __m256i            pairs[2][G]; // per row, sub-blocks 0..7 and 8..15: the scale twice per int32
        for (int64_t r = 0; r < G; ++r) {
            blk[r] = (const q6_K_block *) (rows + r * row_bytes) + s;
            d[r]   = ggml_fp16_to_fp32(blk[r]->d);
            const __m128i sc = _mm_loadu_si128((const __m128i *) blk[r]->scales);
            for (int half = 0; half < 2; ++half) {
                const __m256i sc32 = _mm256_cvtepi8_epi32(half ? _mm_srli_si128(sc, 8) : sc);
                pairs[half][r] = _mm256_or_si256(_mm256_and_si256(sc32, _mm256_set1_epi32(0xFFFF)),
                                                 _mm256_slli_epi32(sc32, 16));
            }
        }
        // the 8 x 8 transpose of 32-bit words that interleaves the quants puts sub-block j's pair of every
        // row in one vector
        store_interleaved_avx2(pairs[0], o + 64);
        store_interleaved_avx2(pairs[1], o + 64 + 8 * 32);

        __m256i weighted[G]; // per row: sum_j sc_j * (quants of sub-block j), in 8 partial lanes
        for (int64_t r = 0; r < G; ++r) {
            weighted[r] = _mm256_setzero_si256();
        }
        for (int h = 0; h < 2; ++h) {
            __m256i q[4][G]; // quants 128h + 32k .. +31 of each row
            for (int64_t r = 0; r < G; ++r) {
                const __m256i l0 = _mm256_loadu_si256((const __m256i *) (blk[r]->ql + 64 * h));
                const __m256i l1 = _mm256_loadu_si256((const __m256i *) (blk[r]->ql + 64 * h + 32));
                const __m256i hb = _mm256_loadu_si256((const __m256i *) (blk[r]->qh + 32 * h));
                q[0][r] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), high));
                q[1][r] = _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), high));
                q[2][r] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(hb, high));
                q[3][r] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                          _mm256_and_si256(_mm256_srli_epi16(hb, 2), high));
                for (int k = 0; k < 4; ++k) {
                    q[k][r] = _mm256_sub_epi8(q[k][r], bias);
                    // sub-blocks j and j + 1 of these 32 quants: their pair sums, times each one's scale
                    const int     j     = 8 * h + 2 * k;
                    const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(blk[r]->scales[j + 1]),
                                                           _mm_set1_epi16(blk[r]->scales[j]));
                    weighted[r] = _mm256_add_epi32(weighted[r],
                                                   _mm256_madd_epi16(_mm256_maddubs_epi16(ones, q[k][r]), scale));
                }
            }
            for (int k = 0; k < 4; ++k) {
                store_interleaved_avx2(q[k], quants + (32 * h + 8 * k) * 4 * G);
            }
        }
        for (int64_t r = 0; r < G; ++r) {
            int32_t lanes[8];
            _mm256_storeu_si256((__m256i *) lanes, weighted[r]);
            int32_t sum = 0;
            for (int32_t lane : lanes) {
                sum += lane;
            }
            corr[r] = 128 * sum;
        }
    }
}

// 8 Q6_K rows x NC columns on AVX2: per 4 quants, vpmaddubsw of the activation + 128 (unsigned) against
// the quants minus 32; two such pair sums stay within int16 (2 x 2 x 255 x 32), then vpmaddwd by the
// sub-block's scale into int32 over the super-block, less the row's correction for the +128.
template <int NC>
__attribute__((target("avx2,fma"))) void tile_q6_K_avx2(const uint8_t * group, const uint8_t * act,
                                                         int64_t act_bytes, int64_t n_blocks, float * out,
                                                         int64_t ld_out) {
    constexpr int64_t G       = 8;
    const int64_t     n_super = n_blocks / 8;

    __m256 acc[NC];
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
        acc[c] = _mm256_setzero_ps();
    }
    for (int64_t s = 0; s < n_super; ++s) {
        const uint8_t * w      = group + s * Q6_K_SB_BYTES;
        const uint8_t * quants = w + 64 + 16 * 32;
        const uint8_t * a      = act + s * Q8_K_BYTES;
        __m256i         dot[NC];
        _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
            dot[c] = _mm256_setzero_si256();
        }
        for (int j = 0; j < 16; ++j) {
            const __m256i scale = _mm256_loadu_si256((const __m256i *) (w + 64 + j * 32));
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
                const int64_t word = 4 * j + 2 * h; // quants 4 * word ..
                const __m256i w0   = _mm256_loadu_si256((const __m256i *) (quants + word * 4 * G));
                const __m256i w1   = _mm256_loadu_si256((const __m256i *) (quants + (word + 1) * 4 * G));
                _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
                    int32_t a0, a1;
                    std::memcpy(&a0, a + c * act_bytes + 4 * word, sizeof(a0));
                    std::memcpy(&a1, a + c * act_bytes + 4 * word + 4, sizeof(a1));
                    const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32(a0), w0),
                                                          _mm256_maddubs_epi16(_mm256_set1_epi32(a1), w1));
                    dot[c] = _mm256_add_epi32(dot[c], _mm256_madd_epi16(pair, scale));
                }
            }
        }
        const __m256  d    = _mm256_loadu_ps((const float *) w);
        const __m256i corr = _mm256_loadu_si256((const __m256i *) (w + 32));
        _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
            float d8;
            std::memcpy(&d8, a + c * act_bytes + QK_K, sizeof(d8));
            acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(d8)),
                                     _mm256_cvtepi32_ps(_mm256_sub_epi32(dot[c], corr)), acc[c]);
        }
    }
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
        _mm256_storeu_ps(out + c * ld_out, acc[c]);
    }
}
#endif

// ---- the repacked experts' layouts (dg_experts::repack, diffusion-gemma-experts.cpp) -------------
//
// Per row group of G rows (16 for VNNI, 8 for AVX2), blocks in order; "[n][G][4]" is n vectors of
// the group's rows, 4 consecutive quants of each, as the tiles load them:
//   Q8_0  per block of 32: d fp16 [G], quant sums int16 [G], quants int8 [8][G][4]: the tiles' layout itself
//   Q5_0  per block: d fp16 [G], sums of (q - 16) int16 [G], nibbles [4][G][4] (the file's bytes 4 at a
//         time: low nibble step q, high step q + 4), then the fifth bits: VNNI [8] uint64 masks, bit 4r + k
//         of mask q set where row r's quant 4q + k lacks it; AVX2 [G][4] bytes, bit q of byte 4r + k
//         that of row r's quant 4q + k
//   Q4_K  per super-block of 256: d fp16 [G], dmin fp16 [G], sc uint8 [8][G], m uint8 [8][G], nibbles
//         [4 pairs][8 steps][G][4] (the file's bytes 4 at a time: low nibble sub-block 2p, high 2p + 1)
//   Q6_K  per super-block: d fp16 [G], (AVX2) correction int32 [G], scales int8 [16][G], low nibbles
//         [32][G][4] (the file's ql bytes 4 at a time), high bit pairs [16][G][4] (its qh bytes)
// Staging (what the tiles read; stage() writes it from the above, a few vector ops per 4 quants):
//   Q8_0, Q5_0: as Q8_0 above. Q4_K: per super-block the sub-blocks' scales d * sc and offsets dmin * m
//   as float [8][G], the quants uint8 [8 sub-blocks][8 steps][G][4]. Q6_K: AVX2 as pack_group_q6_K; VNNI
//   per super-block d * sc as float [16][G] and the quants 0..63 uint8 [64][G][4].

constexpr int64_t Q5_0_STORED    = 24;  // bytes per row and block of 32 (the file's 22, with a quant sum)
constexpr int64_t Q4_K_STORED    = 148; // per row and super-block (the file's 144, scales unpacked)
constexpr int64_t Q6_K_STORED    = 210; // the file's
constexpr int64_t Q6_K_STORED_AVX2 = 214; // with the correction

// step s (quants 4s..4s+3) of a Q6_K super-block: its nibble vector (of ql) and high half, its vector of
// bit pairs (of qh) and the pair's position
inline int64_t q6_K_nibble_vector(int64_t s) { return 16 * (s / 32) + (s % 32) % 16; }
inline bool    q6_K_high_nibble(int64_t s) { return s % 32 >= 16; }
inline int64_t q6_K_pair_vector(int64_t s) { return 8 * (s / 32) + s % 8; }
inline int     q6_K_pair(int64_t s) { return (int) ((s % 32) / 8); }

#ifdef DG_LMH_X86
#    define DG_LMH_VNNI_K __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

// bits [FROM, FROM + 2) of every byte moved to [TO, TO + 2) (16-bit lane shifts: for these positions
// the bits moved never cross a byte)
template <int FROM, int TO> DG_LMH_VNNI_K inline __m512i move_bits_512(__m512i v) {
    if constexpr (FROM < TO) {
        return _mm512_slli_epi16(v, TO - FROM);
    } else if constexpr (FROM > TO) {
        return _mm512_srli_epi16(v, FROM - TO);
    } else {
        return v;
    }
}

template <int FROM, int TO> __attribute__((target("avx2"))) inline __m256i move_bits_256(__m256i v) {
    if constexpr (FROM < TO) {
        return _mm256_slli_epi16(v, TO - FROM);
    } else if constexpr (FROM > TO) {
        return _mm256_srli_epi16(v, FROM - TO);
    } else {
        return v;
    }
}

// The VNNI tiles of the repacked experts read the repacked layout itself, each 4 quants of the group
// made ready in registers (a nibble mask, a shift, a masked subtract or a vpternlogd): with ~16 tokens
// per expert the GEMM streams the weights from memory once, and the arithmetic hides behind that
// stream. The products equal ggml's up to float summation order (its activation quantization, the
// file's quants and scales).

// The tiles below add to out[c * ld_out + r] the products of blocks [b0, b1) of 32 (K-quants: whole
// super-blocks) of the group's 16 rows r and NC columns c: the GEMM walks a group's blocks a span at a
// time, every column tile over a span before the next span, so that the span's weights come from
// memory once and the stream of them never pauses.

// one block of 16 Q8_0 or Q5_0 rows (its 8 steps of quants minus the offset, `quants(q)`) against the
// activations + 128 (unsigned), less 128 x the rows' quant sums
template <int NC, typename Quants>
DG_LMH_VNNI_K inline void q8_0_block_vnni(const uint8_t * w, const uint8_t * act, int64_t act_bytes, int64_t n_blocks,
                                          int64_t b, Quants quants, __m512 * acc) {
    constexpr int64_t G    = 16;
    const __m512      dw   = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) w));
    const __m512i     corr = _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *) (w + 2 * G))), 7);
    __m512i           dot[NC];
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
        dot[c] = _mm512_setzero_si512();
    }
    _Pragma("GCC unroll 8") for (int q = 0; q < 8; ++q) {
        const __m512i wq = quants(q);
        _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
            int32_t four;
            std::memcpy(&four, act + c * act_bytes + b * QK + 4 * q, sizeof(four));
            dot[c] = _mm512_dpbusd_epi32(dot[c], _mm512_set1_epi32(four), wq);
        }
    }
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
        float scale;
        std::memcpy(&scale, act + c * act_bytes + n_blocks * QK + b * 4, sizeof(scale));
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[c], corr)), _mm512_mul_ps(dw, _mm512_set1_ps(scale)),
                                 acc[c]);
    }
}

template <int NC>
DG_LMH_VNNI_K void tile_q8_0_vnni(const uint8_t * group, const uint8_t * act, int64_t act_bytes, int64_t n_blocks,
                                  int64_t b0, int64_t b1, float * out, int64_t ld_out) {
    constexpr int64_t G = 16;
    __m512            acc[NC];
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
        acc[c] = _mm512_loadu_ps(out + c * ld_out);
    }
    for (int64_t b = b0; b < b1; ++b) {
        const uint8_t * w = group + b * 36 * G;
        q8_0_block_vnni<NC>(w, act, act_bytes, n_blocks, b, [w](int q) DG_LMH_VNNI_K {
            return _mm512_loadu_si512((const void *) (w + 4 * G + q * 4 * G));
        }, acc);
    }
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
        _mm512_storeu_ps(out + c * ld_out, acc[c]);
    }
}

// Q5_0: the nibbles, 16 subtracted where the fifth bit's mask says so
template <int NC>
DG_LMH_VNNI_K void tile_q5_0_vnni(const uint8_t * group, const uint8_t * act, int64_t act_bytes, int64_t n_blocks,
                                  int64_t b0, int64_t b1, float * out, int64_t ld_out) {
    constexpr int64_t G = 16;
    __m512            acc[NC];
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
        acc[c] = _mm512_loadu_ps(out + c * ld_out);
    }
    for (int64_t b = b0; b < b1; ++b) {
        const uint8_t * w = group + b * Q5_0_STORED * G;
        q8_0_block_vnni<NC>(w, act, act_bytes, n_blocks, b, [w](int q) DG_LMH_VNNI_K {
            const __m512i v   = _mm512_loadu_si512((const void *) (w + 4 * G + (q % 4) * 4 * G));
            const __m512i nib = _mm512_and_si512(q < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
            uint64_t      clear;
            std::memcpy(&clear, w + 20 * G + 8 * q, 8);
            return _mm512_mask_sub_epi8(nib, clear, nib, _mm512_set1_epi8(16));
        }, acc);
    }
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
        _mm512_storeu_ps(out + c * ld_out, acc[c]);
    }
}

// 16 Q4_K rows x NC columns: per 4 quants of the group one vpdpbusd of the unsigned quants against the
// activation's (signed Q8_K quants); per sub-block the product in float times d * sc of the row, less dmin
// * m times the activation's d * (sum of the sub-block's quants); the activation's d once per super-block.
template <int NC>
DG_LMH_VNNI_K void tile_q4_K_vnni(const uint8_t * group, const uint8_t * act, int64_t act_bytes, int64_t /* n_blocks */,
                                  int64_t b0, int64_t b1, float * out, int64_t ld_out) {
    constexpr int64_t G       = 16;
    const __m512i     low     = _mm512_set1_epi8(0x0F);
    __m512            total[NC];
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
        total[c] = _mm512_loadu_ps(out + c * ld_out);
    }
    for (int64_t s = b0 / 8; s < b1 / 8; ++s) {
        const uint8_t * w       = group + s * Q4_K_STORED * G;
        const uint8_t * nibbles = w + 20 * G;
        const uint8_t * a       = act + s * Q8_K_BYTES;
        const __m512    d       = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) w));
        const __m512    dmin    = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (w + 2 * G)));
        __m512          part[NC];
        _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
            part[c] = _mm512_setzero_ps();
        }
        for (int j = 0; j < 8; ++j) {
            __m512i dot[NC];
            _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
                dot[c] = _mm512_setzero_si512();
            }
            _Pragma("GCC unroll 8") for (int q = 0; q < 8; ++q) {
                const __m512i v  = _mm512_loadu_si512((const void *) (nibbles + ((j / 2) * 8 + q) * 4 * G));
                const __m512i wq = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(v, 4) : v, low);
                _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
                    int32_t four;
                    std::memcpy(&four, a + c * act_bytes + j * QK + 4 * q, sizeof(four));
                    dot[c] = _mm512_dpbusd_epi32(dot[c], wq, _mm512_set1_epi32(four));
                }
            }
            const __m512 scale  = _mm512_mul_ps(
                d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) (w + 4 * G + j * G)))));
            const __m512 offset = _mm512_mul_ps(
                dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) (w + 12 * G + j * G)))));
            _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
                float b;
                std::memcpy(&b, a + c * act_bytes + QK_K + 4 + 4 * j, sizeof(b));
                part[c]  = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[c]), scale, part[c]);
                total[c] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(b), total[c]);
            }
        }
        _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
            float dx;
            std::memcpy(&dx, a + c * act_bytes + QK_K, sizeof(dx));
            total[c] = _mm512_fmadd_ps(part[c], _mm512_set1_ps(dx), total[c]);
        }
    }
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
        _mm512_storeu_ps(out + c * ld_out, total[c]);
    }
}

// step s's 6-bit quants of a repacked Q6_K super-block: nibble | pair << 4 (vpternlogd: (pair & 0x30) | nibble)
template <int K> DG_LMH_VNNI_K inline __m512i q6_K_quants_512(__m512i nibble, __m512i pairs) {
    return _mm512_ternarylogic_epi32(move_bits_512<2 * K, 4>(pairs), _mm512_set1_epi8(0x30), nibble, 0xEA);
}

// one 16-wide sub-block j of a Q6_K tile: its 4 steps' quants (pair K of their bit-pair vectors)
template <int NC, int K>
DG_LMH_VNNI_K inline void q6_K_sub_block_vnni(const uint8_t * w, const uint8_t * a, int64_t act_bytes, int j,
                                               __m512i * dot) {
    constexpr int64_t G       = 16;
    const uint8_t *   nibbles = w + 18 * G;
    const uint8_t *   pairs   = nibbles + 128 * G;
    const __m512i     low     = _mm512_set1_epi8(0x0F);
    _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q) {
        const int64_t s   = 4 * j + q;
        const __m512i v   = _mm512_loadu_si512((const void *) (nibbles + q6_K_nibble_vector(s) * 4 * G));
        const __m512i nib = _mm512_and_si512(q6_K_high_nibble(s) ? _mm512_srli_epi16(v, 4) : v, low);
        const __m512i wq  = q6_K_quants_512<K>(nib, _mm512_loadu_si512((const void *) (pairs + q6_K_pair_vector(s) * 4 * G)));
        _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
            int32_t four;
            std::memcpy(&four, a + c * act_bytes + 4 * s, sizeof(four));
            dot[c] = _mm512_dpbusd_epi32(dot[c], wq, _mm512_set1_epi32(four));
        }
    }
}

// 16 Q6_K rows x NC columns: the unsigned quants 0..63 against the signed Q8_K ones, each 16-wide
// sub-block's int32 product started at -32 x (the sum of its activation quants), which takes the quants'
// -32 back; then in float times d * sc of the row, and the activation's d once per super-block.
template <int NC>
DG_LMH_VNNI_K void tile_q6_K_vnni(const uint8_t * group, const uint8_t * act, int64_t act_bytes, int64_t /* n_blocks */,
                                  int64_t b0, int64_t b1, float * out, int64_t ld_out) {
    constexpr int64_t G       = 16;
    __m512            total[NC];
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
        total[c] = _mm512_loadu_ps(out + c * ld_out);
    }
    for (int64_t s = b0 / 8; s < b1 / 8; ++s) {
        const uint8_t * w = group + s * Q6_K_STORED * G;
        const uint8_t * a = act + s * Q8_K_BYTES_SUMS16;
        const __m512    d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) w));
        __m512          part[NC];
        _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
            part[c] = _mm512_setzero_ps();
        }
        for (int j = 0; j < 16; ++j) {
            __m512i dot[NC];
            _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
                int32_t start;
                std::memcpy(&start, a + c * act_bytes + QK_K + 4 + 4 * j, sizeof(start));
                dot[c] = _mm512_set1_epi32(start);
            }
            switch ((j % 8) / 2) { // the bit pair of this sub-block's steps
                case 0:  q6_K_sub_block_vnni<NC, 0>(w, a, act_bytes, j, dot); break;
                case 1:  q6_K_sub_block_vnni<NC, 1>(w, a, act_bytes, j, dot); break;
                case 2:  q6_K_sub_block_vnni<NC, 2>(w, a, act_bytes, j, dot); break;
                default: q6_K_sub_block_vnni<NC, 3>(w, a, act_bytes, j, dot); break;
            }
            const __m512 scale = _mm512_mul_ps(
                d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (w + 2 * G + j * G)))));
            _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
                part[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[c]), scale, part[c]);
            }
        }
        _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
            float dx;
            std::memcpy(&dx, a + c * act_bytes + QK_K, sizeof(dx));
            total[c] = _mm512_fmadd_ps(part[c], _mm512_set1_ps(dx), total[c]);
        }
    }
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
        _mm512_storeu_ps(out + c * ld_out, total[c]);
    }
}

// the repacked Q5_0, Q4_K and Q6_K groups of 8 rows (AVX2) unpacked into the AVX2 tiles' layouts
__attribute__((target("avx2"))) void unpack_q5_0_avx2(const uint8_t * src, int64_t n_blocks, uint8_t * dst) {
    constexpr int64_t G   = 8;
    const __m256i     low = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10), sixteen = _mm256_set1_epi8(16);
    for (int64_t b = 0; b < n_blocks; ++b) {
        const uint8_t * in = src + b * Q5_0_STORED * G;
        uint8_t *       o  = dst + b * 36 * G;
        _mm256_storeu_si256((__m256i *) o, _mm256_loadu_si256((const __m256i *) in)); // scales and sums
        const __m256i bits = _mm256_loadu_si256((const __m256i *) (in + 20 * G));
        const __m256i high[8] = { move_bits_256<0, 4>(bits), move_bits_256<1, 4>(bits), move_bits_256<2, 4>(bits),
                                  move_bits_256<3, 4>(bits), move_bits_256<4, 4>(bits), move_bits_256<5, 4>(bits),
                                  move_bits_256<6, 4>(bits), move_bits_256<7, 4>(bits) };
        _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q) {
            const __m256i v  = _mm256_loadu_si256((const __m256i *) (in + 4 * G + q * 4 * G));
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(high[q], fifth));
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                               _mm256_and_si256(high[q + 4], fifth));
            _mm256_storeu_si256((__m256i *) (o + 4 * G + q * 4 * G), _mm256_sub_epi8(lo, sixteen));
            _mm256_storeu_si256((__m256i *) (o + 4 * G + (q + 4) * 4 * G), _mm256_sub_epi8(hi, sixteen));
        }
    }
}

__attribute__((target("avx2,f16c"))) void unpack_q4_K_avx2(const uint8_t * src, int64_t n_super, uint8_t * dst) {
    constexpr int64_t G   = 8;
    const __m256i     low = _mm256_set1_epi8(0x0F);
    for (int64_t s = 0; s < n_super; ++s) {
        const uint8_t * in      = src + s * Q4_K_STORED * G;
        uint8_t *       o       = dst + s * Q4_K_SB_BYTES;
        float *         scales  = (float *) o;
        float *         offsets = scales + 8 * G;
        const __m256    d       = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) in));
        const __m256    dmin    = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (in + 2 * G)));
        _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j) {
            const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (in + 4 * G + j * G))));
            const __m256 m  = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (in + 12 * G + j * G))));
            _mm256_storeu_ps(scales + j * G, _mm256_mul_ps(d, sc));
            _mm256_storeu_ps(offsets + j * G, _mm256_mul_ps(dmin, m));
        }
        const uint8_t * nibbles = in + 20 * G;
        uint8_t *       quants  = o + 2 * 8 * G * 4;
        for (int p = 0; p < 4; ++p) {
            _Pragma("GCC unroll 8") for (int q = 0; q < 8; ++q) {
                const __m256i v = _mm256_loadu_si256((const __m256i *) (nibbles + (8 * p + q) * 4 * G));
                _mm256_storeu_si256((__m256i *) (quants + (16 * p + q) * 4 * G), _mm256_and_si256(v, low));
                _mm256_storeu_si256((__m256i *) (quants + (16 * p + 8 + q) * 4 * G),
                                    _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
            }
        }
    }
}

template <int K> __attribute__((target("avx2"))) inline __m256i q6_K_quants_256(__m256i nibble, __m256i pairs) {
    const __m256i q = _mm256_or_si256(_mm256_and_si256(move_bits_256<2 * K, 4>(pairs), _mm256_set1_epi8(0x30)), nibble);
    return _mm256_sub_epi8(q, _mm256_set1_epi8(32));
}

__attribute__((target("avx2,f16c"))) void unpack_q6_K_avx2(const uint8_t * src, int64_t n_super, uint8_t * dst) {
    constexpr int64_t G   = 8;
    const __m256i     low = _mm256_set1_epi8(0x0F);
    for (int64_t s = 0; s < n_super; ++s) {
        const uint8_t * in = src + s * Q6_K_STORED_AVX2 * G;
        uint8_t *       o  = dst + s * Q6_K_SB_BYTES;
        _mm256_storeu_ps((float *) o, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) in)));
        std::memcpy(o + 32, in + 2 * G, 4 * G); // the corrections
        _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j) {
            const __m256i sc32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (in + 6 * G + j * G)));
            const __m256i pair = _mm256_or_si256(_mm256_and_si256(sc32, _mm256_set1_epi32(0xFFFF)),
                                                 _mm256_slli_epi32(sc32, 16));
            _mm256_storeu_si256((__m256i *) (o + 64 + j * 32), pair);
        }
        const uint8_t * nibbles = in + 22 * G;
        const uint8_t * pairs   = nibbles + 128 * G;
        uint8_t *       quants  = o + 64 + 16 * 32;
        for (int h = 0; h < 2; ++h) {
            for (int i = 0; i < 8; ++i) {
                const __m256i pv = _mm256_loadu_si256((const __m256i *) (pairs + (8 * h + i) * 4 * G));
                const __m256i v0 = _mm256_loadu_si256((const __m256i *) (nibbles + (16 * h + i) * 4 * G));
                const __m256i v1 = _mm256_loadu_si256((const __m256i *) (nibbles + (16 * h + 8 + i) * 4 * G));
                uint8_t * step = quants + (32 * h + i) * 4 * G;
                _mm256_storeu_si256((__m256i *) (step + 0 * 8 * 4 * G), q6_K_quants_256<0>(_mm256_and_si256(v0, low), pv));
                _mm256_storeu_si256((__m256i *) (step + 1 * 8 * 4 * G), q6_K_quants_256<1>(_mm256_and_si256(v1, low), pv));
                _mm256_storeu_si256((__m256i *) (step + 2 * 8 * 4 * G),
                                    q6_K_quants_256<2>(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low), pv));
                _mm256_storeu_si256((__m256i *) (step + 3 * 8 * 4 * G),
                                    q6_K_quants_256<3>(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low), pv));
            }
        }
    }
}
#endif

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
const tile_fn tile_q4_K_avx2_by_columns[5] = { nullptr, tile_q4_K_avx2<1>, tile_q4_K_avx2<2>, tile_q4_K_avx2<3>,
                                              tile_q4_K_avx2<4> };
const tile_fn tile_q6_K_avx2_by_columns[5] = { nullptr, tile_q6_K_avx2<1>, tile_q6_K_avx2<2>, tile_q6_K_avx2<3>,
                                              tile_q6_K_avx2<4> };
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
void quantize_columns(dg_lm_head_kernel kernel, int64_t n_blocks, const float * x, int64_t ld_x, int64_t c0, int64_t c1,
                      uint8_t * act, int64_t act_stride, bool scalar = false) {
    // the VNNI layout's operand is unsigned: the activation + 128
    const int8_t offset = kernel == dg_lm_head_kernel::avx2 ? 0 : -128;
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


// this kernel's tiles for weights of `type` by column count, and the widest (Q4_K, Q6_K: AVX2's only,
// which dg_experts::make ensures)
const tile_fn * tiles_for(dg_lm_head_kernel kernel, int64_t * n_wide, ggml_type type = GGML_TYPE_Q8_0) {
    *n_wide = kernel == dg_lm_head_kernel::avx2 ? 4 : 8;
#ifdef DG_LMH_X86
    if (type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K) {
        GGML_ASSERT(kernel == dg_lm_head_kernel::avx2);
        return type == GGML_TYPE_Q4_K ? tile_q4_K_avx2_by_columns : tile_q6_K_avx2_by_columns;
    }
    if (kernel == dg_lm_head_kernel::avx512_vnni) {
        return tile_vnni_by_columns;
    }
    if (kernel == dg_lm_head_kernel::avx2) {
        return tile_avx2_by_columns;
    }
#endif
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

int64_t dg_lm_head::chunk_blocks() const {
    return n_blocks_ > 2 * K_CHUNK ? K_CHUNK : n_blocks_;
}

void dg_lm_head::quantize(const float * x, int64_t ld_x, int64_t c0, int64_t c1, uint8_t * act) const {
    // chunk by chunk: each chunk's quants then its scales, as the tiles read a row of that many blocks
    const int64_t chunk = chunk_blocks();
    for (int64_t k0 = 0; k0 < n_blocks_; k0 += chunk) {
        quantize_columns(kernel_, std::min(chunk, n_blocks_ - k0), x + k0 * QK, ld_x, c0, c1, act + k0 * (QK + 4),
                         act_bytes());
    }
}


void dg_lm_head::gemm(const uint8_t * act, int64_t n_cols, float * out, int64_t ld_out, int64_t g0, int64_t g1) const {
    const int64_t G      = group_;
    const int64_t GBB    = dg_lm_head_group_block_bytes(G);
    const int64_t ab     = act_bytes();
    const int64_t chunk  = chunk_blocks();
    int64_t         n_wide; // columns per tile
    const tile_fn * tiles = tiles_for(kernel_, &n_wide);
    float partial[16 * 8]; // a tile computed aside: the last group's (a partial group), or a later chunk's
    const int64_t panel = panel_columns(ab * chunk / n_blocks_); // one chunk's activations per column
    for (int64_t p0 = 0; p0 < n_cols; p0 += panel) {
        const int64_t p1 = std::min(p0 + panel, n_cols);
        for (int64_t k0 = 0; k0 < n_blocks_; k0 += chunk) {
            const int64_t   nk    = std::min(chunk, n_blocks_ - k0);
            const uint8_t * act_k = act + k0 * (QK + 4); // the chunk's quants and scales (quantize)
            for (int64_t g = g0; g < g1; ++g) {
                const uint8_t * group = base_ + (g * n_blocks_ + k0) * GBB;
                const int64_t   rows  = std::min(G, n_vocab_ - g * G);
                for (int64_t c = p0; c < p1; c += n_wide) {
                    const int64_t nc = std::min(n_wide, p1 - c);
                    if (rows == G && k0 == 0) {
                        tiles[nc](group, act_k + c * ab, ab, nk, out + c * ld_out + g * G, ld_out);
                        continue;
                    }
                    tiles[nc](group, act_k + c * ab, ab, nk, partial, G);
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
    if (is_k_quant(type)) { // their tiles exist for AVX2 only
        return n_in % QK_K == 0 && kernel == dg_lm_head_kernel::avx2;
    }
    return (type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q5_0) && n_in % QK == 0;
}

// The repacked layouts (described above the kernels), written from the file's rows: rows [0, n_rows) of
// a group of G at `rows` (row r at rows + r * row_bytes) into `out`; rows past n_rows are zeros (their
// scales 0, so they compute zeros).
void repack_group_q5_0(const uint8_t * rows, size_t row_bytes, int64_t n_blocks, int64_t n_rows, int64_t G, bool vnni,
                       uint8_t * out) {
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
                    const uint32_t bit = (high >> (4 * q + k)) & 1;
                    if (vnni && !bit) { // mask q: the bytes 16 is taken from
                        fifth[8 * q + (4 * r + k) / 8] |= (uint8_t) (1u << ((4 * r + k) % 8));
                    } else if (!vnni) {
                        fifth[4 * r + k] |= (uint8_t) (bit << q);
                    }
                }
            }
        }
    }
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
        case GGML_TYPE_Q8_0: return n_in / QK * dg_lm_head_group_block_bytes(G);
        case GGML_TYPE_Q5_0: return n_in / QK * Q5_0_STORED * G;
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
                case GGML_TYPE_Q8_0: pack_group(rows, row_bytes, type, n_in / QK, n_rows, G, out); break;
                case GGML_TYPE_Q5_0:
                    repack_group_q5_0(rows, row_bytes, n_in / QK, n_rows, G, kernel != dg_lm_head_kernel::avx2, out);
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
    n_blocks_(n_in / QK), group_(kernel == dg_lm_head_kernel::avx2 ? 8 : 16), row_bytes_(ggml_row_size(type, n_in)) {}

int64_t dg_experts::act_bytes() const {
    if (type_ == GGML_TYPE_Q6_K && kernel_ == dg_lm_head_kernel::avx512_vnni) {
        return n_in_ / QK_K * Q8_K_BYTES_SUMS16;
    }
    return is_k_quant(type_) ? n_in_ / QK_K * Q8_K_BYTES : n_blocks_ * (QK + 4);
}

int64_t dg_experts::group_bytes() const {
    if (repacked_ && kernel_ == dg_lm_head_kernel::avx512_vnni) {
        return 0; // its tiles read the repacked layout
    }
    if (is_k_quant(type_)) {
        return n_in_ / QK_K * (type_ == GGML_TYPE_Q4_K ? Q4_K_SB_BYTES : Q6_K_SB_BYTES);
    }
    return n_blocks_ * dg_lm_head_group_block_bytes(group_);
}

void dg_experts::quantize(const float * x, int64_t ld_x, int64_t r0, int64_t r1, uint8_t * act) const {
    if (type_ == GGML_TYPE_Q6_K && kernel_ == dg_lm_head_kernel::avx512_vnni) {
        quantize_columns_q8_K(n_in_ / QK_K, x, ld_x, r0, r1, act, 0, /*sums16 =*/ true);
    } else if (is_k_quant(type_)) {
        quantize_columns_q8_K(n_in_ / QK_K, x, ld_x, r0, r1, act, type_ == GGML_TYPE_Q6_K ? 0x80 : 0);
    } else {
        quantize_columns(kernel_, n_blocks_, x, ld_x, r0, r1, act);
    }
}

void dg_experts::pack(const uint8_t * first_row, int64_t rows, uint8_t * group) const {
    if (type_ == GGML_TYPE_Q4_K) {
#ifdef DG_LMH_X86
        if (rows == Q4_K_GROUP) {
            pack_group_q4_K_avx2(first_row, row_bytes_, n_in_ / QK_K, group);
            return;
        }
#endif
        pack_group_q4_K(first_row, row_bytes_, n_in_ / QK_K, rows, group);
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

void dg_experts::gemm(const uint8_t * act, int64_t n_act_slots, const int32_t * ids, int64_t ld_ids, int64_t n_used,
                      int64_t n_tokens, char * out, size_t nb_slot, size_t nb_token, int ith, int nth) const {
    const int64_t G        = group_;
    const int64_t n_groups = (n_out_ + G - 1) / G;
    const int64_t ab       = act_bytes();
    int64_t         n_wide     = 8;
    // the repacked experts on VNNI: tiles over spans of blocks of the repacked layout itself
    const span_tile_fn * spans = repacked_ ? span_tiles_for(kernel_, type_) : nullptr;
    const tile_fn *      tiles = spans ? nullptr : tiles_for(kernel_, &n_wide, type_);

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
    // layout costs about as much as running it against three columns, its unpacking from the repacked
    // one about one (nothing where the tiles read it as stored: Q8_0, and every type on VNNI).
    const int64_t PACK_COST = !repacked_ ? 3 : type_ == GGML_TYPE_Q8_0 || kernel_ == dg_lm_head_kernel::avx512_vnni ? 0 : 1;
    int64_t           total     = 0;
    for (int64_t e = 0; e < n_expert_; ++e) {
        const int64_t n = first[(size_t) e + 1] - first[(size_t) e];
        total += n ? n_groups * (n + PACK_COST) : 0;
    }
    const int64_t lo = total * ith / nth, hi = total * (ith + 1) / nth;

    thread_local std::vector<uint8_t> packed, gathered;
    thread_local std::vector<float>   sums;
    packed.resize((size_t) (group_bytes() + 64));
    uint8_t * group = (uint8_t *) (((uintptr_t) packed.data() + 63) & ~(uintptr_t) 63);
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
        // the expert's activation rows, contiguous for the tiles
        gathered.resize((size_t) (n * ab));
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
            if (spans) {
                // every column tile over a span of blocks (8: ~2.3-4.6 KB of weights, kept in L1) before the
                // next span, so that the group's weights stream from memory once, without pauses
                sums.assign((size_t) (n * G), 0.0f);
                for (int64_t b0 = 0; b0 < n_blocks_; b0 += 8) {
                    for (int64_t c = 0, tile = 0; c < n; ++tile) {
                        const int64_t nc = n / n_tiles + (tile < n % n_tiles ? 1 : 0);
                        spans[nc](staged, gathered.data() + c * ab, ab, n_blocks_, b0, std::min(b0 + 8, n_blocks_),
                                  sums.data() + c * G, G);
                        c += nc;
                    }
                }
                for (int64_t j = 0; j < n; ++j) {
                    const int64_t u = pairs[j] % n_used, t = pairs[j] / n_used;
                    std::memcpy(out + u * nb_slot + t * nb_token + g * G * sizeof(float), sums.data() + j * G,
                                (size_t) rows * sizeof(float));
                }
                continue;
            }
            for (int64_t c = 0, tile = 0; c < n; ++tile) {
                const int64_t nc = n / n_tiles + (tile < n % n_tiles ? 1 : 0);
                tiles[nc](staged, gathered.data() + c * ab, ab, n_blocks_, tile_out, G);
                for (int64_t j = 0; j < nc; ++j) {
                    const int64_t u = pairs[c + j] % n_used, t = pairs[c + j] / n_used;
                    std::memcpy(out + u * nb_slot + t * nb_token + g * G * sizeof(float), tile_out + j * G,
                                (size_t) rows * sizeof(float));
                }
                c += nc;
            }
        }
    }
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

namespace {

// random blocks of `type` for the self-tests: a positive fp16 scale, then random quant bytes (Q8_0:
// -127..127, as ggml's quantizer writes them)
std::vector<uint8_t> random_blocks(ggml_type type, int64_t n_blocks, std::mt19937 & rng) {
    std::uniform_int_distribution<int>    byte(0, 255), q8(-127, 127);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    const size_t                          block_bytes = ggml_type_size(type);
    std::vector<uint8_t>                  w((size_t) n_blocks * block_bytes);
    for (size_t off = 0; off < w.size(); off += block_bytes) {
        const ggml_fp16_t d = ggml_fp32_to_fp16(0.001f + 0.01f * std::fabs(unit(rng)));
        std::memcpy(&w[off], &d, 2);
        size_t first_quant = 2;
        if (type == GGML_TYPE_Q4_K) { // and dmin, a positive fp16 too
            const ggml_fp16_t dmin = ggml_fp32_to_fp16(0.001f + 0.01f * std::fabs(unit(rng)));
            std::memcpy(&w[off + 2], &dmin, 2);
            first_quant = 4;
        }
        for (size_t i = first_quant; i < block_bytes; ++i) {
            w[off + i] = type == GGML_TYPE_Q8_0 ? (uint8_t) (int8_t) q8(rng) : (uint8_t) byte(rng);
        }
        if (type == GGML_TYPE_Q6_K) { // its scale is the block's last field: quants and int8 scales first
            w[off] = (uint8_t) byte(rng);
            w[off + 1] = (uint8_t) byte(rng);
            std::memcpy(&w[off + block_bytes - 2], &d, 2);
        }
    }
    return w;
}

// |got - the double-precision product of a decoded weight row and a quantized activation column|,
// relative to the sum of its blocks' magnitudes (infinite if got is not finite); `column` in the Q8_K
// sum += row . column over n_blocks blocks of a quantized column (its quants, then their scales), in
// double; magnitude += the sum of |each block's product|
void q8_0_dot(const float * row, const uint8_t * column, int64_t n_blocks, int8_t offset, double & sum,
              double & magnitude) {
    const float * scales = (const float *) (column + n_blocks * QK);
    for (int64_t b = 0; b < n_blocks; ++b) {
        double dot = 0.0;
        for (int64_t i = 0; i < QK; ++i) {
            dot += (double) row[b * QK + i] * (int8_t) (column[b * QK + i] ^ offset);
        }
        sum += scales[b] * dot;
        magnitude += std::fabs(scales[b] * dot);
    }
}

// layout of quantize_columns_q8_K when q8_K, else dg_lm_head's
double relative_error(const float * row, const uint8_t * column, int64_t n_blocks, int8_t offset, float got,
                      bool q8_K = false, int64_t q8_K_bytes = Q8_K_BYTES) {
    if (q8_K) {
        double sum = 0.0, magnitude = 0.0;
        for (int64_t s = 0; s < n_blocks / 8; ++s) {
            const uint8_t * block = column + s * q8_K_bytes;
            float d;
            std::memcpy(&d, block + QK_K, sizeof(d));
            for (int64_t j = 0; j < 8; ++j) {
                double dot = 0.0;
                for (int64_t i = 0; i < QK; ++i) {
                    dot += (double) row[s * QK_K + j * QK + i] * (int8_t) (block[j * QK + i] ^ offset);
                }
                sum += d * dot;
                magnitude += std::fabs(d * dot);
            }
        }
        const double err = std::fabs(sum - got) / (magnitude + 1e-30);
        return std::isfinite(err) ? err : INFINITY;
    }
    double sum = 0.0, magnitude = 0.0;
    q8_0_dot(row, column, n_blocks, offset, sum, magnitude);
    const double err = std::fabs(sum - got) / (magnitude + 1e-30);
    return std::isfinite(err) ? err : INFINITY;
}

}  // namespace

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
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    const std::vector<uint8_t> w = random_blocks(type, n_vocab * nb, rng);
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

    const int8_t  offset = k == dg_lm_head_kernel::avx2 ? 0 : -128;
    const int64_t chunk  = head->chunk_blocks(); // long rows: quantized and multiplied a chunk at a time
    // the quantization (vectorized where the CPU has AVX2) byte for byte as the portable loop's
    std::vector<uint8_t> portable(act.size());
    for (int64_t k0 = 0; k0 < nb; k0 += chunk) {
        quantize_columns(k, std::min(chunk, nb - k0), x.data() + k0 * QK, n_embd, 0, n_cols,
                         portable.data() + k0 * (QK + 4), head->act_bytes(), /*scalar =*/ true);
    }
    if (portable != act) {
        *max_rel_error = INFINITY;
        return 0;
    }
    double worst = 0.0;
    for (int64_t c = 0; c < n_cols; ++c) {
        for (int64_t v = 0; v < n_vocab; ++v) {
            double sum = 0.0, magnitude = 0.0;
            for (int64_t k0 = 0; k0 < nb; k0 += chunk) {
                q8_0_dot(decoded.data() + v * n_embd + k0 * QK, act.data() + c * head->act_bytes() + k0 * (QK + 4),
                         std::min(chunk, nb - k0), offset, sum, magnitude);
            }
            const double err = std::fabs(sum - out[(size_t) (c * n_vocab + v)]) / (magnitude + 1e-30);
            worst = std::max(worst, std::isfinite(err) ? err : INFINITY);
        }
    }
    *max_rel_error = worst;
    return 0;
}

// The experts' GEMM of a kernel on random experts of `weight_type` and random routing, its work split
// as `nth` threads split it (each share run in turn), against a double-precision sum of the same
// quantized operands with ggml's dequantizer: *max_rel_error relative to each output's magnitude
// (infinite if any output was left unwritten). 0: done, 1: the CPU lacks the kernel, -1: bad arguments.
static int32_t experts_selftest(int32_t kernel, int32_t weight_type, int64_t n_in, int64_t n_out, int64_t n_expert,
                                int64_t n_used, int64_t n_tokens, bool input_per_slot, int32_t nth, uint32_t seed,
                                bool repacked, double * max_rel_error);

int32_t dg_experts_selftest(int32_t kernel, int32_t weight_type, int64_t n_in, int64_t n_out, int64_t n_expert,
                            int64_t n_used, int64_t n_tokens, bool input_per_slot, int32_t nth, uint32_t seed,
                            double * max_rel_error) {
    return experts_selftest(kernel, weight_type, n_in, n_out, n_expert, n_used, n_tokens, input_per_slot, nth, seed,
                            false, max_rel_error);
}

// The same over the experts in the repacked layout (dg_experts::repack, then over_repacked): avx2 (1) or
// avx512-vnni (2) only, every type the layout takes.
int32_t dg_experts_repacked_selftest(int32_t kernel, int32_t weight_type, int64_t n_in, int64_t n_out,
                                     int64_t n_expert, int64_t n_used, int64_t n_tokens, bool input_per_slot,
                                     int32_t nth, uint32_t seed, double * max_rel_error) {
    if (kernel != (int32_t) dg_lm_head_kernel::avx2 && kernel != (int32_t) dg_lm_head_kernel::avx512_vnni) {
        return -1;
    }
    return experts_selftest(kernel, weight_type, n_in, n_out, n_expert, n_used, n_tokens, input_per_slot, nth, seed,
                            true, max_rel_error);
}

static int32_t experts_selftest(int32_t kernel, int32_t weight_type, int64_t n_in, int64_t n_out, int64_t n_expert,
                                int64_t n_used, int64_t n_tokens, bool input_per_slot, int32_t nth, uint32_t seed,
                                bool repacked, double * max_rel_error) {
    const auto type = (ggml_type) weight_type;
    if (n_in <= 0 || n_in % QK || n_out <= 0 || n_expert <= 0 || n_used <= 0 || n_used > n_expert || n_tokens <= 0 ||
        nth <= 0 || !max_rel_error || kernel < 1 || kernel > 3 ||
        (type != GGML_TYPE_Q8_0 && type != GGML_TYPE_Q5_0 && !is_k_quant(type)) ||
        (is_k_quant(type) && n_in % QK_K)) {
        return -1;
    }
    const auto k = (dg_lm_head_kernel) kernel;
    if (!kernel_runs_here(k)) {
        return 1;
    }
    const int64_t nb = n_in / QK;
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    const std::vector<uint8_t> w = random_blocks(type, n_expert * n_out * n_in / ggml_blck_size(type), rng);
    std::vector<float> decoded((size_t) (n_expert * n_out * n_in));
    ggml_get_type_traits(type)->to_float(w.data(), decoded.data(), n_expert * n_out * n_in);

    // each token's n_used distinct experts, drawn from the first half of them so that some stay unused
    // and others get many tokens (uneven shares); all of them when n_used is more than half
    std::vector<int32_t> ids((size_t) (n_used * n_tokens));
    std::vector<int32_t> pool((size_t) n_expert);
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t e = 0; e < n_expert; ++e) {
            pool[(size_t) e] = (int32_t) e;
        }
        const int64_t span = std::max(n_used, n_expert / 2);
        std::shuffle(pool.begin(), pool.begin() + span, rng);
        std::copy(pool.begin(), pool.begin() + n_used, ids.begin() + t * n_used);
    }
    const int64_t n_act_slots = input_per_slot ? n_used : 1;
    std::vector<float> x((size_t) (n_in * n_act_slots * n_tokens));
    for (auto & v : x) {
        v = unit(rng) * 3.0f;
    }
    std::vector<uint8_t>        stored;
    std::unique_ptr<dg_experts> experts;
    if (repacked) {
        stored.resize(dg_experts::repacked_bytes(type, n_in, n_out, n_expert, k));
        dg_experts::repack(type, n_in, n_out, 0, n_expert, k, w.data(), stored.data());
        experts = dg_experts::over_repacked(stored.data(), type, n_in, n_out, n_expert, k);
        if (!experts) {
            return -1;
        }
    } else {
        experts = dg_experts::make(w.data(), type, n_in, n_out, n_expert, k);
        if (!experts) {
            return is_k_quant(type) ? 1 : -1; // Q4_K, Q6_K: AVX2's tiles only
        }
    }
    const int64_t n_rows = n_act_slots * n_tokens;
    std::vector<uint8_t> act((size_t) (experts->act_bytes() * n_rows));
    experts->quantize(x.data(), n_in, 0, n_rows, act.data());
    std::vector<float> out((size_t) (n_out * n_used * n_tokens), NAN);
    for (int32_t ith = 0; ith < nth; ++ith) {
        experts->gemm(act.data(), n_act_slots, ids.data(), n_used, n_used, n_tokens, (char *) out.data(),
                      n_out * sizeof(float), n_out * n_used * sizeof(float), ith, nth);
    }

    // the activations' stored bias: the VNNI Q8_0 / Q5_0 tile's and the AVX2 Q6_K tile's operand is unsigned
    const bool    avx2   = k == dg_lm_head_kernel::avx2;
    const int8_t  offset = avx2 ? (type == GGML_TYPE_Q6_K ? -128 : 0) : (is_k_quant(type) ? 0 : -128);
    const int64_t q8_K_bytes = !avx2 && type == GGML_TYPE_Q6_K ? Q8_K_BYTES_SUMS16 : Q8_K_BYTES;
    double worst = 0.0;
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t u = 0; u < n_used; ++u) {
            const uint8_t * column = act.data() + ((u % n_act_slots) + t * n_act_slots) * experts->act_bytes();
            const int64_t   e      = ids[(size_t) (u + t * n_used)];
            for (int64_t r = 0; r < n_out; ++r) {
                worst = std::max(worst, relative_error(decoded.data() + (e * n_out + r) * n_in, column, nb, offset,
                                                       out[(size_t) ((t * n_used + u) * n_out + r)],
                                                       is_k_quant(type), q8_K_bytes));
            }
        }
    }
    *max_rel_error = worst;
    return 0;
}
