#pragma once
// Device helpers the GPU planner's kernels share (internal).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace mixkv::gpu::planner_detail {

constexpr int kWarp = 32;
constexpr int kBlockThreads = 256;
constexpr int kWarpsPerBlock = kBlockThreads / kWarp;

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// Butterfly sums: every lane ends with the bit-identical total, so branches
// on it are warp-uniform.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

}  // namespace mixkv::gpu::planner_detail
