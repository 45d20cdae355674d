#pragma once
#include <span>

#include "mixkv/core/op_types.h"
#include "mixkv/core/pool_view.h"
#include "mixkv/core/span16.h"

namespace mixkv::cpu {

// Store one layer's prefill K/V, [rows][num_kv_heads][head_dim] each of the
// cache's 16-bit type (pools' format.dtype: FP16 or BF16), where `mapping`
// says (FP16-pool slots per row, one block per quantized window).
// Throws InvalidArgument naming the argument on a dtype other than the
// cache's, a size mismatch, an overlapping window or NaN/inf input, and
// IndexOutOfRange for a slot or block id outside [0, pool.num_blocks) of
// its pool (slots: times block_size); nothing is written then.
void store_prefill(Span16 k, Span16 v, const StoreMapping& mapping, const PoolViews& pools);

// Write one decode token per sequence, [batch][num_kv_heads][head_dim], into
// FP16 slots (AppendResult::slots of one layer). A slot of -1 is padding: its
// row is not written nor read (a CUDA graph captured at a larger batch than
// the step's pads its slots so). IndexOutOfRange for a slot outside -1 and
// [0, num_blocks * block_size), InvalidArgument for a dtype other than
// fp16_pool.format.dtype; nothing is written then.
void append(Span16 k, Span16 v, std::span<const std::int32_t> fp16_slots, const PoolView& fp16_pool);

// Copy whole blocks of one pool (copy-on-write after a fork).
// IndexOutOfRange for an id outside [0, pool.num_blocks); InvalidArgument
// when the copies depend on their order; nothing is copied then.
void copy_blocks(std::span<const BlockCopy> copies, const PoolView& pool);

}  // namespace mixkv::cpu
