#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include <cuda_runtime_api.h>

#include "mixkv/core/op_types.h"
#include "mixkv/core/pool_view.h"
#include "mixkv/kernels/device_arena.h"
#include "mixkv/kernels/device_status.h"

namespace mixkv::gpu {

// The host swap pool of a cache in pinned, mapped host memory: ONE
// cudaHostAlloc of layout.bytes (KVCacheManager::swap_layout()) (cudaHostAllocMapped so that the
// swap kernel reaches it through a device pointer, cudaHostAllocPortable so
// that every device may use it), zero-filled. Move-only; frees on destruction.
class PinnedSwapBuffer {
 public:
  // Throws InvalidArgument when layout.bytes is 0 (no
  // CacheConfig::swap_blocks), OutOfMemory when the host cannot pin that
  // much (the CUDA error is cleared), DeviceError for other CUDA failures.
  explicit PinnedSwapBuffer(const PoolLayout& layout);
  ~PinnedSwapBuffer();
  PinnedSwapBuffer(PinnedSwapBuffer&& other) noexcept;
  PinnedSwapBuffer& operator=(PinnedSwapBuffer&& other) noexcept;
  PinnedSwapBuffer(const PinnedSwapBuffer&) = delete;
  PinnedSwapBuffer& operator=(const PinnedSwapBuffer&) = delete;

  std::byte* host() const { return host_; }      // for the CPU (inspection, cpu::swap_blocks)
  std::byte* device() const { return device_; }  // the same bytes as the kernels address them
  std::size_t bytes() const { return bytes_; }

  // The pools of `layout` (KVCacheManager::swap_layout()) over host() /
  // device(). Throw InvalidArgument if layout.bytes exceeds this buffer.
  DevicePools host_views(const PoolLayout& layout) const;
  DevicePools device_views(const PoolLayout& layout) const;

 private:
  std::byte* host_ = nullptr;
  std::byte* device_ = nullptr;
  std::size_t bytes_ = 0;
};

// Whole-block copies between the device pools and the host swap pool, in
// ONE launch for the whole list over all three pools: a grid-stride copy
// kernel that moves 16-byte vectors through the mapped host pointer. It
// runs on `stream`, never synchronizes, needs no per-block API call and is
// CUDA-graph capturable. Host bytes written by a DeviceToHost copy are
// visible to the CPU once the stream has passed the launch (event or stream
// synchronization); a HostToDevice copy reads the host slots while it runs,
// so they must not change until then.
struct SwapBlocksArgs {
  const SwapCopy* copies = nullptr;  // device [count] (DeviceSwapList::fill)
  std::int32_t count = 0;
  SwapDirection direction = SwapDirection::DeviceToHost;
  DevicePools device{};  // the arena's pools (DeviceArena::pool_views)
  DevicePools host{};    // PinnedSwapBuffer::device_views
  cudaStream_t stream = nullptr;
  // Where an entry out of range is recorded; null:
  // DeviceStatus::for_current_device().
  DeviceStatus* status = nullptr;
};
// Throws InvalidArgument naming the field for pools that are null, of
// another precision or format than their index and their twin, or not
// 16-byte aligned, for count < 0 and a null list; nothing is launched then.
// DeviceSwapList::upload validated its entries on the host; the kernel
// still checks each entry's pool, device block and host slot against the
// pools' num_blocks (a list given raw), skips one out of range and records
// it in the status.
void swap_blocks(const SwapBlocksArgs& args);

// A swap_out/swap_in list on the device, validated on the host (the role
// DeviceStoreMapping plays for store_prefill). fill() points a
// SwapBlocksArgs at it. Uploads and the launches that read the list belong
// on one stream: the next upload overwrites the list in stream order.
class DeviceSwapList {
 public:
  DeviceSwapList();
  ~DeviceSwapList();
  DeviceSwapList(const DeviceSwapList&) = delete;
  DeviceSwapList& operator=(const DeviceSwapList&) = delete;

  // Validates `copies` against the arena's and the swap buffer's pools
  // (KVCacheManager::arena_layout(), swap_layout()): InvalidArgument naming
  // copies[i].pool for a pool other than FP16, INT4, INT2;
  // IndexOutOfRange naming copies[i].device_block for a block id outside
  // [0, arena.pools[p].num_blocks) and copies[i].host_slot for a slot
  // outside [0, swap.pools[p].num_blocks);
  // InvalidArgument naming both copies when two write the same destination
  // (host slot for DeviceToHost, device block for HostToDevice). A call that
  // throws changes nothing and issues no CUDA call. Otherwise copies the
  // list on `stream` (through pinned staging: asynchronous; `copies` may be
  // released on return).
  void upload(std::span<const SwapCopy> copies, SwapDirection direction, const PoolLayout& arena,
              const PoolLayout& swap, cudaStream_t stream);
  // Sets args.copies, args.count and args.direction.
  void fill(SwapBlocksArgs& args) const;
  std::int32_t count() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mixkv::gpu
