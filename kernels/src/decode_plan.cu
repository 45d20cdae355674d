#include "mixkv/kernels/decode_plan.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <iterator>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "decode_dispatch.h"
#include "decode_heuristics.h"
#include "decode_params.cuh"
#include "dtype_guard.h"
#include "mixkv/core/block_format.h"
#include "mixkv/kernels/detail/cuda_check.h"
#include "mixkv/kernels/detail/device_buffer.h"

namespace mixkv::gpu {
namespace {

using detail::DecodeWorkItem;
using detail::require;

std::string field(const char* name, std::int64_t value, const char* expected) {
  return std::string("DecodePlan: config.") + name + " = " + std::to_string(value) + ": expected " + expected;
}

}  // namespace

struct DecodePlan::Impl {
  DecodePlanConfig config;
  const DevicePageTables* tables = nullptr;
  // Query heads an item computes, and items per (sequence, KV head, piece):
  // a group over the instance's 8 or 16 heads runs as head_tiles equal tiles.
  std::int32_t group = 0;
  std::int32_t head_tiles = 1;
  // The kernel's n-tiles of 8 heads for `group`.
  int n_tiles() const { return group > detail::kHeadsPerTileHost ? 2 : 1; }
  std::int32_t max_items = 0;     // per layer
  std::int32_t max_partials = 0;  // per layer (the workspace is shared by the layers run one after another)
  std::int32_t ctas_per_sm = 3;   // of the decode instance
  std::int64_t fp16_block_bytes = 0, int4_block_bytes = 0, int2_block_bytes = 0;  // per head

  struct LayerPlan {
    std::vector<DecodeWorkItem> items;  // in launch order
    std::int32_t partials = 0;          // rows of the partial-state workspace
    std::int64_t bytes = 0;             // the kernel reads
  };
  // Host state of the current plan (slots[i]: batch entry i's page-table
  // slot), and the one plan() builds: swapped in only when every layer is
  // planned (a failed call changes nothing); both keep their capacity from
  // call to call.
  std::vector<std::int32_t> slots, next_slots;
  std::vector<LayerPlan> layers, next_layers;

  // plan_layer's scratch, kept for its capacity.
  std::vector<std::int64_t> cost;                                  // [sequence]
  std::vector<std::array<std::int32_t, 3>> counts;                 // [sequence]
  std::vector<std::int32_t> fills;                                 // [sequence]
  std::vector<DecodeWorkItem> emitted;                             // pair by pair
  std::vector<std::pair<std::int64_t, std::int32_t>> launch_keys;  // (start in share, emitted index)
  std::vector<std::int32_t> cuts;                                  // of the current pair
  std::vector<std::int64_t> starts;                                // of its pieces

  // The plan on the device, one blob uploaded by one copy: each layer's
  // item range {offset, count} (an int2 the kernel reads in one load), then
  // from items_offset (16-byte aligned) the layers' items back to back.
  std::size_t items_offset = 0;
  detail::DeviceBuffer<std::byte> d_plan;
  detail::DeviceBuffer<float> d_partial_out;
  detail::DeviceBuffer<float> d_partial_lse;
  detail::DeviceBuffer<std::int32_t> d_counters;  // group then pair arrival counters, zeroed once
  detail::PinnedBuffer<std::byte> h_plan;         // its staging copy
  detail::Event staging_free;
  std::vector<int2> ranges;  // [layer], for launches that pass the range by value

  // Plans `layer` of the batch in next_slots into next_layers[layer]:
  // `shares` > 0 cuts the layer into that many shares (else chunks,
  // about chunks_auto_target items); whole_pairs: the pairs fill at least
  // 2 CTAs on every SM evenly (plan()), so a layer of equal pairs whose
  // work waits on memory takes one item per pair instead of the shares.
  void plan_layer(int layer, int chunks_auto_target, std::int32_t shares, bool whole_pairs);
};

DecodePlan::DecodePlan(const DecodePlanConfig& config, const DevicePageTables& tables)
    : impl_(std::make_unique<Impl>()) {
  require(config.num_layers >= 1, [&] { return field("num_layers", config.num_layers, ">= 1"); });
  require(config.num_kv_heads >= 1, [&] { return field("num_kv_heads", config.num_kv_heads, ">= 1"); });
  require(config.num_q_heads >= 1 && config.num_q_heads % config.num_kv_heads == 0,
          [&] { return field("num_q_heads", config.num_q_heads, "a positive multiple of num_kv_heads"); });
  detail::check_decode_supported(DType::F16, config.head_dim, config.block_size);
  require(config.max_batch >= 1, [&] { return field("max_batch", config.max_batch, ">= 1"); });
  require(config.max_batch <= tables.config().max_sequences,
          [&] { return field("max_batch", config.max_batch, "<= the page tables' max_sequences"); });
  require(config.num_layers == tables.config().num_layers,
          [&] { return field("num_layers", config.num_layers, "the page tables' num_layers"); });
  require(config.max_items_per_layer >= 0,
          [&] { return field("max_items_per_layer", config.max_items_per_layer, ">= 0"); });
  require(config.num_sms >= 0, [&] { return field("num_sms", config.num_sms, ">= 0"); });
  require(config.chunks_per_sequence >= 0,
          [&] { return field("chunks_per_sequence", config.chunks_per_sequence, ">= 0"); });
  require(config.batch_invariant_blocks >= 0,
          [&] { return field("batch_invariant_blocks", config.batch_invariant_blocks, ">= 0"); });
  require(config.batch_invariant_blocks == 0 || config.chunks_per_sequence == 0, [&] {
    return field("batch_invariant_blocks", config.batch_invariant_blocks, "0 when chunks_per_sequence is set");
  });

  Impl& s = *impl_;
  s.config = config;
  s.tables = &tables;
  if (s.config.num_sms == 0) {
    int device = 0;
    MIXKV_CUDA_CHECK(cudaGetDevice(&device));
    MIXKV_CUDA_CHECK(cudaDeviceGetAttribute(&s.config.num_sms, cudaDevAttrMultiProcessorCount, device));
  }
  require(config.max_heads_per_item == 0 || config.max_heads_per_item == detail::kHeadsPerTileHost ||
              config.max_heads_per_item == 2 * detail::kHeadsPerTileHost,
          [&] { return field("max_heads_per_item", config.max_heads_per_item, "0, 8 or 16"); });
  const bool two_tiles_built = detail::decode_built(DType::F16, config.head_dim, config.block_size, 2);
  require(config.max_heads_per_item != 2 * detail::kHeadsPerTileHost || two_tiles_built, [&] {
    return field("max_heads_per_item", config.max_heads_per_item, "8: no two-tile instance is built for head_dim ") +
           std::to_string(config.head_dim) + ", block_size " + std::to_string(config.block_size);
  });
  const std::int32_t full_group = config.num_q_heads / config.num_kv_heads;
  const int max_heads = detail::decode_max_heads(config.max_heads_per_item, two_tiles_built,
                                                 static_cast<std::int64_t>(config.max_batch) * config.num_kv_heads);
  s.head_tiles = detail::decode_head_tiles(full_group, max_heads);
  s.group = full_group / s.head_tiles;
  const std::int32_t pairs = config.max_batch * config.num_kv_heads * s.head_tiles;
  // With batch_invariant_blocks a pair takes one chunk a that many blocks
  // of its three page lists, at most kMaxMergePieces.
  const std::int64_t invariant_chunks =
      config.batch_invariant_blocks > 0
          ? std::min<std::int64_t>(detail::kMaxMergePieces,
                                   (3LL * tables.config().max_blocks_per_sequence + config.batch_invariant_blocks - 1) /
                                       config.batch_invariant_blocks)
          : 0;
  s.max_items = config.max_items_per_layer > 0
                    ? config.max_items_per_layer
                    : pairs + 3 * detail::kMaxCtasPerSm * s.config.num_sms +
                          (config.chunks_per_sequence > 0 ? pairs * config.chunks_per_sequence : 0) +
                          static_cast<std::int32_t>(pairs * invariant_chunks);
  s.max_partials = s.max_items;
  s.fp16_block_bytes =
      static_cast<std::int64_t>(BlockFormat{Precision::FP16, 1, config.head_dim, config.block_size}.head_bytes());
  s.int4_block_bytes =
      static_cast<std::int64_t>(BlockFormat{Precision::INT4, 1, config.head_dim, config.block_size}.head_bytes());
  s.int2_block_bytes =
      static_cast<std::int64_t>(BlockFormat{Precision::INT2, 1, config.head_dim, config.block_size}.head_bytes());

  s.items_offset = (sizeof(int2) * config.num_layers + 15) / 16 * 16;
  const std::size_t plan_bytes =
      s.items_offset + sizeof(DecodeWorkItem) * static_cast<std::size_t>(s.max_items) * config.num_layers;
  s.d_plan.allocate(plan_bytes);
  MIXKV_CUDA_CHECK(cudaMemset(s.d_plan.get(), 0, s.items_offset));
  s.h_plan.reserve(plan_bytes);
  s.ranges.assign(config.num_layers, make_int2(0, 0));
  s.d_partial_out.allocate(static_cast<std::size_t>(s.max_partials) * s.group * config.head_dim);
  s.d_partial_lse.allocate(static_cast<std::size_t>(s.max_partials) * s.group);
  s.d_counters.allocate(2 * static_cast<std::size_t>(s.max_partials));
  MIXKV_CUDA_CHECK(
      cudaMemset(s.d_counters.get(), 0, 2 * static_cast<std::size_t>(s.max_partials) * sizeof(std::int32_t)));
  // Set the kernels' shared-memory limit now (run() may be under graph
  // capture), for the BF16 instance too where one is built (the plan does
  // not know the cache's type before run()), and learn how many CTAs share
  // an SM: the FP16 instance's count plans both (the same shared memory and
  // __launch_bounds__).
  s.ctas_per_sm = std::max(1, detail::launch_decode(detail::DecodeParams{}, DType::F16, config.head_dim,
                                                    config.block_size, s.n_tiles(), 0, nullptr));
  if (detail::decode_built(DType::BF16, config.head_dim, config.block_size, s.n_tiles())) {
    detail::launch_decode(detail::DecodeParams{}, DType::BF16, config.head_dim, config.block_size, s.n_tiles(), 0,
                          nullptr);
  }
  s.layers.resize(config.num_layers);
  s.next_layers.resize(config.num_layers);
}

DecodePlan::~DecodePlan() = default;

void DecodePlan::Impl::plan_layer(int layer, int target_items, std::int32_t shares, bool whole_pairs) {
  const DecodePlanConfig& c = config;
  const int kvh = c.num_kv_heads;
  const int S = c.block_size;
  LayerPlan& out = next_layers[layer];
  const auto batch = static_cast<std::int32_t>(next_slots.size());
  std::int64_t total_bytes = static_cast<std::int64_t>(batch) * c.num_q_heads * c.head_dim * 2;  // q

  // Work per KV head of each sequence (decode_heuristics.h).
  const std::array<std::int64_t, 3> work =
      detail::decode_block_work(c.head_dim, S, fp16_block_bytes, int4_block_bytes, int2_block_bytes);
  cost.resize(batch);
  counts.resize(batch);
  fills.resize(batch);
  std::int64_t total_cost = 0, int2_cost = 0, max_cost = 0;
  for (int b = 0; b < batch; ++b) {
    for (int p = 0; p < kNumPrecisions; ++p) counts[b][p] = tables->num_blocks(next_slots[b], layer, kAllPrecisions[p]);
    fills[b] = tables->fp16_fill(next_slots[b], layer);
    const std::int64_t fp16_rows =
        counts[b][0] == 0 ? 0 : static_cast<std::int64_t>(counts[b][0] - 1) * S + (fills[b] + 15) / 16 * 16;
    const std::int64_t data =
        fp16_rows * c.head_dim * 4 + counts[b][1] * int4_block_bytes + counts[b][2] * int2_block_bytes;
    cost[b] = counts[b][0] * work[0] + counts[b][1] * work[1] + counts[b][2] * work[2];
    total_cost += cost[b] * kvh;
    int2_cost += counts[b][2] * work[2] * kvh;
    max_cost = std::max(max_cost, cost[b]);
    const std::int64_t blocks = counts[b][0] + counts[b][1] + counts[b][2];
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

  // Work of a sequence's blocks [0, block) and the first block whose
  // cumulative work reaches `target` (blocks in FP16 | INT4 | INT2 order).
  auto work_before = [&](int b, std::int32_t block) {
    std::int64_t w = 0;
    for (int p = 0, first = 0; p < kNumPrecisions; first += counts[b][p], ++p) {
      w += std::clamp(block - first, 0, counts[b][p]) * work[p];
    }
    return w;
  };
  auto block_at = [&](int b, std::int64_t target) {
    std::int32_t first = 0;
    for (int p = 0; p < kNumPrecisions; ++p) {
      const std::int64_t pool_work = counts[b][p] * work[p];
      if (target < pool_work) return first + static_cast<std::int32_t>((target + work[p] - 1) / work[p]);
      target -= pool_work;
      first += counts[b][p];
    }
    return first;
  };
  // The items of one (sequence, KV head) cut at `cuts` (first 0, last its
  // block count); piece k starts after starts[k] of work in its share (0
  // for chunks), the key of the launch order below.
  emitted.clear();
  launch_keys.clear();
  std::int32_t next_partial = 0;
  // DecodeWorkItem::lead_ids: the page id of the block of warp w's first
  // unit (unit w) in the item's first segment, from the host mirror the
  // counts come from too.
  auto set_lead_ids = [&](DecodeWorkItem& item, int b) {
    for (int p = 0, first = 0; p < kNumPrecisions; first += counts[b][p], ++p) {
      const std::int32_t lo = std::max(item.begin - first, 0);
      const std::int32_t hi = std::min(item.end - first, counts[b][p]);
      if (lo >= hi) continue;
      const int units_per_block = p == 0 ? S / 16 : 1;
      const std::span<const std::int32_t> ids = tables->blocks(next_slots[b], layer, kAllPrecisions[p]);
      for (int w = 0; w < detail::kDecodeWarps; ++w) {
        const std::int32_t block = lo + w / units_per_block;
        item.lead_ids[w] = block < hi ? ids[block] : -1;
      }
      return;
    }
  };
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
    for (int p = 0; p < kNumPrecisions; ++p) item.counts[p] = counts[b][p];
    item.fill = fills[b];
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
      set_lead_ids(item, b);
      for (int t = 0; t < tiles; ++t) {
        item.q_head = (h * tiles + t) * group;
        if (pieces > 1) item.first = first + t * pieces;
        item.partial = pieces > 1 ? item.first + k : -1;
        launch_keys.emplace_back(starts[k], static_cast<std::int32_t>(emitted.size()));
        emitted.push_back(item);
      }
    }
  };
  if (shares > 0 && total_cost > 0) {
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
      const std::int32_t n_total = counts[b][0] + counts[b][1] + counts[b][2];
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
          share_work += hi - lo;
          lo = hi;
        }
        emit(b, h);
      }
    }
  } else {
    // Chunks: each (sequence, KV head) cut into chunks of equal work.
    for (int b = 0; b < batch; ++b) {
      const std::int32_t n_total = counts[b][0] + counts[b][1] + counts[b][2];
      const int most = std::min(detail::kMaxMergePieces, std::max(1, n_total));
      int chunks = 0;
      if (c.chunks_per_sequence > 0) {
        chunks = std::clamp(c.chunks_per_sequence, 1, most);
      } else if (c.batch_invariant_blocks > 0) {
        // By this sequence's blocks alone: nothing of the batch decides it.
        chunks = std::clamp((n_total + c.batch_invariant_blocks - 1) / c.batch_invariant_blocks, 1, most);
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
      starts.assign(cuts.size() - 1, 0);
      for (int h = 0; h < kvh; ++h) emit(b, h);
    }
  }

  if (static_cast<std::int32_t>(emitted.size()) > max_items || next_partial > max_partials) {
    throw OutOfMemory("DecodePlan::plan: layer " + std::to_string(layer) + " needs " + std::to_string(emitted.size()) +
                      " work items: expected <= max_items_per_layer = " + std::to_string(max_items));
  }
  // A CTA an item, launched in the order of the work before the item in its
  // share: the block scheduler starts the shares' first pieces as the first
  // wave and then hands each freed CTA slot the next item, so the slot freed
  // first (the shortest first piece) takes the longest second piece, the
  // one that completes that share, and every slot ends with its share.
  // Chunks, all starting at 0, keep their order: pair by pair. The keys are
  // unique by their index, so a plain sort keeps the emission order among
  // equal starts (and moves 16-byte keys, not 56-byte items).
  if (shares > 0) std::sort(launch_keys.begin(), launch_keys.end());
  out.items.resize(emitted.size());
  for (std::size_t i = 0; i < launch_keys.size(); ++i) out.items[i] = emitted[launch_keys[i].second];
  out.partials = next_partial;
}

void DecodePlan::plan(std::span<const std::int32_t> slots, cudaStream_t stream) {
  Impl& s = *impl_;
  const DecodePlanConfig& c = s.config;
  require(!slots.empty() && slots.size() <= static_cast<std::size_t>(c.max_batch), [&] {
    return "DecodePlan::plan: slots has " + std::to_string(slots.size()) + " entries: expected 1.." +
           std::to_string(c.max_batch) + " (max_batch)";
  });
  for (std::size_t i = 0; i < slots.size(); ++i) {
    require(slots[i] >= 0 && slots[i] < s.tables->config().max_sequences, [&] {
      return "DecodePlan::plan: slots[" + std::to_string(i) + "] = " + std::to_string(slots[i]) +
             ": expected a page-table slot in [0, " + std::to_string(s.tables->config().max_sequences) + ")";
    });
  }
  s.next_slots.assign(slots.begin(), slots.end());
  // Items of unsplit (sequence, KV head) pairs: one per head tile.
  const int pairs = static_cast<int>(slots.size()) * c.num_kv_heads * s.head_tiles;
  // The work model of decode_heuristics.h: chunks filling whole waves of
  // resident CTAs, or one equal share a CTA slot, or one item a pair.
  const int wave = detail::decode_wave(pairs, c.num_sms, s.ctas_per_sm);
  const int target = std::min(detail::decode_target_items(pairs, wave), s.max_items);
  const std::int32_t shares = detail::decode_shares(pairs, wave, c.num_sms, s.max_items, s.head_tiles,
                                                    c.chunks_per_sequence != 0 || c.batch_invariant_blocks != 0);
  const bool whole_pairs = detail::decode_whole_pairs(pairs, c.num_sms, s.ctas_per_sm, shares);
  for (int layer = 0; layer < c.num_layers; ++layer) s.plan_layer(layer, target, shares, whole_pairs);
  std::swap(s.slots, s.next_slots);
  std::swap(s.layers, s.next_layers);

  // Stage the ranges and the items, and upload them in one copy.
  s.staging_free.synchronize();
  std::byte* staged = s.h_plan.get();
  std::size_t item_total = 0;
  for (int layer = 0; layer < c.num_layers; ++layer) {
    const std::vector<DecodeWorkItem>& items = s.layers[layer].items;
    s.ranges[layer] = make_int2(static_cast<std::int32_t>(item_total), static_cast<std::int32_t>(items.size()));
    std::memcpy(staged + sizeof(int2) * layer, &s.ranges[layer], sizeof(int2));
    std::memcpy(staged + s.items_offset + sizeof(DecodeWorkItem) * item_total, items.data(),
                sizeof(DecodeWorkItem) * items.size());
    item_total += items.size();
  }
  MIXKV_CUDA_CHECK(cudaMemcpyAsync(s.d_plan.get(), staged, s.items_offset + sizeof(DecodeWorkItem) * item_total,
                                   cudaMemcpyHostToDevice, stream));
  s.staging_free.record(stream);
}

void DecodePlan::run(const DecodeRunArgs& args) const {
  const Impl& s = *impl_;
  const DecodePlanConfig& c = s.config;
  require(!s.slots.empty(), "DecodePlan::run: no plan: call plan() first");
  const DType dtype = detail::require_pool_dtypes("DecodePlan::run", args.pools);
  detail::require_input_dtype("DecodePlan::run", "dtype (of q, out)", args.dtype, dtype, "pools[FP16]");
  require(detail::decode_built(dtype, c.head_dim, c.block_size, s.n_tiles()), [&] {
    return "DecodePlan::run: pools[FP16].format.dtype = " + to_string(dtype) + ": no decode kernel of that type at " +
           "head_dim " + std::to_string(c.head_dim) + ", block_size " + std::to_string(c.block_size) + " with " +
           std::to_string(s.n_tiles()) + " head tiles (kernels/CMakeLists.txt lists the built instances)";
  });
  require(args.layer >= 0 && args.layer < c.num_layers, [&] {
    return "DecodePlan::run: layer = " + std::to_string(args.layer) + ": expected [0, " + std::to_string(c.num_layers) +
           ")";
  });
  require(args.q != nullptr,
          "DecodePlan::run: q is null: expected device [batch][num_q_heads][head_dim] values of dtype");
  require(args.out != nullptr,
          "DecodePlan::run: out is null: expected device [batch][num_q_heads][head_dim] values of dtype");
  require(std::isfinite(args.sm_scale) && args.sm_scale > 0.0f, [&] {
    return "DecodePlan::run: sm_scale = " + std::to_string(args.sm_scale) + ": expected a finite value > 0";
  });
  for (Precision p : kAllPrecisions) {
    const PoolView& pool = args.pools[pool_index(p)];
    auto name = [&] { return "DecodePlan::run: pools[" + std::string(to_string(p)) + "]"; };
    require(pool.base != nullptr, [&] { return name() + ".base is null: expected the device arena"; });
    require(pool.format.precision == p,
            [&] { return name() + ".format.precision: expected " + std::string(to_string(p)); });
    require(pool.format.head_dim == c.head_dim && pool.format.block_size == c.block_size &&
                pool.format.num_kv_heads == c.num_kv_heads,
            [&] {
              return name() + ".format: expected num_kv_heads " + std::to_string(c.num_kv_heads) + ", head_dim " +
                     std::to_string(c.head_dim) + ", block_size " + std::to_string(c.block_size);
            });
    require(pool.blocks_per_slab >= 1, [&] { return name() + ".blocks_per_slab: expected >= 1"; });
    // The tables accept ids below their bound only, so a bound within the
    // pool keeps every block the kernel reads inside the arena.
    const std::int32_t bound = s.tables->config().pool_blocks[pool_index(p)];
    require(bound <= pool.num_blocks, [&] {
      if (bound == PageTableConfig::kNoBound) {
        return name() +
               ": the page tables have no block-id bound: expected DevicePageTables built with the "
               "arena's PoolLayout (or set_pool_blocks) so that decode never reads outside the arena";
      }
      return name() + ".num_blocks = " + std::to_string(pool.num_blocks) + ": expected >= the page tables' bound " +
             std::to_string(bound) + " (pool_blocks)";
    });
  }

  const DeviceTablesView view = s.tables->device_view();
  detail::DecodeParams p;
  p.q = static_cast<const __half*>(args.q);  // the cache's type, read as it by the instance (DecodeParams)
  p.out = static_cast<__half*>(args.out);
  p.lse = args.lse;
  const std::size_t layer_pools = static_cast<std::size_t>(args.layer) * kNumPrecisions;
  p.blocks = view.blocks + layer_pools * view.max_sequences * view.max_blocks;
  p.max_sequences = view.max_sequences;
  p.max_blocks = view.max_blocks;
  p.items = reinterpret_cast<const DecodeWorkItem*>(s.d_plan.get() + s.items_offset);
  if (args.fixed_grid) {
    p.item_range = reinterpret_cast<const int2*>(s.d_plan.get()) + args.layer;
  } else {
    p.launch_range = s.ranges[args.layer];
  }
  p.partial_out = s.d_partial_out.get();
  p.partial_lse = s.d_partial_lse.get();
  p.group_counters = s.d_counters.get();
  p.pair_counters = s.d_counters.get() + s.max_partials;
  for (int i = 0; i < kNumPrecisions; ++i) p.pools[i] = detail::DevicePool(args.pools[i]);
  p.num_q_heads = c.num_q_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.group = s.group;
  p.resident_ctas = s.ctas_per_sm * c.num_sms;
  p.scale_log2 = args.sm_scale * 1.4426950408889634f;
  // The code of bit k is 2^(k-24) x as an FP16 subnormal, 2^k x as a
  // bfloat16 integer (decode_quant.cuh, CodeField).
  const int code_exponent = dtype == DType::BF16 ? 0 : -24;
  for (std::size_t k = 0; k < std::size(p.code_score_scale); ++k) {
    p.code_score_scale[k] = std::ldexp(p.scale_log2, -code_exponent - static_cast<int>(k));
  }

  const int grid = args.fixed_grid ? s.max_items : static_cast<int>(s.layers[args.layer].items.size());
  if (grid > 0) detail::launch_decode(p, dtype, c.head_dim, c.block_size, s.n_tiles(), grid, args.stream);
}

const DecodePlanConfig& DecodePlan::config() const { return impl_->config; }
std::int32_t DecodePlan::batch_size() const { return static_cast<std::int32_t>(impl_->slots.size()); }
std::int32_t DecodePlan::num_items(std::int32_t layer) const {
  return static_cast<std::int32_t>(impl_->layers.at(layer).items.size());
}
std::int32_t DecodePlan::num_split_items(std::int32_t layer) const { return impl_->layers.at(layer).partials; }
std::int64_t DecodePlan::bytes_read(std::int32_t layer) const { return impl_->layers.at(layer).bytes; }

}  // namespace mixkv::gpu
