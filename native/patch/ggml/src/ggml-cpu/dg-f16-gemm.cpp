// dg: C = A x B for an F16 A and an F32 B on AVX-512, for ggml-cpu's MUL_MAT. What it is for: the
// attention's two products without flash attention, a canvas's scores K^T Q (A: the cache's keys) and
// their product with V (A: the cache's transposed values), which llama.cpp's tinyBLAS takes otherwise
// at a fraction of the CPU's fp32 rate: it converts B to F16 first, each of its loads from F16 again,
// and ends every product with a sum across a vector's lanes.
//
// Here A is packed 32 rows at a time into F32, transposed so that a k step of the panel is two
// vectors, and B is read as it is, one broadcast per column and k step: each product is one chain of
// fp32 multiply-adds in k order, 24 chains per tile of 32 rows x 12 columns (the broadcast feeds two
// of them). The panel is packed a chunk of k at a time, so that it stays in L2 while the columns pass.

#include "ggml-cpu-impl.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__GNUC__) && !defined(__clang__)
// GCC's AVX-512 intrinsics start some results from an undefined vector (_mm512_undefined_ps)
#    pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#    include <immintrin.h>
#    define DG_F16_X86 1
#    define DG_F16_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
#endif

extern "C" bool dg_f16_gemm_takes(int64_t m, int64_t n, int64_t k);
extern "C" void dg_f16_gemm(const struct ggml_compute_params * params, int64_t m, int64_t n, int64_t k,
                            const ggml_fp16_t * A, int64_t lda, const float * B, int64_t ldb, float * C, int64_t ldc);

namespace {

constexpr int64_t PANEL_ROWS = 32;  // two vectors
constexpr int     TILE_COLS  = 12;  // 24 accumulators, 2 panel vectors and a broadcast among 32 registers
constexpr int64_t K_CHUNK    = 512; // a packed panel chunk: 64 KB

// DG_F16_GEMM=0 leaves these products to ggml (A/B runs; read per call)
bool switched_off() {
    const char * env = std::getenv("DG_F16_GEMM");
    return env && !std::strcmp(env, "0");
}

#ifdef DG_F16_X86

// the 16 x 16 floats r[0..15] (rows) transposed in place: r[c] then holds column c
DG_F16_AVX512 inline void transpose_16x16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; ++i) { // pairs of rows interleaved within 128-bit lanes
        t[2 * i]     = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) { // 4 x 4 blocks within 128-bit lanes
        u[4 * i]     = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int h = 0; h < 2; ++h) { // 128-bit lanes across rows 0-7 and 8-15
        for (int i = 0; i < 4; ++i) {
            t[8 * h + i]     = _mm512_shuffle_f32x4(u[8 * h + i], u[8 * h + 4 + i], 0x88);
            t[8 * h + 4 + i] = _mm512_shuffle_f32x4(u[8 * h + i], u[8 * h + 4 + i], 0xDD);
        }
    }
    for (int i = 0; i < 8; ++i) {
        r[i]     = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
    }
}

// panel[l * 32 + r] = A[(r * lda) + k0 + l] as float for l in [0, nk), rows r past n_rows zero
DG_F16_AVX512 void pack_panel(const ggml_fp16_t * A, int64_t lda, int64_t n_rows, int64_t k0, int64_t nk, float * panel) {
    for (int64_t l0 = 0; l0 < nk; l0 += 16) {
        const int       nl   = (int) std::min<int64_t>(16, nk - l0);
        const __mmask16 mask = (__mmask16) ((1u << nl) - 1);
        for (int64_t h = 0; h < 2; ++h) {
            __m512 r[16];
            for (int64_t i = 0; i < 16; ++i) {
                const int64_t row = 16 * h + i;
                r[i] = row < n_rows ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, A + row * lda + k0 + l0))
                                    : _mm512_setzero_ps();
            }
            transpose_16x16(r);
            for (int c = 0; c < nl; ++c) {
                _mm512_storeu_ps(panel + (l0 + c) * PANEL_ROWS + 16 * h, r[c]);
            }
        }
    }
}

// C[j * ldc + i] (+)= sum over l of panel[l * 32 + i] x B[j * ldb + l], rows i < n_rows, NC columns j
template <int NC>
DG_F16_AVX512 void tile(const float * panel, int64_t nk, const float * B, int64_t ldb, float * C, int64_t ldc,
                        int64_t n_rows, bool accumulate) {
    __m512 lo[NC], hi[NC];
    for (int j = 0; j < NC; ++j) {
        lo[j] = _mm512_setzero_ps();
        hi[j] = _mm512_setzero_ps();
    }
    for (int64_t l = 0; l < nk; ++l) {
        const __m512 a0 = _mm512_loadu_ps(panel + l * PANEL_ROWS);
        const __m512 a1 = _mm512_loadu_ps(panel + l * PANEL_ROWS + 16);
        for (int j = 0; j < NC; ++j) {
            const __m512 b = _mm512_set1_ps(B[j * ldb + l]);
            lo[j]          = _mm512_fmadd_ps(a0, b, lo[j]);
            hi[j]          = _mm512_fmadd_ps(a1, b, hi[j]);
        }
    }
    const __mmask16 m0 = n_rows >= 16 ? (__mmask16) 0xFFFF : (__mmask16) ((1u << n_rows) - 1);
    const __mmask16 m1 = n_rows >= 32 ? (__mmask16) 0xFFFF : n_rows > 16 ? (__mmask16) ((1u << (n_rows - 16)) - 1) : 0;
    for (int j = 0; j < NC; ++j) {
        float * c = C + j * ldc;
        if (accumulate) {
            lo[j] = _mm512_add_ps(lo[j], _mm512_maskz_loadu_ps(m0, c));
            hi[j] = _mm512_add_ps(hi[j], _mm512_maskz_loadu_ps(m1, c + 16));
        }
        _mm512_mask_storeu_ps(c, m0, lo[j]);
        _mm512_mask_storeu_ps(c + 16, m1, hi[j]);
    }
}

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int64_t, bool);

const tile_fn TILES[TILE_COLS + 1] = { nullptr,  tile<1>, tile<2>, tile<3>,  tile<4>,  tile<5>, tile<6>,
                                       tile<7>,  tile<8>, tile<9>, tile<10>, tile<11>, tile<12> };

#endif  // DG_F16_X86

}  // namespace

// Whether dg_f16_gemm takes an m x n product over k: a batch of columns (a canvas, a prompt; a decode's
// one column stays on ggml's vector dot products) on a CPU with AVX-512.
extern "C" bool dg_f16_gemm_takes(int64_t m, int64_t n, int64_t k) {
#ifdef DG_F16_X86
    static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c");
    return avx512 && m > 0 && n >= 16 && k > 0 && !switched_off();
#else
    (void) m, (void) n, (void) k;
    return false;
#endif
}

// C[j * ldc + i] = sum over l < k of A[i * lda + l] x B[j * ldb + l] for i < m, j < n: this thread's share
// (params->ith of params->nth) of the (row panel, column block) units; dg_f16_gemm_takes must hold.
extern "C" void dg_f16_gemm(const struct ggml_compute_params * params, int64_t m, int64_t n, int64_t k,
                            const ggml_fp16_t * A, int64_t lda, const float * B, int64_t ldb, float * C, int64_t ldc) {
#ifdef DG_F16_X86
    // subnormal operands (a softmax's far tails) as zero, subnormal products flushed: an operand or
    // result below 2^-126 otherwise costs a microcode assist of ~100 cycles, and changes no sum by more
    // than that
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); // FTZ | DAZ
    const int64_t n_panels = (m + PANEL_ROWS - 1) / PANEL_ROWS;
    // column blocks of at most 256 (their copy below stays in L2), and as few as give every thread a unit:
    // a unit packs its panel once per k chunk
    const int64_t max_blocks = std::max<int64_t>(1, n / (4 * TILE_COLS));
    const int64_t n_blocks   = std::max((n + 255) / 256, std::min(max_blocks, (params->nth + n_panels - 1) / n_panels));
    const int64_t n_units    = n_panels * n_blocks;
    const int64_t u0 = n_units * params->ith / params->nth, u1 = n_units * (params->ith + 1) / params->nth;
    const int64_t block_cols = (n + n_blocks - 1) / n_blocks;

    // a block's columns of B copied for a k chunk, each 16 floats over a multiple of 16 apart: read in
    // place, columns a power of two apart (the queries 16 KB, the scores 4 KB at 1024 cells) share an L1
    // set and evict each other and the panel; copied once per chunk, the copy serves every panel
    const int64_t                   b_stride = (std::min(k, K_CHUNK) + 15) / 16 * 16 + 16;
    thread_local std::vector<float> panel, columns;
    panel.resize((size_t) (PANEL_ROWS * std::min(k, K_CHUNK)));
    columns.resize((size_t) (block_cols * b_stride));
    for (int64_t k0 = 0; k0 < k; k0 += K_CHUNK) {
        const int64_t nk     = std::min(K_CHUNK, k - k0);
        int64_t       copied = -1; // the block whose columns `columns` holds
        for (int64_t u = u0; u < u1; ++u) {
            const int64_t p = u / n_blocks, q = u % n_blocks;
            const int64_t i0 = p * PANEL_ROWS, rows = std::min(PANEL_ROWS, m - i0);
            const int64_t j0 = n * q / n_blocks, j1 = n * (q + 1) / n_blocks;
            if (q != copied) {
                for (int64_t j = j0; j < j1; ++j) {
                    std::memcpy(columns.data() + (j - j0) * b_stride, B + j * ldb + k0, (size_t) nk * sizeof(float));
                }
                copied = q;
            }
            pack_panel(A + i0 * lda, lda, rows, k0, nk, panel.data());
            for (int64_t j = j0; j < j1; j += TILE_COLS) {
                const int64_t nc = std::min<int64_t>(TILE_COLS, j1 - j);
                TILES[nc](panel.data(), nk, columns.data() + (j - j0) * b_stride, b_stride, C + j * ldc + i0, ldc, rows,
                          k0 > 0);
            }
        }
    }
    _mm_setcsr(csr);
#else
    (void) params, (void) m, (void) n, (void) k, (void) A, (void) lda, (void) B, (void) ldb, (void) C, (void) ldc;
#endif
}
