#include "mixkv/kernels/demote.h"

#include <cstdint>
#include <string>

#include "dtype_guard.h"
#include "elem16.cuh"
#include "mixkv/kernels/detail/cuda_check.h"
#include "quantize.cuh"

namespace mixkv::gpu {
namespace {

using detail::require;

constexpr int kThreads = 128;

// Reads one head of `src` as floats (FP16-pool values widened, INT4
// dequantized with the reference's min + scale * code), then quantizes it
// into `dst`. E: the cache's 16-bit type (both pools').
template <typename E>
__global__ void __launch_bounds__(kThreads)
    demote_kernel(const BlockCopy* moves, PoolView src, PoolView dst, DeviceStatusView status) {
  extern __shared__ __align__(16) float tile[];  // QuantTile<float>: K, V rows at pitch, then scratch
  const int heads = src.format.num_kv_heads;
  const int row = static_cast<int>(blockIdx.x) / heads;
  const BlockCopy move = moves[row];
  const int head = static_cast<int>(blockIdx.x) % heads;
  // Ids from a device array are checked once a CTA, before any barrier (the
  // whole CTA leaves together): an id past its pool would read or write
  // outside the arena and lose the context.
  const auto src_limit = static_cast<std::uint32_t>(src.num_blocks);
  const auto dst_limit = static_cast<std::uint32_t>(dst.num_blocks);
  const bool bad_src = id_out_of_range(move.src, src_limit);
  if (bad_src || id_out_of_range(move.dst, dst_limit)) {
    if (threadIdx.x == 0 && head == 0) {
      report_out_of_range(status, StatusOp::Demote, bad_src ? StatusArg::MoveSrc : StatusArg::MoveDst, row,
                          bad_src ? move.src : move.dst, bad_src ? src_limit : dst_limit);
    }
    return;
  }
  const BlockFormat& f = src.format;
  const int S = f.block_size;
  const int D = f.head_dim;
  const char* in = reinterpret_cast<const char*>(src.block(move.src)) + f.head_offset(head);
  const int P = detail::QuantTile<float>::pitch(D);
  float* k = tile;
  float* v = tile + S * P;
  using Elem = detail::Elem16<E>;
  if (f.precision == Precision::FP16) {
    const E* kh = reinterpret_cast<const E*>(in + f.k_offset());
    const E* vh = reinterpret_cast<const E*>(in + f.v_offset());
    for (int i = threadIdx.x; i < S * D; i += blockDim.x) {
      k[(i / D) * P + i % D] = Elem::widen(kh[i]);
      v[(i / D) * P + i % D] = Elem::widen(vh[i]);
    }
  } else {
    const int bits = f.bits();
    const uint32_t mask = (1u << bits) - 1u;
    auto half_at = [&](std::size_t offset) { return Elem::widen(*reinterpret_cast<const E*>(in + offset)); };
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
  // NaN or inf must not reach the quantizer's float-to-int conversion: a
  // corrupt source head is skipped (the whole CTA, after the barrier) and
  // recorded, as the CPU backend rejects the block; each head is a CTA, so
  // the move's finite heads are still requantized.
  bool finite = true;
  for (int i = threadIdx.x; i < S * D; i += blockDim.x) {
    finite = finite && isfinite(k[(i / D) * P + i % D]) && isfinite(v[(i / D) * P + i % D]);
  }
  if (__syncthreads_or(!finite)) {
    if (threadIdx.x == 0) report_out_of_range(status, StatusOp::Demote, StatusArg::MoveSrcNotFinite, row, head, 0);
    return;
  }
  char* out = reinterpret_cast<char*>(dst.block(move.dst)) + dst.format.head_offset(head);
  detail::quantize_tile<float, kThreads, E>(dst.format, static_cast<const float*>(tile), tile + 2 * S * P, out);
}

}  // namespace

void demote(const DemoteArgs& a) {
  constexpr const char* fn = "demote";
  const DType dtype = detail::require_cache_dtype(fn, "src_pool", a.src_pool);
  detail::require_pool_dtype(fn, "dst_pool", a.dst_pool, dtype, "src_pool");
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
  require(a.src_pool.num_blocks >= 0 && a.dst_pool.num_blocks >= 0, [&] {
    return std::string(fn) + ": src_pool.num_blocks = " + std::to_string(a.src_pool.num_blocks) +
           ", dst_pool.num_blocks = " + std::to_string(a.dst_pool.num_blocks) + ": expected >= 0";
  });
  require(a.count >= 0, [&] { return std::string(fn) + ": count = " + std::to_string(a.count) + ": expected >= 0"; });
  if (a.count == 0) return;
  require(a.moves != nullptr, [&] { return std::string(fn) + ": moves is null: expected device [count] BlockCopy"; });
  const std::size_t smem = detail::QuantTile<float>::bytes(s.head_dim, s.block_size);
  require(smem <= 227 * 1024,
          [&] { return std::string(fn) + ": head_dim * block_size too large for one tile in shared memory"; });
  const auto kernel = dtype == DType::BF16 ? demote_kernel<__nv_bfloat16> : demote_kernel<__half>;
  if (smem > 48 * 1024) {
    MIXKV_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  require(std::int64_t{a.count} * s.num_kv_heads < (std::int64_t{1} << 31), [&] {
    return std::string(fn) + ": count * num_kv_heads = " + std::to_string(std::int64_t{a.count} * s.num_kv_heads) +
           ": expected < 2^31 (one CTA per head of a move)";
  });
  const DeviceStatusView status = (a.status != nullptr ? *a.status : DeviceStatus::for_current_device()).view();
  kernel<<<static_cast<unsigned>(a.count) * s.num_kv_heads, kThreads, smem, a.stream>>>(a.moves, a.src_pool, a.dst_pool,
                                                                                        status);
  MIXKV_CUDA_CHECK_LAUNCH("demote_kernel");
}

}  // namespace mixkv::gpu
