// Where the AVX2 family's Q4_K tile loses to the int8 peak: dg's tiles themselves (tile_q4_K_avx2 and
// tile_q4_K_avxvnni, native/patch/src/diffusion-gemma-int8-q4k-tile.inc, included) on their staged layout
// (per super-block of 8 rows: the rows' d, 8 x 8 scales sc as int16 pairs, 8 x 8 float offsets dmin * m,
// then 8 sub-blocks x 8 vectors of 8 rows x 4 unsigned quants), and a model of the form before them (8 x
// 8 float scales d * sc in place of the rows' d and the integer scales: a float step per sub-block) with
// variants of that, against Q8_K activations (256 quants, d, 8 sub-block sums times d). The tile runs every Q4_K product of a
// Q4_K_M file on AVX2 (the attention projections, the experts' gate+up, the dense FFN). Timed with its
// operands in L1 (one 8-row group of a 2816-wide row, every column tile over it, as the GEMM does), by
// parts, and in variants. One thread, CPU time, best of 5 rounds. On an x86-64 Linux CPU with AVX2:
//
//   g++ -O3 -o /tmp/avx2_q4k_tile_probe benchmarks/avx2_q4k_tile_probe.cpp && /tmp/avx2_q4k_tile_probe
//
// (dg's tile on AVX-VNNI runs where the CPU has it.) Compare its rates with dg_peak_gmacs's int8 peak
// (benchmarks/step_profile.py prints it).

#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <vector>

#include "probe_timing.h"

namespace {

constexpr int64_t G = 8, QK = 32, QK_K = 256;
constexpr int64_t Q8_K_BYTES = QK_K + 4 + 8 * 4;
constexpr int64_t SB_BYTES   = 2 * 8 * G * 4 + 8 * 8 * G * 4;
constexpr int64_t INT_SB_BYTES = G * 4 + SB_BYTES; // int_scales: the rows' d before the same sizes

// avx_vnni: dg's tile on AVX-VNNI; int_scales: dg's tile on AVX2 (the sub-blocks' products times their
// integer scales in vpmaddwd, summed in int32, one float step per super-block; the mins' term per
// sub-block in float); per_sub_block: the form before it, the activation's d applied to every sub-block's product in float; folded: d applied once per
// super-block to the sum of the sub-blocks' scaled products (tried: docs/performance.md); no_offset:
// per_sub_block without the mins' term; no_scaling: without the float work per sub-block
enum class form { avx_vnni, int_scales, per_sub_block, folded, no_offset, no_scaling };

#define PROBE_AVX2 __attribute__((target("avx2,fma,f16c"), noinline))

// dg's two Q4_K tiles themselves, on their layout (INT_SB_BYTES a super-block)
constexpr int64_t Q4_K_GROUP = G, Q4_K_SB_BYTES = INT_SB_BYTES;
#define DG_Q4K_TILE   tile_int_scales
#define DG_Q4K_TARGET __attribute__((target("avx2,fma"), noinline))
#define DG_Q4K_VNNI   0
#include "../native/patch/src/diffusion-gemma-int8-q4k-tile.inc"
#undef DG_Q4K_TILE
#undef DG_Q4K_TARGET
#undef DG_Q4K_VNNI
#define DG_Q4K_TILE   tile_avx_vnni
#define DG_Q4K_TARGET __attribute__((target("avx2,fma,f16c,avxvnni"), noinline))
#define DG_Q4K_VNNI   1
#include "../native/patch/src/diffusion-gemma-int8-q4k-tile.inc"
#undef DG_Q4K_TILE
#undef DG_Q4K_TARGET
#undef DG_Q4K_VNNI

// out[c * G + r] = the group's 8 rows r x NC columns c over n_super super-blocks
template <int NC, form F>
PROBE_AVX2 void tile(const uint8_t * group, const uint8_t * act, int64_t act_bytes, int64_t n_super, float * out) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256        acc[NC];
    #pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
        acc[c] = _mm256_setzero_ps();
    }
    for (int64_t s = 0; s < n_super; ++s) {
        const uint8_t * w = group + s * SB_BYTES;
        const uint8_t * a = act + s * Q8_K_BYTES;
        __m256          part[F == form::folded ? NC : 1];
        if constexpr (F == form::folded) {
            #pragma GCC unroll 8
            for (int c = 0; c < NC; ++c) {
                part[c] = _mm256_setzero_ps();
            }
        }
        for (int j = 0; j < 8; ++j) {
            const uint8_t * quants = w + 2 * 8 * G * 4 + j * 8 * 4 * G;
            __m256i         sum[NC];
            #pragma GCC unroll 8
            for (int c = 0; c < NC; ++c) {
                sum[c] = _mm256_setzero_si256();
            }
            #pragma GCC unroll 8
            for (int q = 0; q < 8; ++q) {
                const __m256i wq = _mm256_loadu_si256((const __m256i *) (quants + q * 4 * G));
                #pragma GCC unroll 8
                for (int c = 0; c < NC; ++c) {
                    int32_t four;
                    std::memcpy(&four, a + c * act_bytes + j * QK + 4 * q, sizeof(four));
                    sum[c] = _mm256_add_epi16(sum[c], _mm256_maddubs_epi16(wq, _mm256_set1_epi32(four)));
                }
            }
            const __m256 scale  = _mm256_loadu_ps((const float *) w + j * G);
            const __m256 offset = _mm256_loadu_ps((const float *) w + 8 * G + j * G);
            #pragma GCC unroll 8
            for (int c = 0; c < NC; ++c) {
                float d, b;
                std::memcpy(&d, a + c * act_bytes + QK_K, sizeof(d));
                std::memcpy(&b, a + c * act_bytes + QK_K + 4 + 4 * j, sizeof(b));
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[c], ones));
                if constexpr (F == form::no_scaling) {
                    acc[c] = _mm256_add_ps(acc[c], dot);
                } else if constexpr (F == form::folded) {
                    part[c] = _mm256_fmadd_ps(scale, dot, part[c]);
                    acc[c]  = _mm256_fnmadd_ps(offset, _mm256_set1_ps(b), acc[c]);
                } else {
                    acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(scale, dot), _mm256_set1_ps(d), acc[c]);
                    if constexpr (F == form::per_sub_block) {
                        acc[c] = _mm256_fnmadd_ps(offset, _mm256_set1_ps(b), acc[c]);
                    }
                }
            }
        }
        if constexpr (F == form::folded) {
            #pragma GCC unroll 8
            for (int c = 0; c < NC; ++c) {
                float d;
                std::memcpy(&d, a + c * act_bytes + QK_K, sizeof(d));
                acc[c] = _mm256_fmadd_ps(part[c], _mm256_set1_ps(d), acc[c]);
            }
        }
    }
    #pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
        _mm256_storeu_ps(out + c * G, acc[c]);
    }
}

// one group against n_cols columns in tiles of NC, `reps` times: its weights and the columns in L1/L2
// (w: the float layout; w_int: int_scales's)
template <int NC, form F>
double rate(const uint8_t * w, const uint8_t * w_int, const uint8_t * act, int64_t n_super, int64_t n_cols, float * out) {
    const int64_t reps = 400;
    return best_rate([&] {
        for (int64_t r = 0; r < reps; ++r) {
            for (int64_t c = 0; c + NC <= n_cols; c += NC) {
                if constexpr (F == form::avx_vnni) {
                    tile_avx_vnni<NC>(w_int, act + c * n_super * Q8_K_BYTES, n_super * Q8_K_BYTES, 8 * n_super,
                                      out + c * G, G);
                } else if constexpr (F == form::int_scales) {
                    tile_int_scales<NC>(w_int, act + c * n_super * Q8_K_BYTES, n_super * Q8_K_BYTES, 8 * n_super,
                                        out + c * G, G);
                } else {
                    tile<NC, F>(w, act + c * n_super * Q8_K_BYTES, n_super * Q8_K_BYTES, n_super, out + c * G);
                }
            }
        }
        return (double) reps * (double) (n_cols / NC * NC) * (double) G * (double) (n_super * QK_K);
    });
}

}  // namespace

int main() {
    const int64_t n_super = 11, n_cols = 24; // a 2816-wide row; 24 columns: whole tiles of 1-4 and 6
    std::vector<uint8_t> w((size_t) (n_super * SB_BYTES)), act((size_t) (n_cols * n_super * Q8_K_BYTES));
    std::vector<uint8_t> w_int((size_t) (n_super * INT_SB_BYTES));
    std::srand(1);
    for (int64_t s = 0; s < n_super; ++s) {
        float * f = (float *) (w.data() + s * SB_BYTES);
        for (int i = 0; i < 2 * 8 * G; ++i) {
            f[i] = (float) (std::rand() % 64) * 1e-3f;
        }
        for (int64_t i = 2 * 8 * G * 4; i < SB_BYTES; ++i) {
            w[(size_t) (s * SB_BYTES + i)] = (uint8_t) (std::rand() % 16);
        }
        uint8_t * o = w_int.data() + s * INT_SB_BYTES;
        for (int r = 0; r < G; ++r) {
            const float d = (float) (std::rand() % 64) * 1e-3f;
            std::memcpy(o + 4 * r, &d, 4);
        }
        for (int i = 0; i < 8 * G; ++i) {
            const int16_t sc = (int16_t) (std::rand() % 64);
            std::memcpy(o + G * 4 + 4 * i, &sc, 2);
            std::memcpy(o + G * 4 + 4 * i + 2, &sc, 2);
        }
        std::memcpy(o + G * 4 + 8 * G * 4, w.data() + s * SB_BYTES + 8 * G * 4, (size_t) (SB_BYTES - 8 * G * 4));
    }
    for (int64_t c = 0; c < n_cols * n_super; ++c) {
        uint8_t * a = act.data() + c * Q8_K_BYTES;
        for (int i = 0; i < QK_K; ++i) {
            a[i] = (uint8_t) (std::rand() % 255 - 127);
        }
        for (int i = 0; i < 9; ++i) {
            const float v = (float) (std::rand() % 100) * 1e-3f;
            std::memcpy(a + QK_K + 4 * i, &v, 4);
        }
    }
    std::vector<float> out((size_t) (n_cols * G));
    std::printf("AVX2 Q4_K tile, 8 rows x 2816, %lld columns, in L1/L2, G MAC/s (best of 5)\n", (long long) n_cols);
    std::printf("columns  int_scales (dg)  per_sub_block  folded  no_offset  no_scaling  (dg's on AVX-VNNI)\n");
#define RATE(NC, F) rate<NC, form::F>(w.data(), w_int.data(), act.data(), n_super, n_cols, out.data())
#define ROW(NC)                                                                                              \
    std::printf("%7d  %15.1f  %13.1f  %6.1f  %9.1f  %10.1f  %18.1f\n", NC, RATE(NC, int_scales),                 \
                RATE(NC, per_sub_block), RATE(NC, folded), RATE(NC, no_offset), RATE(NC, no_scaling),                  \
                __builtin_cpu_supports("avxvnni") ? RATE(NC, avx_vnni) : 0.0)
    ROW(1);
    ROW(2);
    ROW(3);
    ROW(4);
    ROW(5);
    ROW(6);
    ROW(8);
    // dg's tile against the float form before it, both at its 4 columns, rounds alternating
    std::vector<double> before, now, vnni;
    for (int round = 0; round < 15; ++round) {
        before.push_back(RATE(4, per_sub_block));
        now.push_back(RATE(4, int_scales));
        if (__builtin_cpu_supports("avxvnni")) {
            vnni.push_back(RATE(4, avx_vnni));
        }
    }
    std::sort(before.begin(), before.end());
    std::sort(now.begin(), now.end());
    std::printf("interleaved, 15 rounds, 4 columns: float per sub-block %.1f / %.1f, dg's integer scales %.1f / %.1f "
                "G MAC/s (best / median); dg's / before %.3fx / %.3fx\n",
                before.back(), before[7], now.back(), now[7], now.back() / before.back(), now[7] / before[7]);
    if (!vnni.empty()) {
        std::sort(vnni.begin(), vnni.end());
        std::printf("the same rounds, dg's tile on AVX-VNNI: %.1f / %.1f G MAC/s; / integer scales on AVX2 %.3fx / "
                    "%.3fx\n", vnni.back(), vnni[7], vnni.back() / now.back(), vnni[7] / now[7]);
    }
    return out[0] == 12345.0f; // keeps the results live
}
