#pragma once
// A pool as the CUDA kernels address it: the PoolView with its
// blocks_per_slab as a FastDivisor, so that a block's address costs a
// multiply-high instead of a runtime division, which would be a large part
// of the decode kernel's instructions.
#include "fast_divisor.cuh"
#include "mixkv/core/pool_view.h"

namespace mixkv::gpu::detail {

struct DevicePool {
  PoolView view;
  FastDivisor per_slab;

  DevicePool() = default;
  // view.blocks_per_slab >= 1 (the launchers check it).
  __host__ explicit DevicePool(const PoolView& v) : view(v), per_slab(static_cast<std::uint32_t>(v.blocks_per_slab)) {}

  // PoolView::block(block_id) for a live block id (0 <= id < 2^31).
  __device__ std::byte* block(std::int32_t block_id) const { return block(block_id, view.format); }
  // The same with the pool's format given by the caller: a kernel built for
  // one tile shape passes a format of constant sizes, so that the block size
  // in the address is a constant.
  __device__ std::byte* block(std::int32_t block_id, const BlockFormat& format) const {
    const int slab = per_slab.div(block_id);
    return view.block_at(slab, block_id - slab * view.blocks_per_slab, format.block_bytes());
  }
};

}  // namespace mixkv::gpu::detail
