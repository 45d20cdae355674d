#pragma once
#include <array>
#include <cstdint>
#include <memory>

#include <cuda_runtime_api.h>

#include "mixkv/core/dtype.h"
#include "mixkv/core/op_types.h"
#include "mixkv/core/pool_view.h"
#include "mixkv/kernels/device_arena.h"
#include "mixkv/kernels/device_status.h"

namespace mixkv::gpu {

// An FP16 row of a prefill and the slot it is copied to (block_id *
// block_size + offset in the FP16 pool).
struct RowSlot {
  std::int32_t row = 0;
  std::int32_t slot = 0;
};

// One layer's prefill K/V into the pools, in ONE launch: FP16 rows are
// copied to their slots; every INT4/INT2 window is quantized (K per channel
// over the window's tokens, V per token over the channels, min-max RTN with
// the rounding of quant_math.h) and packed. Codes and (scale, min) are
// bit-identical to cpu::store_prefill. All pointers are device memory.
// k and v are of the cache's 16-bit type (the pools' format.dtype, FP16 or
// BF16), which `dtype` states: InvalidArgument naming k, v otherwise.
//
// The lists are trusted as DeviceStoreMapping::upload validated them; fill()
// also sets max_block_ids, which store_prefill checks against these pools
// before the launch, so a mapping validated for a larger cache cannot write
// past this one's arena.
struct StorePrefillArgs {
  const void* k = nullptr;  // [rows][num_kv_heads][head_dim] of dtype, 16-byte aligned (as v)
  const void* v = nullptr;  // [rows][num_kv_heads][head_dim] of dtype
  std::int32_t rows = 0;
  const RowSlot* fp16_rows = nullptr;  // [num_fp16_rows]: the rows copied as they are, rows ascending
  std::int32_t num_fp16_rows = 0;
  const WindowSlot* int4_windows = nullptr;  // [num_int4_windows]
  std::int32_t num_int4_windows = 0;
  const WindowSlot* int2_windows = nullptr;  // [num_int2_windows]
  std::int32_t num_int2_windows = 0;
  // Per pool (pool_index), the largest block id the lists address (an FP16
  // slot's block), -1 for none: IndexOutOfRange unless < pools[p].num_blocks.
  std::array<std::int32_t, kNumPrecisions> max_block_ids{-1, -1, -1};
  DevicePools pools{};
  cudaStream_t stream = nullptr;
  DType dtype = DType::F16;  // of k and v: the pools' format.dtype
};
void store_prefill(const StorePrefillArgs& args);

// A StoreMapping (prefill_mapping() of one layer, possibly several
// sequences appended) copied to the device once, with its validation done on
// the host. fill() points a StorePrefillArgs at it.
class DeviceStoreMapping {
 public:
  DeviceStoreMapping();
  ~DeviceStoreMapping();
  DeviceStoreMapping(const DeviceStoreMapping&) = delete;
  DeviceStoreMapping& operator=(const DeviceStoreMapping&) = delete;

  // Validates `mapping` for `rows` rows (slots >= -1, windows inside the
  // rows and covering exactly the -1 rows, block ids >= 0) and copies it on
  // `stream`: its windows, and its rows with a slot as RowSlots. Throws
  // InvalidArgument / IndexOutOfRange naming the element; nothing is
  // uploaded then and the previous upload stays.
  void upload(const StoreMapping& mapping, std::int32_t block_size, cudaStream_t stream);
  // The same, with the block size and the pools' bounds of `arena`
  // (KVCacheManager::arena_layout()): IndexOutOfRange naming
  // mapping.fp16_slots[r] for a slot outside [0, FP16 num_blocks *
  // block_size) and mapping.int4_windows[w].block_id /
  // mapping.int2_windows[w].block_id outside [0, that pool's num_blocks).
  void upload(const StoreMapping& mapping, const PoolLayout& arena, cudaStream_t stream);
  void fill(StorePrefillArgs& args) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One decode token per sequence into its FP16 tail slot (the cache's
// 16-bit type, copied as it is).
struct AppendArgs {
  const void* k = nullptr;  // [batch][num_kv_heads][head_dim] of dtype, 16-byte aligned (as v)
  const void* v = nullptr;
  // [batch] (AppendResult::slots of one layer); -1: a padding row, not
  // written (a graph captured at a larger batch than the step's).
  const std::int32_t* fp16_slots = nullptr;
  std::int32_t batch = 0;
  PoolView fp16_pool{};
  cudaStream_t stream = nullptr;
  // Where a slot outside [0, fp16_pool.num_blocks * block_size) (other than
  // -1) is recorded; null: DeviceStatus::for_current_device().
  DeviceStatus* status = nullptr;
  DType dtype = DType::F16;  // of k and v: fp16_pool.format.dtype, else InvalidArgument
};
// The kernel skips a row whose slot is out of range and records it in the
// status (the caller's next raise_if_set()/check() throws IndexOutOfRange).
void append(const AppendArgs& args);

// Whole-block copies inside one pool (copy-on-write after fork).
struct CopyBlocksArgs {
  const BlockCopy* copies = nullptr;  // device [count]
  std::int32_t count = 0;
  PoolView pool{};
  cudaStream_t stream = nullptr;
  // Where a src or dst outside [0, pool.num_blocks) is recorded; null:
  // DeviceStatus::for_current_device().
  DeviceStatus* status = nullptr;
};
// The kernel skips a copy with an id out of range and records it in the
// status.
void copy_blocks(const CopyBlocksArgs& args);

}  // namespace mixkv::gpu
