// What AMX's int8 tiles could give dg's CPU GEMMs, against the AVX-512 VNNI peak its kernels are
// measured by: one thread, operands in L1, CPU time, each rate the best of 5 rounds, the variants
// interleaved. Run on an x86-64 Linux CPU with AMX (Sapphire Rapids and later):
//
//   g++ -O2 -Ibenchmarks -o /tmp/amx_probe benchmarks/amx_probe.cpp && /tmp/amx_probe
//
// Rows: the vpdpbusd zmm chain (dg_peak_gmacs's int8 peak); TDPBUSD over 2 x 2 tiles of 16 x 16 int32
// with K = 64 (one instruction per 16 x 16 x 64) and K = 32 (a K-quant sub-block or a Q8_0 block per
// instruction); and K = 32 with what a block-scaled format needs after each block: the four C tiles
// stored, converted to float and multiply-added into float accumulators with AVX-512.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>

#include "probe_timing.h"

namespace {

// best multiply-add rate (G MAC/s) of `run(iters)` (returning multiply-adds) over rounds of ~0.2 s,
// iters doubled until a round lasts that long
template <typename Run> double best_rate_of_iterations(Run run) {
    double best = 0.0;
    for (int round = 0; round < 5; ++round) {
        long   iters = 256;
        double dt    = 0.0, macs = 0.0;
        for (;;) {
            const double t0 = cpu_now_s();
            macs            = run(iters);
            dt              = cpu_now_s() - t0;
            if (dt > 0.2) {
                break;
            }
            iters *= 2;
        }
        best = macs / dt > best ? macs / dt : best;
    }
    return best / 1e9;
}

volatile int sink;

__attribute__((target("avx512f,avx512bw,avx512vnni"))) double vnni_chain(long iters) {
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5), c[12];
    for (auto & v : c) {
        v = _mm512_setzero_si512();
    }
    for (long it = 0; it < iters; ++it) { // 12 independent chains cover vpdpbusd's latency
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) {
            c[i] = _mm512_dpbusd_epi32(c[i], a, b);
        }
        __asm__ volatile("" : "+v"(a), "+v"(b));
    }
    int x = 0;
    for (auto & v : c) {
        x ^= _mm512_reduce_add_epi32(v);
    }
    sink = x;
    return iters * 12.0 * 64;
}

struct tile_config {
    uint8_t  palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t  rows[16];
};

alignas(64) int8_t  A[2][16 * 64], B[2][16 * 64];
alignas(64) int32_t C[4][16 * 16];

// tiles 0-3: C (16 x 16 int32), 4-5: A (16 rows x k bytes), 6-7: B (k / 4 rows x 16 columns x 4)
__attribute__((target("amx-tile"))) void configure(int k) {
    tile_config cfg = {};
    cfg.palette     = 1;
    for (int t = 0; t < 4; ++t) {
        cfg.rows[t] = 16, cfg.colsb[t] = 64;
    }
    for (int t = 4; t < 6; ++t) {
        cfg.rows[t] = 16, cfg.colsb[t] = (uint16_t) k;
    }
    for (int t = 6; t < 8; ++t) {
        cfg.rows[t] = (uint8_t) (k / 4), cfg.colsb[t] = 64;
    }
    // GCC 12 does not see ldtilecfg read the struct and drops the stores above without this
    __asm__ volatile("" : : "m"(cfg) : "memory");
    _tile_loadconfig(&cfg);
}

template <int K, bool SCALED> __attribute__((target("amx-tile,amx-int8,avx512f"))) double amx(long iters) {
    configure(K);
    __m512       acc[16];
    const __m512 scale = _mm512_set1_ps(0.5f);
    for (auto & v : acc) {
        v = _mm512_setzero_ps();
    }
    for (long it = 0; it < iters; ++it) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(4, A[0], 64);
        _tile_loadd(5, A[1], 64);
        _tile_loadd(6, B[0], 64);
        _tile_loadd(7, B[1], 64);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        _tile_dpbusd(2, 5, 6);
        _tile_dpbusd(3, 5, 7);
        if (SCALED) {
            _tile_stored(0, C[0], 64);
            _tile_stored(1, C[1], 64);
            _tile_stored(2, C[2], 64);
            _tile_stored(3, C[3], 64);
            for (int t = 0; t < 4; ++t) {
                for (int r = 0; r < 16; ++r) {
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(C[t] + 16 * r)), scale, acc[r]);
                }
            }
        }
    }
    _tile_stored(0, C[0], 64);
    float x = 0.0f;
    for (auto & v : acc) {
        x += _mm512_reduce_add_ps(v);
    }
    sink = C[0][5] + (int) x;
    _tile_release();
    return iters * 4.0 * 16 * 16 * K;
}

}  // namespace

int main() {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512vnni")) {
        std::puts("this CPU has no AVX-512 VNNI");
        return 1;
    }
    // Linux hands a process AMX's tile state only when asked (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
        std::puts("no AMX here (the kernel refused the tile state)");
        return 1;
    }
    for (int t = 0; t < 2; ++t) {
        for (int i = 0; i < 16 * 64; ++i) {
            A[t][i] = (int8_t) (i * 7 + t), B[t][i] = (int8_t) (i * 13 + t);
        }
    }
    const char * names[] = { "vpdpbusd zmm chain (the VNNI peak)", "TDPBUSD, K = 64", "TDPBUSD, K = 32",
                             "TDPBUSD, K = 32, each block scaled in float" };
    double (*runs[])(long) = { vnni_chain, amx<64, false>, amx<32, false>, amx<32, true> };
    double best[4]         = {};
    for (int rep = 0; rep < 3; ++rep) { // interleaved
        for (int v = 0; v < 4; ++v) {
            const double r = best_rate_of_iterations(runs[v]);
            best[v]        = r > best[v] ? r : best[v];
        }
    }
    for (int v = 0; v < 4; ++v) {
        std::printf("%-46s %7.0f G MAC/s  %5.2fx the VNNI peak\n", names[v], best[v], best[v] / best[0]);
    }
    return 0;
}
