// One layer's work items (DecodePlan::Impl::plan_items) and what they are
// planned from: its page-list lengths, and its lead page ids.
#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <iterator>
#include <span>
#include <string>

#include "decode_heuristics.h"
#include "decode_plan_impl.h"
#include "mixkv/core/errors.h"

namespace mixkv::gpu {

std::uint64_t DecodePlan::Impl::gather(int layer, std::span<Lengths> out) const {
  // A sum of each sequence's lengths and position, multiplied: only a filter
  // (plan() compares every match), and with no chain from one sequence to
  // the next it costs next to nothing beside the table reads.
  auto word = [](std::int32_t lo, std::int32_t hi) {
    return std::uint64_t{static_cast<std::uint32_t>(hi)} << 32 | static_cast<std::uint32_t>(lo);
  };
  std::uint64_t hash = 0;
  for (std::size_t b = 0; b < out.size(); ++b) {
    const std::int32_t slot = next_slots[b];
    const std::int32_t fp16 = tables->num_blocks(slot, layer, Precision::FP16);
    const std::int32_t int4 = tables->num_blocks(slot, layer, Precision::INT4);
    const std::int32_t int2 = tables->num_blocks(slot, layer, Precision::INT2);
    const std::int32_t fill = tables->fp16_fill(slot, layer);
    out[b] = {fp16, int4, int2, fill};
    hash += ((word(fp16, int4) + b) * 0x9e3779b97f4a7c15ULL) ^ (word(int2, fill) * 0xc2b2ae3d27d4eb4fULL);
  }
  return hash;
}

void DecodePlan::Impl::plan_items(ItemSet& out, std::span<const Lengths> lengths, DecodeWorkItem* items,
                                  int target_items, std::int32_t shares, bool whole_pairs) {
  const DecodePlanConfig& c = config;
  const int kvh = c.num_kv_heads;
  const int S = c.block_size;
  const auto batch = static_cast<std::int32_t>(lengths.size());
  std::int64_t total_bytes = static_cast<std::int64_t>(batch) * c.num_q_heads * c.head_dim * 2;  // q

  // Work per KV head of each sequence (decode_heuristics.h).
  const std::array<std::int64_t, 3> work =
      detail::decode_block_work(c.head_dim, S, fp16_block_bytes, int4_block_bytes, int2_block_bytes);
  cost.resize(batch);
  std::int64_t total_cost = 0, int2_cost = 0, max_cost = 0;
  for (int b = 0; b < batch; ++b) {
    const Lengths& n = lengths[b];
    const std::int64_t fp16_rows = n[0] == 0 ? 0 : static_cast<std::int64_t>(n[0] - 1) * S + (n[3] + 15) / 16 * 16;
    const std::int64_t data = fp16_rows * c.head_dim * 4 + n[1] * int4_block_bytes + n[2] * int2_block_bytes;
    cost[b] = n[0] * work[0] + n[1] * work[1] + n[2] * work[2];
    total_cost += cost[b] * kvh;
    int2_cost += n[2] * work[2] * kvh;
    max_cost = std::max(max_cost, cost[b]);
    const std::int64_t blocks = n[0] + n[1] + n[2];
    total_bytes += (data + blocks * 4) * kvh + 4 * kNumPrecisions + 4;  // data + page-table entries + counts
  }
  out.bytes = total_bytes;

  const bool one_per_pair =
      detail::decode_one_item_per_pair(whole_pairs, total_cost, int2_cost, max_cost, kvh, batch, work[1]);
  const int tiles = head_tiles;
  // As chunks, every pair's count rounds to 1: its work is at most 1.05x
  // the mean.
  if (one_per_pair) {
    shares = 0;
    target_items = batch * kvh * tiles;
  }

  const bool in_shares = shares > 0 && total_cost > 0;

  // Work of a sequence's blocks [0, block) and the first block whose
  // cumulative work reaches `target` (blocks in FP16 | INT4 | INT2 order).
  auto work_before = [&](int b, std::int32_t block) {
    std::int64_t w = 0;
    for (int p = 0, first = 0; p < kNumPrecisions; first += lengths[b][p], ++p) {
      w += std::clamp(block - first, 0, lengths[b][p]) * work[p];
    }
    return w;
  };
  auto block_at = [&](int b, std::int64_t target) {
    std::int32_t first = 0;
    for (int p = 0; p < kNumPrecisions; ++p) {
      const std::int64_t pool_work = lengths[b][p] * work[p];
      if (target < pool_work) return first + static_cast<std::int32_t>((target + work[p] - 1) / work[p]);
      target -= pool_work;
      first += lengths[b][p];
    }
    return first;
  };
  // The items of one (sequence, KV head) cut at `cuts` (first 0, last its
  // block count); in shares piece k starts after starts[k] of work in its
  // share, the key of the launch order below.
  emitted.clear();
  launch_keys.clear();
  std::int64_t max_start = 0;  // of launch_keys
  std::int32_t next_partial = 0;
  // A piece's head tiles are emitted together, so they are launched
  // together and the tiles after the first find its blocks in L2.
  auto emit = [&](int b, int h) {
    const int pieces = static_cast<int>(cuts.size()) - 1;
    // The in-kernel merge: one level up to 16 pieces, else two levels of
    // ceil(sqrt(pieces)) rows (<= 32 each at kMaxMergePieces = 1024).
    int fan_in = pieces;
    if (pieces > 16) {
      fan_in = 1;
      while (fan_in * fan_in < pieces) ++fan_in;
    }
    DecodeWorkItem item;
    item.seq = b;
    item.slot = next_slots[b];
    for (int p = 0; p < kNumPrecisions; ++p) item.counts[p] = lengths[b][p];
    item.fill = lengths[b][3];
    item.kv_head = h;
    // Tile t's pieces take partial rows first + t * pieces ..: each tile
    // merges on its own.
    const std::int32_t first = next_partial;
    if (pieces > 1) {
      item.pieces = pieces;
      item.fan_in = fan_in;
      next_partial += pieces * tiles;
    }
    for (int k = 0; k < pieces; ++k) {
      item.begin = cuts[k];
      item.end = cuts[k + 1];
      for (int t = 0; t < tiles; ++t) {
        item.q_head = (h * tiles + t) * group;
        if (pieces > 1) item.first = first + t * pieces;
        item.partial = pieces > 1 ? item.first + k : -1;
        if (in_shares) launch_keys.emplace_back(starts[k], static_cast<std::int32_t>(emitted.size()));
        emitted.push_back(item);
      }
    }
  };
  if (in_shares) {
    // Shares: the layer's work laid end to end over the pairs (b, h) and
    // cut into `shares` equal shares, one per resident CTA: a pair may be
    // cut where a share ends. Pieces under kMinBlocksPerChunk are not cut
    // off (a share moves by less than that); a piece belongs to the share
    // holding its midpoint.
    const double share = static_cast<double>(total_cost) / shares;
    std::int64_t start = 0;  // work before the pair
    std::int32_t current_share = -1;
    std::int64_t share_work = 0;  // of the current share's pieces so far
    for (int b = 0; b < batch; ++b) {
      const std::int32_t n_total = lengths[b][0] + lengths[b][1] + lengths[b][2];
      for (int h = 0; h < kvh; ++h, start += cost[b]) {
        cuts.assign(1, 0);
        for (auto k = static_cast<std::int64_t>(start / share) + 1; k < shares && k * share < start + cost[b]; ++k) {
          const std::int32_t cut = block_at(b, std::llround(k * share) - start);
          if (cut - cuts.back() >= detail::kMinBlocksPerChunk && n_total - cut >= detail::kMinBlocksPerChunk) {
            cuts.push_back(cut);
          }
        }
        cuts.push_back(n_total);
        starts.clear();
        std::int64_t lo = 0;  // work before piece k (cuts[0] is 0)
        for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
          const std::int64_t hi = work_before(b, cuts[k + 1]);
          const auto in_share = std::min(shares - 1, static_cast<std::int32_t>((start + 0.5 * (lo + hi)) / share));
          if (in_share != current_share) {
            current_share = in_share;
            share_work = 0;
          }
          starts.push_back(share_work);
          max_start = std::max(max_start, share_work);
          share_work += hi - lo;
          lo = hi;
        }
        emit(b, h);
      }
    }
  } else {
    // Chunks: each (sequence, KV head) cut into chunks of equal work.
    for (int b = 0; b < batch; ++b) {
      const std::int32_t n_total = lengths[b][0] + lengths[b][1] + lengths[b][2];
      const int most = std::min(detail::kMaxMergePieces, std::max(1, n_total));
      int chunks = 0;
      if (c.chunks_per_sequence > 0) {
        chunks = std::clamp(c.chunks_per_sequence, 1, most);
      } else if (c.batch_invariant_blocks > 0) {
        chunks = detail::decode_invariant_chunks(n_total, c.batch_invariant_blocks);
      } else {
        chunks = detail::decode_pair_chunks(cost[b], total_cost, kvh, target_items, tiles, n_total);
      }
      // Chunk boundaries at equal work along FP16 | INT4 | INT2.
      cuts.assign(1, 0);
      for (int k = 1; k < chunks; ++k) {
        const std::int32_t cut = std::clamp(block_at(b, cost[b] * k / chunks), cuts.back(), n_total);
        if (cut > cuts.back() && cut < n_total) cuts.push_back(cut);
      }
      cuts.push_back(n_total);
      for (int h = 0; h < kvh; ++h) emit(b, h);
    }
  }

  if (static_cast<std::int32_t>(emitted.size()) > max_items || next_partial > max_partials) {
    throw OutOfMemory("DecodePlan::plan: layer " + std::to_string(out.layer) + " needs " +
                      std::to_string(emitted.size()) +
                      " work items: expected <= max_items_per_layer = " + std::to_string(max_items));
  }
  // A CTA an item, launched in the order of the work before the item in its
  // share: the block scheduler starts the shares' first pieces as the first
  // wave and then hands each freed CTA slot the next item, so the slot freed
  // first (the shortest first piece) takes the longest second piece, the
  // one that completes that share, and every slot ends with its share.
  // Chunks, all starting at 0, keep their order: pair by pair. The keys are
  // unique by their index, so a plain sort keeps the emission order among
  // equal starts (and moves 16-byte keys, not 72-byte items).
  const auto index_bits = static_cast<int>(std::bit_width(emitted.size()));
  if (in_shares && static_cast<int>(std::bit_width(static_cast<std::uint64_t>(max_start))) <= 64 - index_bits) {
    // The same order sorted as start << index_bits | index where every start
    // fits: one 64-bit compare a step sorts about twice as fast as pairs.
    packed_keys.clear();
    for (const auto& [start, index] : launch_keys) {
      packed_keys.push_back(static_cast<std::uint64_t>(start) << index_bits | static_cast<std::uint64_t>(index));
    }
    std::sort(packed_keys.begin(), packed_keys.end());
    const std::uint64_t index_mask = (std::uint64_t{1} << index_bits) - 1;
    for (std::size_t i = 0; i < packed_keys.size(); ++i) items[i] = emitted[packed_keys[i] & index_mask];
  } else if (in_shares) {
    std::sort(launch_keys.begin(), launch_keys.end());
    for (std::size_t i = 0; i < launch_keys.size(); ++i) items[i] = emitted[launch_keys[i].second];
  } else {
    std::copy(emitted.begin(), emitted.end(), items);
  }
  out.count = static_cast<std::int32_t>(emitted.size());
  out.partials = next_partial;
}

// DecodeWorkItem::lead_ids: the page id of the block of warp w's first unit
// (unit w) in the item's first segment, from the host mirror the lengths
// come from too.
void DecodePlan::Impl::set_lead_ids(std::span<DecodeWorkItem> items, int layer) const {
  const int units_per_fp16_block = config.block_size / 16;
  for (std::size_t i = 0; i < items.size(); ++i) {
    DecodeWorkItem& item = items[i];
    // The head tiles and KV heads of a piece, emitted side by side, start
    // at the same blocks.
    if (i > 0) {
      const DecodeWorkItem& prev = items[i - 1];
      if (prev.slot == item.slot && prev.begin == item.begin && prev.end == item.end) {
        std::copy(std::begin(prev.lead_ids), std::end(prev.lead_ids), std::begin(item.lead_ids));
        continue;
      }
    }
    for (int p = 0, first = 0; p < kNumPrecisions; first += item.counts[p], ++p) {
      const std::int32_t lo = std::max(item.begin - first, 0);
      const std::int32_t hi = std::min(item.end - first, item.counts[p]);
      if (lo >= hi) continue;
      const int units_per_block = p == 0 ? units_per_fp16_block : 1;
      const std::span<const std::int32_t> ids = tables->blocks(item.slot, layer, kAllPrecisions[p]);
      for (int w = 0; w < detail::kDecodeWarps; ++w) {
        const std::int32_t block = lo + w / units_per_block;
        item.lead_ids[w] = block < hi ? ids[block] : -1;
      }
      break;
    }
  }
}

}  // namespace mixkv::gpu
