#pragma once
#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/kernels/device_arena.h"

namespace mixkv::python {

// The CUDA backend's cache: a KVCacheManager with a device arena (one
// cudaMalloc of config.arena_bytes on the device current at construction).
class DeviceKVCache : public KVCacheManager {
 public:
  explicit DeviceKVCache(CacheConfig config);

  int device() const { return device_; }
  const gpu::DeviceArena& arena() const { return arena_; }
  gpu::DevicePools pools() const { return arena_.pool_views(*this); }

 private:
  int device_ = 0;
  gpu::DeviceArena arena_;
};

}  // namespace mixkv::python
