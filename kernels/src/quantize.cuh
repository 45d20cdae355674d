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

// Shared-memory layout of a tile: K [S][D] floats, V [S][D] floats, then
// per-channel K (scale, min) and per-token V (scale, min) as floats.
__host__ __device__ constexpr std::size_t quant_tile_smem_bytes(int head_dim, int block_size) {
  return (2 * static_cast<std::size_t>(block_size) * head_dim + 2 * head_dim + 2 * block_size) * sizeof(float);
}

// Quantizes the K/V tile in `tile` (all threads of the CTA take part) into
// the head region `out` of `format` (INT4 or INT2). Ends with no barrier
// pending; the caller's next use of `tile` needs __syncthreads().
__device__ inline void quantize_tile(const BlockFormat& format, float* tile, char* out) {
  const int S = format.block_size;
  const int D = format.head_dim;
  const int bits = format.bits();
  const int max_code = (1 << bits) - 1;
  const float* k = tile;
  const float* v = tile + S * D;
  float* k_scale = tile + 2 * S * D;
  float* k_min = k_scale + D;
  float* v_scale = k_min + D;
  float* v_min = v_scale + S;
  uint32_t* k_params = reinterpret_cast<uint32_t*>(out + format.k_params_offset());
  uint32_t* v_params = reinterpret_cast<uint32_t*>(out + format.v_params_offset());

  // K: one group per channel over the tokens.
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float lo = k[c], hi = k[c];
    for (int t = 1; t < S; ++t) {
      lo = fminf(lo, k[t * D + c]);
      hi = fmaxf(hi, k[t * D + c]);
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
      lo = fminf(lo, v[t * D + c]);
      hi = fmaxf(hi, v[t * D + c]);
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
  // V token-major packed along channels (block_format.h).
  const int per_word = 32 / bits;
  const int k_words_per_channel = S * bits / 32;
  uint32_t* k_codes = reinterpret_cast<uint32_t*>(out + format.k_offset());
  for (int w = threadIdx.x; w < D * k_words_per_channel; w += blockDim.x) {
    const int c = w / k_words_per_channel;
    const int t0 = (w % k_words_per_channel) * per_word;
    uint32_t word = 0;
    for (int i = 0; i < per_word; ++i) {
      word |= quant_code_device(k[(t0 + i) * D + c], k_scale[c], k_min[c], max_code) << (i * bits);
    }
    k_codes[w] = word;
  }
  const int v_words_per_token = D * bits / 32;
  uint32_t* v_codes = reinterpret_cast<uint32_t*>(out + format.v_offset());
  for (int w = threadIdx.x; w < S * v_words_per_token; w += blockDim.x) {
    const int t = w / v_words_per_token;
    const int c0 = (w % v_words_per_token) * per_word;
    uint32_t word = 0;
    for (int i = 0; i < per_word; ++i) {
      word |= quant_code_device(v[t * D + c0 + i], v_scale[t], v_min[t], max_code) << (i * bits);
    }
    v_codes[w] = word;
  }
}

}  // namespace mixkv::gpu::detail
