#include "mixkv/kernels/decode_plan.h"

#include <algorithm>
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
#include "decode_plan_impl.h"
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

  require(config.layer_sharing == LayerSharing::kAuto || config.layer_sharing == LayerSharing::kNever ||
              config.layer_sharing == LayerSharing::kAlways,
          [&] {
            return field("layer_sharing", static_cast<std::int32_t>(config.layer_sharing),
                         "kAuto (0), kNever (1) or kAlways (2)");
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
  s.layer_set.assign(config.num_layers, -1);
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
}

DecodePlan::~DecodePlan() = default;

void DecodePlan::Impl::check_layer(const char* fn, std::int32_t layer) const {
  if (layer < 0 || layer >= config.num_layers) {
    throw IndexOutOfRange(std::string("DecodePlan::") + fn + ": layer = " + std::to_string(layer) + ": expected [0, " +
                          std::to_string(config.num_layers) + ")");
  }
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
  const auto batch = slots.size();
  // Items of unsplit (sequence, KV head) pairs: one per head tile.
  const int pairs = static_cast<int>(batch) * c.num_kv_heads * s.head_tiles;
  // The work model of decode_heuristics.h: chunks filling whole waves of
  // resident CTAs, or one equal share a CTA slot, or one item a pair.
  const int wave = detail::decode_wave(pairs, c.num_sms, s.ctas_per_sm);
  const int target = std::min(detail::decode_target_items(pairs, wave), s.max_items);
  const std::int32_t shares = detail::decode_shares(pairs, wave, c.num_sms, s.max_items, s.head_tiles,
                                                    c.chunks_per_sequence != 0 || c.batch_invariant_blocks != 0);
  const bool whole_pairs = detail::decode_whole_pairs(pairs, c.num_sms, s.ctas_per_sm, shares);
  const bool share = c.layer_sharing == LayerSharing::kAlways ||
                     (c.layer_sharing == LayerSharing::kAuto && detail::decode_share_layers(pairs, c.num_sms));

  // The items go straight into the staging copy once the previous upload
  // has read it: a layer of the same lengths as an earlier one (found by
  // hash, then compared) takes that layer's set, the others are planned.
  s.staging_free.synchronize();
  auto* const staged = reinterpret_cast<DecodeWorkItem*>(s.h_plan.get() + s.items_offset);
  s.next_sets.clear();
  s.next_layer_set.resize(c.num_layers);
  std::int32_t item_total = 0;
  for (int layer = 0; layer < c.num_layers; ++layer) {
    const std::size_t at = share ? s.next_sets.size() * batch : 0;
    if (s.lengths.size() < at + batch) s.lengths.resize(at + batch);
    const std::span<Impl::Lengths> lengths(s.lengths.data() + at, batch);
    const std::uint64_t hash = s.gather(layer, lengths);
    std::size_t found = s.next_sets.size();
    for (std::size_t g = 0; share && g < s.next_sets.size(); ++g) {
      if (s.next_sets[g].hash == hash && std::equal(lengths.begin(), lengths.end(), s.lengths.begin() + g * batch)) {
        found = g;
        break;
      }
    }
    if (found < s.next_sets.size()) {
      ++s.next_sets[found].layers;
    } else {
      Impl::ItemSet& set = s.next_sets.emplace_back();
      set.layer = layer;
      set.layers = 1;
      set.offset = item_total;
      set.hash = hash;
      s.plan_items(set, lengths, staged + item_total, target, shares, whole_pairs);
      item_total += set.count;
    }
    s.next_layer_set[layer] = static_cast<std::int32_t>(found);
  }
  // Lead page ids are one layer's: only a set that one layer runs has them.
  for (const Impl::ItemSet& set : s.next_sets) {
    if (set.layers == 1) s.set_lead_ids({staged + set.offset, static_cast<std::size_t>(set.count)}, set.layer);
  }
  std::swap(s.slots, s.next_slots);
  std::swap(s.sets, s.next_sets);
  std::swap(s.layer_set, s.next_layer_set);

  // The ranges go in front of the items; one copy uploads both.
  for (int layer = 0; layer < c.num_layers; ++layer) {
    const Impl::ItemSet& set = s.sets[s.layer_set[layer]];
    s.ranges[layer] = make_int2(set.offset, set.count);
  }
  std::memcpy(s.h_plan.get(), s.ranges.data(), sizeof(int2) * s.ranges.size());
  MIXKV_CUDA_CHECK(cudaMemcpyAsync(s.d_plan.get(), s.h_plan.get(),
                                   s.items_offset + sizeof(DecodeWorkItem) * static_cast<std::size_t>(item_total),
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

  const int grid = args.fixed_grid ? s.max_items : s.ranges[args.layer].y;
  if (grid > 0) detail::launch_decode(p, dtype, c.head_dim, c.block_size, s.n_tiles(), grid, args.stream);
}

const DecodePlanConfig& DecodePlan::config() const { return impl_->config; }
std::int32_t DecodePlan::batch_size() const { return static_cast<std::int32_t>(impl_->slots.size()); }
std::int32_t DecodePlan::num_items(std::int32_t layer) const {
  impl_->check_layer("num_items", layer);
  return impl_->ranges[layer].y;
}
std::int32_t DecodePlan::num_split_items(std::int32_t layer) const {
  impl_->check_layer("num_split_items", layer);
  const std::int32_t set = impl_->layer_set[layer];
  return set < 0 ? 0 : impl_->sets[set].partials;
}
std::int64_t DecodePlan::bytes_read(std::int32_t layer) const {
  impl_->check_layer("bytes_read", layer);
  const std::int32_t set = impl_->layer_set[layer];
  return set < 0 ? 0 : impl_->sets[set].bytes;
}
std::int32_t DecodePlan::planned_layer(std::int32_t layer) const {
  impl_->check_layer("planned_layer", layer);
  const std::int32_t set = impl_->layer_set[layer];
  return set < 0 ? -1 : impl_->sets[set].layer;
}
std::int32_t DecodePlan::num_planned_layers() const { return static_cast<std::int32_t>(impl_->sets.size()); }

std::int64_t DecodePlan::invariant_items_needed(std::span<const std::int32_t> slots) const {
  const Impl& s = *impl_;
  const DecodePlanConfig& c = s.config;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] < 0 || slots[i] >= s.tables->config().max_sequences) {
      throw IndexOutOfRange("DecodePlan::invariant_items_needed: slots[" + std::to_string(i) +
                            "] = " + std::to_string(slots[i]) + ": expected a page-table slot in [0, " +
                            std::to_string(s.tables->config().max_sequences) + ")");
    }
  }
  if (c.batch_invariant_blocks == 0) return 0;
  std::int64_t most = 0;
  for (std::int32_t layer = 0; layer < c.num_layers; ++layer) {
    std::int64_t chunks = 0;
    for (const std::int32_t slot : slots) {
      std::int32_t blocks = 0;
      for (const Precision p : kAllPrecisions) blocks += s.tables->num_blocks(slot, layer, p);
      chunks += detail::decode_invariant_chunks(blocks, c.batch_invariant_blocks);
    }
    most = std::max(most, chunks);
  }
  return most * c.num_kv_heads * s.head_tiles;
}

}  // namespace mixkv::gpu
