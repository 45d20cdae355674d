#pragma once
// Launch of one paged_extend_kernel instance; included only by the
// extend_instance_*.cu files that kernels/CMakeLists.txt generates (each
// instantiates launch_extend_kernel, declared in extend_dispatch.cuh, for
// one 16-bit type, head_dim and block_size).
#include "extend_kernel.cuh"
#include "mixkv/kernels/detail/cuda_check.h"

namespace mixkv::gpu::detail {

template <typename E, int D, int S>
int launch_extend_kernel(const ExtendParams& params, int grid, cudaStream_t stream) {
  using Tile = ExtendTile<D, S>;
  if (grid == 0) {  // configuration only (ExtendPlan does this before any capture)
    // Above 48 KiB of dynamic shared memory needs an opt-in, which is per
    // device: made by every plan, on the device it is built on.
    MIXKV_CUDA_CHECK(cudaFuncSetAttribute(paged_extend_kernel<E, D, S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          Tile::kSmemBytes));
    int ctas = 0;
    MIXKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, paged_extend_kernel<E, D, S>, kExtendThreads,
                                                                   Tile::kSmemBytes));
    return ctas;
  }
  paged_extend_kernel<E, D, S><<<grid, kExtendThreads, Tile::kSmemBytes, stream>>>(params);
  MIXKV_CUDA_CHECK_LAUNCH("paged_extend_kernel");
  return 0;
}

}  // namespace mixkv::gpu::detail
