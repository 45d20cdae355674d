#pragma once
// Launch of one paged_decode_kernel instance; included only by the
// decode_instance_*.cu files that kernels/CMakeLists.txt generates (each
// instantiates launch_decode_kernel, declared in decode_dispatch.h, for one
// 16-bit type, head_dim and block_size).
#include "decode_kernel.cuh"
#include "mixkv/kernels/detail/cuda_check.h"

namespace mixkv::gpu::detail {

// grid == 0 only configures the instance and returns how many of its CTAs
// fit on one SM; otherwise launches and returns 0.
template <typename E, int D, int S, int NT>
int launch_decode_kernel(const DecodeParams& params, int grid, cudaStream_t stream) {
  using Tile = DecodeTile<D, S, NT>;
  if (grid == 0) {  // configuration only (DecodePlan does this before any capture)
    // Above 48 KiB of dynamic shared memory needs an opt-in, which is
    // per device: made by every plan, on the device it is built on.
    MIXKV_CUDA_CHECK(cudaFuncSetAttribute(paged_decode_kernel<E, D, S, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          Tile::kSmemBytes));
    int ctas = 0;
    MIXKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, paged_decode_kernel<E, D, S, NT>,
                                                                   kDecodeThreads, Tile::kSmemBytes));
    return ctas;
  }
  paged_decode_kernel<E, D, S, NT><<<grid, kDecodeThreads, Tile::kSmemBytes, stream>>>(params);
  MIXKV_CUDA_CHECK_LAUNCH("paged_decode_kernel");
  return 0;
}

}  // namespace mixkv::gpu::detail
