// dg: the compacted MoE grid's tile layout on the device (dg-moe-layout.cuh has the layout and its
// host form, dg-moe-layout-kernel.cuh the kernel).

#include "common.cuh"
#include "dg-cuda.cuh"
#include "dg-moe-layout-kernel.cuh"

void dg_moe_tile_layout_cuda(const int32_t * expert_bounds, int n_experts, int J, int n_tiles_max,
                             int32_t * tile_bounds, int32_t * tile_expert, cudaStream_t stream) {
    dg_moe_tile_layout_kernel<<<1, DG_LAYOUT_THREADS, 0, stream>>>(expert_bounds, n_experts, J, n_tiles_max,
                                                                   tile_bounds, tile_expert);
    CUDA_CHECK(cudaGetLastError());
}
