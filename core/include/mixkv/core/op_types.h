#pragma once
// The values that cross from the cache manager to the ops (CPU or CUDA):
// where prefill rows go, which blocks to copy, swap or requantize, and a
// batch's page lists. Plain data, so kernels depend on these and not on the
// manager that produces them.
#include <array>
#include <cstdint>
#include <vector>

#include "mixkv/core/precision.h"

namespace mixkv {

using SequenceId = std::int64_t;

// Blocks per pool, indexed by pool_index().
using BlockCounts = std::array<std::int64_t, kNumPrecisions>;

// One quantized window to store: the block it owns and the row of its first
// token in the K/V rows handed to store_prefill (its S tokens follow it).
struct WindowSlot {
  std::int32_t block_id = 0;
  std::int32_t first_row = 0;
};

// Where each K/V row of a prefill goes for one layer (vLLM's slot mapping,
// extended to quantized windows). Rows are the prompt tokens of one or more
// sequences, concatenated.
struct StoreMapping {
  // Per row: FP16 slot = block_id * block_size + offset, or -1 when the row
  // belongs to a quantized window.
  std::vector<std::int32_t> fp16_slots;
  std::vector<WindowSlot> int4_windows;
  std::vector<WindowSlot> int2_windows;

  // Appends `other`, whose rows follow this mapping's rows.
  void append(const StoreMapping& other);
};

struct BlockCopy {
  std::int32_t src = 0;  // FP16 block ids
  std::int32_t dst = 0;
};

// Direction of a swap copy: swap_out lists DeviceToHost copies, swap_in
// HostToDevice ones; both backends take the same enum.
enum class SwapDirection : std::uint8_t { DeviceToHost = 0, HostToDevice = 1 };

// One block moved between the device pools and the host swap pool: the
// caller copies block_bytes of pool `pool` between the device block
// (pool_view(pool, arena).block(device_block)) and the host slot
// (swap_view(pool, host).block(host_slot)), in the direction of the call.
struct SwapCopy {
  Precision pool = Precision::FP16;
  std::int32_t device_block = 0;
  std::int32_t host_slot = 0;
};

// What the requantize kernel (cpu::demote, gpu::demote) does for one
// Demotion: read src_block of the src pool (FP16, or INT4 dequantized) and
// write it quantized into dst_block of the dst pool. The manager has already
// moved the window to dst_block and released src_block; src_block is not
// reused by the demote() call that made the op (all destinations are taken
// before any source is released), so one call's ops may run in any order.
struct DemoteOp {
  SequenceId id = 0;
  std::int32_t layer = 0;
  std::int32_t window = 0;
  Precision src_precision = Precision::FP16;
  std::int32_t src_block = 0;
  Precision dst_precision = Precision::INT4;
  std::int32_t dst_block = 0;
};

// The page lists of a batch for one (layer, pool) in CSR form, the shape
// FlashInfer's paged_kv_t uses.
struct PagedPoolTable {
  std::vector<std::int32_t> indptr;          // [batch + 1]
  std::vector<std::int32_t> indices;         // block ids, indptr[i]..indptr[i+1] for sequence i
  std::vector<std::int32_t> last_block_len;  // [batch]: valid tokens in the last block (0 if none)
};

struct DecodeMetadata {
  std::int32_t batch_size = 0;
  // [layer][pool_index]
  std::vector<std::array<PagedPoolTable, kNumPrecisions>> layers;
};

}  // namespace mixkv
