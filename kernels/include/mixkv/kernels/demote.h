#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "mixkv/core/op_types.h"
#include "mixkv/core/pool_view.h"
#include "mixkv/kernels/device_status.h"

namespace mixkv::gpu {

// Requantizes blocks into a lower precision: FP16 -> INT4/INT2 (the same
// codes store_prefill would make from those FP16 values) or INT4 -> INT2
// (from the INT4 block's dequantized values). Meant for a stream of its own
// so that decode is not stalled; it reads `src` blocks and writes `dst`
// blocks only, so it may overlap decode of other blocks.
struct DemoteArgs {
  const BlockCopy* moves = nullptr;  // device [count]: src block id in src_pool, dst block id in dst_pool
  std::int32_t count = 0;
  PoolView src_pool{};
  PoolView dst_pool{};
  cudaStream_t stream = nullptr;
  // Where a src outside [0, src_pool.num_blocks) or a dst outside [0,
  // dst_pool.num_blocks) is recorded; null: DeviceStatus::for_current_device().
  DeviceStatus* status = nullptr;
};
// Throws InvalidArgument unless (src, dst) is (FP16, INT4), (FP16, INT2) or
// (INT4, INT2) with the same num_kv_heads, head_dim, block_size and 16-bit
// type (format.dtype: FP16 or BF16, the codes and (scale, min) as
// cpu::demote makes them for that type). The
// kernel skips a move with an id out of range and records it in the status.
void demote(const DemoteArgs& args);

}  // namespace mixkv::gpu
