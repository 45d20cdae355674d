#pragma once
#include <cstddef>
#include <cstdlib>
#include <memory>

#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/cpu/store.h"

namespace mixkv::python {

// design.md's Python KVCache for the CPU backend: a KVCacheManager together
// with the host memory of its arena (one zero-filled allocation of
// config.arena_bytes) and of its swap pool (swap_bytes()), so that the CPU
// ops have somewhere to put KV bytes. Nothing else is added to the manager.
class HostKVCache : public KVCacheManager {
 public:
  // Errors of KVCacheManager's constructor first; OutOfMemory when the host
  // cannot provide arena_bytes.
  explicit HostKVCache(CacheConfig config);

  std::byte* arena() const { return arena_.get(); }
  std::byte* swap() const { return swap_.get(); }
  PoolViews pools() const;
  PoolViews swap_pools() const;

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> arena_;
  std::unique_ptr<std::byte, Free> swap_;
};

}  // namespace mixkv::python
