#pragma once
// The decode work model: how DecodePlan (decode_plan.cu) cuts each layer's
// (sequence, KV head) pairs into work items, one CTA an item. A pair's work
// is its blocks over FP16 | INT4 | INT2, weighted by decode_block_work.
//
// Worked example: 28 query / 4 KV heads, head_dim 128, block 32, batch 64 x
// 19,600 tokens on 132 SMs, 3 CTAs an SM:
// - 64 x 4 = 256 pairs >= 16: items of up to 16 heads; the group of 7 is one
//   tile, so 256 unsplit items. Wave 3 x 132 = 396; 256 pairs >= 132 SMs:
//   396 equal shares, and whole pairs (2 an SM, 256 >= 0.95 x 264).
// - All INT4 (612 blocks and an FP16 tail a pair): no INT2 work, so one
//   item a pair, 256 items. A mixed plan (10/30/60% FP16/INT4/INT2 windows)
//   is 46% INT2 work: 396 shares of 0.65 pair each, 640 pieces.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include "decode_dispatch.h"

namespace mixkv::gpu::detail {

// Fewest blocks of a split piece: two per warp of the CTA.
inline constexpr std::int32_t kMinBlocksPerChunk = 8;

// Query heads an item computes at most. 16 (two n-tiles sharing each code
// extraction) from 16 (sequence, KV head) pairs of max_batch: with fewer,
// short split chunks set the time and 8 heads an item doubles their CTAs.
inline constexpr int kWideItemMinPairs = 16;
inline int decode_max_heads(int requested, bool two_tiles_built, std::int64_t max_pairs) {
  if (requested != 0) return requested;
  return kHeadsPerTileHost * (two_tiles_built && max_pairs >= kWideItemMinPairs ? 2 : 1);
}
// The fewest equal tiles of <= max_heads heads (16: 12 is one, 32 is 2 x 16;
// 8: 16 is 2 x 8, 12 is 2 x 6, a prime 11 is 11 x 1).
inline std::int32_t decode_head_tiles(std::int32_t group, int max_heads) {
  std::int32_t tiles = 1;
  while (group % tiles != 0 || group / tiles > max_heads) ++tiles;
  return tiles;
}

// Work of one block (per KV head) of each pool: its bytes plus 16 a SASS
// instruction (INT4 650, INT2 550 a block, FP16 550 a 16-token unit, at
// head_dim 128, block 32, scaled by shape): quantized blocks are bound by
// issue and latency, so equal bytes would give INT2 warps 3x the blocks.
inline std::array<std::int64_t, 3> decode_block_work(int head_dim, int block_size, std::int64_t fp16_bytes,
                                                     std::int64_t int4_bytes, std::int64_t int2_bytes) {
  constexpr std::int64_t kBytesPerInstruction = 16;
  return {fp16_bytes + kBytesPerInstruction * (550LL * head_dim / 128 * block_size / 16),
          int4_bytes + kBytesPerInstruction * (650LL * head_dim / 128 * block_size / 32),
          int2_bytes + kBytesPerInstruction * (550LL * head_dim / 128 * block_size / 32)};
}

// CTAs that run at once. Fewer pairs than SMs count 2 an SM: every extra
// split piece adds a start and a merge to a latency-bound step.
inline constexpr int kSmallBatchCtasPerSm = 2;
inline int decode_wave(int pairs, int num_sms, int ctas_per_sm) {
  return (pairs < num_sms ? std::min(ctas_per_sm, kSmallBatchCtasPerSm) : ctas_per_sm) * num_sms;
}
// Chunk items to aim for: pairs x the fewest chunks a pair that fill their
// waves to >= 93% (else the best fill), so equal pairs end together.
inline int decode_target_items(int pairs, int wave) {
  if (pairs >= 4 * wave) return pairs;
  int target = pairs;
  double best = 0.0;
  const int c_max = std::max(1, 3 * ((wave + pairs - 1) / pairs));
  for (int chunks = 1; chunks <= c_max; ++chunks) {
    const int items = pairs * chunks;
    const double efficiency = static_cast<double>(items) / (((items + wave - 1) / wave) * wave);
    if (efficiency > best + 1e-9) {
      best = efficiency;
      target = items;
    }
    if (efficiency >= 0.93) break;
  }
  return target;
}
// Chunks of a pair (no shares): its part of target_items by work, but no
// piece under kMinBlocksPerChunk blocks (a piece's start and merge cost a
// fixed latency that a warp with one block cannot hide).
inline int decode_pair_chunks(std::int64_t pair_work, std::int64_t total_work, int kv_heads, int target_items,
                              std::int32_t head_tiles, std::int32_t blocks) {
  int chunks = 1;
  if (total_work > 0) {
    chunks = static_cast<int>(
        std::llround(static_cast<double>(pair_work) * kv_heads / total_work * target_items / (kv_heads * head_tiles)));
  }
  chunks = std::min(chunks, std::max(1, blocks / kMinBlocksPerChunk));
  return std::clamp(chunks, 1, std::min(kMaxMergePieces, std::max(1, blocks)));
}
// Chunks of a (sequence, KV head) of `blocks` blocks in a batch-invariant
// plan of `chunk_blocks` a chunk: from its own lists alone, so nothing of
// the batch decides them.
inline int decode_invariant_chunks(std::int32_t blocks, std::int32_t chunk_blocks) {
  return std::clamp((blocks + chunk_blocks - 1) / chunk_blocks, 1, std::min(kMaxMergePieces, std::max(1, blocks)));
}
// With a pair for every SM, the layer is cut into one equal share a CTA
// slot instead (chunks of unequal pairs leave the last wave ragged), a pair
// cut where a share ends; 0: chunks. A share's head tiles run side by side.
inline std::int32_t decode_shares(int pairs, int wave, int num_sms, std::int32_t max_items, std::int32_t head_tiles,
                                  bool chunks_forced) {
  const bool fits = pairs + wave <= max_items && wave < kMaxMergePieces;
  return !chunks_forced && pairs >= num_sms && fits ? wave / head_tiles : 0;
}
// One item a pair instead of the shares when the pairs fill >= 2 CTAs on
// every SM, all resident and within 5% of equal counts (whole_pairs), their
// work is equal within 5%, and either waits on memory (INT2, bound by its
// instructions, <= 1/4 of it) or is short (<= kShortPairBlocks INT4 blocks):
// such pairs end together without the split pieces' starts and merges.
inline constexpr std::int64_t kShortPairBlocks = 128;  // 4,096 tokens at block 32
inline bool decode_whole_pairs(int pairs, int num_sms, int ctas_per_sm, std::int32_t shares) {
  const int per_sm = (pairs + num_sms - 1) / num_sms;
  return shares > 0 && per_sm >= 2 && per_sm <= ctas_per_sm && pairs >= 0.95 * per_sm * num_sms;
}
inline bool decode_one_item_per_pair(bool whole_pairs, std::int64_t total_work, std::int64_t int2_work,
                                     std::int64_t max_pair_work, int kv_heads, int batch,
                                     std::int64_t int4_block_work) {
  const bool memory_bound = int2_work * 4 <= total_work;
  const bool short_pairs = max_pair_work <= kShortPairBlocks * int4_block_work;
  return whole_pairs && (memory_bound || short_pairs) &&
         static_cast<double>(max_pair_work) * kv_heads * batch <= 1.05 * static_cast<double>(total_work);
}

// Layers share work items (DecodePlanConfig::layer_sharing, kAuto) from
// as many pairs as SMs, where the plan leaves the latency-bound regime
// (decode_wave): one layer's launch then streams for long enough that the
// lead page ids sharing drops save a small part of it (one page-table load
// a CTA start), while planning and uploading every layer's items costs
// host time in proportion to batch x layers. Below it each layer is a few
// waves of short CTAs whose starts the lead ids shorten, and few items.
inline bool decode_share_layers(int pairs, int num_sms) { return pairs >= num_sms; }

}  // namespace mixkv::gpu::detail
