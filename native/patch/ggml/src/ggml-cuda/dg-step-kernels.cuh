#pragma once
// dg: the two kernels of the fused sampler pass (dg-step.cu launches them for the custom op;
// native/tests/dg_cuda_kernel_test.cu runs them alone against the host twin). CUDA only, no ggml.

#include "dg-step-algo.cuh"

#include <climits>
#include <cstdint>

static constexpr int DG_WARP = 32;
static constexpr int DG_STEP_THREADS = 256;

struct dg_maxloc {
    float   max;
    int32_t idx;
};

static __device__ __forceinline__ dg_maxloc dg_maxloc_better(dg_maxloc a, dg_maxloc b) {
    return (b.max > a.max || (b.max == a.max && b.idx < a.idx)) ? b : a;
}

// Block-wide reductions over DG_STEP_THREADS threads; every thread gets the result.
static __device__ dg_maxloc dg_block_maxloc(dg_maxloc v) {
    __shared__ float   s_max[DG_STEP_THREADS / DG_WARP];
    __shared__ int32_t s_idx[DG_STEP_THREADS / DG_WARP];
#pragma unroll
    for (int off = DG_WARP / 2; off > 0; off >>= 1) {
        dg_maxloc o;
        o.max = __shfl_xor_sync(0xffffffff, v.max, off);
        o.idx = __shfl_xor_sync(0xffffffff, v.idx, off);
        v     = dg_maxloc_better(v, o);
    }
    const int warp = threadIdx.x / DG_WARP;
    if (threadIdx.x % DG_WARP == 0) {
        s_max[warp] = v.max;
        s_idx[warp] = v.idx;
    }
    __syncthreads();
    dg_maxloc r = { s_max[0], s_idx[0] };
    for (int w = 1; w < DG_STEP_THREADS / DG_WARP; ++w) {
        r = dg_maxloc_better(r, { s_max[w], s_idx[w] });
    }
    __syncthreads();
    return r;
}

static __device__ double dg_block_sum(double v) {
    __shared__ double s_sum[DG_STEP_THREADS / DG_WARP];
#pragma unroll
    for (int off = DG_WARP / 2; off > 0; off >>= 1) {
        v += __shfl_xor_sync(0xffffffff, v, off);
    }
    if (threadIdx.x % DG_WARP == 0) {
        s_sum[threadIdx.x / DG_WARP] = v;
    }
    __syncthreads();
    double r = 0.0;
    for (int w = 0; w < DG_STEP_THREADS / DG_WARP; ++w) {  // in warp order: the same sum on every run
        r += s_sum[w];
    }
    __syncthreads();
    return r;
}

// Exclusive prefix count of `flag` over the block, in thread order; *total gets the block's count.
static __device__ int dg_block_exclusive_count(bool flag, int * total) {
    __shared__ int s_warp[DG_STEP_THREADS / DG_WARP];
    const unsigned ballot = __ballot_sync(0xffffffff, flag);
    const int      lane   = threadIdx.x % DG_WARP;
    const int      warp   = threadIdx.x / DG_WARP;
    if (lane == 0) {
        s_warp[warp] = __popc(ballot);
    }
    __syncthreads();
    int before = 0;
    int sum    = 0;
    for (int w = 0; w < DG_STEP_THREADS / DG_WARP; ++w) {
        before += w < warp ? s_warp[w] : 0;
        sum += s_warp[w];
    }
    __syncthreads();
    *total = sum;
    return before + __popc(ballot & ((1u << lane) - 1u));
}

// Pass 1: one block per (chunk, row). Values into shared memory (and back over the logits when the
// caller keeps them), the chunk's statistics, and its n_cand largest values by a radix select on
// their order keys (8 bits at a time), ties to the lower index.
static __global__ void __launch_bounds__(DG_STEP_THREADS)
dg_step_pass1(const float * logits, float * values_out /* logits itself, or null */, int64_t row_stride, int n_vocab,
              int chunk, int n_chunks, const float * __restrict__ temps, float softcap, int n_cand,
              dg_chunk_stats * __restrict__ stats, float * __restrict__ cand_v, int32_t * __restrict__ cand_i) {
    extern __shared__ float sv[];  // [chunk]
    __shared__ int      hist[256];
    __shared__ uint32_t s_prefix;
    __shared__ int      s_rank;
    __shared__ int      s_count;
    __shared__ int      s_taken;

    const int     tid   = threadIdx.x;
    const int     c     = blockIdx.x;
    const int     row   = blockIdx.y;
    const int     begin = c * chunk;
    const int     n     = min(chunk, n_vocab - begin);
    const float   t     = temps[row];
    const float * x     = logits + (int64_t) row * row_stride + begin;

    dg_maxloc best   = { -INFINITY, INT_MAX };
    bool      finite = true;
    for (int i = tid; i < n; i += DG_STEP_THREADS) {
        const float v = dg_step_value(x[i], softcap, t);
        sv[i] = v;
        if (values_out) {
            values_out[(int64_t) row * row_stride + begin + i] = v;
        }
        finite = finite && isfinite(v);
        best   = dg_maxloc_better(best, { v, i });
    }
    finite = __syncthreads_and(finite);
    best   = dg_block_maxloc(best);

    dg_chunk_stats * st = stats + (int64_t) row * n_chunks + c;
    if (!finite) {
        if (tid == 0) {
            *st = { -INFINITY, begin, 0, 0, 0.0, 0.0 };
        }
        return;  // pass 2 reads nothing else of a row that is not finite
    }

    double sum  = 0.0;
    double wsum = 0.0;
    for (int i = tid; i < n; i += DG_STEP_THREADS) {
        const float d = sv[i] - best.max;
        const float w = dg_step_exp(d);
        sum += (double) w;
        wsum += (double) w * (double) d;
    }
    sum  = dg_block_sum(sum);
    wsum = dg_block_sum(wsum);
    if (tid == 0) {
        *st = { best.max, begin + best.idx, 1, 0, sum, wsum };
    }
    if (n_cand == 0) {
        return;
    }

    float *   out_v = cand_v + ((int64_t) row * n_chunks + c) * n_cand;
    int32_t * out_i = cand_i + ((int64_t) row * n_chunks + c) * n_cand;
    if (n <= n_cand) {  // the whole chunk; the rest of its slots empty
        for (int i = tid; i < n_cand; i += DG_STEP_THREADS) {
            out_v[i] = i < n ? sv[i] : -INFINITY;
            out_i[i] = i < n ? begin + i : -1;
        }
        return;
    }

    // the n_cand-th largest key, 8 bits at a time
    uint32_t prefix = 0;
    uint32_t mask   = 0;
    int      rank   = n_cand;  // how many of the keys under `prefix` are still to take
    for (int shift = 24; shift >= 0; shift -= 8) {
        hist[tid] = 0;  // DG_STEP_THREADS == 256 bins
        __syncthreads();
        // a chunk's values share their top bits: one atomic per warp and bin, not per value
        for (int base = 0; base < n; base += DG_STEP_THREADS) {
            const int      i      = base + tid;
            const uint32_t key    = i < n ? dg_order_key(sv[i]) : 0u;
            const bool     active = i < n && (key & mask) == prefix;
            const uint32_t bin    = (key >> shift) & 255;
            const unsigned voters = __ballot_sync(0xffffffff, active);
            if (active) {
                const unsigned same = __match_any_sync(voters, bin);
                if ((int) (threadIdx.x % DG_WARP) == __ffs(same) - 1) {
                    atomicAdd(&hist[bin], __popc(same));
                }
            }
        }
        __syncthreads();
        if (tid == 0) {
            int above = 0;
            int bin   = 255;
            for (; bin > 0 && above + hist[bin] < rank; --bin) {
                above += hist[bin];
            }
            s_prefix = prefix | ((uint32_t) bin << shift);
            s_rank   = rank - above;
        }
        __syncthreads();
        prefix = s_prefix;
        rank   = s_rank;
        mask |= 255u << shift;
    }
    // `prefix` is the key of the n_cand-th largest value; take every larger key, then the `rank`
    // equal ones of the lowest indices
    if (tid == 0) {
        s_count = 0;
        s_taken = 0;
    }
    __syncthreads();
    for (int i = tid; i < n; i += DG_STEP_THREADS) {
        if (dg_order_key(sv[i]) > prefix) {
            const int slot = atomicAdd(&s_count, 1);
            out_v[slot] = sv[i];
            out_i[slot] = begin + i;
        }
    }
    const int first_equal = n_cand - rank;
    for (int base = 0; base < n; base += DG_STEP_THREADS) {
        const int  i    = base + tid;
        const bool flag = i < n && dg_order_key(sv[i]) == prefix;
        int        total;
        const int  pos  = s_taken + dg_block_exclusive_count(flag, &total);
        if (flag && pos < rank) {
            out_v[first_equal + pos] = sv[i];
            out_i[first_equal + pos] = begin + i;
        }
        __syncthreads();
        if (tid == 0) {
            s_taken += total;
        }
        __syncthreads();
        if (s_taken >= rank) {
            break;
        }
    }
}

// Pass 2: one block per row. The row's statistics from its chunks, its top-k from the candidates
// (bitonic sort in shared memory), the sample from one chunk scanned in index order; the record.
static __global__ void __launch_bounds__(DG_STEP_THREADS)
dg_step_pass2(float * logits, bool values_kept, float probs_scale, int64_t row_stride, int n_vocab, int chunk,
              int n_chunks, const float * __restrict__ temps, const double * __restrict__ uniforms, float softcap,
              int top_k, int n_cand, const dg_chunk_stats * __restrict__ stats, const float * __restrict__ cand_v,
              const int32_t * __restrict__ cand_i, int n_sort, float * __restrict__ record, int64_t record_stride) {
    extern __shared__ char smem[];
    float *   sw = (float *) smem;                // [n_sort] candidate weights
    int32_t * si = (int32_t *) (smem + (size_t) n_sort * sizeof(float));
    __shared__ dg_row_stats s_row;
    __shared__ int          s_chunk;
    __shared__ double       s_before;
    __shared__ double       s_seg[DG_STEP_THREADS];
    __shared__ int          s_pick;
    __shared__ int          s_last;

    const int    tid       = threadIdx.x;
    const int    row       = blockIdx.x;
    const int    row_index = row;
    float *      rec       = record + (int64_t) row * record_stride;
    const float  t   = temps[row];
    const dg_chunk_stats * st = stats + (int64_t) row * n_chunks;

    if (tid == 0) {
        s_row = dg_merge_chunks(st, n_chunks);
    }
    __syncthreads();
    const dg_row_stats r = s_row;
    for (int j = tid; j < DG_REC_TOPK + 2 * top_k; j += DG_STEP_THREADS) {
        rec[j] = 0.0f;
    }
    __syncthreads();
    if (!r.finite) {
        if (tid == 0) {
            rec[DG_REC_ENTROPY] = NAN;
        }
        return;
    }

    if (top_k > 0) {
        const int n_total = n_chunks * n_cand;
        const float *   cv = cand_v + (int64_t) row * n_total;
        const int32_t * ci = cand_i + (int64_t) row * n_total;
        for (int i = tid; i < n_sort; i += DG_STEP_THREADS) {
            const bool real = i < n_total && ci[i] >= 0;
            sw[i] = real ? dg_step_exp(cv[i] - r.max) : -1.0f;
            si[i] = real ? ci[i] : INT_MAX;
        }
        __syncthreads();
        // bitonic sort, best first (dg_cand_better)
        for (int k = 2; k <= n_sort; k <<= 1) {
            for (int j = k >> 1; j > 0; j >>= 1) {
                for (int i = tid; i < n_sort; i += DG_STEP_THREADS) {
                    const int l = i ^ j;
                    if (l > i) {
                        const bool first_half = (i & k) == 0;
                        const bool l_better   = dg_cand_better(sw[l], si[l], sw[i], si[i]);
                        if (first_half == l_better) {
                            const float   w  = sw[i];
                            const int32_t id = si[i];
                            sw[i] = sw[l];
                            si[i] = si[l];
                            sw[l] = w;
                            si[l] = id;
                        }
                    }
                }
                __syncthreads();
            }
        }
        for (int j = tid; j < top_k; j += DG_STEP_THREADS) {
            rec[DG_REC_TOPK + j]         = (float) si[j];
            rec[DG_REC_TOPK + top_k + j] = (float) ((double) sw[j] / r.sum);
        }
        if (tid == 0) {
            double kept = 0.0;
            for (int j = 0; j < top_k; ++j) {
                kept += (double) sw[j] / r.sum;
            }
            rec[DG_REC_DROPPED] = kept < 1.0 ? (float) (1.0 - kept) : 0.0f;
        }
    }

    // the sample: the chunk where the running weight passes u S, then its columns in order
    const double target = uniforms[row] * r.sum;
    if (tid == 0) {
        double before;
        s_chunk  = dg_sample_chunk(st, n_chunks, r.max, target, &before);
        s_before = before;
        s_pick   = -1;
        s_last   = -1;
    }
    __syncthreads();
    const int     begin = s_chunk * chunk;
    const int     n     = min(chunk, n_vocab - begin);
    const int     seg   = (n + DG_STEP_THREADS - 1) / DG_STEP_THREADS;
    const int     lo    = min(n, tid * seg);
    const int     hi    = min(n, lo + seg);
    const float * x     = logits + (int64_t) row * row_stride + begin;
    auto weight = [&](int i) {
        const float v = values_kept ? x[i] : dg_step_value(x[i], softcap, t);
        return dg_step_exp(v - r.max);
    };
    double seg_sum = 0.0;
    int    last    = -1;
    for (int i = lo; i < hi; ++i) {
        const float w = weight(i);
        seg_sum += (double) w;
        last = w > 0.0f ? i : last;
    }
    s_seg[tid] = seg_sum;
    if (last >= 0) {
        atomicMax(&s_last, last);
    }
    __syncthreads();
    double base = s_before;
    for (int w = 0; w < tid; ++w) {
        base += s_seg[w];
    }
    if (base <= target && base + seg_sum > target) {
        double  cdf  = base;
        int32_t pick = last;  // rounding: the sum over the segment passed the target, the walk not
        for (int i = lo; i < hi; ++i) {
            cdf += (double) weight(i);
            if (cdf > target) {
                pick = i;
                break;
            }
        }
        s_pick = pick;
    }
    __syncthreads();
    if (tid == 0) {
        const int pick = s_pick >= 0 ? s_pick : s_last;
        rec[DG_REC_ENTROPY] = (float) dg_entropy(r);
        rec[DG_REC_ARGMAX]  = (float) r.argmax;
        rec[DG_REC_SAMPLED] = (float) (pick >= 0 ? begin + pick : r.argmax);
    }
    if (probs_scale != 0.0f) {
        // the next step's probabilities over the row, as the CPU op leaves them: each weight times
        // (float) (scale / S); after the sample, which read this row's logits
        __syncthreads();
        const float   to_probs = (float) ((double) probs_scale / r.sum);
        float *       row      = logits + (int64_t) row_index * row_stride;
        for (int i = tid; i < n_vocab; i += DG_STEP_THREADS) {
            row[i] = dg_step_exp(dg_step_value(row[i], softcap, t) - r.max) * to_probs;
        }
    }
}

struct dg_step_scratch_size {
    size_t stats;  // dg_chunk_stats
    size_t cand;   // floats and int32s each
};

static inline dg_step_scratch_size dg_step_scratch(const dg_step_plan & plan, int n_rows) {
    const size_t cand = (size_t) n_rows * plan.n_chunks * plan.n_cand;
    return { (size_t) n_rows * plan.n_chunks, cand > 0 ? cand : 1 };
}

// Both passes over logits [n_rows rows of row_stride floats, n_vocab used] into record [n_rows rows of
// record_stride floats]; keep_values leaves softcap(logits) / t in the logits, probs_scale (not 0,
// without keep_values) softmax of them times probs_scale. The plan must be ok.
static inline cudaError_t dg_step_launch(float * logits, bool keep_values, float probs_scale, int64_t row_stride,
                                         int n_vocab, int n_rows,
                                         const float * temps, const double * uniforms, float softcap, int top_k,
                                         float * record, int64_t record_stride, dg_chunk_stats * stats, float * cand_v,
                                         int32_t * cand_i, cudaStream_t stream) {
    const dg_step_plan plan = dg_step_make_plan(n_vocab, top_k);
    if (!plan.ok || n_rows <= 0 || n_rows > 65535 || (keep_values && probs_scale != 0.0f)) {
        return cudaErrorInvalidValue;
    }
    const size_t smem1 = (size_t) plan.chunk * sizeof(float);
    cudaError_t  err   = cudaFuncSetAttribute(dg_step_pass1, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem1);
    if (err != cudaSuccess) {
        return err;
    }
    dg_step_pass1<<<dim3(plan.n_chunks, n_rows), DG_STEP_THREADS, smem1, stream>>>(
        logits, keep_values ? logits : nullptr, row_stride, n_vocab, plan.chunk, plan.n_chunks, temps, softcap,
        plan.n_cand, stats, cand_v, cand_i);
    if ((err = cudaGetLastError()) != cudaSuccess) {
        return err;
    }
    const int64_t n_cand_row = (int64_t) plan.n_chunks * plan.n_cand;
    int n_sort = 1;
    while (n_sort < n_cand_row) {
        n_sort <<= 1;
    }
    const size_t smem2 = top_k > 0 ? (size_t) n_sort * (sizeof(float) + sizeof(int32_t)) : 0;
    err = cudaFuncSetAttribute(dg_step_pass2, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem2);
    if (err != cudaSuccess) {
        return err;
    }
    dg_step_pass2<<<n_rows, DG_STEP_THREADS, smem2, stream>>>(
        logits, keep_values, probs_scale, row_stride, n_vocab, plan.chunk, plan.n_chunks, temps, uniforms, softcap, top_k,
        plan.n_cand, stats, cand_v, cand_i, top_k > 0 ? n_sort : 1, record, record_stride);
    return cudaGetLastError();
}
