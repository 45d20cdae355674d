#pragma once
// The state of a DecodePlan, shared by decode_plan.cu (construction,
// plan(), run()) and decode_plan_layer.cu (one layer's work items).
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "decode_dispatch.h"
#include "decode_params.cuh"
#include "mixkv/kernels/decode_plan.h"
#include "mixkv/kernels/detail/device_buffer.h"

namespace mixkv::gpu {

struct DecodePlan::Impl {
  using DecodeWorkItem = detail::DecodeWorkItem;

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

  // One layer's page-list lengths a sequence: its FP16, INT4 and INT2
  // block counts and FP16 fill. With the batch's slots they decide the
  // layer's work items, all but their lead page ids.
  using Lengths = std::array<std::int32_t, 4>;
  // Work items planned once and run by every layer of the same lengths as
  // `layer`, the first of them.
  struct ItemSet {
    std::int32_t layer = 0;
    std::int32_t layers = 0;    // that run it
    std::int32_t offset = 0;    // of its first item among the uploaded items
    std::int32_t count = 0;     // items, in launch order
    std::int32_t partials = 0;  // rows of the partial-state workspace
    std::int64_t bytes = 0;     // one run reads
    std::uint64_t hash = 0;     // of its lengths: a filter before comparing them
  };
  // Host state of the current plan (slots[i]: batch entry i's page-table
  // slot; layer_set[layer]: the set that layer runs), and the one plan()
  // builds: swapped in only when every layer is planned (a failed call
  // changes nothing); all keep their capacity from call to call.
  std::vector<std::int32_t> slots, next_slots;
  std::vector<ItemSet> sets, next_sets;
  std::vector<std::int32_t> layer_set, next_layer_set;

  // plan()'s scratch, kept for its capacity.
  std::vector<Lengths> lengths;                                    // [set][sequence] when layers share, else [sequence]
  std::vector<std::int64_t> cost;                                  // [sequence]
  std::vector<DecodeWorkItem> emitted;                             // pair by pair
  std::vector<std::pair<std::int64_t, std::int32_t>> launch_keys;  // (start in share, emitted index)
  std::vector<std::uint64_t> packed_keys;                          // the same, packed for sorting
  std::vector<std::int32_t> cuts;                                  // of the current pair
  std::vector<std::int64_t> starts;                                // of its pieces

  // The plan on the device, one blob uploaded by one copy: each layer's
  // item range {offset, count} (an int2 the kernel reads in one load), then
  // from items_offset (16-byte aligned) the item sets back to back, a set
  // once however many layers run it. plan() writes the items straight into
  // the staging copy, so the blob is sized for every layer unshared.
  std::size_t items_offset = 0;
  detail::DeviceBuffer<std::byte> d_plan;
  detail::DeviceBuffer<float> d_partial_out;
  detail::DeviceBuffer<float> d_partial_lse;
  detail::DeviceBuffer<std::int32_t> d_counters;  // group then pair arrival counters, zeroed once
  detail::PinnedBuffer<std::byte> h_plan;         // its staging copy
  detail::Event staging_free;
  std::vector<int2> ranges;  // [layer] of the current plan, for launches that pass the range by value

  // Reads `layer`'s lengths of the batch in next_slots into `out`; returns
  // their hash.
  std::uint64_t gather(int layer, std::span<Lengths> out) const;
  // Plans the batch in next_slots at `lengths` into `out` (count, partials,
  // bytes), its items into `items` (room for max_items), without lead ids:
  // `shares` > 0 cuts the layer into that many shares (else chunks, about
  // target_items items); whole_pairs: the pairs fill at least 2 CTAs on
  // every SM evenly (plan()), so a layer of equal pairs whose work waits on
  // memory takes one item per pair instead of the shares. Throws
  // OutOfMemory naming out.layer over max_items.
  void plan_items(ItemSet& out, std::span<const Lengths> lengths, DecodeWorkItem* items, int target_items,
                  std::int32_t shares, bool whole_pairs);
  // Sets the lead page ids of `items`, planned for `layer`.
  void set_lead_ids(std::span<DecodeWorkItem> items, int layer) const;
  // Throws IndexOutOfRange naming `layer` outside the plan's layers.
  void check_layer(const char* fn, std::int32_t layer) const;
};

}  // namespace mixkv::gpu
