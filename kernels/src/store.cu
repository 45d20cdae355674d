#include "mixkv/kernels/store.h"

#include <algorithm>
#include <string>
#include <vector>

#include "cuda_check.cuh"
#include "device_buffer.cuh"
#include "quantize.cuh"

namespace mixkv::gpu {
namespace {

using detail::require;

constexpr int kThreads = 128;
constexpr int kRowsPerCta = 16;

struct StoreParams {
  const uint4* k;  // rows of num_kv_heads * head_dim halves, as 16-byte chunks
  const uint4* v;
  std::int32_t rows;
  const std::int32_t* fp16_slots;
  const WindowSlot* windows[2];  // INT4, INT2
  std::int32_t num_windows[2];
  std::int32_t fp16_ctas;
  PoolView pools[kNumPrecisions];
};

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

// Loads window rows [first_row, first_row + S) of KV head `head` into the
// FP16 tile as they are (16-byte row chunks into padded rows) with cp.async:
// the copies go global -> shared without passing through registers, so all
// of a thread's chunks are in flight at once with one instruction each
// (instead of a load, a shared store and the registers held in between).
// Ends with the thread's copies complete; the caller's __syncthreads()
// publishes them.
__device__ __forceinline__ void load_window(const uint4* k, const uint4* v, std::int32_t first_row, int head,
                                            int heads, int D, int S, __half* tile) {
  const int chunks_per_row = D / 8;
  const int pitch = detail::QuantTile<__half>::pitch(D);
  const auto k_tile = static_cast<std::uint32_t>(__cvta_generic_to_shared(tile));
  const auto v_tile = k_tile + static_cast<std::uint32_t>(S * pitch * sizeof(__half));
  for (detail::StridedIndex i(chunks_per_row); i.row < S; i.next()) {
    const std::size_t src =
        (static_cast<std::size_t>(first_row + i.row) * heads + head) * chunks_per_row + i.col;
    const auto at = static_cast<std::uint32_t>((i.row * pitch + 8 * i.col) * sizeof(__half));
    // .cg: the input is read once, so it bypasses L1.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                 ::"r"(k_tile + at), "l"(__cvta_generic_to_global(k + src)));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                 ::"r"(v_tile + at), "l"(__cvta_generic_to_global(v + src)));
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

__global__ void __launch_bounds__(kThreads) store_prefill_kernel(const __grid_constant__ StoreParams p) {
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  const BlockFormat& f16 = p.pools[0].format;
  const int heads = f16.num_kv_heads;
  const int D = f16.head_dim;
  const int S = f16.block_size;
  if (static_cast<int>(blockIdx.x) < p.fp16_ctas) {
    const int chunks_per_head = D / 8;
    const int chunks_per_row = heads * chunks_per_head;
    const int first = blockIdx.x * kRowsPerCta;
    const int rows = min(kRowsPerCta, p.rows - first);
    const int total = rows * chunks_per_row;
    constexpr int kBatch = 4;  // loads in flight per thread before the first store
    for (int base = threadIdx.x; base < total; base += kBatch * blockDim.x) {
      uint4 kx[kBatch], vx[kBatch];
      std::int32_t slot[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * blockDim.x;
        slot[u] = -1;
        if (i < total) {
          const std::size_t at = static_cast<std::size_t>(first) * chunks_per_row + i;
          slot[u] = __ldg(p.fp16_slots + first + i / chunks_per_row);
          kx[u] = __ldg(p.k + at);
          vx[u] = __ldg(p.v + at);
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (slot[u] < 0) continue;
        const int chunk = (base + u * blockDim.x) % chunks_per_row;
        const BlockFormat& f = p.pools[0].format;
        char* head_base = reinterpret_cast<char*>(p.pools[0].block(slot[u] / f.block_size)) +
                          f.head_offset(chunk / chunks_per_head);
        const std::size_t row_offset = static_cast<std::size_t>(slot[u] % f.block_size) * f.head_dim * 2;
        reinterpret_cast<uint4*>(head_base + f.k_offset() + row_offset)[chunk % chunks_per_head] = kx[u];
        reinterpret_cast<uint4*>(head_base + f.v_offset() + row_offset)[chunk % chunks_per_head] = vx[u];
      }
    }
    return;
  }
  int j = blockIdx.x - p.fp16_ctas;
  const int which = j < p.num_windows[0] * heads ? 0 : 1;
  if (which == 1) j -= p.num_windows[0] * heads;
  const WindowSlot w = p.windows[which][j / heads];
  const int head = j % heads;
  const PoolView& pool = p.pools[1 + which];
  __half* tile = reinterpret_cast<__half*>(smem_bytes);
  float* scratch = reinterpret_cast<float*>(smem_bytes + 2 * static_cast<std::size_t>(S) *
                                                             detail::QuantTile<__half>::pitch(D) * sizeof(__half));
  load_window(p.k, p.v, w.first_row, head, heads, D, S, tile);
  __syncthreads();
  char* out = reinterpret_cast<char*>(pool.block(w.block_id)) + pool.format.head_offset(head);
  detail::quantize_tile(pool.format, tile, scratch, out);
}

struct AppendParams {
  const uint4* k;
  const uint4* v;
  const std::int32_t* slots;
  PoolView pool;
};

__global__ void append_kernel(const __grid_constant__ AppendParams p) {
  const BlockFormat& f = p.pool.format;
  const int chunks_per_head = f.head_dim / 8;
  const int chunks_per_row = f.num_kv_heads * chunks_per_head;
  const std::int32_t slot = p.slots[blockIdx.x];
  const std::size_t base = static_cast<std::size_t>(blockIdx.x) * chunks_per_row;
  for (int i = threadIdx.x; i < chunks_per_row; i += blockDim.x) {
    copy_row(p.pool, slot, p.k + base, p.v + base, i, chunks_per_head);
  }
}

__global__ void copy_blocks_kernel(const BlockCopy* copies, PoolView pool) {
  const BlockCopy c = copies[blockIdx.x];
  const uint4* src = reinterpret_cast<const uint4*>(pool.block(c.src));
  uint4* dst = reinterpret_cast<uint4*>(pool.block(c.dst));
  const std::size_t chunks = pool.format.block_bytes() / 16;
  for (std::size_t i = threadIdx.x; i < chunks; i += blockDim.x) dst[i] = src[i];
}

void check_pool(const char* fn, const char* name, const PoolView& pool, Precision expected) {
  const std::string prefix = std::string(fn) + ": " + name;
  require(pool.base != nullptr, prefix + ".base is null: expected the device arena");
  require(pool.format.precision == expected,
          prefix + ".format.precision = " + std::string(to_string(pool.format.precision)) + ": expected " +
              std::string(to_string(expected)));
  require(pool.format.head_dim % 16 == 0 && pool.format.head_dim >= 16 && pool.format.head_dim <= 512,
          prefix + ".format.head_dim = " + std::to_string(pool.format.head_dim) +
              ": expected a multiple of 16 in [16, 512]");
  require(pool.format.block_size % 16 == 0 && pool.format.block_size >= 16 && pool.format.block_size <= 256,
          prefix + ".format.block_size = " + std::to_string(pool.format.block_size) +
              ": expected a multiple of 16 in [16, 256]");
  require(pool.format.num_kv_heads >= 1, prefix + ".format.num_kv_heads: expected >= 1");
  require(pool.blocks_per_slab >= 1, prefix + ".blocks_per_slab: expected >= 1");
}

}  // namespace

void store_prefill(const StorePrefillArgs& a) {
  constexpr const char* fn = "store_prefill";
  check_pool(fn, "pools[FP16]", a.pools[0], Precision::FP16);
  check_pool(fn, "pools[INT4]", a.pools[1], Precision::INT4);
  check_pool(fn, "pools[INT2]", a.pools[2], Precision::INT2);
  const BlockFormat& f = a.pools[0].format;
  for (int i = 1; i < kNumPrecisions; ++i) {
    const BlockFormat& g = a.pools[i].format;
    require(g.num_kv_heads == f.num_kv_heads && g.head_dim == f.head_dim && g.block_size == f.block_size,
            std::string(fn) + ": pools[" + std::string(to_string(kAllPrecisions[i])) +
                "].format: expected the FP16 pool's num_kv_heads, head_dim and block_size");
  }
  require(a.rows >= 0, std::string(fn) + ": rows = " + std::to_string(a.rows) + ": expected >= 0");
  require(a.num_int4_windows >= 0 && a.num_int2_windows >= 0,
          std::string(fn) + ": num_int4_windows / num_int2_windows: expected >= 0");
  if (a.rows == 0) return;
  require(a.k != nullptr && a.v != nullptr,
          std::string(fn) + ": k, v: expected device [rows][num_kv_heads][head_dim] halves");
  require(a.fp16_slots != nullptr, std::string(fn) + ": fp16_slots is null: expected device [rows] slots");
  require(a.num_int4_windows == 0 || a.int4_windows != nullptr, std::string(fn) + ": int4_windows is null");
  require(a.num_int2_windows == 0 || a.int2_windows != nullptr, std::string(fn) + ": int2_windows is null");

  StoreParams p;
  p.k = reinterpret_cast<const uint4*>(a.k);
  p.v = reinterpret_cast<const uint4*>(a.v);
  p.rows = a.rows;
  p.fp16_slots = a.fp16_slots;
  p.windows[0] = a.int4_windows;
  p.windows[1] = a.int2_windows;
  p.num_windows[0] = a.num_int4_windows;
  p.num_windows[1] = a.num_int2_windows;
  p.fp16_ctas = (a.rows + kRowsPerCta - 1) / kRowsPerCta;
  for (int i = 0; i < kNumPrecisions; ++i) p.pools[i] = a.pools[i];
  const std::int64_t grid =
      p.fp16_ctas + static_cast<std::int64_t>(a.num_int4_windows + a.num_int2_windows) * f.num_kv_heads;
  const std::size_t smem = detail::QuantTile<__half>::bytes(f.head_dim, f.block_size);
  require(smem <= 227 * 1024, std::string(fn) + ": head_dim * block_size too large for one tile in shared memory");
  if (smem > 48 * 1024) {
    MIXKV_CUDA_CHECK(cudaFuncSetAttribute(store_prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
  }
  store_prefill_kernel<<<static_cast<unsigned>(grid), kThreads, smem, a.stream>>>(p);
  MIXKV_CUDA_CHECK_LAUNCH("store_prefill_kernel");
}

struct DeviceStoreMapping::Impl {
  std::int32_t rows = 0;
  std::int32_t num_windows[2] = {0, 0};
  detail::DeviceBuffer<std::int32_t> slots;
  detail::DeviceBuffer<WindowSlot> windows[2];
};

DeviceStoreMapping::DeviceStoreMapping() : impl_(std::make_unique<Impl>()) {}
DeviceStoreMapping::~DeviceStoreMapping() = default;

void DeviceStoreMapping::upload(const StoreMapping& mapping, std::int32_t block_size, cudaStream_t stream) {
  constexpr const char* fn = "DeviceStoreMapping::upload";
  require(block_size >= 16, std::string(fn) + ": block_size = " + std::to_string(block_size) + ": expected >= 16");
  const auto rows = static_cast<std::int32_t>(mapping.fp16_slots.size());
  std::vector<int> covered(rows, 0);
  for (std::int32_t r = 0; r < rows; ++r) {
    require(mapping.fp16_slots[r] >= -1, std::string(fn) + ": mapping.fp16_slots[" + std::to_string(r) + "] = " +
                                             std::to_string(mapping.fp16_slots[r]) +
                                             ": expected a slot >= 0, or -1 for a quantized row");
  }
  const std::vector<WindowSlot>* lists[2] = {&mapping.int4_windows, &mapping.int2_windows};
  const char* names[2] = {"mapping.int4_windows", "mapping.int2_windows"};
  for (int which = 0; which < 2; ++which) {
    for (std::size_t w = 0; w < lists[which]->size(); ++w) {
      const WindowSlot& s = (*lists[which])[w];
      const std::string at = std::string(fn) + ": " + names[which] + "[" + std::to_string(w) + "]";
      require(s.block_id >= 0, at + ".block_id = " + std::to_string(s.block_id) + ": expected >= 0");
      require(s.first_row >= 0 && s.first_row + block_size <= rows,
              at + ".first_row = " + std::to_string(s.first_row) + ": expected a row in [0, rows - block_size]");
      for (std::int32_t r = s.first_row; r < s.first_row + block_size; ++r) {
        require(mapping.fp16_slots[r] == -1 && ++covered[r] == 1,
                at + " covers row " + std::to_string(r) + ": expected rows with fp16_slots -1 covered once");
      }
    }
  }
  for (std::int32_t r = 0; r < rows; ++r) {
    require(mapping.fp16_slots[r] != -1 || covered[r] == 1,
            std::string(fn) + ": mapping.fp16_slots[" + std::to_string(r) + "] = -1 but no window covers row " +
                std::to_string(r));
  }
  Impl& s = *impl_;
  s.slots.reserve(std::max(rows, 1));
  if (rows > 0) {
    MIXKV_CUDA_CHECK(cudaMemcpyAsync(s.slots.get(), mapping.fp16_slots.data(), rows * sizeof(std::int32_t),
                                     cudaMemcpyHostToDevice, stream));
  }
  for (int which = 0; which < 2; ++which) {
    const auto n = static_cast<std::int32_t>(lists[which]->size());
    s.windows[which].reserve(std::max(n, 1));
    if (n > 0) {
      MIXKV_CUDA_CHECK(cudaMemcpyAsync(s.windows[which].get(), lists[which]->data(), n * sizeof(WindowSlot),
                                       cudaMemcpyHostToDevice, stream));
    }
    s.num_windows[which] = n;
  }
  s.rows = rows;
  // Pageable source memory: cudaMemcpyAsync returns once it is staged, so
  // `mapping` may be released right after this call.
}

void DeviceStoreMapping::fill(StorePrefillArgs& args) const {
  const Impl& s = *impl_;
  args.rows = s.rows;
  args.fp16_slots = s.slots.get();
  args.int4_windows = s.windows[0].get();
  args.num_int4_windows = s.num_windows[0];
  args.int2_windows = s.windows[1].get();
  args.num_int2_windows = s.num_windows[1];
}

void append(const AppendArgs& a) {
  check_pool("append", "fp16_pool", a.fp16_pool, Precision::FP16);
  require(a.batch >= 0, "append: batch = " + std::to_string(a.batch) + ": expected >= 0");
  if (a.batch == 0) return;
  require(a.k != nullptr && a.v != nullptr, "append: k, v: expected device [batch][num_kv_heads][head_dim] halves");
  require(a.fp16_slots != nullptr, "append: fp16_slots is null: expected device [batch] slots");
  AppendParams p{reinterpret_cast<const uint4*>(a.k), reinterpret_cast<const uint4*>(a.v), a.fp16_slots,
                 a.fp16_pool};
  append_kernel<<<a.batch, kThreads, 0, a.stream>>>(p);
  MIXKV_CUDA_CHECK_LAUNCH("append_kernel");
}

void copy_blocks(const CopyBlocksArgs& a) {
  check_pool("copy_blocks", "pool", a.pool, Precision::FP16);
  require(a.count >= 0, "copy_blocks: count = " + std::to_string(a.count) + ": expected >= 0");
  if (a.count == 0) return;
  require(a.copies != nullptr, "copy_blocks: copies is null: expected device [count] BlockCopy");
  copy_blocks_kernel<<<a.count, 256, 0, a.stream>>>(a.copies, a.pool);
  MIXKV_CUDA_CHECK_LAUNCH("copy_blocks_kernel");
}

}  // namespace mixkv::gpu
