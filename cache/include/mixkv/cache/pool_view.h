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

}  // namespace mixkv
