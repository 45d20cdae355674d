#pragma once
// Parameters of the paged extend-attention kernels (one layer): the work
// items ExtendPlan builds on the host and the kernels read on the device.
#include <cuda_fp16.h>

#include <cstdint>

#include "device_pool.cuh"
#include "mixkv/core/precision.h"

namespace mixkv::gpu::detail {

// Warps of an extend CTA; each owns 16 rows of the CTA's tile.
inline constexpr int kExtendWarps = 4;
// Rows of one tile: (new row, query head of the GQA group) pairs of one
// (sequence, KV head), row m = j * group + h (FlashInfer's packed GQA), so
// that the causal limit of a row is j = m / group.
inline constexpr int kExtendTileRows = 16 * kExtendWarps;

// One CTA's work: tile rows [row0, row0 + kExtendTileRows) of (sequence,
// KV head) over a range of its units. Units are the concatenation of the
// sequence's FP16 blocks, INT4 blocks, INT2 blocks (the page lists of the
// item's slot, in that order) and then the tiles of block_size new rows the
// tile's rows see (causally): [begin, end) indexes that concatenation.
// The planner copies the list lengths and the FP16 fill from the host
// mirror of the page tables, as the decode plan does.
struct ExtendWorkItem {
  std::int32_t kv_head = 0;
  std::int32_t row0 = 0;               // first tile row
  std::int32_t q_begin = 0;            // qo_indptr[seq]: the sequence's first row of q, k, v, out
  std::int32_t n_new = 0;              // the sequence's new rows (n_i >= 1)
  std::int32_t slot = 0;               // page-table slot of the sequence
  std::int32_t counts[3] = {0, 0, 0};  // FP16, INT4, INT2 list lengths
  std::int32_t fill = 0;               // valid tokens in the last FP16 block
  std::int32_t begin = 0;              // unit range [begin, end)
  std::int32_t end = 0;
  // Row of the partial-state workspace (a split piece), or -1: the item
  // covers all of the tile's units and writes the output itself.
  std::int32_t partial = -1;
};

// The merge of one split tile: partial rows first .. first + pieces - 1
// hold its pieces' states, merged by log-sum-exp into the output.
struct ExtendMergeTask {
  std::int32_t kv_head = 0;
  std::int32_t row0 = 0;
  std::int32_t q_begin = 0;
  std::int32_t n_new = 0;
  std::int32_t first = 0;
  std::int32_t pieces = 0;
};

// q, k, v and out are of the cache's 16-bit type, the kernel instance's E.
struct ExtendParams {
  const void* q = nullptr;  // [rows][num_q_heads][head_dim]
  const void* k = nullptr;  // [rows][num_kv_heads][head_dim]: the new rows' keys
  const void* v = nullptr;  // [rows][num_kv_heads][head_dim]
  void* out = nullptr;      // [rows][num_q_heads][head_dim]
  float* lse = nullptr;     // [rows][num_q_heads], natural log, or null

  // This layer's device page tables (DeviceTablesView offset to the layer).
  const std::int32_t* blocks = nullptr;  // [pool][slot][max_blocks]
  std::int32_t max_sequences = 0;
  std::int32_t max_blocks = 0;

  // The plan: this layer's items are items[range.x .. range.x + range.y),
  // read from item_range on the device under a fixed grid (a captured graph
  // then sees the latest plan), else passed by value in launch_range.
  const ExtendWorkItem* items = nullptr;
  const int2* item_range = nullptr;
  int2 launch_range{0, 0};
  // Split pieces' states: [partials][kExtendTileRows][head_dim] and
  // [partials][kExtendTileRows], the LSE in base 2 (scores times
  // sm_scale * log2(e)), -inf for a row that saw no token.
  float* partial_out = nullptr;
  float* partial_lse = nullptr;

  DevicePool pools[kNumPrecisions];
  std::int32_t num_q_heads = 0;
  std::int32_t num_kv_heads = 0;
  std::int32_t group = 0;   // num_q_heads / num_kv_heads
  float scale_log2 = 0.0f;  // sm_scale * log2(e): scores are kept in base 2
};

struct ExtendMergeParams {
  const ExtendMergeTask* tasks = nullptr;
  const int2* task_range = nullptr;  // as ExtendParams::item_range
  int2 launch_range{0, 0};
  const float* partial_out = nullptr;
  const float* partial_lse = nullptr;
  void* out = nullptr;  // of the cache's 16-bit type
  float* lse = nullptr;
  std::int32_t num_q_heads = 0;
  std::int32_t group = 0;
  std::int32_t head_dim = 0;
};

}  // namespace mixkv::gpu::detail
