#include "mixkv/kernels/swap.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include <boost/unordered/unordered_flat_map.hpp>

#include "mixkv/kernels/detail/cuda_check.h"
#include "mixkv/kernels/detail/device_buffer.h"

namespace mixkv::gpu {
namespace {

using detail::require;

constexpr int kThreads = 256;
// Loads in flight per thread before its first store: reads through the
// mapped pointer cross PCIe (~1-2 us each), so each thread keeps several
// outstanding to cover that latency.
constexpr int kBatch = 4;
// Grid cap: a few waves of CTAs on any current GPU; longer lists are walked
// by the grid-stride loop.
constexpr std::int32_t kMaxCtas = 8192;

struct SwapParams {
  const SwapCopy* copies;
  std::int32_t count;
  bool to_host;
  PoolView device[kNumPrecisions];
  PoolView host[kNumPrecisions];
  DeviceStatusView status;
};

// One CTA per copy at a time (grid-stride over the list); its threads move
// the block in 16-byte vectors. Validation guarantees 16-byte aligned blocks
// whose size is a multiple of 16.
__global__ void __launch_bounds__(kThreads) swap_blocks_kernel(const __grid_constant__ SwapParams p) {
  for (std::int32_t i = blockIdx.x; i < p.count; i += gridDim.x) {
    const SwapCopy c = p.copies[i];
    const int pool = pool_index(c.pool);
    // Entries are checked once a copy (the whole CTA skips together): a raw
    // list could name a block past either buffer.
    if (id_out_of_range(pool, kNumPrecisions)) {
      if (threadIdx.x == 0)
        report_out_of_range(p.status, StatusOp::SwapBlocks, StatusArg::SwapPool, i, pool, kNumPrecisions);
      continue;
    }
    const auto device_limit = static_cast<std::uint32_t>(p.device[pool].num_blocks);
    const auto host_limit = static_cast<std::uint32_t>(p.host[pool].num_blocks);
    const bool bad_device = id_out_of_range(c.device_block, device_limit);
    if (bad_device || id_out_of_range(c.host_slot, host_limit)) {
      if (threadIdx.x == 0) {
        report_out_of_range(p.status, StatusOp::SwapBlocks,
                            bad_device ? StatusArg::SwapDeviceBlock : StatusArg::SwapHostSlot, i,
                            bad_device ? c.device_block : c.host_slot, bad_device ? device_limit : host_limit);
      }
      continue;
    }
    uint4* on_device = reinterpret_cast<uint4*>(p.device[pool].block(c.device_block));
    uint4* on_host = reinterpret_cast<uint4*>(p.host[pool].block(c.host_slot));
    const uint4* src = p.to_host ? on_device : on_host;
    uint4* dst = p.to_host ? on_host : on_device;
    const int chunks = static_cast<int>(p.device[pool].format.block_bytes() / 16);
    for (int base = threadIdx.x; base < chunks; base += kBatch * kThreads) {
      uint4 x[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int at = base + u * kThreads;
        if (at < chunks) x[u] = src[at];
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int at = base + u * kThreads;
        if (at < chunks) dst[at] = x[u];
      }
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

void check_pools(const char* fn, const char* name, const DevicePools& pools) {
  for (const Precision p : kAllPrecisions) {
    const PoolView& v = pools[pool_index(p)];
    const auto at = [&] { return std::string(fn) + ": " + name + "[" + std::string(to_string(p)) + "]"; };
    require(v.base != nullptr, [&] {
      return at() + ".base is null: expected " +
             (std::string(name) == "device" ? "the device arena" : "the mapped swap buffer");
    });
    require(v.format.precision == p, [&] {
      return at() + ".format.precision = " + std::string(to_string(v.format.precision)) + ": expected " +
             std::string(to_string(p));
    });
    require(v.format.num_kv_heads >= 1 && v.format.head_dim >= 1 && v.format.block_size >= 1,
            [&] { return at() + ".format: expected num_kv_heads, head_dim and block_size >= 1"; });
    require(v.blocks_per_slab >= 1,
            [&] { return at() + ".blocks_per_slab = " + std::to_string(v.blocks_per_slab) + ": expected >= 1"; });
    require(v.num_blocks >= 0,
            [&] { return at() + ".num_blocks = " + std::to_string(v.num_blocks) + ": expected >= 0"; });
    require(aligned16(v.base) && v.slab_bytes % 16 == 0 && v.format.block_bytes() % 16 == 0, [&] {
      return at() + ": base, slab_bytes and block_bytes must be multiples of 16 (16-byte vector copies)";
    });
  }
}

std::string copy_at(std::size_t i) { return "copies[" + std::to_string(i) + "]"; }

}  // namespace

// --- PinnedSwapBuffer -------------------------------------------------------

PinnedSwapBuffer::PinnedSwapBuffer(const PoolLayout& layout) {
  const std::size_t bytes = layout.bytes;
  require(bytes > 0,
          "PinnedSwapBuffer: layout.bytes = 0: expected a host swap pool "
          "(CacheConfig::swap_blocks > 0 for some pool)");
  void* p = nullptr;
  // throw_cuda_error clears the runtime's last error and maps
  // cudaErrorMemoryAllocation to OutOfMemory.
  MIXKV_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  void* d = nullptr;
  const cudaError_t status = cudaHostGetDevicePointer(&d, p, 0);
  if (status != cudaSuccess) {
    cudaFreeHost(p);
    detail::check_cuda(status, "cudaHostGetDevicePointer", __FILE__, __LINE__);
  }
  // Slots never written read as zeros rather than as stale process memory.
  std::memset(p, 0, bytes);
  host_ = static_cast<std::byte*>(p);
  device_ = static_cast<std::byte*>(d);
  bytes_ = bytes;
}

PinnedSwapBuffer::~PinnedSwapBuffer() {
  if (host_ != nullptr) cudaFreeHost(host_);
}

PinnedSwapBuffer::PinnedSwapBuffer(PinnedSwapBuffer&& other) noexcept
    : host_(std::exchange(other.host_, nullptr)),
      device_(std::exchange(other.device_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

PinnedSwapBuffer& PinnedSwapBuffer::operator=(PinnedSwapBuffer&& other) noexcept {
  if (this != &other) {
    if (host_ != nullptr) cudaFreeHost(host_);
    host_ = std::exchange(other.host_, nullptr);
    device_ = std::exchange(other.device_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

namespace {
DevicePools swap_views(const char* fn, const PoolLayout& layout, std::byte* base, std::size_t bytes) {
  require(base != nullptr,
          [&] { return std::string(fn) + ": the buffer was moved from: expected a live PinnedSwapBuffer"; });
  require(layout.bytes <= bytes, [&] {
    return std::string(fn) + ": layout.bytes = " + std::to_string(layout.bytes) + ": expected <= the buffer's " +
           std::to_string(bytes) + " bytes";
  });
  return layout.at(base);
}
}  // namespace

DevicePools PinnedSwapBuffer::host_views(const PoolLayout& layout) const {
  return swap_views("PinnedSwapBuffer::host_views", layout, host_, bytes_);
}

DevicePools PinnedSwapBuffer::device_views(const PoolLayout& layout) const {
  return swap_views("PinnedSwapBuffer::device_views", layout, device_, bytes_);
}

// --- swap_blocks ------------------------------------------------------------

void swap_blocks(const SwapBlocksArgs& a) {
  constexpr const char* fn = "swap_blocks";
  require(a.direction == SwapDirection::DeviceToHost || a.direction == SwapDirection::HostToDevice, [&] {
    return std::string(fn) + ": direction = " + std::to_string(static_cast<int>(a.direction)) +
           ": expected DeviceToHost or HostToDevice";
  });
  check_pools(fn, "device", a.device);
  check_pools(fn, "host", a.host);
  for (const Precision p : kAllPrecisions) {
    const BlockFormat& d = a.device[pool_index(p)].format;
    const BlockFormat& h = a.host[pool_index(p)].format;
    require(d.num_kv_heads == h.num_kv_heads && d.head_dim == h.head_dim && d.block_size == h.block_size, [&] {
      return std::string(fn) + ": host[" + std::string(to_string(p)) + "].format: expected device[" +
             std::string(to_string(p)) + "]'s num_kv_heads, head_dim and block_size";
    });
  }
  require(a.count >= 0, [&] { return std::string(fn) + ": count = " + std::to_string(a.count) + ": expected >= 0"; });
  if (a.count == 0) return;
  require(a.copies != nullptr, [&] { return std::string(fn) + ": copies is null: expected device [count] SwapCopy"; });
  SwapParams p;
  p.copies = a.copies;
  p.count = a.count;
  p.to_host = a.direction == SwapDirection::DeviceToHost;
  for (int i = 0; i < kNumPrecisions; ++i) {
    p.device[i] = a.device[i];
    p.host[i] = a.host[i];
  }
  p.status = (a.status != nullptr ? *a.status : DeviceStatus::for_current_device()).view();
  const auto grid = static_cast<unsigned>(std::min(a.count, kMaxCtas));
  swap_blocks_kernel<<<grid, kThreads, 0, a.stream>>>(p);
  MIXKV_CUDA_CHECK_LAUNCH("swap_blocks_kernel");
}

// --- DeviceSwapList ---------------------------------------------------------

struct DeviceSwapList::Impl {
  std::int32_t count = 0;
  SwapDirection direction = SwapDirection::DeviceToHost;
  detail::PinnedBuffer<SwapCopy> staging;
  detail::DeviceBuffer<SwapCopy> list;
  detail::Event staged;  // the last upload's copy out of `staging`
};

DeviceSwapList::DeviceSwapList() : impl_(std::make_unique<Impl>()) {}
DeviceSwapList::~DeviceSwapList() = default;

void DeviceSwapList::upload(std::span<const SwapCopy> copies, SwapDirection direction, const PoolLayout& arena,
                            const PoolLayout& swap, cudaStream_t stream) {
  constexpr const char* fn = "DeviceSwapList::upload";
  require(direction == SwapDirection::DeviceToHost || direction == SwapDirection::HostToDevice, [&] {
    return std::string(fn) + ": direction = " + std::to_string(static_cast<int>(direction)) +
           ": expected DeviceToHost or HostToDevice";
  });
  require(copies.size() <= static_cast<std::size_t>(INT32_MAX), [&] {
    return std::string(fn) + ": copies.size() = " + std::to_string(copies.size()) + ": expected <= 2^31 - 1";
  });
  std::int64_t device_blocks[kNumPrecisions];
  std::int64_t host_slots[kNumPrecisions];
  for (const Precision p : kAllPrecisions) {
    device_blocks[pool_index(p)] = arena.pools[pool_index(p)].num_blocks;
    host_slots[pool_index(p)] = swap.pools[pool_index(p)].num_blocks;
  }
  const bool to_host = direction == SwapDirection::DeviceToHost;
  // Destination (pool, id) -> first copy writing it: two writers of one
  // block would race inside the kernel.
  boost::unordered_flat_map<std::int64_t, std::size_t> written;
  written.reserve(copies.size());
  for (std::size_t i = 0; i < copies.size(); ++i) {
    // Messages are built only on failure: this loop runs over every copy.
    const SwapCopy& c = copies[i];
    const int p = pool_index(c.pool);
    if (p < 0 || p >= kNumPrecisions) {
      throw InvalidArgument(std::string(fn) + ": " + copy_at(i) + ".pool = " + std::to_string(p) +
                            ": expected FP16, INT4 or INT2");
    }
    if (c.device_block < 0 || c.device_block >= device_blocks[p]) {
      throw IndexOutOfRange(std::string(fn) + ": " + copy_at(i) + ".device_block = " + std::to_string(c.device_block) +
                            ": expected a block id in [0, " + std::to_string(device_blocks[p]) + ") of the " +
                            std::string(to_string(c.pool)) + " pool");
    }
    if (c.host_slot < 0 || c.host_slot >= host_slots[p]) {
      throw IndexOutOfRange(std::string(fn) + ": " + copy_at(i) + ".host_slot = " + std::to_string(c.host_slot) +
                            ": expected a slot in [0, " + std::to_string(host_slots[p]) + ") of the " +
                            std::string(to_string(c.pool)) + " swap pool");
    }
    const std::int32_t dst = to_host ? c.host_slot : c.device_block;
    const auto [it, fresh] = written.try_emplace((static_cast<std::int64_t>(p) << 32) | dst, i);
    if (!fresh) {
      throw InvalidArgument(std::string(fn) + ": " + copy_at(i) + (to_host ? ".host_slot = " : ".device_block = ") +
                            std::to_string(dst) + ": also the destination of " + copy_at(it->second) +
                            ": expected distinct destinations");
    }
  }
  Impl& s = *impl_;
  const auto n = static_cast<std::int32_t>(copies.size());
  if (n > 0) {
    // The previous upload may still be reading the staging buffer.
    s.staged.synchronize();
    s.staging.reserve(static_cast<std::size_t>(n));
    s.list.reserve(static_cast<std::size_t>(n));
    std::copy(copies.begin(), copies.end(), s.staging.get());
    MIXKV_CUDA_CHECK(cudaMemcpyAsync(s.list.get(), s.staging.get(), static_cast<std::size_t>(n) * sizeof(SwapCopy),
                                     cudaMemcpyHostToDevice, stream));
    s.staged.record(stream);
  }
  s.count = n;
  s.direction = direction;
}

void DeviceSwapList::fill(SwapBlocksArgs& args) const {
  args.copies = impl_->list.get();
  args.count = impl_->count;
  args.direction = impl_->direction;
}

std::int32_t DeviceSwapList::count() const { return impl_->count; }

}  // namespace mixkv::gpu
