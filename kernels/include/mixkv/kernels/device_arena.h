#pragma once
#include <array>
#include <cstddef>

#include "mixkv/core/pool_view.h"
#include "mixkv/core/precision.h"

namespace mixkv::gpu {

// The three pools of an arena, indexed by pool_index(); device addresses.
using DevicePools = PoolViews;

// True when the CUDA runtime sees at least one device (tests skip otherwise).
bool cuda_device_available();

// The KV memory of every pool: ONE cudaMalloc of `bytes`, cut into slabs by
// the cache manager, whose arena_layout() turns this base into device
// addresses. Move-only; frees the allocation on destruction.
class DeviceArena {
 public:
  // Throws InvalidArgument for bytes == 0, OutOfMemory when the device
  // cannot provide the allocation, DeviceError for other CUDA failures.
  explicit DeviceArena(std::size_t bytes);
  ~DeviceArena();
  DeviceArena(DeviceArena&& other) noexcept;
  DeviceArena& operator=(DeviceArena&& other) noexcept;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  std::byte* base() const { return base_; }
  std::size_t bytes() const { return bytes_; }

  // The three pools of `layout` (KVCacheManager::arena_layout()) inside
  // this arena. Throws InvalidArgument if layout.bytes exceeds this
  // allocation.
  DevicePools pool_views(const PoolLayout& layout) const;

 private:
  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace mixkv::gpu
