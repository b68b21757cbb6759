#pragma once
// dg: the compacted tile layout of a MoE product (MUL_MAT_ID through MMQ), after vLLM's
// moe_align_block_size: the routed rows sorted by expert are cut into tiles of at most J rows, one
// expert per tile, and the kernel's grid has one channel per tile instead of ceil(n_tokens / J)
// column tiles for every expert (most of them empty when each expert gets a few of the tokens).
//
// Plain C++ (no CUDA types) so that tests/test_cuda_host_math.py runs it on the CPU; the device
// kernel (dg-moe-layout.cu) uses the same per-expert functions with a block-wide scan.

#include <cstdint>

#if defined(__CUDACC__)
#    define DG_HD __host__ __device__
#else
#    define DG_HD
#endif

// The most tiles n_rows routed rows over n_experts experts can need: sum_e ceil(n_e / J) over the
// non-empty experts is at most floor((n_rows + k (J - 1)) / J) with k = min(n_experts, n_rows) of them.
DG_HD inline int dg_moe_tiles_max(int n_rows, int n_experts, int J) {
    const int nonempty = n_experts < n_rows ? n_experts : n_rows;
    const int64_t bound = ((int64_t) n_rows + (int64_t) nonempty * (J - 1)) / J;
    return bound > 0 ? (int) bound : 1;
}

// tiles of expert e: ceil(n_e / J)
DG_HD inline int dg_moe_expert_tiles(const int32_t * expert_bounds, int e, int J) {
    return (expert_bounds[e + 1] - expert_bounds[e] + J - 1) / J;
}

// Expert e's tiles, the first at index `first`: tile first + j starts at sorted row
// expert_bounds[e] + j J. A tile ends where the next one starts (tile_bounds[t + 1]): the next tile of
// the same expert, or the first row of the next expert with rows (empty experts have equal bounds),
// so each tile holds at most J rows of one expert.
DG_HD inline void dg_moe_write_tiles(const int32_t * expert_bounds, int e, int J, int first, int32_t * tile_bounds,
                                     int32_t * tile_expert) {
    const int lo = expert_bounds[e];
    const int hi = expert_bounds[e + 1];
    for (int r = lo, t = first; r < hi; r += J, ++t) {
        tile_bounds[t] = r;
        tile_expert[t] = e;
    }
}

// Tiles from `count` (the number written) to n_tiles_max: empty (both bounds at the end of the rows),
// expert 0 (never read: the kernel skips a tile without rows before it reads any weight).
DG_HD inline void dg_moe_fill_tail(const int32_t * expert_bounds, int n_experts, int t, int32_t * tile_bounds,
                                   int32_t * tile_expert, int n_tiles_max) {
    tile_bounds[t] = expert_bounds[n_experts];
    if (t < n_tiles_max) {
        tile_expert[t] = 0;
    }
}

// The whole layout, sequentially: tile_bounds[n_tiles_max + 1], tile_expert[n_tiles_max]. Returns the
// number of tiles with rows. (The device computes the same with one thread per expert.)
inline int dg_moe_tile_layout_host(const int32_t * expert_bounds, int n_experts, int J, int n_tiles_max,
                                   int32_t * tile_bounds, int32_t * tile_expert) {
    int count = 0;
    for (int e = 0; e < n_experts; ++e) {
        dg_moe_write_tiles(expert_bounds, e, J, count, tile_bounds, tile_expert);
        count += dg_moe_expert_tiles(expert_bounds, e, J);
    }
    for (int t = count; t <= n_tiles_max; ++t) {
        dg_moe_fill_tail(expert_bounds, n_experts, t, tile_bounds, tile_expert, n_tiles_max);
    }
    return count;
}
