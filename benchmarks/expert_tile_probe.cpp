// Where the VNNI family's repacked Q4_K expert tile loses to the int8 peak: the tile's loop (a model of
// tile_q4_K_vnni in native/patch/src/diffusion-gemma-int8-kernels.inc, on the same repacked layout:
// per super-block of 16 rows d, dmin, 8 scales, 8 mins, then 32 vectors of 16 rows x 4 nibble bytes)
// timed by parts with its operands in L1, then streamed from memory as a canvas step streams the
// experts (128 experts x 1408 rows x 2816, 16 tokens each, two tiles of 8 columns over each span) on
// 4 KiB and on 2 MiB pages, with the results kept or stored into a MUL_MAT_ID result as dg did and does. One thread, CPU time, best of 5 rounds. On an AVX-512 VNNI x86-64 Linux CPU:
//
//   g++ -O3 -o /tmp/expert_tile_probe benchmarks/expert_tile_probe.cpp && /tmp/expert_tile_probe
//
// Compare its rates with dg_peak_gmacs's int8 peak (benchmarks/step_profile.py prints it).

#include <immintrin.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "probe_timing.h"

namespace {

constexpr int64_t G = 16, QK = 32, QK_K = 256;
constexpr int64_t Q8_K_BYTES = QK_K + 4 + 8 * 4; // quants, d, 8 sub-block sums times d
constexpr int64_t Q4_K_STORED = 148;              // per row and super-block, as the repacked layout

enum class part { whole, no_scaling, no_unpacking };

#define PROBE_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"), noinline))

// out[c * 16 + r] += 16 rows r x NC columns c over n_super super-blocks; `what` drops a part of the work
// (no_scaling: the sub-blocks' float scaling and offsets; no_unpacking: also the nibble masks and shifts)
template <int NC, part what>
PROBE_VNNI void tile(const uint8_t * group, const uint8_t * act, int64_t act_bytes, int64_t n_super, float * out) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512        total[NC];
    #pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
        total[c] = _mm512_loadu_ps(out + c * 16);
    }
    for (int64_t s = 0; s < n_super; ++s) {
        const uint8_t * w       = group + s * Q4_K_STORED * G;
        const uint8_t * nibbles = w + 20 * G;
        const uint8_t * a       = act + s * Q8_K_BYTES;
        const __m512    d       = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) w));
        const __m512    dmin    = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (w + 2 * G)));
        __m512          part_sum[NC];
        #pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
            part_sum[c] = _mm512_setzero_ps();
        }
        for (int j = 0; j < 8; ++j) {
            __m512i dot[NC];
            #pragma GCC unroll 8
            for (int c = 0; c < NC; ++c) {
                dot[c] = _mm512_setzero_si512();
            }
#pragma GCC unroll 8
            for (int q = 0; q < 8; ++q) {
                __m512i wq;
                if (what == part::no_unpacking) {
                    wq = _mm512_loadu_si512(nibbles + q * 4 * G);
                } else {
                    const __m512i v = _mm512_loadu_si512(nibbles + ((j / 2) * 8 + q) * 4 * G);
                    wq              = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(v, 4) : v, low);
                }
#pragma GCC unroll 8
                for (int c = 0; c < NC; ++c) {
                    int32_t four;
                    std::memcpy(&four, a + c * act_bytes + j * QK + 4 * q, sizeof(four));
                    dot[c] = _mm512_dpbusd_epi32(dot[c], wq, _mm512_set1_epi32(four));
                }
            }
            if (what == part::whole) {
                const __m512 scale  = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                          _mm_loadu_si128((const __m128i *) (w + 4 * G + j * G)))));
                const __m512 offset = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                              _mm_loadu_si128((const __m128i *) (w + 12 * G + j * G)))));
                #pragma GCC unroll 8
                for (int c = 0; c < NC; ++c) {
                    float b;
                    std::memcpy(&b, a + c * act_bytes + QK_K + 4 + 4 * j, sizeof(b));
                    part_sum[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[c]), scale, part_sum[c]);
                    total[c]    = _mm512_fnmadd_ps(offset, _mm512_set1_ps(b), total[c]);
                }
            } else {
                #pragma GCC unroll 8
                for (int c = 0; c < NC; ++c) { // keeps the products live
                    part_sum[c] = _mm512_add_ps(part_sum[c], _mm512_castsi512_ps(dot[c]));
                }
            }
        }
        #pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
            float dx;
            std::memcpy(&dx, a + c * act_bytes + QK_K, sizeof(dx));
            total[c] = _mm512_fmadd_ps(part_sum[c], _mm512_set1_ps(dx), total[c]);
        }
    }
    #pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
        _mm512_storeu_ps(out + c * 16, total[c]);
    }
}

// weights with finite fp16 scales (zeros) and arbitrary quants
void fill_weights(uint8_t * w, int64_t n_super_total) {
    for (int64_t i = 0; i < n_super_total * Q4_K_STORED * G; ++i) {
        w[i] = (uint8_t) (i * 7);
    }
    for (int64_t s = 0; s < n_super_total; ++s) {
        std::memset(w + s * Q4_K_STORED * G, 0, 4 * G);
    }
}

template <int NC, part what> double in_l1(const uint8_t * w, const uint8_t * act, int64_t act_bytes, int64_t n_super) {
    alignas(64) static float out[16 * 8];
    return best_rate([&] {
        const long iters = 4000;
        for (long i = 0; i < iters; ++i) {
            tile<NC, what>(w, act, act_bytes, n_super, out);
        }
        return (double) iters * n_super * QK_K * G * NC;
    });
}

// where each group's 16 x 16 results go: nowhere (the tile's own output), into the MUL_MAT_ID result
// [1408, 8, 256] a group's 64 bytes per column (rows of one token 45 KB apart), or into the expert's own
// rows, copied out whole once its last group is done
enum class results { kept, stored_per_group, stored_per_expert };

// the experts' stream: per group of 16 rows, per super-block, two tiles of 8 columns
double streamed(bool huge_pages, results where = results::kept) {
    const int64_t n_super = 11, act_bytes = n_super * Q8_K_BYTES, group_bytes = n_super * Q4_K_STORED * G;
    const int64_t n_groups = 128 * 1408 / G;
    const size_t  huge     = (size_t) 2 << 20;
    const size_t  bytes    = ((size_t) (n_groups * group_bytes) + huge - 1) / huge * huge;
    auto *        w        = (uint8_t *) aligned_alloc(huge, bytes);
    if (w == nullptr) {
        return 0.0;
    }
    madvise(w, bytes, huge_pages ? MADV_HUGEPAGE : MADV_NOHUGEPAGE); // before the first touch
    fill_weights(w, n_groups * n_super);
    std::vector<uint8_t> act((size_t) (16 * act_bytes), 2);
    alignas(64) static float out[16 * 16];
    constexpr int64_t  n_out = 1408, n_used = 8, n_tokens = 256, groups_per_expert = n_out / G;
    std::vector<float> result((size_t) (n_out * n_used * n_tokens)), rows((size_t) (16 * n_out));
    const double rate = best_rate([&] {
        for (int64_t g = 0; g < n_groups; ++g) {
            const uint8_t * group = w + g * group_bytes;
            std::memset(out, 0, sizeof(out));
            for (int64_t s = 0; s < n_super; ++s) {
                tile<8, part::whole>(group + s * Q4_K_STORED * G, act.data() + s * Q8_K_BYTES, act_bytes, 1, out);
                tile<8, part::whole>(group + s * Q4_K_STORED * G, act.data() + 8 * act_bytes + s * Q8_K_BYTES, act_bytes,
                                     1, out + 8 * 16);
            }
            const int64_t e = g / groups_per_expert, in_expert = g % groups_per_expert;
            for (int64_t c = 0; c < 16 && where != results::kept; ++c) {
                const int64_t token = (2 * e + 16 * c) % n_tokens, slot = (e + c) % n_used; // 16 tokens an expert
                float *       row   = result.data() + (token * n_used + slot) * n_out;
                if (where == results::stored_per_group) {
                    std::memcpy(row + in_expert * G, out + 16 * c, 16 * sizeof(float));
                    continue;
                }
                std::memcpy(rows.data() + c * n_out + in_expert * G, out + 16 * c, 16 * sizeof(float));
                if (in_expert + 1 == groups_per_expert) {
                    std::memcpy(row, rows.data() + c * n_out, n_out * sizeof(float));
                }
            }
        }
        return (double) n_groups * n_super * QK_K * G * 16;
    });
    free(w);
    return rate;
}

}  // namespace

int main() {
    if (!__builtin_cpu_supports("avx512vnni")) {
        std::printf("this CPU has no AVX-512 VNNI\n");
        return 1;
    }
    const int64_t        n_super = 2, act_bytes = n_super * Q8_K_BYTES; // 4.6 KB of weights, 4.7 KB of activations
    std::vector<uint8_t> w((size_t) (n_super * Q4_K_STORED * G)), act((size_t) (8 * act_bytes), 2);
    fill_weights(w.data(), n_super);
    std::printf("G MAC/s, one thread (best of 5)\n");
    std::printf("in L1, 8 columns:  whole tile %.1f, without the float scaling %.1f, without the unpacking too %.1f\n",
                in_l1<8, part::whole>(w.data(), act.data(), act_bytes, n_super),
                in_l1<8, part::no_scaling>(w.data(), act.data(), act_bytes, n_super),
                in_l1<8, part::no_unpacking>(w.data(), act.data(), act_bytes, n_super));
    std::printf("in L1, 4 columns:  whole tile %.1f, without the float scaling %.1f, without the unpacking too %.1f\n",
                in_l1<4, part::whole>(w.data(), act.data(), act_bytes, n_super),
                in_l1<4, part::no_scaling>(w.data(), act.data(), act_bytes, n_super),
                in_l1<4, part::no_unpacking>(w.data(), act.data(), act_bytes, n_super));
    for (int round = 0; round < 2; ++round) {
        const double small = streamed(false), large = streamed(true);
        std::printf("streamed, 16 columns: 4 KiB pages %.1f, 2 MiB pages %.1f (%.2f GB/s of weights)\n", small, large,
                    large / 16.0 * 0.578);
        std::printf("  on 2 MiB pages, the results stored: a group's 64 bytes per column %.1f, whole rows per expert %.1f\n",
                    streamed(true, results::stored_per_group), streamed(true, results::stored_per_expert));
    }
    return 0;
}
