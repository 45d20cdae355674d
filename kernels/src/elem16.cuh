#pragma once
// The cache's 16-bit element type on the device: FP16 (__half) or BF16
// (__nv_bfloat16). The kernels that interpret values are templates over it
// and take every operation that depends on it from Elem16<E>: the FP16
// members are FP16's own intrinsics, so an FP16 instance compiles to the
// code of an FP16-only kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "device_math.cuh"
#include "mixkv/core/dtype.h"

namespace mixkv::gpu::detail {

template <typename E>
struct Elem16;

template <>
struct Elem16<__half> {
  using T = __half;
  using T2 = __half2;
  static constexpr DType kDType = DType::F16;
  __device__ static __forceinline__ T2 pair(uint32_t bits) { return *reinterpret_cast<const __half2*>(&bits); }
  __device__ static __forceinline__ uint32_t bits(T2 x) { return *reinterpret_cast<const uint32_t*>(&x); }
  __device__ static __forceinline__ float widen(T x) { return __half2float(x); }
  __device__ static __forceinline__ float2 widen2(T2 x) { return __half22float2(x); }
  __device__ static __forceinline__ T round(float x) { return __float2half_rn(x); }
  __device__ static __forceinline__ T2 round2(float x) { return __float2half2_rn(x); }
  __device__ static __forceinline__ T2 round2(float lo, float hi) { return __floats2half2_rn(lo, hi); }
  __device__ static __forceinline__ unsigned short as_ushort(T x) { return __half_as_ushort(x); }
  // D = A * B + D, m16n8k16, FP32 accumulators (device_math.cuh).
  __device__ static __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    detail::mma_16816(d, a, b0, b1);
  }
};

template <>
struct Elem16<__nv_bfloat16> {
  using T = __nv_bfloat16;
  using T2 = __nv_bfloat162;
  static constexpr DType kDType = DType::BF16;
  __device__ static __forceinline__ T2 pair(uint32_t bits) { return *reinterpret_cast<const __nv_bfloat162*>(&bits); }
  __device__ static __forceinline__ uint32_t bits(T2 x) { return *reinterpret_cast<const uint32_t*>(&x); }
  __device__ static __forceinline__ float widen(T x) { return __bfloat162float(x); }
  __device__ static __forceinline__ float2 widen2(T2 x) { return __bfloat1622float2(x); }
  __device__ static __forceinline__ T round(float x) { return __float2bfloat16_rn(x); }
  __device__ static __forceinline__ T2 round2(float x) { return __float2bfloat162_rn(x); }
  __device__ static __forceinline__ T2 round2(float lo, float hi) { return __floats2bfloat162_rn(lo, hi); }
  __device__ static __forceinline__ unsigned short as_ushort(T x) { return __bfloat16_as_ushort(x); }
  __device__ static __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// An array of the cache's 16-bit values held in a kernel parameter typed
// as FP16 (DecodeParams), as the instance's type E.
template <typename E>
__device__ __forceinline__ const E* values16(const __half* at) {
  return reinterpret_cast<const E*>(at);
}
template <typename E>
__device__ __forceinline__ E* values16(__half* at) {
  return reinterpret_cast<E*>(at);
}

// Two floats rounded to E and packed into a 32-bit word, lo in the low half.
template <typename E>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<E, __half>) {
    return pack_half2(lo, hi);
  } else {
    const typename Elem16<E>::T2 h = Elem16<E>::round2(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

}  // namespace mixkv::gpu::detail
