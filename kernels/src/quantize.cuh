#pragma once
// Min-max RTN quantization of one (block, KV head) tile held in shared
// memory, with the rounding of quant_math.h written with explicit IEEE
// intrinsics (no FMA contraction) so that codes and (scale, min) match the
// CPU reference bit for bit. Shared by store_prefill and demote.
#include <cuda_fp16.h>

#include <cstdint>

#include "mixkv/cache/block_format.h"

namespace mixkv::gpu::detail {

struct GroupParamsDevice {
  float inverse_step;  // quant_inverse_step of the stored FP16 scale
  float min;           // the stored FP16 minimum, widened
  uint32_t packed;     // (scale, min) halves as stored
};

__device__ __forceinline__ GroupParamsDevice group_params(float lo, float hi, int max_code) {
  const __half scale = __float2half_rn(__fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(max_code)));
  const __half min = __float2half_rn(lo);
  const float widened = __half2float(scale);
  GroupParamsDevice g;
  g.inverse_step = widened > 0.0f ? __frcp_rn(widened) : 0.0f;  // __frcp_rn: IEEE 1/x, as the host's 1.0f / x
  g.min = __half2float(min);
  g.packed = static_cast<uint32_t>(__half_as_ushort(scale)) | (static_cast<uint32_t>(__half_as_ushort(min)) << 16);
  return g;
}

// quant_code() of quant_math.h without branches: the float-to-unsigned
// conversion rounds down and saturates negatives to 0, so only the upper
// clamp is left. A constant group (inverse_step 0) gives floor(0.5) = 0.
__device__ __forceinline__ uint32_t quant_code_device(float x, float inverse_step, float min, uint32_t max_code) {
  return ::min(__float2uint_rd(__fadd_rn(__fmul_rn(__fsub_rn(x, min), inverse_step), 0.5f)), max_code);
}

__device__ __forceinline__ float dequant_device(uint32_t code, float scale, float min) {
  return __fadd_rn(min, __fmul_rn(scale, static_cast<float>(code)));
}

// Two adjacent tile values as floats (a half widens exactly).
__device__ __forceinline__ float2 tile_pair(const __half* at) {
  return __half22float2(*reinterpret_cast<const __half2*>(at));
}
__device__ __forceinline__ float2 tile_pair(const float* at) { return *reinterpret_cast<const float2*>(at); }

// Eight adjacent tile values as floats, from 16-byte aligned `at`.
__device__ __forceinline__ void tile_eight(const __half* at, float (&x)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(at);
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void tile_eight(const float* at, float (&x)[8]) {
  const float4 a = reinterpret_cast<const float4*>(at)[0];
  const float4 b = reinterpret_cast<const float4*>(at)[1];
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

// A K/V tile in shared memory: K [S][pitch] then V [S][pitch] elements of T
// (__half for store_prefill: exact and half the bytes; float for demote's
// dequantized INT4 values). The pitch pads each row by 16 bytes so that
// column walks and 16-byte row accesses avoid bank conflicts and every row
// starts 16-byte aligned.
template <typename T>
struct QuantTile {
  static constexpr int pad() { return 16 / static_cast<int>(sizeof(T)); }
  __host__ __device__ static constexpr int pitch(int head_dim) { return head_dim + pad(); }
  __host__ __device__ static constexpr std::size_t bytes(int head_dim, int block_size) {
    return 2 * static_cast<std::size_t>(block_size) * pitch(head_dim) * sizeof(T) +
           (2 * static_cast<std::size_t>(head_dim) + 2 * block_size) * sizeof(float);
  }
};

// Threads that share one V group (a token's channels) in the statistics
// pass: a quarter of the channels each, combined by two shuffles.
inline constexpr int kThreadsPerVGroup = 4;

// Quantizes the K/V tile (all threads of the CTA take part; blockDim.x a
// multiple of 64) into the head region `out` of `format` (INT4 or INT2).
// Ends with no barrier pending; the caller's next use of the tile needs
// __syncthreads().
template <typename T>
__device__ inline void quantize_tile(const BlockFormat& format, const T* tile, float* scratch, char* out) {
  const int S = format.block_size;
  const int D = format.head_dim;
  const int P = QuantTile<T>::pitch(D);
  const int bits = format.bits();
  const uint32_t max_code = (1u << bits) - 1u;
  const T* k = tile;
  const T* v = tile + S * P;
  float* k_inverse = scratch;
  float* k_min = k_inverse + D;
  float* v_inverse = k_min + D;
  float* v_min = v_inverse + S;
  uint32_t* k_params = reinterpret_cast<uint32_t*>(out + format.k_params_offset());
  uint32_t* v_params = reinterpret_cast<uint32_t*>(out + format.v_params_offset());

  // K: one group per channel over the tokens, two adjacent channels a thread.
  for (int pair = threadIdx.x; pair < D / 2; pair += blockDim.x) {
    float2 lo = tile_pair(k + 2 * pair), hi = lo;
#pragma unroll 4
    for (int t = 1; t < S; ++t) {
      const float2 x = tile_pair(k + t * P + 2 * pair);
      lo.x = fminf(lo.x, x.x), lo.y = fminf(lo.y, x.y);
      hi.x = fmaxf(hi.x, x.x), hi.y = fmaxf(hi.y, x.y);
    }
    const GroupParamsDevice a = group_params(lo.x, hi.x, max_code);
    const GroupParamsDevice b = group_params(lo.y, hi.y, max_code);
    k_inverse[2 * pair] = a.inverse_step, k_inverse[2 * pair + 1] = b.inverse_step;
    k_min[2 * pair] = a.min, k_min[2 * pair + 1] = b.min;
    reinterpret_cast<uint2*>(k_params)[pair] = make_uint2(a.packed, b.packed);
  }
  // V: one group per token over the channels. S * 4 is a multiple of 64, so
  // every warp that enters an iteration enters it whole (the shuffles).
  const int quarter = D / kThreadsPerVGroup;
  for (int i = threadIdx.x; i < S * kThreadsPerVGroup; i += blockDim.x) {
    const int t = i / kThreadsPerVGroup;
    const T* row = v + t * P + (i % kThreadsPerVGroup) * quarter;
    float lo = INFINITY, hi = -INFINITY;
#pragma unroll 4
    for (int c = 0; c < quarter; c += 2) {
      const float2 x = tile_pair(row + c);
      lo = fminf(lo, fminf(x.x, x.y));
      hi = fmaxf(hi, fmaxf(x.x, x.y));
    }
#pragma unroll
    for (int offset = 1; offset < kThreadsPerVGroup; offset <<= 1) {
      lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, offset));
      hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, offset));
    }
    if (i % kThreadsPerVGroup == 0) {
      const GroupParamsDevice g = group_params(lo, hi, max_code);
      v_inverse[t] = g.inverse_step;
      v_min[t] = g.min;
      v_params[t] = g.packed;
    }
  }
  __syncthreads();
  // K codes, channel-major packed along tokens (block_format.h): a thread
  // packs one word of each of two adjacent channels; consecutive lanes read
  // consecutive channel pairs of a row (conflict-free).
  const int per_word = 32 / bits;
  const int k_words_per_channel = S * bits / 32;
  uint32_t* k_codes = reinterpret_cast<uint32_t*>(out + format.k_offset());
  for (int w = threadIdx.x; w < (D / 2) * k_words_per_channel; w += blockDim.x) {
    const int pair = w % (D / 2);
    const int j = w / (D / 2);
    const float2 inverse = *reinterpret_cast<const float2*>(k_inverse + 2 * pair);
    const float2 min = *reinterpret_cast<const float2*>(k_min + 2 * pair);
    const T* column = k + j * per_word * P + 2 * pair;
    uint32_t a = 0, b = 0;
    for (int i = 0; i < per_word; ++i) {
      const float2 x = tile_pair(column + i * P);
      a |= quant_code_device(x.x, inverse.x, min.x, max_code) << (i * bits);
      b |= quant_code_device(x.y, inverse.y, min.y, max_code) << (i * bits);
    }
    k_codes[2 * pair * k_words_per_channel + j] = a;
    k_codes[(2 * pair + 1) * k_words_per_channel + j] = b;
  }
  // V codes, token-major packed along channels: a word is 8 (INT4) or 16
  // (INT2) consecutive channels, read 8 at a time with 16-byte loads.
  const int v_words_per_token = D * bits / 32;
  uint32_t* v_codes = reinterpret_cast<uint32_t*>(out + format.v_offset());
  for (int w = threadIdx.x; w < S * v_words_per_token; w += blockDim.x) {
    const int t = w / v_words_per_token;
    const T* at = v + t * P + (w % v_words_per_token) * per_word;
    const float inverse = v_inverse[t];
    const float min = v_min[t];
    uint32_t word = 0;
    for (int e = 0; e < per_word; e += 8) {
      float x[8];
      tile_eight(at + e, x);
#pragma unroll
      for (int i = 0; i < 8; ++i) word |= quant_code_device(x[i], inverse, min, max_code) << ((e + i) * bits);
    }
    v_codes[w] = word;
  }
}

}  // namespace mixkv::gpu::detail
