// DecodePlan's layer sharing (DecodePlanConfig::layer_sharing): layers whose
// page lists have the same lengths run one set of work items, without lead
// page ids. Every layer's output and LSE must be bitwise those of per-layer
// planning (only the kernel's first page-table loads differ, not its
// arithmetic), and within the CPU reference's tolerance (decode_test.cpp).
// Shape: SmolLM2-135M's attention (9 query, 3 KV heads, head_dim 64), block 16.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <numeric>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "mixkv/core/errors.h"
#include "mixkv/cpu/decode_attention.h"
#include "mixkv/kernels/decode_plan.h"

namespace mixkv::test {
namespace {

constexpr int kQHeads = 9, kKVHeads = 3, kDim = 64, kBlock = 16;
constexpr Mix kMixed{0.1, 0.3};

std::vector<int> cycle(std::initializer_list<int> lengths, int batch) {
  std::vector<int> out;
  for (int i = 0; i < batch; ++i) out.push_back(*(lengths.begin() + i % lengths.size()));
  return out;
}

// One batch over several layers in one arena: layer l holds its own random
// K/V of contexts[l] tokens a sequence, its windows drawn with mixes[l], and
// its own queries.
struct LayeredBatch {
  TestArena arena;
  std::vector<PlacedBatch> placed;   // [layer]
  std::vector<std::vector<Half>> q;  // [layer]
  std::int32_t longest = 1;

  static std::array<std::int32_t, kNumPrecisions> blocks(const std::vector<std::vector<int>>& contexts) {
    std::array<std::int32_t, kNumPrecisions> total{};
    for (const auto& c : contexts) {
      const auto n = blocks_needed(c, kBlock);
      for (int p = 0; p < kNumPrecisions; ++p) total[p] += n[p];
    }
    return total;
  }
  LayeredBatch(const std::vector<std::vector<int>>& contexts, const std::vector<Mix>& mixes, std::uint64_t seed)
      : arena(kKVHeads, kDim, kBlock, blocks(contexts), seed) {
    Rng rng(seed);
    for (std::size_t l = 0; l < contexts.size(); ++l) {
      placed.push_back(place_batch(arena, mixed_sequences<Half>(contexts[l], kKVHeads, kDim, kBlock, mixes[l], rng)));
      q.push_back(random_halves(rng, contexts[l].size() * kQHeads * kDim));
      longest = std::max(longest, longest_list(placed.back()));
    }
  }
  int layers() const { return static_cast<int>(placed.size()); }
  std::int32_t batch() const { return static_cast<std::int32_t>(placed[0].tables[0].indptr.size() - 1); }
};

struct PlanRun {
  std::vector<DecodeResult> out;  // [layer]
  std::vector<std::int32_t> planned_layer, items, split_items;
  std::vector<std::int64_t> bytes;
  std::int32_t planned_layers = 0;
};

// Plans every layer of `b` once with `config` (the shape fields are filled
// in) and runs each layer, by grid of its items or of the plan's capacity.
PlanRun run_layers(LayeredBatch& b, gpu::DecodePlanConfig config, bool fixed_grid = false) {
  const int layers = b.layers();
  const std::int32_t batch = b.batch();
  DeviceArenaCopy device(b.arena);
  gpu::DevicePageTables tables({layers, batch, b.longest}, layout_of(b.arena));
  for (int l = 0; l < layers; ++l) fill_tables(tables, b.placed[l], l);
  tables.upload(nullptr);
  config.num_layers = layers;
  config.num_q_heads = kQHeads;
  config.num_kv_heads = kKVHeads;
  config.head_dim = kDim;
  config.block_size = kBlock;
  config.max_batch = batch;
  gpu::DecodePlan plan(config, tables);
  std::vector<std::int32_t> slots(batch);
  std::iota(slots.begin(), slots.end(), 0);
  plan.plan(slots, nullptr);

  PlanRun r;
  r.planned_layers = plan.num_planned_layers();
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  for (int l = 0; l < layers; ++l) {
    DeviceVector<Half> dq(b.q[l]);
    DeviceVector<Half> dout(b.q[l].size());
    DeviceVector<float> dlse(static_cast<std::size_t>(batch) * kQHeads);
    dout.fill_bytes(0x7e);  // NaN: every element must be written
    dlse.fill_bytes(0x7f);
    gpu::DecodeRunArgs run;
    run.layer = l;
    run.q = dq.get();
    run.out = dout.get();
    run.lse = dlse.get();
    run.sm_scale = scale;
    run.pools = device.pools;
    run.fixed_grid = fixed_grid;
    plan.run(run);
    r.out.push_back({halves_to_floats(dout.to_host()), dlse.to_host()});
    r.planned_layer.push_back(plan.planned_layer(l));
    r.items.push_back(plan.num_items(l));
    r.split_items.push_back(plan.num_split_items(l));
    r.bytes.push_back(plan.bytes_read(l));
  }
  return r;
}

gpu::DecodePlanConfig with_sharing(gpu::LayerSharing sharing, int chunks = 0, int num_sms = 0) {
  gpu::DecodePlanConfig config;
  config.layer_sharing = sharing;
  config.chunks_per_sequence = chunks;
  config.num_sms = num_sms;
  return config;
}

void expect_bitwise(const PlanRun& got, const PlanRun& want, const std::string& what) {
  ASSERT_EQ(got.out.size(), want.out.size());
  for (std::size_t l = 0; l < want.out.size(); ++l) {
    ASSERT_EQ(got.out[l].out.size(), want.out[l].out.size());
    for (std::size_t i = 0; i < want.out[l].out.size(); ++i) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got.out[l].out[i]), std::bit_cast<std::uint32_t>(want.out[l].out[i]))
          << what << ": layer " << l << " out[" << i << "]";
    }
    for (std::size_t i = 0; i < want.out[l].lse.size(); ++i) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got.out[l].lse[i]), std::bit_cast<std::uint32_t>(want.out[l].lse[i]))
          << what << ": layer " << l << " lse[" << i << "]";
    }
  }
  // The same items, partial rows and bytes a layer, shared or not.
  EXPECT_EQ(got.items, want.items) << what;
  EXPECT_EQ(got.split_items, want.split_items) << what;
  EXPECT_EQ(got.bytes, want.bytes) << what;
}

// decode_test.cpp's tolerance against the CPU reference.
void expect_matches_reference(LayeredBatch& b, const PlanRun& got) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  for (int l = 0; l < b.layers(); ++l) {
    const DecodeResult ref = cpu_decode(b.arena, b.placed[l], b.q[l], kQHeads, scale);
    const ErrorStats e = row_errors(got.out[l].out, ref.out, kDim);
    EXPECT_TRUE(e.finite) << "layer " << l;
    EXPECT_LE(e.mean, 1e-3) << "layer " << l;
    EXPECT_LE(e.max, 5e-3) << "layer " << l;
    for (std::size_t i = 0; i < ref.lse.size(); ++i) {
      EXPECT_NEAR(got.out[l].lse[i], ref.lse[i], 1e-3 * std::max(1.0f, std::abs(ref.lse[i])))
          << "layer " << l << " lse[" << i << "]";
    }
  }
}

std::vector<std::int32_t> each_layer_itself(int layers) {
  std::vector<std::int32_t> v(layers);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// 96 sequences (288 pairs: shares on any GPU of <= 288 SMs) of odd lengths,
// FP16 only, 4 layers of the same lengths: one plan, bitwise the outputs of
// four, also with every pair split (partial rows and merges shared) and
// through the device-side ranges of fixed-grid launches.
TEST(DecodePlanShare, Fp16LayersShareOnePlanBitwise) {
  MIXKV_REQUIRE_CUDA();
  const std::vector<int> contexts = cycle({97, 300, 1, 16, 17, 511, 33}, 96);
  LayeredBatch b({contexts, contexts, contexts, contexts}, {kAllFp16, kAllFp16, kAllFp16, kAllFp16}, 5);
  const PlanRun per_layer = run_layers(b, with_sharing(gpu::LayerSharing::kNever));
  const PlanRun shared = run_layers(b, with_sharing(gpu::LayerSharing::kAlways));
  EXPECT_EQ(per_layer.planned_layers, 4);
  EXPECT_EQ(per_layer.planned_layer, each_layer_itself(4));
  EXPECT_EQ(shared.planned_layers, 1);
  EXPECT_EQ(shared.planned_layer, std::vector<std::int32_t>(4, 0));
  expect_bitwise(shared, per_layer, "shared");
  expect_matches_reference(b, shared);

  const PlanRun split_per_layer = run_layers(b, with_sharing(gpu::LayerSharing::kNever, 3));
  const PlanRun split_shared = run_layers(b, with_sharing(gpu::LayerSharing::kAlways, 3));
  EXPECT_GT(split_shared.split_items[0], 0);
  expect_bitwise(split_shared, split_per_layer, "3 chunks, shared");
  expect_bitwise(run_layers(b, with_sharing(gpu::LayerSharing::kAlways), true), shared, "fixed grid, shared");
}

// Layers of FP16, INT4 and mixed windows: a layer shares the first earlier
// layer of the same lengths, including the FP16 fill (layer 5 differs from
// layer 0 only in one sequence's fill); the others plan their own items.
TEST(DecodePlanShare, MixedLayersShareWhereLengthsMatch) {
  MIXKV_REQUIRE_CUDA();
  const std::vector<int> contexts = cycle({99, 300, 1, 16, 17, 511, 33}, 40);
  std::vector<int> other_fill = contexts;
  other_fill[0] = 98;  // 7 blocks as 99, a fill of 2 instead of 3
  LayeredBatch b({contexts, contexts, contexts, contexts, contexts, other_fill},
                 {kAllFp16, kAllInt4, kAllFp16, kMixed, kAllInt4, kAllFp16}, 9);
  const std::vector<std::int32_t> expected = {0, 1, 0, 3, 1, 5};
  const PlanRun per_layer = run_layers(b, with_sharing(gpu::LayerSharing::kNever));
  const PlanRun shared = run_layers(b, with_sharing(gpu::LayerSharing::kAlways));
  EXPECT_EQ(per_layer.planned_layer, each_layer_itself(6));
  EXPECT_EQ(shared.planned_layers, 4);
  EXPECT_EQ(shared.planned_layer, expected);
  expect_bitwise(shared, per_layer, "shared");
  expect_matches_reference(b, shared);
  expect_bitwise(run_layers(b, with_sharing(gpu::LayerSharing::kAlways), true), shared, "fixed grid, shared");

  // kAuto on 1 SM: 120 pairs, so it shares.
  const PlanRun auto_shared = run_layers(b, with_sharing(gpu::LayerSharing::kAuto, 0, 1));
  EXPECT_EQ(auto_shared.planned_layer, expected);
  expect_bitwise(auto_shared, run_layers(b, with_sharing(gpu::LayerSharing::kNever, 0, 1)), "auto, 1 SM");
}

// Page tables of `batch` sequences of `tokens` FP16 tokens in every layer
// (ids need no data: plan() reads lengths and ids only).
void fill_fp16(gpu::DevicePageTables& tables, int layers, int batch, int tokens) {
  const int n = (tokens + kBlock - 1) / kBlock;
  std::vector<std::int32_t> ids(n);
  for (int l = 0; l < layers; ++l) {
    for (int s = 0; s < batch; ++s) {
      std::iota(ids.begin(), ids.end(), (l * batch + s) * n);
      tables.set_blocks(s, l, Precision::FP16, ids, tokens - (n - 1) * kBlock);
    }
  }
}

// kAuto: a batch of at least as many (sequence, KV head) pairs as SMs plans
// one layer (256 x 3 KV heads: any GPU of <= 768 SMs); batch 1 plans each
// layer.
TEST(DecodePlanShare, AutoSharesFromFullBatches) {
  MIXKV_REQUIRE_CUDA();  // DevicePageTables allocates device memory
  const int layers = 5, batch = 256;
  gpu::DevicePageTables tables({layers, batch, 64});
  fill_fp16(tables, layers, batch, 1000);
  gpu::DecodePlanConfig config{layers, kQHeads, kKVHeads, kDim, kBlock, batch};
  gpu::DecodePlan plan(config, tables);
  EXPECT_EQ(plan.num_planned_layers(), 0);
  EXPECT_EQ(plan.planned_layer(0), -1);
  EXPECT_EQ(plan.num_items(0), 0);

  std::vector<std::int32_t> slots(batch);
  std::iota(slots.begin(), slots.end(), 0);
  plan.plan(slots, nullptr);
  EXPECT_EQ(plan.num_planned_layers(), 1);
  for (int l = 0; l < layers; ++l) EXPECT_EQ(plan.planned_layer(l), 0);
  for (int l = 1; l < layers; ++l) EXPECT_EQ(plan.num_items(l), plan.num_items(0));
  const std::vector<std::int32_t> one = {7};
  plan.plan(one, nullptr);
  EXPECT_EQ(plan.num_planned_layers(), layers);
  for (int l = 0; l < layers; ++l) EXPECT_EQ(plan.planned_layer(l), l);
  cuda_ok(cudaDeviceSynchronize(), "sync");
}

// A failed plan() (a layer over its capacity) leaves the sharing of the
// previous plan as it was; bad layers and settings are named.
TEST(DecodePlanShare, FailedPlanKeepsSharingAndBadInputIsNamed) {
  MIXKV_REQUIRE_CUDA();
  const int layers = 3;
  gpu::DevicePageTables tables({layers, 4, 64});
  fill_fp16(tables, layers, 4, 200);  // 13 blocks: 2 chunks a pair
  const std::vector<std::int32_t> one_block = {5000};
  for (int l = 0; l < 2; ++l) tables.set_blocks(3, l, Precision::FP16, one_block, 1);  // 1 chunk a pair
  gpu::DecodePlanConfig config{layers, kQHeads, kKVHeads, kDim, kBlock, 4, 22, 0, 2};  // 2 chunks, <= 22 items
  config.layer_sharing = gpu::LayerSharing::kAlways;
  gpu::DecodePlan plan(config, tables);
  const std::vector<std::int32_t> two = {0, 1};
  plan.plan(two, nullptr);
  auto state = [&] {
    std::vector<std::int64_t> v = {plan.batch_size(), plan.num_planned_layers()};
    for (int l = 0; l < layers; ++l) {
      v.insert(v.end(), {plan.planned_layer(l), plan.num_items(l), plan.num_split_items(l), plan.bytes_read(l)});
    }
    return v;
  };
  const std::vector<std::int64_t> before = state();
  EXPECT_EQ(before[1], 1);                             // every layer of slots 0, 1 alike
  const std::vector<std::int32_t> all = {0, 1, 2, 3};  // layers 0, 1: 21 items; layer 2: 24
  EXPECT_THROW(plan.plan(all, nullptr), OutOfMemory);
  EXPECT_EQ(state(), before);

  expect_error_naming<IndexOutOfRange>([&] { plan.planned_layer(layers); }, {"planned_layer", "layer = 3"});
  expect_error_naming<IndexOutOfRange>([&] { plan.num_items(-1); }, {"num_items", "layer = -1"});
  gpu::DecodePlanConfig bad = config;
  bad.layer_sharing = static_cast<gpu::LayerSharing>(7);
  MIXKV_EXPECT_INVALID(gpu::DecodePlan(bad, tables), "layer_sharing = 7");
  cuda_ok(cudaDeviceSynchronize(), "sync");
}

// invariant_items_needed() is what a batch-invariant plan of those slots
// takes in its largest layer; 0 without the mode; a bad slot is named.
TEST(DecodePlanShare, InvariantItemsNeededIsWhatThePlanTakes) {
  MIXKV_REQUIRE_CUDA();
  const int layers = 3;
  gpu::DevicePageTables tables({layers, 4, 64});
  fill_fp16(tables, layers, 4, 200);  // 13 blocks: 4 chunks of 4
  const std::vector<std::int32_t> one_block = {5000};
  for (int l = 0; l < 2; ++l) tables.set_blocks(3, l, Precision::FP16, one_block, 1);  // 1 chunk
  gpu::DecodePlanConfig config{layers, kQHeads, kKVHeads, kDim, kBlock, 4};
  config.batch_invariant_blocks = 4;
  gpu::DecodePlan plan(config, tables);
  const std::vector<std::int32_t> all = {0, 1, 2, 3};
  const std::int64_t need = plan.invariant_items_needed(all);
  plan.plan(all, nullptr);
  std::int64_t most = 0;
  for (int l = 0; l < layers; ++l) most = std::max<std::int64_t>(most, plan.num_items(l));
  EXPECT_EQ(need, most);
  EXPECT_EQ(plan.num_items(0) * 16, plan.num_items(2) * 13);  // 13 chunks in layer 0, 16 in layer 2

  gpu::DecodePlanConfig automatic = config;
  automatic.batch_invariant_blocks = 0;
  EXPECT_EQ(gpu::DecodePlan(automatic, tables).invariant_items_needed(all), 0);
  const std::vector<std::int32_t> bad = {0, 4};
  expect_error_naming<IndexOutOfRange>([&] { plan.invariant_items_needed(bad); }, {"slots[1] = 4"});
  cuda_ok(cudaDeviceSynchronize(), "sync");
}

}  // namespace
}  // namespace mixkv::test
