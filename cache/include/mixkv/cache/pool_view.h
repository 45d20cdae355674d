#pragma once
#include <cstddef>
#include <cstdint>

#include "mixkv/cache/block_format.h"
#include "mixkv/cache/host_device.h"

namespace mixkv {

// How kernels address one precision's blocks inside the arena. The arena is
// one allocation cut into equal slabs; a slab owned by a pool holds
// blocks_per_slab blocks of that pool's format, packed from the slab's start.
// Block id = slab index * blocks_per_slab + index within the slab, so ids
// never change while a block is alive and need no table to resolve.
struct PoolView {
  std::byte* base = nullptr;  // first byte of the arena (host or device memory)
  std::size_t slab_bytes = 0;
  std::int32_t blocks_per_slab = 0;
  BlockFormat format{};

  MIXKV_HOST_DEVICE std::byte* block(std::int32_t block_id) const {
    const std::size_t slab = static_cast<std::size_t>(block_id / blocks_per_slab);
    const std::size_t index = static_cast<std::size_t>(block_id % blocks_per_slab);
    return base + slab * slab_bytes + index * format.block_bytes();
  }
};

}  // namespace mixkv
