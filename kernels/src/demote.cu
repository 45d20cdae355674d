#include "mixkv/kernels/demote.h"

#include <string>

#include "cuda_check.cuh"
#include "quantize.cuh"

namespace mixkv::gpu {
namespace {

using detail::require;

constexpr int kThreads = 128;

// Reads one head of `src` as floats (FP16 widened, INT4 dequantized with
// the reference's min + scale * code), then quantizes it into `dst`.
__global__ void __launch_bounds__(kThreads) demote_kernel(const BlockCopy* moves, PoolView src, PoolView dst) {
  extern __shared__ __align__(16) float tile[];  // QuantTile<float>: K, V rows at pitch, then scratch
  const int heads = src.format.num_kv_heads;
  const BlockCopy move = moves[blockIdx.x / heads];
  const int head = blockIdx.x % heads;
  const BlockFormat& f = src.format;
  const int S = f.block_size;
  const int D = f.head_dim;
  const char* in = reinterpret_cast<const char*>(src.block(move.src)) + f.head_offset(head);
  const int P = detail::QuantTile<float>::pitch(D);
  float* k = tile;
  float* v = tile + S * P;
  if (f.precision == Precision::FP16) {
    const __half* kh = reinterpret_cast<const __half*>(in + f.k_offset());
    const __half* vh = reinterpret_cast<const __half*>(in + f.v_offset());
    for (int i = threadIdx.x; i < S * D; i += blockDim.x) {
      k[(i / D) * P + i % D] = __half2float(kh[i]);
      v[(i / D) * P + i % D] = __half2float(vh[i]);
    }
  } else {
    const int bits = f.bits();
    const uint32_t mask = (1u << bits) - 1u;
    auto half_at = [&](std::size_t offset) { return __half2float(*reinterpret_cast<const __half*>(in + offset)); };
    const auto* bytes = reinterpret_cast<const unsigned char*>(in);
    for (int i = threadIdx.x; i < S * D; i += blockDim.x) {
      const int t = i / D;
      const int c = i % D;
      const BlockFormat::CodeLocation kl = f.k_code_location(t, c);
      const BlockFormat::CodeLocation vl = f.v_code_location(t, c);
      const uint32_t kc = (bytes[kl.byte] >> kl.shift) & mask;
      const uint32_t vc = (bytes[vl.byte] >> vl.shift) & mask;
      k[t * P + c] = detail::dequant_device(kc, half_at(f.k_scale_offset(c)), half_at(f.k_min_offset(c)));
      v[t * P + c] = detail::dequant_device(vc, half_at(f.v_scale_offset(t)), half_at(f.v_min_offset(t)));
    }
  }
  __syncthreads();
  char* out = reinterpret_cast<char*>(dst.block(move.dst)) + dst.format.head_offset(head);
  detail::quantize_tile<float, kThreads>(dst.format, static_cast<const float*>(tile), tile + 2 * S * P, out);
}

}  // namespace

void demote(const DemoteArgs& a) {
  constexpr const char* fn = "demote";
  const Precision sp = a.src_pool.format.precision;
  const Precision dp = a.dst_pool.format.precision;
  require((sp == Precision::FP16 && is_quantized(dp)) || (sp == Precision::INT4 && dp == Precision::INT2), [&] {
    return std::string(fn) + ": (src_pool, dst_pool) precisions = (" + std::string(to_string(sp)) + ", " +
           std::string(to_string(dp)) + "): expected (FP16, INT4), (FP16, INT2) or (INT4, INT2)";
  });
  require(a.src_pool.base != nullptr && a.dst_pool.base != nullptr,
          [&] { return std::string(fn) + ": src_pool.base / dst_pool.base: expected the device arena"; });
  const BlockFormat& s = a.src_pool.format;
  const BlockFormat& d = a.dst_pool.format;
  require(s.num_kv_heads == d.num_kv_heads && s.head_dim == d.head_dim && s.block_size == d.block_size, [&] {
    return std::string(fn) + ": dst_pool.format: expected src_pool's num_kv_heads, head_dim and block_size";
  });
  require(
      s.num_kv_heads >= 1 && s.head_dim % 16 == 0 && s.head_dim >= 16 && s.block_size % 16 == 0 && s.block_size >= 16,
      [&] {
        return std::string(fn) +
               ": src_pool.format: expected num_kv_heads >= 1 and head_dim, block_size multiples of 16";
      });
  require(a.src_pool.blocks_per_slab >= 1 && a.dst_pool.blocks_per_slab >= 1,
          [&] { return std::string(fn) + ": blocks_per_slab: expected >= 1"; });
  require(a.count >= 0, [&] { return std::string(fn) + ": count = " + std::to_string(a.count) + ": expected >= 0"; });
  if (a.count == 0) return;
  require(a.moves != nullptr, [&] { return std::string(fn) + ": moves is null: expected device [count] BlockCopy"; });
  const std::size_t smem = detail::QuantTile<float>::bytes(s.head_dim, s.block_size);
  require(smem <= 227 * 1024,
          [&] { return std::string(fn) + ": head_dim * block_size too large for one tile in shared memory"; });
  if (smem > 48 * 1024) {
    MIXKV_CUDA_CHECK(
        cudaFuncSetAttribute(demote_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  demote_kernel<<<static_cast<unsigned>(a.count) * s.num_kv_heads, kThreads, smem, a.stream>>>(a.moves, a.src_pool,
                                                                                                a.dst_pool);
  MIXKV_CUDA_CHECK_LAUNCH("demote_kernel");
}

}  // namespace mixkv::gpu
