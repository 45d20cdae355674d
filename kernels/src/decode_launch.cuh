#pragma once
// Launch of one paged_decode_kernel instance; included only by the
// decode_instances_d*.cu files (each instantiates its head_dim).
#include "cuda_check.cuh"
#include "decode_kernel.cuh"

namespace mixkv::gpu::detail {

template <int D, int S>
void launch_decode_kernel(const DecodeParams& params, int grid, cudaStream_t stream) {
  using Tile = DecodeTile<D, S>;
  // Above 48 KiB of dynamic shared memory needs an opt-in, once per process.
  static const bool configured = [] {
    MIXKV_CUDA_CHECK(cudaFuncSetAttribute(paged_decode_kernel<D, S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          Tile::kSmemBytes));
    return true;
  }();
  (void)configured;
  if (grid == 0) return;  // configuration only (DecodePlan does this before any capture)
  paged_decode_kernel<D, S><<<grid, kDecodeThreads, Tile::kSmemBytes, stream>>>(params);
  MIXKV_CUDA_CHECK_LAUNCH("paged_decode_kernel");
}

}  // namespace mixkv::gpu::detail
