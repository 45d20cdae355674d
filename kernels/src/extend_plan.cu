#include "mixkv/kernels/extend_plan.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "dtype_guard.h"
#include "extend_dispatch.cuh"
#include "extend_params.cuh"
#include "mixkv/core/block_format.h"
#include "mixkv/kernels/detail/cuda_check.h"
#include "mixkv/kernels/detail/device_buffer.h"

namespace mixkv::gpu {
namespace {

using detail::ExtendMergeTask;
using detail::ExtendWorkItem;
using detail::require;

constexpr std::int32_t kTileRows = detail::kExtendTileRows;
// Fewest units of a split piece: a piece's start (Q tile, first copies) and
// its merge cost about as much as a few units.
constexpr std::int32_t kMinUnitsPerPiece = 4;

std::string field(const char* name, std::int64_t value, const char* expected) {
  return std::string("ExtendPlan: config.") + name + " = " + std::to_string(value) + ": expected " + expected;
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

}  // namespace

struct ExtendPlan::Impl {
  ExtendPlanConfig config;
  const DevicePageTables* tables = nullptr;
  std::int32_t group = 0;
  std::int32_t ctas_per_sm = 1;  // of the instance
  std::int32_t max_items = 0;    // per layer
  std::int32_t max_partials =
      0;                       // split pieces per layer (the workspace is shared by the layers run one after another)
  std::int32_t max_tasks = 0;  // split tiles per layer: each has >= 2 pieces

  struct LayerPlan {
    std::vector<ExtendWorkItem> items;  // in launch order
    std::vector<ExtendMergeTask> tasks;
    std::int32_t partials = 0;
  };
  // Host state of the current plan, and the one plan() builds: swapped in
  // only when every layer is planned (a failed call changes nothing); both
  // keep their capacity from call to call.
  std::vector<std::int32_t> slots, next_slots;
  std::vector<std::int32_t> indptr, next_indptr;
  std::vector<std::int32_t> next_exclude;  // FP16 tokens left out at the end of each list (empty: none)
  std::vector<LayerPlan> layers, next_layers;

  // The plan on the device, one blob uploaded by one copy: each layer's
  // item range {offset, count}, then each layer's task range (int2s the
  // kernels read in one load), then from items_offset (16-byte aligned)
  // the layers' items back to back, then their merge tasks, addressed in
  // units of ExtendMergeTask from items_offset too. Pointers into it are
  // fixed for the plan's life, so a captured run() stays valid.
  std::size_t items_offset = 0;
  detail::DeviceBuffer<std::byte> d_plan;
  detail::PinnedBuffer<std::byte> h_plan;  // its staging copy
  detail::Event staging_free;
  detail::DeviceBuffer<float> d_partial_out;   // [max_partials][kTileRows][head_dim]
  detail::DeviceBuffer<float> d_partial_lse;   // [max_partials][kTileRows]
  std::vector<int2> item_ranges, task_ranges;  // [layer], for launches that pass the range by value

  void plan_layer(int layer);
  void fp16_list(int b, int layer, std::int32_t& blocks, std::int32_t& fill) const;
};

ExtendPlan::ExtendPlan(const ExtendPlanConfig& config, const DevicePageTables& tables)
    : impl_(std::make_unique<Impl>()) {
  require(config.num_layers >= 1, [&] { return field("num_layers", config.num_layers, ">= 1"); });
  require(config.num_kv_heads >= 1, [&] { return field("num_kv_heads", config.num_kv_heads, ">= 1"); });
  require(config.num_q_heads >= 1 && config.num_q_heads % config.num_kv_heads == 0,
          [&] { return field("num_q_heads", config.num_q_heads, "a positive multiple of num_kv_heads"); });
  detail::check_extend_supported(DType::F16, config.head_dim, config.block_size);
  require(config.max_batch >= 1, [&] { return field("max_batch", config.max_batch, ">= 1"); });
  require(config.max_batch <= tables.config().max_sequences,
          [&] { return field("max_batch", config.max_batch, "<= the page tables' max_sequences"); });
  require(config.max_rows >= 1, [&] { return field("max_rows", config.max_rows, ">= 1"); });
  require(config.num_layers == tables.config().num_layers,
          [&] { return field("num_layers", config.num_layers, "the page tables' num_layers"); });
  require(config.num_sms >= 0, [&] { return field("num_sms", config.num_sms, ">= 0"); });
  require(config.max_items_per_layer >= 0,
          [&] { return field("max_items_per_layer", config.max_items_per_layer, ">= 0"); });
  require(config.chunks_per_tile >= 0, [&] { return field("chunks_per_tile", config.chunks_per_tile, ">= 0"); });

  Impl& s = *impl_;
  s.config = config;
  s.tables = &tables;
  s.group = config.num_q_heads / config.num_kv_heads;
  if (s.config.num_sms == 0) {
    int device = 0;
    MIXKV_CUDA_CHECK(cudaGetDevice(&device));
    MIXKV_CUDA_CHECK(cudaDeviceGetAttribute(&s.config.num_sms, cudaDevAttrMultiProcessorCount, device));
  }
  // Set the kernels' shared-memory limit now (run() may be under graph
  // capture), for the BF16 instance too where one is built (the plan does
  // not know the cache's type before run()), and learn how many CTAs share
  // an SM: the same shared memory and register cap give both types the
  // same occupancy.
  s.ctas_per_sm = std::max(
      1, detail::launch_extend(detail::ExtendParams{}, DType::F16, config.head_dim, config.block_size, 0, nullptr));
  if (detail::extend_built(DType::BF16, config.head_dim, config.block_size)) {
    detail::launch_extend(detail::ExtendParams{}, DType::BF16, config.head_dim, config.block_size, 0, nullptr);
  }
  const std::int64_t wave = static_cast<std::int64_t>(s.ctas_per_sm) * s.config.num_sms;
  const std::int64_t tiles =
      config.num_kv_heads *
      (ceil_div(static_cast<std::int64_t>(config.max_rows) * s.group, kTileRows) + config.max_batch);
  const std::int64_t items = config.max_items_per_layer > 0 ? config.max_items_per_layer : tiles + 2 * wave;
  const std::int64_t partials = config.max_items_per_layer > 0 ? config.max_items_per_layer : 2 * wave;
  require(items <= (1 << 30), [&] { return field("max_items_per_layer", items, "<= 2^30 (max_rows too large)"); });
  s.max_items = static_cast<std::int32_t>(items);
  s.max_partials = static_cast<std::int32_t>(partials);
  s.max_tasks = s.max_partials / 2;

  const std::size_t layers = config.num_layers;
  s.items_offset = (2 * sizeof(int2) * layers + 15) / 16 * 16;
  const std::size_t plan_bytes = s.items_offset + sizeof(ExtendWorkItem) * s.max_items * layers +
                                 sizeof(ExtendMergeTask) * (static_cast<std::size_t>(s.max_tasks) * layers + 1);
  s.d_plan.allocate(plan_bytes);
  MIXKV_CUDA_CHECK(cudaMemset(s.d_plan.get(), 0, s.items_offset));
  s.h_plan.reserve(plan_bytes);
  s.item_ranges.assign(layers, make_int2(0, 0));
  s.task_ranges.assign(layers, make_int2(0, 0));
  s.d_partial_out.allocate(static_cast<std::size_t>(s.max_partials) * kTileRows * config.head_dim);
  s.d_partial_lse.allocate(static_cast<std::size_t>(s.max_partials) * kTileRows);
  s.layers.resize(layers);
  s.next_layers.resize(layers);
}

ExtendPlan::~ExtendPlan() = default;

// The FP16 list batch entry b reads in `layer`: the table's, less the last
// next_exclude[b] tokens. InvalidArgument when the list holds fewer.
void ExtendPlan::Impl::fp16_list(int b, int layer, std::int32_t& blocks, std::int32_t& fill) const {
  const std::int32_t S = config.block_size;
  const std::int32_t slot = next_slots[b];
  blocks = tables->num_blocks(slot, layer, Precision::FP16);
  fill = blocks > 0 ? tables->fp16_fill(slot, layer) : 0;
  if (next_exclude.empty() || next_exclude[b] == 0) return;
  const std::int64_t tokens = blocks == 0 ? 0 : std::int64_t{blocks - 1} * S + fill;
  const std::int64_t kept = tokens - next_exclude[b];
  require(kept >= 0, [&] {
    return "ExtendPlan::plan: fp16_exclude[" + std::to_string(b) + "] = " + std::to_string(next_exclude[b]) +
           ": expected <= the " + std::to_string(tokens) + " FP16 tokens of slots[" + std::to_string(b) +
           "] at layer " + std::to_string(layer);
  });
  blocks = static_cast<std::int32_t>((kept + S - 1) / S);
  fill = blocks == 0 ? 0 : static_cast<std::int32_t>(kept - std::int64_t{blocks - 1} * S);
}

void ExtendPlan::Impl::plan_layer(int layer) {
  const ExtendPlanConfig& c = config;
  const std::int32_t S = c.block_size;
  const auto batch = static_cast<std::int32_t>(next_slots.size());
  LayerPlan& out = next_layers[layer];
  out.items.clear();
  out.tasks.clear();
  out.partials = 0;

  // Each tile's units: the sequence's cached blocks, then the new-row units
  // its rows see (up to new row j_last).
  std::int64_t total_tiles = 0, total_units = 0;
  auto tile_units = [&](std::int32_t cached, std::int32_t n, std::int32_t row0) {
    const std::int32_t j_last = std::min<std::int32_t>(n - 1, (row0 + kTileRows - 1) / group);
    return cached + static_cast<std::int32_t>(ceil_div(j_last + 1, S));
  };
  for (int b = 0; b < batch; ++b) {
    const std::int32_t slot = next_slots[b];
    const std::int32_t fill = tables->fp16_fill(slot, layer);
    require(tables->num_blocks(slot, layer, Precision::FP16) == 0 || fill <= S, [&] {
      return "ExtendPlan::plan: the FP16 fill of slots[" + std::to_string(b) + "] = " + std::to_string(slot) +
             " at layer " + std::to_string(layer) + " is " + std::to_string(fill) + ": expected <= block_size " +
             std::to_string(S);
    });
    std::int32_t cached = 0;
    for (Precision p : kAllPrecisions) cached += tables->num_blocks(slot, layer, p);
    std::int32_t fp16_blocks = 0, fp16_fill = 0;
    fp16_list(b, layer, fp16_blocks, fp16_fill);
    cached += fp16_blocks - tables->num_blocks(slot, layer, Precision::FP16);
    const std::int32_t n = next_indptr[b + 1] - next_indptr[b];
    for (std::int32_t row0 = 0; row0 < n * group; row0 += kTileRows) {
      total_tiles += c.num_kv_heads;
      total_units += static_cast<std::int64_t>(c.num_kv_heads) * tile_units(cached, n, row0);
    }
  }
  const std::int64_t wave = static_cast<std::int64_t>(ctas_per_sm) * c.num_sms;
  auto pieces_of = [&](std::int32_t units) -> std::int32_t {
    if (c.chunks_per_tile > 0) return std::min(c.chunks_per_tile, units);
    if (total_tiles >= wave) return 1;
    // The tile's share of a wave by its units.
    const auto share = static_cast<std::int32_t>(
        std::llround(static_cast<double>(units) * static_cast<double>(wave) / static_cast<double>(total_units)));
    return std::clamp(share, 1, std::max(1, units / kMinUnitsPerPiece));
  };

  for (int b = 0; b < batch; ++b) {
    const std::int32_t slot = next_slots[b];
    ExtendWorkItem item;
    item.slot = slot;
    item.q_begin = next_indptr[b];
    item.n_new = next_indptr[b + 1] - next_indptr[b];
    for (int p = 0; p < kNumPrecisions; ++p) item.counts[p] = tables->num_blocks(slot, layer, kAllPrecisions[p]);
    fp16_list(b, layer, item.counts[0], item.fill);
    const std::int32_t cached = item.counts[0] + item.counts[1] + item.counts[2];
    // Tiles of one KV head are launched together: they read the same blocks,
    // the later ones from L2.
    for (std::int32_t h = 0; h < c.num_kv_heads; ++h) {
      item.kv_head = h;
      for (std::int32_t row0 = 0; row0 < item.n_new * group; row0 += kTileRows) {
        item.row0 = row0;
        const std::int32_t units = tile_units(cached, item.n_new, row0);
        const std::int32_t pieces = pieces_of(units);
        if (pieces == 1) {
          item.begin = 0;
          item.end = units;
          item.partial = -1;
          out.items.push_back(item);
          continue;
        }
        out.tasks.push_back({h, row0, item.q_begin, item.n_new, out.partials, pieces});
        // Cuts at equal unit counts: with pieces <= units every piece is non-empty.
        for (std::int32_t k = 0; k < pieces; ++k) {
          item.begin = static_cast<std::int32_t>(static_cast<std::int64_t>(units) * k / pieces);
          item.end = static_cast<std::int32_t>(static_cast<std::int64_t>(units) * (k + 1) / pieces);
          item.partial = out.partials + k;
          out.items.push_back(item);
        }
        out.partials += pieces;
      }
    }
  }
  if (static_cast<std::int64_t>(out.items.size()) > max_items || out.partials > max_partials ||
      static_cast<std::int64_t>(out.tasks.size()) > max_tasks) {
    throw OutOfMemory("ExtendPlan::plan: layer " + std::to_string(layer) + " needs " +
                      std::to_string(out.items.size()) + " work items and " + std::to_string(out.partials) +
                      " split pieces: expected <= " + std::to_string(max_items) +
                      " and <= " + std::to_string(max_partials) + " (max_items_per_layer)");
  }
}

void ExtendPlan::plan(std::span<const std::int32_t> slots, std::span<const std::int32_t> qo_indptr, cudaStream_t stream,
                      std::span<const std::int32_t> fp16_exclude) {
  Impl& s = *impl_;
  const ExtendPlanConfig& c = s.config;
  require(!slots.empty() && slots.size() <= static_cast<std::size_t>(c.max_batch), [&] {
    return "ExtendPlan::plan: slots has " + std::to_string(slots.size()) + " entries: expected 1.." +
           std::to_string(c.max_batch) + " (max_batch)";
  });
  for (std::size_t i = 0; i < slots.size(); ++i) {
    require(slots[i] >= 0 && slots[i] < s.tables->config().max_sequences, [&] {
      return "ExtendPlan::plan: slots[" + std::to_string(i) + "] = " + std::to_string(slots[i]) +
             ": expected a page-table slot in [0, " + std::to_string(s.tables->config().max_sequences) + ")";
    });
  }
  require(qo_indptr.size() == slots.size() + 1, [&] {
    return "ExtendPlan::plan: qo_indptr has " + std::to_string(qo_indptr.size()) +
           " entries: expected batch + 1 = " + std::to_string(slots.size() + 1);
  });
  require(qo_indptr[0] == 0,
          [&] { return "ExtendPlan::plan: qo_indptr[0] = " + std::to_string(qo_indptr[0]) + ": expected 0"; });
  for (std::size_t i = 1; i < qo_indptr.size(); ++i) {
    require(qo_indptr[i] > qo_indptr[i - 1], [&] {
      return "ExtendPlan::plan: qo_indptr[" + std::to_string(i) + "] = " + std::to_string(qo_indptr[i]) +
             ": expected > qo_indptr[" + std::to_string(i - 1) + "] = " + std::to_string(qo_indptr[i - 1]) +
             " (strictly increasing: every sequence brings at least one new row)";
    });
  }
  require(qo_indptr.back() <= c.max_rows, [&] {
    return "ExtendPlan::plan: rows = qo_indptr[" + std::to_string(slots.size()) +
           "] = " + std::to_string(qo_indptr.back()) + ": expected <= max_rows = " + std::to_string(c.max_rows);
  });
  require(fp16_exclude.empty() || fp16_exclude.size() == slots.size(), [&] {
    return "ExtendPlan::plan: fp16_exclude has " + std::to_string(fp16_exclude.size()) +
           " entries: expected none or one per slot (" + std::to_string(slots.size()) + ")";
  });
  for (std::size_t i = 0; i < fp16_exclude.size(); ++i) {
    require(fp16_exclude[i] >= 0, [&] {
      return "ExtendPlan::plan: fp16_exclude[" + std::to_string(i) + "] = " + std::to_string(fp16_exclude[i]) +
             ": expected >= 0";
    });
  }
  s.next_slots.assign(slots.begin(), slots.end());
  s.next_indptr.assign(qo_indptr.begin(), qo_indptr.end());
  s.next_exclude.assign(fp16_exclude.begin(), fp16_exclude.end());
  for (int layer = 0; layer < c.num_layers; ++layer) s.plan_layer(layer);
  std::swap(s.slots, s.next_slots);
  std::swap(s.indptr, s.next_indptr);
  std::swap(s.layers, s.next_layers);

  // Stage the ranges, the items and the tasks, and upload them in one copy.
  s.staging_free.synchronize();
  std::byte* staged = s.h_plan.get();
  const std::size_t layers = c.num_layers;
  std::size_t item_total = 0;
  for (std::size_t layer = 0; layer < layers; ++layer) item_total += s.layers[layer].items.size();
  // Tasks start at the first multiple of their size after the items.
  const std::size_t task_base =
      (sizeof(ExtendWorkItem) * item_total + sizeof(ExtendMergeTask) - 1) / sizeof(ExtendMergeTask);
  std::size_t items_at = 0, tasks_at = task_base;
  for (std::size_t layer = 0; layer < layers; ++layer) {
    const Impl::LayerPlan& lp = s.layers[layer];
    s.item_ranges[layer] = make_int2(static_cast<std::int32_t>(items_at), static_cast<std::int32_t>(lp.items.size()));
    s.task_ranges[layer] = make_int2(static_cast<std::int32_t>(tasks_at), static_cast<std::int32_t>(lp.tasks.size()));
    std::memcpy(staged + sizeof(int2) * layer, &s.item_ranges[layer], sizeof(int2));
    std::memcpy(staged + sizeof(int2) * (layers + layer), &s.task_ranges[layer], sizeof(int2));
    std::memcpy(staged + s.items_offset + sizeof(ExtendWorkItem) * items_at, lp.items.data(),
                sizeof(ExtendWorkItem) * lp.items.size());
    std::memcpy(staged + s.items_offset + sizeof(ExtendMergeTask) * tasks_at, lp.tasks.data(),
                sizeof(ExtendMergeTask) * lp.tasks.size());
    items_at += lp.items.size();
    tasks_at += lp.tasks.size();
  }
  const std::size_t bytes =
      s.items_offset + std::max(sizeof(ExtendWorkItem) * item_total, sizeof(ExtendMergeTask) * tasks_at);
  MIXKV_CUDA_CHECK(cudaMemcpyAsync(s.d_plan.get(), staged, bytes, cudaMemcpyHostToDevice, stream));
  s.staging_free.record(stream);
}

void ExtendPlan::run(const ExtendRunArgs& args) const {
  const Impl& s = *impl_;
  const ExtendPlanConfig& c = s.config;
  require(!s.slots.empty(), "ExtendPlan::run: no plan: call plan() first");
  const DType dtype = detail::require_pool_dtypes("ExtendPlan::run", args.pools);
  detail::require_input_dtype("ExtendPlan::run", "dtype (of q, k, v, out)", args.dtype, dtype, "pools[FP16]");
  try {
    detail::check_extend_supported(dtype, c.head_dim, c.block_size);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(std::string("ExtendPlan::run: ") + e.what());
  }
  require(args.layer >= 0 && args.layer < c.num_layers, [&] {
    return "ExtendPlan::run: layer = " + std::to_string(args.layer) + ": expected [0, " + std::to_string(c.num_layers) +
           ")";
  });
  require(args.q != nullptr, "ExtendPlan::run: q is null: expected device [rows][num_q_heads][head_dim] values");
  require(args.k != nullptr, "ExtendPlan::run: k is null: expected device [rows][num_kv_heads][head_dim] values");
  require(args.v != nullptr, "ExtendPlan::run: v is null: expected device [rows][num_kv_heads][head_dim] values");
  require(args.out != nullptr, "ExtendPlan::run: out is null: expected device [rows][num_q_heads][head_dim] values");
  require(std::isfinite(args.sm_scale) && args.sm_scale > 0.0f, [&] {
    return "ExtendPlan::run: sm_scale = " + std::to_string(args.sm_scale) + ": expected a finite value > 0";
  });
  for (Precision p : kAllPrecisions) {
    const PoolView& pool = args.pools[pool_index(p)];
    auto name = [&] { return "ExtendPlan::run: pools[" + std::string(to_string(p)) + "]"; };
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
               "arena's PoolLayout (or set_pool_blocks) so that extend never reads outside the arena";
      }
      return name() + ".num_blocks = " + std::to_string(pool.num_blocks) + ": expected >= the page tables' bound " +
             std::to_string(bound) + " (pool_blocks)";
    });
  }

  const DeviceTablesView view = s.tables->device_view();
  detail::ExtendParams p;
  p.q = args.q;
  p.k = args.k;
  p.v = args.v;
  p.out = args.out;
  p.lse = args.lse;
  const std::size_t layer_pools = static_cast<std::size_t>(args.layer) * kNumPrecisions;
  p.blocks = view.blocks + layer_pools * view.max_sequences * view.max_blocks;
  p.max_sequences = view.max_sequences;
  p.max_blocks = view.max_blocks;
  p.items = reinterpret_cast<const ExtendWorkItem*>(s.d_plan.get() + s.items_offset);
  const int2* device_ranges = reinterpret_cast<const int2*>(s.d_plan.get());
  if (args.fixed_grid) {
    p.item_range = device_ranges + args.layer;
  } else {
    p.launch_range = s.item_ranges[args.layer];
  }
  p.partial_out = s.d_partial_out.get();
  p.partial_lse = s.d_partial_lse.get();
  for (int i = 0; i < kNumPrecisions; ++i) p.pools[i] = detail::DevicePool(args.pools[i]);
  p.num_q_heads = c.num_q_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.group = s.group;
  p.scale_log2 = args.sm_scale * 1.4426950408889634f;

  const Impl::LayerPlan& lp = s.layers[args.layer];
  const int grid = args.fixed_grid ? s.max_items : static_cast<int>(lp.items.size());
  if (grid > 0) detail::launch_extend(p, dtype, c.head_dim, c.block_size, grid, args.stream);

  detail::ExtendMergeParams m;
  m.tasks = reinterpret_cast<const ExtendMergeTask*>(s.d_plan.get() + s.items_offset);
  if (args.fixed_grid) {
    m.task_range = device_ranges + c.num_layers + args.layer;
  } else {
    m.launch_range = s.task_ranges[args.layer];
  }
  m.partial_out = s.d_partial_out.get();
  m.partial_lse = s.d_partial_lse.get();
  m.out = p.out;
  m.lse = p.lse;
  m.num_q_heads = c.num_q_heads;
  m.group = s.group;
  m.head_dim = c.head_dim;
  const int merge_grid = args.fixed_grid ? s.max_tasks : static_cast<int>(lp.tasks.size());
  if (merge_grid > 0) detail::launch_extend_merge(m, dtype, merge_grid, args.stream);
}

const ExtendPlanConfig& ExtendPlan::config() const { return impl_->config; }
std::int32_t ExtendPlan::batch_size() const { return static_cast<std::int32_t>(impl_->slots.size()); }
std::int32_t ExtendPlan::num_rows() const { return impl_->indptr.empty() ? 0 : impl_->indptr.back(); }
std::int32_t ExtendPlan::num_items(std::int32_t layer) const {
  return static_cast<std::int32_t>(impl_->layers.at(layer).items.size());
}
std::int32_t ExtendPlan::num_split_tiles(std::int32_t layer) const {
  return static_cast<std::int32_t>(impl_->layers.at(layer).tasks.size());
}

}  // namespace mixkv::gpu
