// dg_peak_gmacs (include/diffusion-gemma.h): this CPU's single-thread multiply-add peak, measured
// with register-resident instruction chains, so that benchmarks can say how far each op of the
// step is from what the core can do. Every kernel is compiled for its own instruction set
// (target attributes) and chosen at run time, whatever the build's -march.

#include "diffusion-gemma.h"

#include <cstring>
#include <ctime>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#    include <immintrin.h>
#    define DG_PEAK_X86 1
#endif

namespace {

// this thread's CPU time: what the chain cost, whatever else the machine runs
double cpu_now_s() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

// Runs `chain(iters)` (returning multiply-adds done) with growing iteration counts until one run
// lasts `seconds` / 5, five times, and keeps the fastest rate.
template <typename Chain>
double best_rate(Chain chain, double seconds) {
    long   iters = 1 << 12;
    double best  = 0.0;
    for (int round = 0; round < 5; ++round) {
        for (;;) {
            const double t0   = cpu_now_s();
            const double macs = chain(iters);
            const double dt   = cpu_now_s() - t0;
            if (dt >= seconds / 5 || iters > (1L << 40)) {
                best = macs / dt > best ? macs / dt : best;
                break;
            }
            iters *= 2;
        }
    }
    return best / 1e9;
}

volatile unsigned char dg_peak_sink;

// Keeps every accumulator alive: a byte of each ends in a volatile.
template <typename Vec>
void consume(const Vec * acc, int n) {
    unsigned char x = 0;
    for (int i = 0; i < n; ++i) {
        unsigned char byte;
        std::memcpy(&byte, &acc[i], 1);
        x ^= byte;
    }
    dg_peak_sink = x;
}

// One chain per instruction: 12 independent accumulators of type Acc (enough to cover the latency
// of every instruction below on current cores), acc = MAC(acc, a, b) each on inputs of type Vec, `lanes` multiply-adds per
// instruction; the empty asm keeps the compiler from hoisting the loop-invariant product.
#define DG_PEAK_CHAIN(name, attr, Acc, Vec, reg, zero, a0, b0, MAC, lanes)               \
    attr double name(long iters) {                                                        \
        Vec a = a0, b = b0;                                                               \
        Acc c[12];                                                                        \
        for (auto & v : c) {                                                              \
            v = zero;                                                                     \
        }                                                                                 \
        for (long it = 0; it < iters; ++it) {                                             \
            c[0] = MAC(c[0], a, b), c[1] = MAC(c[1], a, b), c[2] = MAC(c[2], a, b);         \
            c[3] = MAC(c[3], a, b), c[4] = MAC(c[4], a, b), c[5] = MAC(c[5], a, b);         \
            c[6] = MAC(c[6], a, b), c[7] = MAC(c[7], a, b), c[8] = MAC(c[8], a, b);         \
            c[9] = MAC(c[9], a, b), c[10] = MAC(c[10], a, b), c[11] = MAC(c[11], a, b);     \
            __asm__ volatile("" : "+" reg(a), "+" reg(b));                                \
        }                                                                                 \
        consume(c, 12);                                                                   \
        return iters * 12.0 * (lanes);                                                    \
    }

#ifdef DG_PEAK_X86
#    define DG_DPBUSD512(c, a, b) _mm512_dpbusd_epi32(c, a, b)
#    define DG_DPBUSD256(c, a, b) _mm256_dpbusd_avx_epi32(c, a, b)
#    define DG_DPBF16(c, a, b)    _mm512_dpbf16_ps(c, a, b)
#    define DG_FMA512(c, a, b)    _mm512_fmadd_ps(a, b, c)
#    define DG_FMA256(c, a, b)    _mm256_fmadd_ps(a, b, c)

#    define DG_ISA(isa) __attribute__((target(isa)))

DG_PEAK_CHAIN(int8_avx512_vnni, DG_ISA("avx512f,avx512bw,avx512vnni"), __m512i, __m512i, "v", _mm512_setzero_si512(),
              _mm512_set1_epi8(3), _mm512_set1_epi8(5), DG_DPBUSD512, 64)
DG_PEAK_CHAIN(int8_avx_vnni, DG_ISA("avx2,avxvnni"), __m256i, __m256i, "x", _mm256_setzero_si256(), _mm256_set1_epi8(3),
              _mm256_set1_epi8(5), DG_DPBUSD256, 32)
DG_PEAK_CHAIN(bf16_avx512, DG_ISA("avx512f,avx512bf16"), __m512, __m512bh, "v", _mm512_setzero_ps(),
              (__m512bh) _mm512_set1_epi16(0x3f80), (__m512bh) _mm512_set1_epi16(0x3f80), DG_DPBF16, 32)
DG_PEAK_CHAIN(f32_avx512, DG_ISA("avx512f"), __m512, __m512, "v", _mm512_setzero_ps(), _mm512_set1_ps(1.0001f),
              _mm512_set1_ps(0.9999f), DG_FMA512, 16)
DG_PEAK_CHAIN(f32_avx2, DG_ISA("avx2,fma"), __m256, __m256, "x", _mm256_setzero_ps(), _mm256_set1_ps(1.0001f),
              _mm256_set1_ps(0.9999f), DG_FMA256, 8)

// u8 x s8 pairs to int16 (vpmaddubsw), pairs of those to int32 (vpmaddwd), accumulate: what
// llama.cpp's AVX2 int8 kernels do per 32 multiply-adds. Eight distinct products (four a, two b:
// identical ones would be computed once), all registers: 8 accumulators + 6 inputs + the ones.
__attribute__((target("avx2"))) double int8_avx2(long iters) {
    __m256i a0 = _mm256_set1_epi8(3), a1 = _mm256_set1_epi8(4), a2 = _mm256_set1_epi8(5), a3 = _mm256_set1_epi8(6);
    __m256i b0 = _mm256_set1_epi8(7), b1 = _mm256_set1_epi8(9);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    for (long it = 0; it < iters; ++it) {
        c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(_mm256_maddubs_epi16(a0, b0), ones));
        c1 = _mm256_add_epi32(c1, _mm256_madd_epi16(_mm256_maddubs_epi16(a1, b0), ones));
        c2 = _mm256_add_epi32(c2, _mm256_madd_epi16(_mm256_maddubs_epi16(a2, b0), ones));
        c3 = _mm256_add_epi32(c3, _mm256_madd_epi16(_mm256_maddubs_epi16(a3, b0), ones));
        c4 = _mm256_add_epi32(c4, _mm256_madd_epi16(_mm256_maddubs_epi16(a0, b1), ones));
        c5 = _mm256_add_epi32(c5, _mm256_madd_epi16(_mm256_maddubs_epi16(a1, b1), ones));
        c6 = _mm256_add_epi32(c6, _mm256_madd_epi16(_mm256_maddubs_epi16(a2, b1), ones));
        c7 = _mm256_add_epi32(c7, _mm256_madd_epi16(_mm256_maddubs_epi16(a3, b1), ones));
        __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(b0), "+x"(b1));
    }
    const __m256i c[8] = { c0, c1, c2, c3, c4, c5, c6, c7 };
    consume(c, 8);
    return iters * 8.0 * 32;
}

#endif

// plain C++ (whatever the compiler makes of it): the floor on CPUs without the above
#define DG_SCALAR_MAC(c, a, b) ((c) + (a) * (b))
DG_PEAK_CHAIN(f32_scalar, , float, float, "r", 0.0f, 1.0001f, 0.9999f, DG_SCALAR_MAC, 1)

void set_name(char * out, int32_t len, const char * name) {
    if (out && len > 0) {
        std::strncpy(out, name, (size_t) len - 1);
        out[len - 1] = '\0';
    }
}

}  // namespace

double dg_peak_gmacs(int32_t kind, double seconds, char * name_out, int32_t name_len) {
    if (!(seconds > 0.0)) {
        seconds = 0.5;
    }
    double (*chain)(long) = f32_scalar;
    const char * name = "fp32 scalar";
#ifdef DG_PEAK_X86
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = __builtin_cpu_supports("avx512f");
    if (kind == DG_PEAK_INT8_AVX2) {
        if (avx2 && dg_avx_vnni_in_use()) { // the family's tiles on AVX-VNNI
            chain = int8_avx_vnni, name = "int8 AVX-VNNI (vpdpbusd ymm)";
        } else if (avx2) {
            chain = int8_avx2, name = "int8 AVX2 (vpmaddubsw + vpmaddwd)";
        }
    } else if (kind == DG_PEAK_INT8) {
        if (avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni")) {
            chain = int8_avx512_vnni, name = "int8 AVX-512 VNNI (vpdpbusd zmm)";
        } else if (avx2 && __builtin_cpu_supports("avxvnni")) {
            chain = int8_avx_vnni, name = "int8 AVX-VNNI (vpdpbusd ymm)";
        } else if (avx2) {
            chain = int8_avx2, name = "int8 AVX2 (vpmaddubsw + vpmaddwd)";
        }
    } else if (kind == DG_PEAK_BF16 && avx512 && __builtin_cpu_supports("avx512bf16")) {
        chain = bf16_avx512, name = "bf16 AVX-512 BF16 (vdpbf16ps zmm)";
    } else if (avx512) {
        // no bf16 instructions: a bf16 GEMM converts to fp32 and runs at the fp32 FMA rate
        chain = f32_avx512, name = kind == DG_PEAK_BF16 ? "bf16 as fp32 AVX-512 FMA (no bf16 instructions)"
                                                        : "fp32 AVX-512 FMA (zmm)";
    } else if (avx2) {
        chain = f32_avx2, name = kind == DG_PEAK_BF16 ? "bf16 as fp32 AVX2 FMA (no bf16 instructions)"
                                                      : "fp32 AVX2 FMA (ymm)";
    }
#endif
    set_name(name_out, name_len, name);
    return best_rate(chain, seconds);
}
