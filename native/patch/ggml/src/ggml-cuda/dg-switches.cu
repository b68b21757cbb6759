// dg: the A/B switches of dg's CUDA kernel choices (dg-cuda.cuh lists them), read from the
// environment at each graph compute.

#include "common.cuh"
#include "dg-cuda.cuh"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

static std::mutex       dg_switches_mutex;
static dg_cuda_switches dg_switches_now;
static uint64_t         dg_switches_sig = 0;

static const char * dg_env(const char * name) {
    const char * v = getenv(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
}

static bool dg_env_on(const char * name) {
    const char * v = dg_env(name);
    return v != nullptr && strcmp(v, "0") != 0 && strcasecmp(v, "off") != 0 && strcasecmp(v, "false") != 0;
}

// "mean", "mean:F" or N
static void dg_parse_moe_tile(const char * v, dg_cuda_switches & s) {
    if (v == nullptr || strcmp(v, "0") == 0) {
        return;
    }
    if (strncmp(v, "mean", 4) == 0) {
        s.moe_tile = -1;
        if (v[4] == ':') {
            const float f = strtof(v + 5, nullptr);
            s.moe_tile_factor = std::isfinite(f) && f > 0.0f && f <= 16.0f ? f : 1.0f;
        }
        return;
    }
    const long n = strtol(v, nullptr, 10);
    if (n >= 1 && n <= 128) {
        s.moe_tile = (int) n;
    } else {
        GGML_LOG_WARN("%s: DG_CUDA_MOE_TILE=%s ignored (expected mean, mean:F or 1..128)\n", __func__, v);
    }
}

// "bf16" or "bf16:MxK,MxK,..."
static void dg_parse_dense(const char * v, dg_cuda_switches & s) {
    if (v == nullptr || strncmp(v, "bf16", 4) != 0) {
        return;
    }
    if (v[4] == '\0') {
        s.dense = 1;
        return;
    }
    if (v[4] != ':') {
        return;
    }
    s.dense = 2;
    const char * p = v + 5;
    while (*p != '\0' && s.n_dense_shapes < DG_DENSE_SHAPES_MAX) {
        char *     end = nullptr;
        const long m   = strtol(p, &end, 10);
        if (end == p || *end != 'x') {
            break;
        }
        p = end + 1;
        const long k = strtol(p, &end, 10);
        if (end == p || m <= 0 || k <= 0) {
            break;
        }
        s.dense_shapes[s.n_dense_shapes][0] = m;
        s.dense_shapes[s.n_dense_shapes][1] = k;
        s.n_dense_shapes++;
        p = *end == ',' ? end + 1 : end;
        if (*end != ',') {
            break;
        }
    }
}

static uint64_t dg_hash(uint64_t h, const void * data, size_t n) {
    const unsigned char * b = (const unsigned char *) data;
    for (size_t i = 0; i < n; ++i) {
        h = (h ^ b[i]) * 1099511628211ull;  // FNV-1a
    }
    return h;
}

uint64_t dg_cuda_switches_refresh() {
    dg_cuda_switches s;
    dg_parse_moe_tile(dg_env("DG_CUDA_MOE_TILE"), s);
    s.moe_compact = dg_env_on("DG_CUDA_MOE_COMPACT");
    s.moe_mmf     = dg_env_on("DG_CUDA_MOE_MMF");
    const char * topk = dg_env("DG_CUDA_TOPK");
    s.topk_radix  = topk != nullptr && strcmp(topk, "radix") == 0;
    dg_parse_dense(dg_env("DG_CUDA_DENSE"), s);

    uint64_t h = 1469598103934665603ull;
    h = dg_hash(h, &s.moe_tile, sizeof(s.moe_tile));
    h = dg_hash(h, &s.moe_tile_factor, sizeof(s.moe_tile_factor));
    h = dg_hash(h, &s.moe_compact, sizeof(s.moe_compact));
    h = dg_hash(h, &s.moe_mmf, sizeof(s.moe_mmf));
    h = dg_hash(h, &s.topk_radix, sizeof(s.topk_radix));
    h = dg_hash(h, &s.dense, sizeof(s.dense));
    h = dg_hash(h, s.dense_shapes, sizeof(s.dense_shapes[0]) * s.n_dense_shapes);

    std::lock_guard<std::mutex> lock(dg_switches_mutex);
    dg_switches_now = s;
    dg_switches_sig = h;
    return h;
}

const dg_cuda_switches & dg_cuda_switches_get() {
    static std::once_flag first;
    std::call_once(first, [] { dg_cuda_switches_refresh(); });
    return dg_switches_now;
}

uint64_t dg_cuda_switches_signature() {
    dg_cuda_switches_get();
    std::lock_guard<std::mutex> lock(dg_switches_mutex);
    return dg_switches_sig;
}

int64_t dg_moe_ncols_opt(int64_t ne12, int64_t n_used, int64_t n_experts) {
    const dg_cuda_switches & s = dg_cuda_switches_get();
    if (s.moe_tile > 0) {
        return s.moe_tile;
    }
    if (s.moe_tile < 0 && n_experts > 0) {
        const double mean = (double) ne12 * (double) n_used / (double) n_experts;
        const int64_t n   = (int64_t) std::ceil(mean * s.moe_tile_factor);
        return n < 1 ? 1 : (n > 128 ? 128 : n);
    }
    return 0;
}

bool dg_dense_bf16(const ggml_tensor * src0, const ggml_tensor * src1) {
    const dg_cuda_switches & s = dg_cuda_switches_get();
    if (s.dense == 0 || !ggml_is_quantized(src0->type) || src1->ne[1] < 64 || src0->ne[2] != 1 || src0->ne[3] != 1 ||
        src1->ne[2] != 1 || src1->ne[3] != 1) {
        return false;
    }
    if (s.dense == 1) {
        return true;
    }
    for (int i = 0; i < s.n_dense_shapes; ++i) {
        if (s.dense_shapes[i][0] == src0->ne[1] && s.dense_shapes[i][1] == src0->ne[0]) {
            return true;
        }
    }
    return false;
}
