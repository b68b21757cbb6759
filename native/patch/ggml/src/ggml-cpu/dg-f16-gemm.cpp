// dg: C = A x B for an F16 A and an F32 B on AVX-512 or AVX2, for ggml-cpu's MUL_MAT. What it is for:
// the attention's two products without flash attention, a canvas's scores K^T Q (A: the cache's keys)
// and their product with V (A: the cache's transposed values), which llama.cpp's tinyBLAS takes
// otherwise at a fraction of the CPU's fp32 rate: it converts B to F16 first, each of its loads from
// F16 again, and ends every product with a sum across a vector's lanes.
//
// Here A is packed two vectors of rows at a time (AVX-512 32, AVX2 16) into F32, transposed so that a k
// step of the panel is two vectors, and B is read in F32, one broadcast per column and k step: each
// product is one chain of fp32 multiply-adds in k order, a tile of the panel x 12 columns (AVX2: 6) in
// 24 (12) chains, the broadcast feeding two of them. The panel is packed a chunk of k at a time, so that
// it stays in L2 while the columns pass.

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
#    define DG_F16_AVX2   __attribute__((target("avx2,fma,f16c")))
#endif

extern "C" int dg_f16_gemm_takes(int64_t m, int64_t n, int64_t k);
extern "C" void dg_f16_gemm(const struct ggml_compute_params * params, int family, int64_t m, int64_t n, int64_t k,
                            const ggml_fp16_t * A, int64_t lda, const float * B, int64_t ldb, float * C, int64_t ldc);

namespace {

constexpr int64_t K_CHUNK = 512; // a packed panel chunk: 64 KB on AVX-512, 32 KB on AVX2

typedef void (*pack_fn)(const ggml_fp16_t * A, int64_t lda, int64_t n_rows, int64_t k0, int64_t nk, float * panel);
typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int64_t, bool);

// one family's kernels: panels of `rows` rows, tiles of up to `cols` columns (tiles[nc] takes nc)
struct kernels {
    int64_t         rows;
    int64_t         cols;
    pack_fn         pack;
    const tile_fn * tiles;
};

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
DG_F16_AVX512 void pack_panel_512(const ggml_fp16_t * A, int64_t lda, int64_t n_rows, int64_t k0, int64_t nk, float * panel) {
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
                _mm512_storeu_ps(panel + (l0 + c) * 32 + 16 * h, r[c]);
            }
        }
    }
}

// C[j * ldc + i] (+)= sum over l of panel[l * 32 + i] x B[j * ldb + l], rows i < n_rows, NC columns j
template <int NC>
DG_F16_AVX512 void tile_512(const float * panel, int64_t nk, const float * B, int64_t ldb, float * C, int64_t ldc,
                        int64_t n_rows, bool accumulate) {
    __m512 lo[NC], hi[NC];
    _Pragma("GCC unroll 16") for (int j = 0; j < NC; ++j) {
        lo[j] = _mm512_setzero_ps();
        hi[j] = _mm512_setzero_ps();
    }
    for (int64_t l = 0; l < nk; ++l) {
        const __m512 a0 = _mm512_loadu_ps(panel + l * 32);
        const __m512 a1 = _mm512_loadu_ps(panel + l * 32 + 16);
        _Pragma("GCC unroll 16") for (int j = 0; j < NC; ++j) {
            const __m512 b = _mm512_set1_ps(B[j * ldb + l]);
            lo[j]          = _mm512_fmadd_ps(a0, b, lo[j]);
            hi[j]          = _mm512_fmadd_ps(a1, b, hi[j]);
        }
    }
    const __mmask16 m0 = n_rows >= 16 ? (__mmask16) 0xFFFF : (__mmask16) ((1u << n_rows) - 1);
    const __mmask16 m1 = n_rows >= 32 ? (__mmask16) 0xFFFF : n_rows > 16 ? (__mmask16) ((1u << (n_rows - 16)) - 1) : 0;
    _Pragma("GCC unroll 16") for (int j = 0; j < NC; ++j) {
        float * c = C + j * ldc;
        if (accumulate) {
            lo[j] = _mm512_add_ps(lo[j], _mm512_maskz_loadu_ps(m0, c));
            hi[j] = _mm512_add_ps(hi[j], _mm512_maskz_loadu_ps(m1, c + 16));
        }
        _mm512_mask_storeu_ps(c, m0, lo[j]);
        _mm512_mask_storeu_ps(c + 16, m1, hi[j]);
    }
}

const tile_fn TILES_512[13] = { nullptr,     tile_512<1>, tile_512<2>, tile_512<3>,  tile_512<4>,  tile_512<5>, tile_512<6>,
                                tile_512<7>, tile_512<8>, tile_512<9>, tile_512<10>, tile_512<11>, tile_512<12> };

// the 8 x 8 floats r[0..7] (rows) transposed in place
DG_F16_AVX2 inline void transpose_8x8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i]     = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        u[4 * i]     = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        r[i]     = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
        r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
    }
}

// pack_panel_512's layout at 16 rows: panel[l * 16 + r]
DG_F16_AVX2 void pack_panel_256(const ggml_fp16_t * A, int64_t lda, int64_t n_rows, int64_t k0, int64_t nk, float * panel) {
    for (int64_t l0 = 0; l0 < nk; l0 += 8) {
        const int nl = (int) std::min<int64_t>(8, nk - l0);
        for (int64_t h = 0; h < 2; ++h) {
            __m256 r[8];
            for (int64_t i = 0; i < 8; ++i) {
                const int64_t       row = 8 * h + i;
                const ggml_fp16_t * src = A + row * lda + k0 + l0;
                if (row >= n_rows) {
                    r[i] = _mm256_setzero_ps();
                } else if (nl == 8) {
                    r[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) src));
                } else { // the chunk's last steps: no 16-bit masked loads on AVX2
                    ggml_fp16_t part[8] = {};
                    std::memcpy(part, src, (size_t) nl * sizeof(ggml_fp16_t));
                    r[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) part));
                }
            }
            transpose_8x8(r);
            for (int c = 0; c < nl; ++c) {
                _mm256_storeu_ps(panel + (l0 + c) * 16 + 8 * h, r[c]);
            }
        }
    }
}

// tile_512 at 16 rows x NC (<= 6) columns: 12 accumulators, the panel's 2 vectors and the broadcast among 16
// registers. The loops over columns unrolled: otherwise GCC keeps the accumulators' array in memory too and
// stores it every k step.
template <int NC>
DG_F16_AVX2 void tile_256(const float * panel, int64_t nk, const float * B, int64_t ldb, float * C, int64_t ldc,
                          int64_t n_rows, bool accumulate) {
    __m256 lo[NC], hi[NC];
    _Pragma("GCC unroll 16") for (int j = 0; j < NC; ++j) {
        lo[j] = _mm256_setzero_ps();
        hi[j] = _mm256_setzero_ps();
    }
    for (int64_t l = 0; l < nk; ++l) {
        const __m256 a0 = _mm256_loadu_ps(panel + l * 16);
        const __m256 a1 = _mm256_loadu_ps(panel + l * 16 + 8);
        _Pragma("GCC unroll 16") for (int j = 0; j < NC; ++j) {
            const __m256 b = _mm256_broadcast_ss(B + j * ldb + l);
            lo[j]          = _mm256_fmadd_ps(a0, b, lo[j]);
            hi[j]          = _mm256_fmadd_ps(a1, b, hi[j]);
        }
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0   = _mm256_cmpgt_epi32(_mm256_set1_epi32((int) n_rows), lane);
    const __m256i m1   = _mm256_cmpgt_epi32(_mm256_set1_epi32((int) n_rows - 8), lane);
    _Pragma("GCC unroll 16") for (int j = 0; j < NC; ++j) {
        float * c = C + j * ldc;
        if (accumulate) {
            lo[j] = _mm256_add_ps(lo[j], _mm256_maskload_ps(c, m0));
            hi[j] = _mm256_add_ps(hi[j], _mm256_maskload_ps(c + 8, m1));
        }
        _mm256_maskstore_ps(c, m0, lo[j]);
        _mm256_maskstore_ps(c + 8, m1, hi[j]);
    }
}

const tile_fn TILES_256[7] = { nullptr, tile_256<1>, tile_256<2>, tile_256<3>, tile_256<4>, tile_256<5>, tile_256<6> };

const kernels AVX512 = { 32, 12, pack_panel_512, TILES_512 };
const kernels AVX2   = { 16, 6, pack_panel_256, TILES_256 };

// The family for this call: DG_F16_GEMM=0 leaves these products to ggml, =avx2 / =avx512 asks for one
// family (tests); otherwise DG_CPU_KERNELS, the switch of every dg CPU kernel, decides (ggml: ggml's,
// avx2: AVX2's), else the widest this CPU runs. Read per call, for A/B runs within one process.
const kernels * family_for_call() {
    static const int widest = [] {
        __builtin_cpu_init();
        const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl");
        return avx512 ? 512 : avx2 ? 256 : 0;
    }();
    const char * own    = std::getenv("DG_F16_GEMM");
    const char * family = std::getenv("DG_CPU_KERNELS");
    int          width  = widest;
    if (own && *own) {
        width = !std::strcmp(own, "0") ? 0 : !std::strcmp(own, "avx2") ? 256 : !std::strcmp(own, "avx512") ? 512 : widest;
    } else if (family && !std::strcmp(family, "ggml")) {
        width = 0;
    } else if (family && !std::strcmp(family, "avx2")) {
        width = 256;
    }
    if (width > widest) {
        return nullptr;
    }
    return width == 512 ? &AVX512 : width == 256 ? &AVX2 : nullptr;
}

#endif  // DG_F16_X86

}  // namespace

// Which of dg's kernels takes an m x n product over k (512: AVX-512's, 256: AVX2's), or 0 for ggml's: a
// batch of columns (a canvas, a prompt; a decode's one column stays on ggml's vector dot products).
extern "C" int dg_f16_gemm_takes(int64_t m, int64_t n, int64_t k) {
#ifdef DG_F16_X86
    const kernels * ks = family_for_call();
    return ks && m > 0 && n >= 16 && k > 0 ? (ks == &AVX512 ? 512 : 256) : 0;
#else
    (void) m, (void) n, (void) k;
    return 0;
#endif
}

// C[j * ldc + i] = sum over l < k of A[i * lda + l] x B[j * ldb + l] for i < m, j < n: this thread's share
// (params->ith of params->nth) of the (row panel, column block) units, on the family dg_f16_gemm_takes
// gave (every thread of a product is given the same).
extern "C" void dg_f16_gemm(const struct ggml_compute_params * params, int family, int64_t m, int64_t n, int64_t k,
                            const ggml_fp16_t * A, int64_t lda, const float * B, int64_t ldb, float * C, int64_t ldc) {
#ifdef DG_F16_X86
    const kernels * ks         = family == 512 ? &AVX512 : &AVX2;
    const int64_t   PANEL_ROWS = ks->rows, TILE_COLS = ks->cols;
    // subnormal operands (a softmax's far tails) as zero, subnormal products flushed: an operand or
    // result below 2^-126 otherwise costs a microcode assist of ~100 cycles, and changes no sum by more
    // than that
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); // FTZ | DAZ
    const int64_t n_panels = (m + PANEL_ROWS - 1) / PANEL_ROWS;
    // column blocks of at most 256 (their copy below stays in L2), and as few as give every thread a unit:
    // a unit packs its panel once per k chunk; units go block by block, so that a thread copies each of
    // its blocks once per k chunk
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
            const int64_t q = u / n_panels, p = u % n_panels;
            const int64_t i0 = p * PANEL_ROWS, rows = std::min(PANEL_ROWS, m - i0);
            const int64_t j0 = n * q / n_blocks, j1 = n * (q + 1) / n_blocks;
            if (q != copied) {
                for (int64_t j = j0; j < j1; ++j) {
                    std::memcpy(columns.data() + (j - j0) * b_stride, B + j * ldb + k0, (size_t) nk * sizeof(float));
                }
                copied = q;
            }
            ks->pack(A + i0 * lda, lda, rows, k0, nk, panel.data());
            for (int64_t j = j0; j < j1; j += TILE_COLS) {
                const int64_t nc = std::min<int64_t>(TILE_COLS, j1 - j);
                ks->tiles[nc](panel.data(), nk, columns.data() + (j - j0) * b_stride, b_stride, C + j * ldc + i0, ldc, rows,
                          k0 > 0);
            }
        }
    }
    _mm_setcsr(csr);
#else
    (void) params, (void) family, (void) m, (void) n, (void) k, (void) A, (void) lda, (void) B, (void) ldb, (void) C, (void) ldc;
#endif
}
