#include "mixkv/kernels/store.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "device_pool.cuh"
#include "dtype_guard.h"
#include "mixkv/kernels/detail/cuda_check.h"
#include "mixkv/kernels/detail/device_buffer.h"
#include "store_kernels.cuh"

namespace mixkv::gpu {
namespace {

using detail::DevicePool;
using detail::FastDivisor;
using detail::require;
using store_kernels::kCopyPairs;
using store_kernels::kMaxSmem;
using store_kernels::kThreads;
using store_kernels::StoreKernel;
using store_kernels::StoreParams;
using store_kernels::tile_stages;

// FP16 row `slot`: K/V of head h go to token (slot % S) of block slot / S.
__device__ __forceinline__ void copy_row(const PoolView& pool, std::int32_t slot, const uint4* k_row,
                                         const uint4* v_row, int chunk, int chunks_per_head) {
  const BlockFormat& f = pool.format;
  const int head = chunk / chunks_per_head;
  const int c = chunk % chunks_per_head;
  char* head_base = reinterpret_cast<char*>(pool.block(slot / f.block_size)) + f.head_offset(head);
  const std::size_t row_offset = static_cast<std::size_t>(slot % f.block_size) * f.head_dim * 2;
  reinterpret_cast<uint4*>(head_base + f.k_offset() + row_offset)[c] = k_row[chunk];
  reinterpret_cast<uint4*>(head_base + f.v_offset() + row_offset)[c] = v_row[chunk];
}

struct AppendParams {
  const uint4* k;
  const uint4* v;
  const std::int32_t* slots;
  PoolView pool;
  std::uint32_t slot_limit;  // FP16 slots of the pool: num_blocks * block_size, at most 2^31
  DeviceStatusView status;
};

__global__ void append_kernel(const __grid_constant__ AppendParams p) {
  const BlockFormat& f = p.pool.format;
  const int chunks_per_head = f.head_dim / 8;
  const int chunks_per_row = f.num_kv_heads * chunks_per_head;
  const std::int32_t slot = p.slots[blockIdx.x];
  if (slot == -1) return;  // a padding row
  // A slot from a device array is checked here, once a row: an id past the
  // pool would write outside the arena and lose the context.
  if (id_out_of_range(slot, p.slot_limit)) {
    if (threadIdx.x == 0) {
      report_out_of_range(p.status, StatusOp::Append, StatusArg::Fp16Slot, static_cast<std::int32_t>(blockIdx.x), slot,
                          p.slot_limit);
    }
    return;
  }
  const std::size_t base = static_cast<std::size_t>(blockIdx.x) * chunks_per_row;
  for (int i = threadIdx.x; i < chunks_per_row; i += blockDim.x) {
    copy_row(p.pool, slot, p.k + base, p.v + base, i, chunks_per_head);
  }
}

__global__ void copy_blocks_kernel(const BlockCopy* copies, PoolView pool, DeviceStatusView status) {
  const BlockCopy c = copies[blockIdx.x];
  const auto limit = static_cast<std::uint32_t>(pool.num_blocks);
  const bool bad_src = id_out_of_range(c.src, limit);
  if (bad_src || id_out_of_range(c.dst, limit)) {
    if (threadIdx.x == 0) {
      report_out_of_range(status, StatusOp::CopyBlocks, bad_src ? StatusArg::CopySrc : StatusArg::CopyDst,
                          static_cast<std::int32_t>(blockIdx.x), bad_src ? c.src : c.dst, limit);
    }
    return;
  }
  const uint4* src = reinterpret_cast<const uint4*>(pool.block(c.src));
  uint4* dst = reinterpret_cast<uint4*>(pool.block(c.dst));
  const std::size_t chunks = pool.format.block_bytes() / 16;
  for (std::size_t i = threadIdx.x; i < chunks; i += blockDim.x) dst[i] = src[i];
}

// K/V rows are read in 16-byte chunks (head_dim is a multiple of 16).
void check_rows_aligned(const char* fn, const void* k, const void* v) {
  const auto misaligned = [](const void* x) { return reinterpret_cast<std::uintptr_t>(x) % 16 != 0; };
  require(!misaligned(k) && !misaligned(v), [&] {
    return std::string(fn) + ": k, v: expected 16-byte aligned device pointers (k " +
           (misaligned(k) ? "is not" : "is") + ", v " + (misaligned(v) ? "is not" : "is") + ")";
  });
}

void check_pool(const char* fn, const char* name, const PoolView& pool, Precision expected) {
  const auto prefix = [&] { return std::string(fn) + ": " + name; };
  require(pool.base != nullptr, [&] { return prefix() + ".base is null: expected the device arena"; });
  require(pool.format.precision == expected, [&] {
    return prefix() + ".format.precision = " + std::string(to_string(pool.format.precision)) + ": expected " +
           std::string(to_string(expected));
  });
  require(pool.format.head_dim % 16 == 0 && pool.format.head_dim >= 16 && pool.format.head_dim <= 512, [&] {
    return prefix() + ".format.head_dim = " + std::to_string(pool.format.head_dim) +
           ": expected a multiple of 16 in [16, 512]";
  });
  require(pool.format.block_size % 16 == 0 && pool.format.block_size >= 16 && pool.format.block_size <= 256, [&] {
    return prefix() + ".format.block_size = " + std::to_string(pool.format.block_size) +
           ": expected a multiple of 16 in [16, 256]";
  });
  require(pool.format.num_kv_heads >= 1, [&] { return prefix() + ".format.num_kv_heads: expected >= 1"; });
  require(pool.blocks_per_slab >= 1, [&] { return prefix() + ".blocks_per_slab: expected >= 1"; });
  require(pool.num_blocks >= 0, [&] {
    return prefix() + ".num_blocks = " + std::to_string(pool.num_blocks) +
           ": expected >= 0 (the blocks the arena holds)";
  });
}

DeviceStatusView status_view(DeviceStatus* status) {
  return (status != nullptr ? *status : DeviceStatus::for_current_device()).view();
}

}  // namespace

void store_prefill(const StorePrefillArgs& a) {
  constexpr const char* fn = "store_prefill";
  check_pool(fn, "pools[FP16]", a.pools[0], Precision::FP16);
  check_pool(fn, "pools[INT4]", a.pools[1], Precision::INT4);
  check_pool(fn, "pools[INT2]", a.pools[2], Precision::INT2);
  const DType dtype = detail::require_pool_dtypes(fn, a.pools);
  detail::require_input_dtype(fn, "dtype (of k, v)", a.dtype, dtype, "pools[FP16]");
  const BlockFormat& f = a.pools[0].format;
  for (int i = 1; i < kNumPrecisions; ++i) {
    const BlockFormat& g = a.pools[i].format;
    require(g.num_kv_heads == f.num_kv_heads && g.head_dim == f.head_dim && g.block_size == f.block_size, [&] {
      return std::string(fn) + ": pools[" + std::string(to_string(kAllPrecisions[i])) +
             "].format: expected the FP16 pool's num_kv_heads, head_dim and block_size";
    });
  }
  require(a.rows >= 0, [&] { return std::string(fn) + ": rows = " + std::to_string(a.rows) + ": expected >= 0"; });
  require(a.num_int4_windows >= 0 && a.num_int2_windows >= 0,
          [&] { return std::string(fn) + ": num_int4_windows / num_int2_windows: expected >= 0"; });
  require(a.num_fp16_rows >= 0 && a.num_fp16_rows <= a.rows, [&] {
    return std::string(fn) + ": num_fp16_rows = " + std::to_string(a.num_fp16_rows) +
           ": expected in [0, rows = " + std::to_string(a.rows) + "]";
  });
  if (a.rows == 0) return;
  require(a.k != nullptr && a.v != nullptr,
          [&] { return std::string(fn) + ": k, v: expected device [rows][num_kv_heads][head_dim] 16-bit values"; });
  check_rows_aligned(fn, a.k, a.v);
  require(a.num_fp16_rows == 0 || a.fp16_rows != nullptr,
          [&] { return std::string(fn) + ": fp16_rows is null: expected device [num_fp16_rows] RowSlots"; });
  require(a.num_int4_windows == 0 || a.int4_windows != nullptr,
          [&] { return std::string(fn) + ": int4_windows is null"; });
  require(a.num_int2_windows == 0 || a.int2_windows != nullptr,
          [&] { return std::string(fn) + ": int2_windows is null"; });
  for (int i = 0; i < kNumPrecisions; ++i) {
    if (a.max_block_ids[i] >= a.pools[i].num_blocks) {
      throw IndexOutOfRange(std::string(fn) + ": max_block_ids[" + std::string(to_string(kAllPrecisions[i])) +
                            "] = " + std::to_string(a.max_block_ids[i]) +
                            ": the mapping addresses that block, expected block ids in [0, " +
                            std::to_string(a.pools[i].num_blocks) + ") of pools[" +
                            std::string(to_string(kAllPrecisions[i])) + "] (a mapping uploaded for another cache?)");
    }
  }

  StoreParams p;
  p.k = reinterpret_cast<const uint4*>(a.k);
  p.v = reinterpret_cast<const uint4*>(a.v);
  p.fp16_rows = a.fp16_rows;
  p.num_fp16_rows = a.num_fp16_rows;
  p.windows[0] = a.int4_windows;
  p.windows[1] = a.int2_windows;
  p.num_windows[0] = a.num_int4_windows;
  p.num_windows[1] = a.num_int2_windows;
  for (int i = 0; i < kNumPrecisions; ++i) p.pools[i] = DevicePool(a.pools[i]);
  require(static_cast<std::int64_t>(f.num_kv_heads) * f.head_dim < (std::int64_t{1} << 27), [&] {
    return std::string(fn) +
           ": num_kv_heads * head_dim = " + std::to_string(static_cast<std::int64_t>(f.num_kv_heads) * f.head_dim) +
           ": expected < 2^27 (16-byte chunks of a row counted in 24 bits)";
  });
  const std::int64_t windows = static_cast<std::int64_t>(a.num_int4_windows) + a.num_int2_windows;
  const std::int64_t tiles = windows * f.num_kv_heads;
  const StoreKernel launch = dtype == DType::BF16 ? store_kernels::store_kernel<__nv_bfloat16>(f.head_dim, f.block_size)
                                                  : store_kernels::store_kernel<__half>(f.head_dim, f.block_size);
  // Indices in 32 bits: store_prefill_kernel's tiles run to tiles + 2 * grid
  // and its copy units to copy_units + 4 * grid, the units kernel's work
  // items to copy_units + tiles * units_per_tile + 3.
  const std::int64_t units = tiles * std::max(launch.units_per_tile, 1);
  require(units < (std::int64_t{1} << 30), [&] {
    return std::string(fn) + ": (num_int4_windows + num_int2_windows) * num_kv_heads = " + std::to_string(tiles) +
           ": expected < 2^30 / " + std::to_string(std::max(launch.units_per_tile, 1)) +
           " (work items a tile at this shape)";
  });
  // Copy units of ~4 KB: whole rows, as many as give a warp's lanes
  // kCopyPairs K/V chunk pairs each.
  const std::int64_t pairs_per_row = static_cast<std::int64_t>(f.num_kv_heads) * (f.head_dim / 8);
  p.rows_per_copy_unit = static_cast<std::int32_t>(std::max<std::int64_t>(1, 32 * kCopyPairs / pairs_per_row));
  const std::int64_t copy_units = (std::int64_t{a.num_fp16_rows} + p.rows_per_copy_unit - 1) / p.rows_per_copy_unit;
  require(copy_units + units < (std::int64_t{1} << 30), [&] {
    return std::string(fn) + ": num_fp16_rows = " + std::to_string(a.num_fp16_rows) +
           ": expected < 2^30 work items with " + std::to_string(units) + " of the windows (" +
           std::to_string(p.rows_per_copy_unit) + " FP16 rows a work item at this shape)";
  });
  p.copy_units = static_cast<std::int32_t>(copy_units);
  p.tiles = static_cast<std::int32_t>(tiles);
  p.int4_tiles = a.num_int4_windows * f.num_kv_heads;
  p.heads = FastDivisor(static_cast<std::uint32_t>(f.num_kv_heads));
  // Two tile stages where they fit, else one, for store_prefill_kernel; no
  // shared memory without tiles (then the FP16 copy alone decides the
  // occupancy), nor for the units kernel.
  // Tiles of either 16-bit type take the same bytes.
  const std::size_t tile_bytes = detail::QuantTile<__half>::tile_bytes(f.head_dim, f.block_size);
  const std::size_t scratch_bytes = detail::QuantTile<__half>::scratch_bytes(f.head_dim, f.block_size);
  p.stages = tile_stages(f.head_dim, f.block_size);
  const std::size_t smem = tiles > 0 && launch.units_per_tile == 0 ? p.stages * tile_bytes + scratch_bytes : 0;
  require(smem <= kMaxSmem,
          [&] { return std::string(fn) + ": head_dim * block_size too large for one tile in shared memory"; });
  if (smem > 48 * 1024) {
    MIXKV_CUDA_CHECK(
        cudaFuncSetAttribute(launch.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  constexpr int kWarps = kThreads / 32;
  std::int64_t grid = 0;
  if (launch.units_per_tile > 0) {
    grid = (p.copy_units + units + kWarps - 1) / kWarps;  // one unit a warp
  } else {
    // Tiles: as many rounds as the resident CTAs need, then as few CTAs as
    // give every CTA that many tiles (or one fewer): no last round that a
    // few CTAs run alone. The copy units widen the grid up to the resident
    // CTAs. Only this kernel needs the occupancy, so the units kernel's
    // calls skip its queries.
    int device = 0, sms = 0, per_sm = 0;
    MIXKV_CUDA_CHECK(cudaGetDevice(&device));
    MIXKV_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    MIXKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, launch.kernel, kThreads, smem));
    const std::int64_t resident = static_cast<std::int64_t>(sms) * std::max(per_sm, 1);
    const std::int64_t rounds = (tiles + resident - 1) / resident;
    const std::int64_t tile_ctas = rounds > 0 ? (tiles + rounds - 1) / rounds : 0;
    grid = std::max(tile_ctas, std::min<std::int64_t>(resident, (p.copy_units + kWarps - 1) / kWarps));
  }
  launch.kernel<<<static_cast<unsigned>(std::max<std::int64_t>(grid, 1)), kThreads, smem, a.stream>>>(p);
  MIXKV_CUDA_CHECK_LAUNCH("store_prefill_kernel");
}

void append(const AppendArgs& a) {
  check_pool("append", "fp16_pool", a.fp16_pool, Precision::FP16);
  detail::require_input_dtype("append", "dtype (of k, v)", a.dtype,
                              detail::require_cache_dtype("append", "fp16_pool", a.fp16_pool), "fp16_pool");
  require(a.batch >= 0, [&] { return "append: batch = " + std::to_string(a.batch) + ": expected >= 0"; });
  if (a.batch == 0) return;
  require(a.k != nullptr && a.v != nullptr,
          "append: k, v: expected device [batch][num_kv_heads][head_dim] 16-bit values");
  check_rows_aligned("append", a.k, a.v);
  require(a.fp16_slots != nullptr, "append: fp16_slots is null: expected device [batch] slots");
  const std::int64_t slots = std::int64_t{a.fp16_pool.num_blocks} * a.fp16_pool.format.block_size;
  AppendParams p{reinterpret_cast<const uint4*>(a.k),
                 reinterpret_cast<const uint4*>(a.v),
                 a.fp16_slots,
                 a.fp16_pool,
                 static_cast<std::uint32_t>(std::min<std::int64_t>(slots, std::int64_t{1} << 31)),
                 status_view(a.status)};
  append_kernel<<<a.batch, kThreads, 0, a.stream>>>(p);
  MIXKV_CUDA_CHECK_LAUNCH("append_kernel");
}

void copy_blocks(const CopyBlocksArgs& a) {
  check_pool("copy_blocks", "pool", a.pool, Precision::FP16);
  require(a.count >= 0, [&] { return "copy_blocks: count = " + std::to_string(a.count) + ": expected >= 0"; });
  if (a.count == 0) return;
  require(a.copies != nullptr, "copy_blocks: copies is null: expected device [count] BlockCopy");
  copy_blocks_kernel<<<a.count, 256, 0, a.stream>>>(a.copies, a.pool, status_view(a.status));
  MIXKV_CUDA_CHECK_LAUNCH("copy_blocks_kernel");
}

}  // namespace mixkv::gpu