#pragma once
#include <span>

#include "mixkv/core/op_types.h"
#include "mixkv/cpu/store.h"

namespace mixkv::cpu {

// Copies whole blocks between the pools of the arena (`device`, pool_view)
// and the host swap buffer (`host`, KVCacheManager::swap_view), as
// swap_out (DeviceToHost) or swap_in (HostToDevice) listed them. On the CPU
// backend both live in host memory; the GPU backend makes the same copies
// with gpu::swap_blocks (kernels/include/mixkv/kernels/swap.h): one kernel
// launch per list, between the device arena and a PinnedSwapBuffer.
// Throws InvalidArgument naming copies[i] for a pool other than FP16, INT4,
// INT2, and the pools as store_prefill does; IndexOutOfRange for a
// device_block outside [0, device[pool].num_blocks) or a host_slot outside
// [0, host[pool].num_blocks) (0 slots without a swap pool); nothing is
// copied then.
void swap_blocks(std::span<const SwapCopy> copies, SwapDirection direction, const PoolViews& device,
                 const PoolViews& host);

}  // namespace mixkv::cpu
