#pragma once
// Warp-level building blocks of the decode kernels: tensor-core MMA,
// register transposes, ldmatrix, cp.async, exp2 and the lop3 that puts
// packed codes into FP16 mantissas. sm_80+ PTX (built for sm_90).
#include <cuda_fp16.h>

#include <cstdint>

namespace mixkv::gpu::detail {

// D = A * B + D, m16n8k16, FP16 inputs, FP32 accumulators. Fragment layout
// (g = lane / 4, r = lane % 4):
//   a[0] (row g, k 2r..2r+1)   a[1] (row g+8, k 2r..)   a[2] (row g, k 2r+8..)   a[3] (row g+8, k 2r+8..)
//   b[0] (k 2r..2r+1, col g)   b[1] (k 2r+8..2r+9, col g)
//   d[0..1] (row g, cols 2r, 2r+1)   d[2..3] (row g+8, cols 2r, 2r+1)
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Transposes the 8x8 FP16 matrix held in the accumulator-style fragment
// (thread holds row g, cols 2r..2r+1).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Transposing ldmatrix: thread (g, r) of each 8x8 b16 matrix gets element g
// of rows 2r (low half) and 2r + 1 (high half).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16-byte asynchronous global -> shared copy; `src_bytes` < 16 zero-fills
// the rest (0 reads nothing: used for token rows past a block's fill).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes = 16) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem_src), "r"(src_bytes));
}
// cp_async_16 of the 16 bytes at byte offset Off from both addresses (a
// shared-space address here), the offset folded into the instruction.
template <int Off>
__device__ __forceinline__ void cp_async_16_at(uint32_t smem_addr, const void* gmem_src) {
  asm volatile("cp.async.cg.shared.global [%0+%2], [%1+%2], 16;\n" ::"r"(smem_addr), "l"(gmem_src), "n"(Off));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// Waits for every cp.async of the thread, committed to a group or not.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// 2^x in one MUFU: results below 2^-126 flush to zero (exp2f adds a
// subnormal fix-up of three instructions, pointless for softmax weights).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t hmul2_u32(uint32_t a, uint32_t b) {
  __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

}  // namespace mixkv::gpu::detail
