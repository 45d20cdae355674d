#pragma once
#include <optional>
#include "mixkv/cache/kv_cache_manager.h"

#include "mixkv/kernels/device_arena.h"
#include "mixkv/kernels/device_status.h"
#include "mixkv/kernels/swap.h"

namespace mixkv::gpu {
class DecodePlan;
class DevicePageTables;
}  // namespace mixkv::gpu

namespace mixkv::python {

// The tables a DecodePlan made from Python reads (null for another plan).
const gpu::DevicePageTables* tables_of(const gpu::DecodePlan& plan);

// The CUDA backend's cache: a KVCacheManager with a device arena (one
// cudaMalloc of config.arena_bytes on the device current at construction)
// and, when config.swap_blocks asks for a host swap pool, its pinned host
// memory and the device copy of the last swap list.
class DeviceKVCache : public KVCacheManager {
 public:
  explicit DeviceKVCache(CacheConfig config);

  int device() const { return device_; }
  const gpu::DeviceArena& arena() const { return arena_; }
  gpu::DevicePools pools() const { return arena_.pool_views(this->arena_layout()); }
  // Null without a swap pool.
  const gpu::PinnedSwapBuffer* swap() const { return swap_ ? &*swap_ : nullptr; }
  gpu::DeviceSwapList& swap_list() { return swap_list_; }
  // Where the cache's ops record an out-of-range id found on the device;
  // every op raises a recorded one before it starts (mutable: recording is
  // not a change of the cache).
  gpu::DeviceStatus& status() const { return status_; }

 private:
  int device_ = 0;
  gpu::DeviceArena arena_;
  std::optional<gpu::PinnedSwapBuffer> swap_;
  gpu::DeviceSwapList swap_list_;
  mutable gpu::DeviceStatus status_;
};

}  // namespace mixkv::python
