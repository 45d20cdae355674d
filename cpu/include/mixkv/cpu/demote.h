#pragma once
#include <span>

#include "mixkv/core/op_types.h"
#include "mixkv/cpu/store.h"

namespace mixkv::cpu {

// Performs the requantization of KVCacheManager::demote() on host pools:
// each op reads its source block (FP16 widened, or INT4 dequantized exactly
// as read_head does) and quantizes it into its destination block with the
// rounding of write_head. So FP16 -> INT4/INT2 writes the very codes
// write_head (store_prefill) makes from those FP16 values, and INT4 -> INT2
// requantizes the INT4-dequantized floats, as gpu::demote does.
// Throws IndexOutOfRange naming ops[i] for a block outside [0, num_blocks)
// of its pool; InvalidArgument naming ops[i] for a pair other than (FP16,
// INT4), (FP16, INT2), (INT4, INT2), a destination written twice or also
// read by another op, a source block holding NaN or inf (or INT4 values
// whose group FP16 cannot hold: a corrupt block), and the pools as
// store_prefill does; nothing is written then.
void demote(std::span<const DemoteOp> ops, const PoolViews& pools);

}  // namespace mixkv::cpu
