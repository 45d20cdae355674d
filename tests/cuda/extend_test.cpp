// Paged extend (chunked-prefill) attention on the device against
// cpu::extend_attention and a float64 dense attention over the same
// dequantized K/V (testing.md item 3): mean normalized error <= 1e-3, max
// <= 5e-3, LSE within 1e-3, no NaN; cached contexts 0, 1, 31, 33, 4,099 and
// 19,600 tokens over the three pools, chunks of 1 to 600 new rows, mixed
// batches, empty pools, GQA 7:1 and 3:1, head_dim 64 / 128 / 256; split-KV
// pieces (forced and automatic) merged exactly; n_i = 1 against the decode
// kernel; a captured graph replayed after a re-plan; bad input rejected
// with nothing changed.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_test_util.h"
#include "extend_test_util.h"
#include "mixkv/core/errors.h"
#include "mixkv/cpu/extend_attention.h"
#include "mixkv/kernels/decode_plan.h"
#include "mixkv/kernels/extend_plan.h"

namespace mixkv::test {
namespace {

// Fractions of full windows in FP16 / INT4 (the rest INT2) of the mixed cases.
constexpr Mix kMixed{0.2, 0.4};

using NewRows = BasicNewRows<Half>;

// The cached part of a batch (an arena holding its blocks) and one step.
struct ExtendData {
  std::unique_ptr<TestArena> arena;
  std::vector<SequenceData> seqs;
  PlacedBatch placed;
  NewRows rows;
  int q_heads = 0;
  float scale = 0.0f;
};

ExtendData make_data(const std::vector<int>& contexts, const std::vector<int>& chunks, int q_heads, int kv_heads,
                     int dim, int block, Mix mix, std::uint64_t seed) {
  ExtendData d;
  Rng rng(seed);
  d.arena = std::make_unique<TestArena>(kv_heads, dim, block, blocks_needed(contexts, block), seed + 1);
  d.seqs = mixed_sequences<Half>(contexts, kv_heads, dim, block, mix, rng);
  d.placed = place_batch(*d.arena, d.seqs);
  d.rows = make_new_rows<Half>(chunks, q_heads, kv_heads, dim, rng);
  d.q_heads = q_heads;
  d.scale = 1.0f / std::sqrt(static_cast<float>(dim));
  return d;
}

// The two references over `d`'s blocks (extend_test_util.h).
DecodeResult dense_extend(const ExtendData& d, const NewRows& rows) {
  const BlockFormat f = d.arena->format(Precision::FP16);
  return test::dense_extend(d.placed, f.num_kv_heads, f.head_dim, d.q_heads, d.scale, rows);
}

DecodeResult cpu_extend(const ExtendData& d, const NewRows& rows) {
  return test::cpu_extend(*d.arena, d.placed, d.q_heads, d.scale, rows);
}

struct GpuOptions {
  int chunks_per_tile = 0;
  int num_sms = 0;
  int layers = 1;
  int layer = 0;
  int max_items = 0;                        // ExtendPlanConfig::max_items_per_layer
  std::int32_t* num_split_tiles = nullptr;  // out
};

// Tiles of 64 rows (new row, query head) of a step, over all KV heads.
int tiles_of(const NewRows& rows, int q_heads, int kv_heads) {
  int tiles = 0;
  for (std::size_t b = 0; b + 1 < rows.indptr.size(); ++b) {
    const int seq_rows = (rows.indptr[b + 1] - rows.indptr[b]) * (q_heads / kv_heads);
    tiles += kv_heads * ((seq_rows + 63) / 64);
  }
  return tiles;
}

gpu::ExtendPlanConfig config_of(const ExtendData& d, std::int32_t max_batch, std::int32_t max_rows,
                                const GpuOptions& o) {
  const BlockFormat f = d.arena->format(Precision::FP16);
  gpu::ExtendPlanConfig c;
  c.num_layers = o.layers;
  c.num_q_heads = d.q_heads;
  c.num_kv_heads = f.num_kv_heads;
  c.head_dim = f.head_dim;
  c.block_size = f.block_size;
  c.max_batch = max_batch;
  c.max_rows = max_rows;
  c.num_sms = o.num_sms;
  c.chunks_per_tile = o.chunks_per_tile;
  c.max_items_per_layer = o.max_items;
  return c;
}

// The CUDA extend for one layer of `d` (stored in its arena); every output
// element starts as NaN, so one the kernels fail to write cannot pass.
DecodeResult run_gpu(const ExtendData& d, const GpuOptions& o = {}) {
  const auto batch = static_cast<std::int32_t>(d.rows.indptr.size() - 1);
  DeviceArenaCopy device(*d.arena);
  gpu::DevicePageTables tables({o.layers, batch, longest_list(d.placed)}, layout_of(*d.arena));
  fill_tables(tables, d.placed, o.layer);
  tables.upload(nullptr);
  gpu::ExtendPlan plan(config_of(d, batch, d.rows.rows(), o), tables);
  std::vector<std::int32_t> slots(batch);
  std::iota(slots.begin(), slots.end(), 0);
  plan.plan(slots, d.rows.indptr, nullptr);
  if (o.num_split_tiles != nullptr) *o.num_split_tiles = plan.num_split_tiles(o.layer);
  DeviceVector<Half> dq(d.rows.q), dk(d.rows.k), dv(d.rows.v), dout(d.rows.q.size());
  DeviceVector<float> dlse(static_cast<std::size_t>(d.rows.rows()) * d.q_heads);
  dout.fill_bytes(0x7e);
  dlse.fill_bytes(0x7f);
  gpu::ExtendRunArgs run;
  run.layer = o.layer;
  run.q = dq.get();
  run.k = dk.get();
  run.v = dv.get();
  run.out = dout.get();
  run.lse = dlse.get();
  run.sm_scale = d.scale;
  run.pools = device.pools;
  plan.run(run);
  return {halves_to_floats(dout.to_host()), dlse.to_host()};
}

void expect_close(const DecodeResult& got, const DecodeResult& ref, int dim, const std::string& what,
                  double mean_bound = 1e-3, double max_bound = 5e-3) {
  ASSERT_EQ(got.out.size(), ref.out.size()) << what;
  const ErrorStats e = row_errors(got.out, ref.out, dim);
  EXPECT_TRUE(e.finite) << what << ": non-finite output";
  EXPECT_LE(e.mean, mean_bound) << what;
  EXPECT_LE(e.max, max_bound) << what;
  int reported = 0;
  for (std::size_t i = 0; i < ref.lse.size(); ++i) {
    const bool ok = std::abs(got.lse[i] - ref.lse[i]) <= 1e-3 * std::max(1.0f, std::abs(ref.lse[i]));
    if (!ok && reported++ < 5)
      ADD_FAILURE() << what << ": lse[" << i << "] = " << got.lse[i] << ", expected " << ref.lse[i];
  }
  EXPECT_EQ(reported, 0) << what << ": " << reported << " lse values off";
}

struct ExtendCase {
  std::vector<int> contexts;  // cached tokens, one per sequence
  std::vector<int> chunks;    // new rows, one per sequence
  int q_heads, kv_heads, dim, block;
  Mix mix;
  const char* name;
};

class ExtendCuda : public ::testing::TestWithParam<ExtendCase> {};

// Against both references, unsplit and cut into 3 pieces a tile.
TEST_P(ExtendCuda, MatchesReferences) {
  MIXKV_REQUIRE_CUDA();
  const ExtendCase c = GetParam();
  const ExtendData d = make_data(c.contexts, c.chunks, c.q_heads, c.kv_heads, c.dim, c.block, c.mix, 42);
  const DecodeResult dense = dense_extend(d, d.rows);
  const DecodeResult cpu = cpu_extend(d, d.rows);
  // Forced pieces may exceed the default workspace (two waves of CTAs).
  const int max_items = 3 * tiles_of(d.rows, c.q_heads, c.kv_heads) + 8;
  for (int chunks : {1, 3}) {
    const DecodeResult got = run_gpu(d, {.chunks_per_tile = chunks, .max_items = max_items});
    const std::string what = std::string(c.name) + ", " + std::to_string(chunks) + " pieces a tile";
    expect_close(got, dense, c.dim, what + " vs float64");
    expect_close(got, cpu, c.dim, what + " vs cpu::extend_attention");
  }
}

std::vector<int> cycle(std::initializer_list<int> lengths, int batch) {
  std::vector<int> out;
  for (int i = 0; i < batch; ++i) out.push_back(*(lengths.begin() + i % lengths.size()));
  return out;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ExtendCuda,
    ::testing::Values(ExtendCase{{0}, {1}, 28, 4, 128, 32, kMixed, "ctx0_n1"},
                      ExtendCase{{0}, {100}, 28, 4, 128, 32, kMixed, "ctx0_n100"},
                      ExtendCase{{1}, {7}, 28, 4, 128, 32, kMixed, "ctx1_n7"},
                      ExtendCase{{31}, {17}, 28, 4, 128, 32, kMixed, "ctx31_n17"},
                      ExtendCase{{33}, {100}, 28, 4, 128, 32, kMixed, "ctx33_n100"},
                      ExtendCase{{33}, {600}, 28, 4, 128, 32, kMixed, "ctx33_n600"},
                      ExtendCase{{4099}, {17}, 28, 4, 128, 32, kMixed, "ctx4099_n17"},
                      ExtendCase{{4099}, {100}, 28, 4, 128, 32, kMixed, "ctx4099_n100"},
                      ExtendCase{{0, 1, 31, 33, 4099}, {1, 7, 17, 100, 3}, 28, 4, 128, 32, kMixed, "b5_mixed_n"},
                      ExtendCase{cycle({97, 1, 300}, 17), cycle({1, 7, 2, 17}, 17), 28, 4, 128, 32, kMixed, "b17"},
                      ExtendCase{{97, 33, 0}, {7, 17, 1}, 9, 3, 64, 32, kMixed, "d64_gqa3"},
                      ExtendCase{{1000, 31}, {100, 600}, 9, 3, 64, 32, kMixed, "d64_gqa3_long"},
                      ExtendCase{{31, 130}, {17, 7}, 28, 4, 256, 32, kMixed, "d256"},
                      ExtendCase{{600}, {33}, 8, 8, 256, 32, kMixed, "d256_mha"},
                      ExtendCase{{97, 200}, {17, 7}, 28, 4, 128, 16, kMixed, "block16"},
                      ExtendCase{{97, 300}, {17, 70}, 28, 4, 128, 64, kMixed, "block64"},
                      ExtendCase{{256, 97}, {17, 7}, 28, 4, 128, 32, kAllFp16, "all_fp16"},
                      ExtendCase{{256, 97}, {17, 7}, 28, 4, 128, 32, kAllInt4, "all_int4"},
                      ExtendCase{{256, 64}, {17, 7}, 28, 4, 128, 32, kAllInt2, "all_int2_empty_fp16"},
                      ExtendCase{{256, 97}, {9, 64}, 32, 1, 128, 32, kMixed, "mqa32"}),
    [](const auto& info) { return std::string(info.param.name); });

// Batch 1 over 19,600 cached tokens: too few tiles for the GPU, so the
// plan splits every tile into pieces by itself (and the merge kernel joins
// them); the same layer planned for one SM is not split.
TEST(ExtendCudaSplit, LongContextSplitsAutomatically) {
  MIXKV_REQUIRE_CUDA();
  for (int n : {1, 17}) {
    const ExtendData d = make_data({19600}, {n}, 28, 4, 128, 32, kMixed, 7);
    const DecodeResult dense = dense_extend(d, d.rows);
    std::int32_t split = 0;
    expect_close(run_gpu(d, {.num_split_tiles = &split}), dense, 128, "n " + std::to_string(n) + ", auto split");
    EXPECT_GT(split, 0) << "n " << n << ": a batch-1 step of " << n << " rows must be split";
    expect_close(run_gpu(d, {.num_sms = 1, .num_split_tiles = &split}), dense, 128,
                 "n " + std::to_string(n) + ", 1 SM");
    EXPECT_EQ(split, 0) << "n " << n << ": the tiles fill the CTA slots of one SM";
  }
}

// Different cuts of the same units give the same output (pieces of 1 unit
// included), and layer > 0 of a multi-layer table works.
TEST(ExtendCudaSplit, PiecesAndLayerDoNotChangeTheResult) {
  MIXKV_REQUIRE_CUDA();
  const ExtendData d = make_data({2000, 500}, {40, 3}, 28, 4, 128, 32, kMixed, 8);
  const DecodeResult one = run_gpu(d, {.chunks_per_tile = 1});
  // Pieces differ only in rounding (P in FP16 against each piece's max, the
  // output once more to FP16).
  for (int chunks : {2, 7, 100}) {  // 100: every unit a piece
    const DecodeResult other = run_gpu(d, {.chunks_per_tile = chunks, .max_items = 4096});
    const ErrorStats e = row_errors(other.out, one.out, 128);
    EXPECT_LE(e.mean, 1e-3) << chunks << " pieces";
    EXPECT_LE(e.max, 2.5e-3) << chunks << " pieces";
  }
  const DecodeResult layer2 = run_gpu(d, {.layers = 3, .layer = 2});
  EXPECT_LE(row_errors(layer2.out, one.out, 128).mean, 1e-3);
  EXPECT_LE(row_errors(layer2.out, one.out, 128).max, 2.5e-3);
}

// One new row a sequence is decode after appending the row: the decode
// kernel over the cache plus the row (stored as the FP16 tail) against the
// extend kernel over the cache with the row as k, v.
TEST(ExtendCudaDecode, OneRowEqualsDecodeAfterAppend) {
  MIXKV_REQUIRE_CUDA();
  const int kvh = 4, qh = 28, dim = 128, block = 32;
  const std::vector<int> contexts = {1, 31, 33, 97, 4099, 0, 63};
  const std::vector<int> ones(contexts.size(), 1);
  const ExtendData d = make_data(contexts, ones, qh, kvh, dim, block, kMixed, 5);
  const DecodeResult got = run_gpu(d);
  // The same sequences with the new row appended; a window the row fills
  // stays FP16, so every quantized window is the same as in d.
  std::vector<int> appended;
  std::vector<SequenceData> seqs = d.seqs;
  const std::size_t row = static_cast<std::size_t>(kvh) * dim;
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    SequenceData& s = seqs[b];
    s.k.insert(s.k.end(), d.rows.k.begin() + b * row, d.rows.k.begin() + (b + 1) * row);
    s.v.insert(s.v.end(), d.rows.v.begin() + b * row, d.rows.v.begin() + (b + 1) * row);
    ++s.tokens;
    if (s.tokens % block == 0) s.windows.push_back(Precision::FP16);
    appended.push_back(s.tokens);
  }
  TestArena arena(kvh, dim, block, blocks_needed(appended, block), 6);
  const PlacedBatch placed = place_batch(arena, seqs);
  const auto batch = static_cast<std::int32_t>(seqs.size());
  DeviceArenaCopy device(arena);
  gpu::DevicePageTables tables({1, batch, longest_list(placed)}, layout_of(arena));
  fill_tables(tables, placed, 0);
  tables.upload(nullptr);
  gpu::DecodePlan plan({1, qh, kvh, dim, block, batch, 0, 0, 0}, tables);
  std::vector<std::int32_t> slots(batch);
  std::iota(slots.begin(), slots.end(), 0);
  plan.plan(slots, nullptr);
  DeviceVector<Half> dq(d.rows.q), dout(d.rows.q.size());
  DeviceVector<float> dlse(static_cast<std::size_t>(batch) * qh);
  dout.fill_bytes(0x7e);
  dlse.fill_bytes(0x7f);
  gpu::DecodeRunArgs run{0, dq.get(), dout.get(), dlse.get(), d.scale, device.pools, nullptr, false};
  plan.run(run);
  const DecodeResult decode{halves_to_floats(dout.to_host()), dlse.to_host()};
  expect_close(got, decode, dim, "extend n = 1 vs decode");
  expect_close(got, dense_extend(d, d.rows), dim, "extend n = 1 vs float64");
}

// A captured graph of run() (fixed grids, split pieces and their merge)
// replays correctly after the step's rows and the plan changed.
TEST(ExtendCudaGraph, CapturedRunSurvivesReplanning) {
  MIXKV_REQUIRE_CUDA();
  const int dim = 128;
  ExtendData d = make_data({700, 300}, {5, 40}, 28, 4, dim, 32, kMixed, 12);
  Rng rng(13);
  const NewRows next = make_new_rows<Half>({33, 12}, 28, 4, dim, rng);  // the same 45 rows, cut otherwise
  const DecodeResult ref = dense_extend(d, next);

  DeviceArenaCopy device(*d.arena);
  gpu::DevicePageTables tables({1, 2, longest_list(d.placed)}, layout_of(*d.arena));
  fill_tables(tables, d.placed, 0);
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream), "stream");
  tables.upload(stream);
  gpu::ExtendPlan plan(config_of(d, 2, 45, {.chunks_per_tile = 2}), tables);
  const std::vector<std::int32_t> slots = {0, 1};
  plan.plan(slots, d.rows.indptr, stream);
  DeviceVector<Half> dq(d.rows.q), dk(d.rows.k), dv(d.rows.v), dout(d.rows.q.size());
  DeviceVector<float> dlse(45 * 28);
  gpu::ExtendRunArgs run{0, dq.get(), dk.get(), dv.get(), dout.get(), dlse.get(), d.scale, device.pools, stream, true};
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
  plan.run(run);
  cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  // The next step: new rows in the same buffers, planned again, replayed.
  cuda_ok(cudaStreamSynchronize(stream), "sync");
  cuda_ok(cudaMemcpy(dq.get(), next.q.data(), next.q.size() * sizeof(Half), cudaMemcpyHostToDevice), "q");
  cuda_ok(cudaMemcpy(dk.get(), next.k.data(), next.k.size() * sizeof(Half), cudaMemcpyHostToDevice), "k");
  cuda_ok(cudaMemcpy(dv.get(), next.v.data(), next.v.size() * sizeof(Half), cudaMemcpyHostToDevice), "v");
  plan.plan(slots, next.indptr, stream);
  EXPECT_GT(plan.num_split_tiles(0), 0);
  for (int replay = 0; replay < 2; ++replay) {
    dout.fill_bytes(0x7e);
    dlse.fill_bytes(0x7f);
    cuda_ok(cudaGraphLaunch(exec, stream), "replay");
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    expect_close({halves_to_floats(dout.to_host()), dlse.to_host()}, ref, dim, "replay " + std::to_string(replay));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Every bad argument throws a typed error naming it, and a plan() or run()
// that throws changes nothing: the previous plan stays, no kernel runs.
TEST(ExtendCudaBadInput, RejectedAndNothingChanges) {
  MIXKV_REQUIRE_CUDA();
  gpu::DevicePageTables tables({2, 4, 8});
  const std::vector<std::int32_t> ids = {0, 1, 2};
  for (std::int32_t slot = 0; slot < 4; ++slot) {
    for (int layer = 0; layer < 2; ++layer) tables.set_blocks(slot, layer, Precision::INT4, ids);
  }
  const gpu::ExtendPlanConfig valid{2, 28, 4, 128, 32, 3, 64, 0, 0, 0};
  const std::vector<std::pair<std::function<void(gpu::ExtendPlanConfig&)>, std::string>> changes = {
      {[](gpu::ExtendPlanConfig& c) { c.head_dim = 96; }, "Unsupported head_dim: 96"},
      {[](gpu::ExtendPlanConfig& c) { c.block_size = 48; }, "Unsupported block_size: 48"},
      {[](gpu::ExtendPlanConfig& c) { c.num_q_heads = 30; }, "num_q_heads"},
      {[](gpu::ExtendPlanConfig& c) { c.max_rows = 0; }, "max_rows"},
      {[](gpu::ExtendPlanConfig& c) { c.max_batch = 5; }, "max_batch"},
      {[](gpu::ExtendPlanConfig& c) { c.num_layers = 3; }, "num_layers"},
      {[](gpu::ExtendPlanConfig& c) { c.chunks_per_tile = -1; }, "chunks_per_tile"}};
  for (const auto& [change, message] : changes) {
    gpu::ExtendPlanConfig config = valid;
    change(config);
    MIXKV_EXPECT_INVALID(gpu::ExtendPlan(config, tables), message);
  }

  gpu::ExtendPlan plan(valid, tables);
  gpu::ExtendRunArgs run;
  MIXKV_EXPECT_INVALID(plan.run(run), "plan()");
  const std::vector<std::int32_t> slots = {2, 0};
  const std::vector<std::int32_t> indptr = {0, 3, 10};
  plan.plan(slots, indptr, nullptr);
  auto state = [&] {
    return std::vector<std::int32_t>{plan.batch_size(), plan.num_rows(), plan.num_items(0), plan.num_items(1),
                                     plan.num_split_tiles(0)};
  };
  const std::vector<std::int32_t> before = state();
  EXPECT_EQ(before[0], 2);
  EXPECT_EQ(before[1], 10);
  using Slots = std::vector<std::int32_t>;
  const std::vector<std::tuple<Slots, Slots, std::string>> bad_plans = {{{0, 1}, {1, 3, 10}, "qo_indptr[0] = 1"},
                                                                        {{0, 1}, {0, 3, 3}, "qo_indptr[2] = 3"},
                                                                        {{0, 1}, {0, 5, 4}, "qo_indptr[2] = 4"},
                                                                        {{0, 1}, {0, 3}, "qo_indptr has 2 entries"},
                                                                        {{0, 1}, {0, 3, 65}, "max_rows = 64"},
                                                                        {{0, 1, 2, 3}, {0, 1, 2, 3, 4}, "max_batch"},
                                                                        {{}, {0}, "max_batch"},
                                                                        {{0, 4}, {0, 1, 2}, "slots[1] = 4"},
                                                                        {{-1, 0}, {0, 1, 2}, "slots[0] = -1"}};
  for (const auto& [bad_slots, bad_indptr, message] : bad_plans) {
    MIXKV_EXPECT_INVALID(plan.plan(bad_slots, bad_indptr, nullptr), message);
    EXPECT_EQ(state(), before) << message;
  }
  // An FP16 fill over block_size in layer 1 of slot 3: layer 0 plans, the call fails, nothing changes.
  tables.set_blocks(3, 1, Precision::FP16, ids, 40);
  MIXKV_EXPECT_INVALID(plan.plan(Slots{3}, Slots{0, 2}, nullptr), "FP16 fill");
  EXPECT_EQ(state(), before);
  // More items than the capacity: OutOfMemory, nothing changes.
  {
    gpu::ExtendPlanConfig small = valid;
    small.max_items_per_layer = 4;  // 4 KV heads x 1 tile
    gpu::ExtendPlan tight(small, tables);
    tight.plan(Slots{0}, Slots{0, 9}, nullptr);  // 63 rows: one tile a KV head
    EXPECT_EQ(tight.num_items(0), 4);
    EXPECT_THROW(tight.plan(Slots{0}, Slots{0, 10}, nullptr), OutOfMemory);  // 70 rows: two tiles
    EXPECT_EQ(tight.num_items(0), 4);
    EXPECT_EQ(tight.num_rows(), 9);
  }

  // run(): every check before any launch; the output stays as it was.
  DeviceVector<Half> q(10 * 28 * 128), k(10 * 4 * 128), v(10 * 4 * 128), out(10 * 28 * 128);
  out.fill_bytes(0x11);
  TestArena host(4, 128, 32, {4, 4, 4});
  DeviceArenaCopy device(host);
  gpu::DevicePageTables bounded({2, 4, 8}, layout_of(host));
  gpu::ExtendPlan bounded_plan(valid, bounded);
  bounded_plan.plan(slots, indptr, nullptr);
  const gpu::ExtendRunArgs good{0, q.get(), k.get(), v.get(), out.get(), nullptr, 0.1f, device.pools, nullptr, false};
  const std::vector<std::pair<std::function<void(gpu::ExtendRunArgs&)>, std::string>> bad_runs = {
      {[](gpu::ExtendRunArgs& a) { a.layer = 2; }, "layer = 2"},
      {[](gpu::ExtendRunArgs& a) { a.q = nullptr; }, "q is null"},
      {[](gpu::ExtendRunArgs& a) { a.k = nullptr; }, "k is null"},
      {[](gpu::ExtendRunArgs& a) { a.v = nullptr; }, "v is null"},
      {[](gpu::ExtendRunArgs& a) { a.out = nullptr; }, "out is null"},
      {[](gpu::ExtendRunArgs& a) { a.sm_scale = 0.0f; }, "sm_scale"},
      {[](gpu::ExtendRunArgs& a) { a.pools[1].base = nullptr; }, "pools[INT4].base"},
      {[](gpu::ExtendRunArgs& a) { a.pools[2].format.head_dim = 64; }, "pools[INT2].format"}};
  for (const auto& [change, message] : bad_runs) {
    gpu::ExtendRunArgs a = good;
    change(a);
    MIXKV_EXPECT_INVALID(bounded_plan.run(a), message);
  }
  // Tables without a block-id bound are refused by run().
  MIXKV_EXPECT_INVALID(plan.run(good), "no block-id bound");
  const std::vector<Half> untouched = out.to_host();
  for (const Half h : untouched) ASSERT_EQ(h.bits, 0x1111);
  expect_context_usable("rejected extend calls");
}

}  // namespace
}  // namespace mixkv::test
