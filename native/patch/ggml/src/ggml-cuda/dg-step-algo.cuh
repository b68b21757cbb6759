#pragma once
// dg: the arithmetic of the fused sampler pass (dg-step.cu) that does not depend on how a block's
// threads share the work, written once for the device and the host. tests/test_cuda_host_math.py
// runs dg_step_row_chunked (the kernels' per-row algorithm, sequentially) against the CPU step's
// row routine (dg_step_row) on the same rows.
//
// The row is cut into chunks. Pass 1 (one block per chunk): the chunk's values v = softcap(x) / t,
// their maximum m_c and its first index, S_c = sum exp(v - m_c), W_c = sum exp(v - m_c) (v - m_c)
// (both in double) and the chunk's top-k candidates by value (ties: the lower index). Pass 2 (one
// block per row): the row's m, argmax, S = sum_c S_c exp(m_c - m), W = sum_c exp(m_c - m) (W_c + S_c
// (m_c - m)), entropy log S - W / S; the candidates' weights exp(v - m) sorted (weight desc, index
// asc), the first k with probabilities w / S; the inverse-CDF sample: the chunk where the running sum
// of the S_c exp(m_c - m) passes u S, then that chunk's weights in index order, summed in double.

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#    define DG_HD __host__ __device__
#else
#    define DG_HD
#endif

#include "dg-moe-layout.cuh"  // DG_HD (also defined there, identically)

// The record of a row, as the CPU step op writes it (diffusion-gemma-step.h: dg_step_field).
constexpr int DG_REC_ENTROPY = 0;
constexpr int DG_REC_ARGMAX  = 1;
constexpr int DG_REC_SAMPLED = 2;
constexpr int DG_REC_DROPPED = 3;
constexpr int DG_REC_TOPK    = 4;

// Candidates a row may carry into pass 2 (n_chunks * min(top_k, chunk)); 64 KiB of (weight, index).
constexpr int DG_STEP_CAND_MAX = 8192;
constexpr int DG_STEP_CHUNK_MIN = 8192;
constexpr int DG_STEP_CHUNK_MAX = 16384;  // 64 KiB of values in pass 1's shared memory

struct dg_chunk_stats {
    float   max;     // -inf for a chunk without columns
    int32_t argmax;  // row index of the chunk's first maximum
    int32_t finite;  // 0: the chunk held an inf or NaN value
    int32_t pad;
    double  sum;     // sum exp(v - max)
    double  wsum;    // sum exp(v - max) (v - max)
};

struct dg_step_plan {
    int chunk    = 0;  // columns per chunk (pass 1 block)
    int n_chunks = 0;
    int n_cand   = 0;  // candidates per chunk: min(top_k, chunk)
    bool ok      = false;
};

// The chunking of a row of n_vocab columns for top_k candidates: chunks of 8192 columns, 16384
// where that keeps n_chunks * min(top_k, chunk) within DG_STEP_CAND_MAX; ok = false beyond that.
DG_HD inline dg_step_plan dg_step_make_plan(int64_t n_vocab, int32_t top_k) {
    dg_step_plan p;
    if (n_vocab <= 0 || top_k < 0 || top_k > n_vocab || n_vocab > (1 << 24)) {
        return p;
    }
    for (int chunk = DG_STEP_CHUNK_MIN; chunk <= DG_STEP_CHUNK_MAX; chunk *= 2) {
        const int     c        = n_vocab < chunk ? (int) n_vocab : chunk;
        const int64_t n_chunks = (n_vocab + c - 1) / c;
        const int     n_cand   = top_k < c ? top_k : c;
        if (n_chunks * n_cand <= DG_STEP_CAND_MAX) {
            p.chunk    = c;
            p.n_chunks = (int) n_chunks;
            p.n_cand   = n_cand;
            p.ok       = true;
            return p;
        }
    }
    return p;
}

DG_HD inline float dg_div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);  // IEEE division: ggml-cuda compiles with -use_fast_math
#else
    return a / b;
#endif
}

DG_HD inline float dg_bits_to_float(int32_t bits) {
#if defined(__CUDA_ARCH__)
    return __int_as_float(bits);
#else
    float f;
    __builtin_memcpy(&f, &bits, sizeof(f));
    return f;
#endif
}

// exp(x) for x <= 0, the CPU sampler's (diffusion-gemma-sampler.cpp: exp_nonpositive): Cephes' expf,
// ~2 ulp, exactly 0 below -87.3, NaN for NaN (the device's __expf, what -use_fast_math makes of expf, loses ~20
// bits of relative accuracy near -87 and flushes differently).
DG_HD inline float dg_step_exp(float x) {
    if (x != x) {
        return x;
    }
    if (x < -87.3f) {
        return 0.0f;
    }
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
    float r = x - n * 0.693359375f;
    r       = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p       = p * r + 1.3981999507e-3f;
    p       = p * r + 8.3334519073e-3f;
    p       = p * r + 4.1665795894e-2f;
    p       = p * r + 1.6666665459e-1f;
    p       = p * r + 5.0000001201e-1f;
    p       = p * r * r + r + 1.0f;
    return p * dg_bits_to_float(((int32_t) n + 127) << 23);
}

// tanh(x), the CPU sampler's (tanh_approx): Cephes' tanhf, ~2 ulp (the device's tanhf under
// -use_fast_math may be the hardware approximation, ~2^-11).
DG_HD inline float dg_step_tanh(float x) {
    const float a = x < 0.0f ? -x : x;
    if (a < 0.625f) {
        const float z = x * x;
        float p = -5.70498872745e-3f;
        p       = p * z + 2.06390887954e-2f;
        p       = p * z + -5.37397155531e-2f;
        p       = p * z + 1.33314422036e-1f;
        p       = p * z + -3.33332819422e-1f;
        return p * z * x + x;
    }
    const float e = dg_step_exp(-2.0f * a);
    const float t = dg_div_rn(1.0f - e, 1.0f + e);
    return x < 0.0f ? -t : t;
}

// softcap(x) / t as the CPU step computes it outside exact mode: tanh(x * (1 / cap)) * cap, then
// the division.
DG_HD inline float dg_step_value(float x, float softcap, float t) {
    float v = x;
    if (softcap != 0.0f) {
        v = dg_step_tanh(x * (1.0f / softcap)) * softcap;
    }
    return dg_div_rn(v, t);
}

// Floats (not NaN) to unsigned keys in the same order.
DG_HD inline uint32_t dg_order_key(float v) {
    uint32_t bits;
#if defined(__CUDA_ARCH__)
    bits = __float_as_uint(v);
#else
    static_assert(sizeof(float) == sizeof(uint32_t), "");
    __builtin_memcpy(&bits, &v, sizeof(bits));
#endif
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// (weight, index) ordered best first: the larger weight, then the lower index (the CPU's top-k).
DG_HD inline bool dg_cand_better(float wa, int32_t ia, float wb, int32_t ib) {
    return wa > wb || (wa == wb && ia < ib);
}

struct dg_row_stats {
    float   max;
    int32_t argmax;
    bool    finite;
    double  sum;
    double  wsum;
};

// The row from its chunks (in column order).
DG_HD inline dg_row_stats dg_merge_chunks(const dg_chunk_stats * c, int n_chunks) {
    dg_row_stats r;
    r.max    = -INFINITY;
    r.argmax = 0;
    r.finite = true;
    r.sum    = 0.0;
    r.wsum   = 0.0;
    for (int i = 0; i < n_chunks; ++i) {
        r.finite = r.finite && c[i].finite != 0;
        if (c[i].max > r.max) {  // strictly: the first chunk holding the maximum keeps the argmax
            r.max    = c[i].max;
            r.argmax = c[i].argmax;
        }
    }
    if (!r.finite) {
        return r;
    }
    for (int i = 0; i < n_chunks; ++i) {
        const double shift = (double) c[i].max - (double) r.max;  // <= 0
        const double scale = exp(shift);
        r.sum += c[i].sum * scale;
        r.wsum += scale * (c[i].wsum + c[i].sum * shift);
    }
    return r;
}

DG_HD inline double dg_entropy(const dg_row_stats & r) {
    const double e = log(r.sum) - r.wsum / r.sum;
    return e > 0.0 ? e : 0.0;
}

// The chunk holding the sample: the first whose running sum of weight (rescaled to the row maximum)
// passes target = u S, with the weight of the chunks before it in *before; the last chunk with weight
// if rounding leaves the running sum below the target.
DG_HD inline int dg_sample_chunk(const dg_chunk_stats * c, int n_chunks, float row_max, double target, double * before) {
    double cum  = 0.0;
    int    last = 0;
    double last_before = 0.0;
    for (int i = 0; i < n_chunks; ++i) {
        const double s = c[i].sum * exp((double) c[i].max - (double) row_max);
        if (cum + s > target) {
            *before = cum;
            return i;
        }
        if (s > 0.0) {
            last        = i;
            last_before = cum;
        }
        cum += s;
    }
    *before = last_before;
    return last;
}

#if !defined(__CUDA_ARCH__)
#    include <algorithm>
#    include <utility>
#    include <vector>

// The kernels' per-row algorithm, sequentially (for tests on a CPU). logits: the row; record:
// DG_REC_TOPK + 2 top_k floats; probs (may be null): the row's probabilities times probs_scale, as
// pass 2 leaves them over the logits. Returns false if the plan does not hold these sizes.
inline bool dg_step_row_chunked(const float * logits, int32_t n_vocab, float softcap, float t, double u,
                                int32_t top_k, float * record, float probs_scale = 0.0f, float * probs = nullptr) {
    const dg_step_plan plan = dg_step_make_plan(n_vocab, top_k);
    if (!plan.ok) {
        return false;
    }
    std::vector<dg_chunk_stats>              stats(plan.n_chunks);
    std::vector<std::pair<float, int32_t>>   cands;  // (value, index)
    std::vector<float>                       v(plan.chunk);
    for (int c = 0; c < plan.n_chunks; ++c) {
        const int begin = c * plan.chunk;
        const int n     = std::min(plan.chunk, n_vocab - begin);
        dg_chunk_stats & s = stats[c];
        s.max = -INFINITY; s.argmax = begin; s.finite = 1; s.sum = 0.0; s.wsum = 0.0;
        for (int i = 0; i < n; ++i) {
            v[i] = dg_step_value(logits[begin + i], softcap, t);
            if (!std::isfinite(v[i])) {
                s.finite = 0;
            }
            if (v[i] > s.max) {
                s.max    = v[i];
                s.argmax = begin + i;
            }
        }
        if (s.finite) {
            for (int i = 0; i < n; ++i) {
                const float d = v[i] - s.max;
                const float w = dg_step_exp(d);
                s.sum += (double) w;
                s.wsum += (double) w * (double) d;
            }
        }
        // the chunk's candidates: its n_cand largest values, ties to the lower index
        std::vector<std::pair<float, int32_t>> chunk_c;
        for (int i = 0; i < n; ++i) {
            chunk_c.emplace_back(v[i], begin + i);
        }
        const int keep = std::min(plan.n_cand, n);
        std::partial_sort(chunk_c.begin(), chunk_c.begin() + keep, chunk_c.end(),
                          [](const auto & a, const auto & b) {
                              const uint32_t ka = dg_order_key(a.first), kb = dg_order_key(b.first);
                              return ka > kb || (ka == kb && a.second < b.second);
                          });
        cands.insert(cands.end(), chunk_c.begin(), chunk_c.begin() + keep);
    }
    const dg_row_stats r = dg_merge_chunks(stats.data(), plan.n_chunks);
    for (int j = 0; j < DG_REC_TOPK + 2 * top_k; ++j) {
        record[j] = 0.0f;
    }
    if (!r.finite) {
        record[DG_REC_ENTROPY] = NAN;
        return true;
    }
    record[DG_REC_ENTROPY] = (float) dg_entropy(r);
    record[DG_REC_ARGMAX]  = (float) r.argmax;

    if (top_k > 0) {
        std::vector<std::pair<float, int32_t>> weighted;
        for (const auto & cv : cands) {
            weighted.emplace_back(dg_step_exp(cv.first - r.max), cv.second);
        }
        std::sort(weighted.begin(), weighted.end(),
                  [](const auto & a, const auto & b) { return dg_cand_better(a.first, a.second, b.first, b.second); });
        double kept = 0.0;
        for (int j = 0; j < top_k; ++j) {
            const double p = (double) weighted[j].first / r.sum;
            record[DG_REC_TOPK + j]         = (float) weighted[j].second;
            record[DG_REC_TOPK + top_k + j] = (float) p;
            kept += p;
        }
        record[DG_REC_DROPPED] = kept < 1.0 ? (float) (1.0 - kept) : 0.0f;
    }

    const double target = u * r.sum;
    double       before = 0.0;
    const int    c      = dg_sample_chunk(stats.data(), plan.n_chunks, r.max, target, &before);
    const int    begin  = c * plan.chunk;
    const int    n      = std::min(plan.chunk, n_vocab - begin);
    double       cdf    = before;
    int32_t      pick   = -1;
    int32_t      last   = -1;
    for (int i = 0; i < n; ++i) {
        const float w = dg_step_exp(dg_step_value(logits[begin + i], softcap, t) - r.max);
        cdf += (double) w;
        last = w > 0.0f ? begin + i : last;
        if (cdf > target) {
            pick = begin + i;
            break;
        }
    }
    record[DG_REC_SAMPLED] = (float) (pick >= 0 ? pick : (last >= 0 ? last : r.argmax));
    if (probs != nullptr) {
        const float to_probs = (float) ((double) probs_scale / r.sum);
        for (int32_t i = 0; i < n_vocab; ++i) {
            probs[i] = dg_step_exp(dg_step_value(logits[i], softcap, t) - r.max) * to_probs;
        }
    }
    return true;
}
#endif
