#pragma once
#include "mixkv/cache/kv_cache_manager.h"
#include <optional>

#include "mixkv/kernels/device_arena.h"
#include "mixkv/kernels/swap.h"

namespace mixkv::python {

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

 private:
  int device_ = 0;
  gpu::DeviceArena arena_;
  std::optional<gpu::PinnedSwapBuffer> swap_;
  gpu::DeviceSwapList swap_list_;
};

}  // namespace mixkv::python
