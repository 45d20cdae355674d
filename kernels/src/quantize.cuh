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
  float scale;  // the stored FP16 scale, widened
  float min;    // the stored FP16 minimum, widened
  uint32_t packed;  // (scale, min) halves as stored
};

__device__ __forceinline__ GroupParamsDevice group_params(float lo, float hi, int max_code) {
  const __half scale = __float2half_rn(__fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(max_code)));
  const __half min = __float2half_rn(lo);
  GroupParamsDevice g;
  g.scale = __half2float(scale);
  g.min = __half2float(min);
  g.packed = static_cast<uint32_t>(__half_as_ushort(scale)) | (static_cast<uint32_t>(__half_as_ushort(min)) << 16);
  return g;
}

__device__ __forceinline__ uint32_t quant_code_device(float x, float scale, float min, int max_code) {
  if (!(scale > 0.0f)) return 0u;
  const float q = floorf(__fadd_rn(__fdiv_rn(__fsub_rn(x, min), scale), 0.5f));
  return q < 0.0f ? 0u : (q > static_cast<float>(max_code) ? static_cast<uint32_t>(max_code) : static_cast<uint32_t>(q));
}

__device__ __forceinline__ float dequant_device(uint32_t code, float scale, float min) {
  return __fadd_rn(min, __fmul_rn(scale, static_cast<float>(code)));
}

__device__ __forceinline__ float tile_value(float x) { return x; }
__device__ __forceinline__ float tile_value(__half x) { return __half2float(x); }

// A K/V tile in shared memory: K [S][pitch] then V [S][pitch] elements of T
// (__half for store_prefill: exact and half the bytes; float for demote's
// dequantized INT4 values). The pitch pads each row so that column walks and
// 16-byte row stores avoid bank conflicts.
template <typename T>
struct QuantTile {
  static constexpr int pad() { return 16 / static_cast<int>(sizeof(T)); }
  __host__ __device__ static constexpr int pitch(int head_dim) { return head_dim + pad(); }
  __host__ __device__ static constexpr std::size_t bytes(int head_dim, int block_size) {
    return 2 * static_cast<std::size_t>(block_size) * pitch(head_dim) * sizeof(T) +
           (2 * static_cast<std::size_t>(head_dim) + 2 * block_size) * sizeof(float);
  }
};

// Quantizes the K/V tile (all threads of the CTA take part) into the head
// region `out` of `format` (INT4 or INT2). Ends with no barrier pending; the
// caller's next use of the tile needs __syncthreads().
template <typename T>
__device__ inline void quantize_tile(const BlockFormat& format, const T* tile, float* scratch, char* out) {
  const int S = format.block_size;
  const int D = format.head_dim;
  const int P = QuantTile<T>::pitch(D);
  const int bits = format.bits();
  const int max_code = (1 << bits) - 1;
  const T* k = tile;
  const T* v = tile + S * P;
  float* k_scale = scratch;
  float* k_min = k_scale + D;
  float* v_scale = k_min + D;
  float* v_min = v_scale + S;
  uint32_t* k_params = reinterpret_cast<uint32_t*>(out + format.k_params_offset());
  uint32_t* v_params = reinterpret_cast<uint32_t*>(out + format.v_params_offset());

  // K: one group per channel over the tokens.
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float lo = tile_value(k[c]), hi = lo;
    for (int t = 1; t < S; ++t) {
      const float x = tile_value(k[t * P + c]);
      lo = fminf(lo, x);
      hi = fmaxf(hi, x);
    }
    const GroupParamsDevice g = group_params(lo, hi, max_code);
    k_scale[c] = g.scale;
    k_min[c] = g.min;
    k_params[c] = g.packed;
  }
  // V: one group per token over the channels; a warp per token.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int t = warp; t < S; t += warps) {
    float lo = INFINITY, hi = -INFINITY;
    for (int c = lane; c < D; c += 32) {
      const float x = tile_value(v[t * P + c]);
      lo = fminf(lo, x);
      hi = fmaxf(hi, x);
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, offset));
      hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, offset));
    }
    if (lane == 0) {
      const GroupParamsDevice g = group_params(lo, hi, max_code);
      v_scale[t] = g.scale;
      v_min[t] = g.min;
      v_params[t] = g.packed;
    }
  }
  __syncthreads();
  // Codes, one 32-bit word per thread: K channel-major packed along tokens,
  // V token-major packed along channels (block_format.h). Consecutive lanes
  // take consecutive K channels (conflict-free column walks).
  const int per_word = 32 / bits;
  const int k_words_per_channel = S * bits / 32;
  uint32_t* k_codes = reinterpret_cast<uint32_t*>(out + format.k_offset());
  for (int w = threadIdx.x; w < D * k_words_per_channel; w += blockDim.x) {
    const int c = w % D;
    const int j = w / D;
    const int t0 = j * per_word;
    uint32_t word = 0;
    for (int i = 0; i < per_word; ++i) {
      word |= quant_code_device(tile_value(k[(t0 + i) * P + c]), k_scale[c], k_min[c], max_code) << (i * bits);
    }
    k_codes[c * k_words_per_channel + j] = word;
  }
  const int v_words_per_token = D * bits / 32;
  uint32_t* v_codes = reinterpret_cast<uint32_t*>(out + format.v_offset());
  for (int w = threadIdx.x; w < S * v_words_per_token; w += blockDim.x) {
    const int t = w / v_words_per_token;
    const int c0 = (w % v_words_per_token) * per_word;
    uint32_t word = 0;
    for (int i = 0; i < per_word; ++i) {
      word |= quant_code_device(tile_value(v[t * P + c0 + i]), v_scale[t], v_min[t], max_code) << (i * bits);
    }
    v_codes[w] = word;
  }
}

}  // namespace mixkv::gpu::detail
