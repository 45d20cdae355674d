#pragma once
// Parameters of the paged decode kernel (one layer).
#include <cuda_fp16.h>

#include <cstdint>

#include "device_pool.cuh"
#include "mixkv/core/precision.h"

namespace mixkv::gpu::detail {

// Warps of a decode CTA.
inline constexpr int kDecodeWarps = 4;

// A range of one (sequence, KV head)'s blocks in the concatenation of its
// FP16, INT4 and INT2 page lists (in that order).
// The planner copies the list lengths from the host mirror of the page
// tables into the item, which saves the kernel two dependent global loads
// before its first block address is known (batch-1 latency).
struct DecodeWorkItem {
  std::int32_t seq = 0;      // batch index
  std::int32_t kv_head = 0;  // whose blocks the item reads
  // First of the item's DecodeParams::group query heads. A KV head with
  // more query heads than the kernel instance computes (8, or 16 with two
  // n-tiles) is planned as equal tiles of at most that many, an item a tile.
  std::int32_t q_head = 0;
  std::int32_t begin = 0;  // virtual block range [begin, end)
  std::int32_t end = 0;
  std::int32_t partial = -1;           // row of the partial-state workspace, or -1: the item covers the whole sequence
  std::int32_t slot = 0;               // page-table slot of the sequence
  std::int32_t counts[3] = {0, 0, 0};  // FP16, INT4, INT2 list lengths
  std::int32_t fill = 0;               // valid tokens in the last FP16 block
  // Page ids of the blocks the CTA's warps start with (warp w's first unit)
  // in the item's first segment, -1 where a warp has none: their copies
  // need no page-table load, a DRAM round trip off the front of every CTA.
  std::int32_t lead_ids[kDecodeWarps] = {-1, -1, -1, -1};
  // Split items only: the (sequence, KV head)'s partial rows are
  // first .. first + pieces - 1, merged in groups of fan_in consecutive rows
  // (the last CTA of a group merges it; the last group's merger merges the
  // groups: merge_split_item in decode_merge.cuh).
  std::int32_t first = 0;
  std::int32_t pieces = 0;
  std::int32_t fan_in = 0;
};

// q and out hold values of the cache's 16-bit type, the kernel instance's
// E, which reads them through values16<E> (elem16.cuh). They are typed as
// FP16 rather than void: with void pointers the stores through out lose
// their type for alias analysis, and the FP16 instances compile to other
// SASS.
struct DecodeParams {
  const __half* q = nullptr;  // [batch][num_q_heads][head_dim]
  __half* out = nullptr;      // [batch][num_q_heads][head_dim]
  float* lse = nullptr;       // [batch][num_q_heads] or null

  // This layer's device page tables (DeviceTablesView offset to the layer);
  // list lengths come with the work items.
  const std::int32_t* blocks = nullptr;  // [pool][slot][max_blocks]
  std::int32_t max_sequences = 0;
  std::int32_t max_blocks = 0;

  // The plan: this layer's items are items[range.x .. range.x + range.y).
  // A graph-capturable launch reads the range on the device (item_range),
  // so a replay sees the latest plan; a direct launch passes it by value
  // (item_range null), which takes one dependent global load off the
  // front of every CTA.
  const DecodeWorkItem* items = nullptr;
  const int2* item_range = nullptr;
  int2 launch_range{0, 0};
  float* partial_out = nullptr;  // [partials][group][head_dim]
  float* partial_lse = nullptr;  // [partials][group]
  // Arrival counters, zero between runs (each is reset by its last
  // arrival, so runs need no memset and stay graph-capturable):
  std::int32_t* group_counters = nullptr;  // [partials], at a group's first row
  std::int32_t* pair_counters = nullptr;   // [partials], at a pair's first row

  DevicePool pools[kNumPrecisions];
  std::int32_t num_q_heads = 0;
  std::int32_t num_kv_heads = 0;
  std::int32_t group = 0;  // query heads an item computes (all or a tile of its KV head's; <= 8 NT)
  // CTAs the GPU holds at once: a launch of at least as many items keeps
  // every slot busy (DecodeTile::stages' kBusyGpu).
  std::int32_t resident_ctas = 0;
  float scale_log2 = 0.0f;  // sm_scale * log2(e): scores are kept in base 2
  // scale_log2 * 2^(24 - k): the score factor of a quantized K code that
  // the tensor cores took as the FP16 subnormal 2^(k-24) x (k <= 8); in a
  // BF16 instance scale_log2 * 2^-k, the code taken as the exact 2^k x
  // (CodeField in decode_quant.cuh).
  float code_score_scale[9] = {};
};

}  // namespace mixkv::gpu::detail
