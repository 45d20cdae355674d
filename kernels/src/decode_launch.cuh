#pragma once
// Launch of one paged_decode_kernel instance; included only by the
// decode_instances_d*.cu files (each instantiates its head_dim).
#include <algorithm>

#include "cuda_check.cuh"
#include "decode_kernel.cuh"

namespace mixkv::gpu::detail {

template <int D, int S, bool kChained>
int launch_decode_variant(const DecodeParams& params, int grid, cudaStream_t stream) {
  using Tile = DecodeTile<D, S>;
  if (grid == 0) {  // configuration only (DecodePlan does this before any capture)
    // Above 48 KiB of dynamic shared memory needs an opt-in, which is
    // per device: made by every plan, on the device it is built on.
    MIXKV_CUDA_CHECK(cudaFuncSetAttribute(paged_decode_kernel<D, S, kChained>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes));
    int ctas = 0;
    MIXKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, paged_decode_kernel<D, S, kChained>,
                                                                   kDecodeThreads, Tile::kSmemBytes));
    return ctas;
  }
  paged_decode_kernel<D, S, kChained><<<grid, kDecodeThreads, Tile::kSmemBytes, stream>>>(params);
  MIXKV_CUDA_CHECK_LAUNCH("paged_decode_kernel");
  return 0;
}

// grid == 0 only configures both variants of the instance and returns how
// many of its CTAs fit on one SM (the fewer of the two); otherwise launches
// the chained or the one-item variant and returns 0.
template <int D, int S>
int launch_decode_kernel(const DecodeParams& params, int grid, bool chained, cudaStream_t stream) {
  if (grid == 0) {
    return std::min(launch_decode_variant<D, S, false>(params, 0, stream),
                    launch_decode_variant<D, S, true>(params, 0, stream));
  }
  return chained ? launch_decode_variant<D, S, true>(params, grid, stream)
                 : launch_decode_variant<D, S, false>(params, grid, stream);
}

}  // namespace mixkv::gpu::detail
