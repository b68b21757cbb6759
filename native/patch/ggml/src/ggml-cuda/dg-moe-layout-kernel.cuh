#pragma once
// dg: the compacted MoE tile layout's kernel (dg-moe-layout.cu launches it; native/tests/
// dg_cuda_kernel_test.cu runs it alone). One block: each thread takes an expert, a block-wide scan of
// the tile counts gives its first tile, then the tail past the last tile is filled with empty tiles.

#include "dg-moe-layout.cuh"

static constexpr int DG_LAYOUT_THREADS = 256;

static __global__ void __launch_bounds__(DG_LAYOUT_THREADS)
dg_moe_tile_layout_kernel(const int32_t * __restrict__ expert_bounds, int n_experts, int J, int n_tiles_max,
                          int32_t * __restrict__ tile_bounds, int32_t * __restrict__ tile_expert) {
    __shared__ int s_scan[DG_LAYOUT_THREADS];
    __shared__ int s_offset;
    const int tid = threadIdx.x;
    if (tid == 0) {
        s_offset = 0;
    }
    __syncthreads();
    for (int e0 = 0; e0 < n_experts; e0 += DG_LAYOUT_THREADS) {
        const int e     = e0 + tid;
        const int tiles = e < n_experts ? dg_moe_expert_tiles(expert_bounds, e, J) : 0;
        s_scan[tid] = tiles;
        __syncthreads();
        // inclusive Hillis-Steele scan
        for (int off = 1; off < DG_LAYOUT_THREADS; off <<= 1) {
            const int add = tid >= off ? s_scan[tid - off] : 0;
            __syncthreads();
            s_scan[tid] += add;
            __syncthreads();
        }
        const int first = s_offset + s_scan[tid] - tiles;
        if (e < n_experts) {
            dg_moe_write_tiles(expert_bounds, e, J, first, tile_bounds, tile_expert);
        }
        __syncthreads();
        if (tid == DG_LAYOUT_THREADS - 1) {
            s_offset += s_scan[tid];
        }
        __syncthreads();
    }
    for (int t = s_offset + tid; t <= n_tiles_max; t += DG_LAYOUT_THREADS) {
        dg_moe_fill_tail(expert_bounds, n_experts, t, tile_bounds, tile_expert, n_tiles_max);
    }
}
