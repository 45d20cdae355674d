#pragma once
#include <array>
#include <cstddef>
#include <cstdint>

#include "mixkv/core/block_format.h"
#include "mixkv/core/host_device.h"
#include "mixkv/core/precision.h"

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
  // Ids in [0, num_blocks) address bytes inside the buffer: the bound every
  // op checks a block id, slot or host slot against before it is used.
  std::int32_t num_blocks = 0;

  MIXKV_HOST_DEVICE bool contains(std::int64_t block_id) const { return block_id >= 0 && block_id < num_blocks; }

  MIXKV_HOST_DEVICE std::byte* block(std::int32_t block_id) const {
    return block_at(block_id / blocks_per_slab, block_id % blocks_per_slab);
  }
  // Block `index` of slab `slab`: for callers that split the id themselves
  // (the CUDA kernels divide by a precomputed reciprocal). Both are >= 0, so
  // they are zero-extended: on the GPU a sign extension costs a shift and a
  // multiply-add per 64-bit product, in every block of the decode loop.
  MIXKV_HOST_DEVICE std::byte* block_at(std::int32_t slab, std::int32_t index) const {
    return block_at(slab, index, format.block_bytes());
  }
  // With format.block_bytes() given by the caller (a constant where a kernel
  // is built for one block shape).
  MIXKV_HOST_DEVICE std::byte* block_at(std::int32_t slab, std::int32_t index, std::size_t block_bytes) const {
    return base + static_cast<std::size_t>(static_cast<std::uint32_t>(slab)) * slab_bytes +
           static_cast<std::size_t>(static_cast<std::uint32_t>(index)) * block_bytes;
  }
};

// The three pools of one buffer, indexed by pool_index().
using PoolViews = std::array<PoolView, kNumPrecisions>;

// The three pools of a buffer (the arena, or the host swap buffer) without
// its address: what the cache manager hands a backend, which adds the base
// of its own allocation. Kernels and ops know this, never the manager.
struct PoolLayout {
  std::size_t bytes = 0;                              // bytes the buffer must hold
  std::array<std::size_t, kNumPrecisions> offsets{};  // pool p's first byte, from the buffer's start
  PoolViews pools{};                                  // base == nullptr

  // The pools inside a buffer that starts at `base`.
  PoolViews at(std::byte* base) const {
    PoolViews views = pools;
    for (std::size_t i = 0; i < views.size(); ++i) views[i].base = base + offsets[i];
    return views;
  }
};

}  // namespace mixkv
