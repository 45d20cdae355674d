// The Engine on the CUDA backend against the CPU backend: the same workload
// (chunked prefill, forks, cancels, swaps, demotions) gives the same
// scheduler decisions and outputs within FP16 rounding for FP16 plans and
// within the quantized kernels' tolerance (tests/cuda) for mixed plans.
// Every test skips visibly without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../cuda/cuda_test_util.h"
#include "engine_loop.h"
#include "invariance_loop.h"
#include "mixkv/core/errors.h"
#include "mixkv/kernels/decode_plan.h"
#include "mixkv/kernels/device_arena.h"

namespace mixkv {
namespace {

#define MIXKV_REQUIRE_CUDA()                                                      \
  do {                                                                            \
    if (!::mixkv::gpu::cuda_device_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

void ok(cudaError_t e, const char* what) { ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorString(e); }

// Device copies of the loop's arrays, freed after each step.
class DeviceMemory : public test::Memory {
 public:
  ~DeviceMemory() override { release(); }
  TensorView input(const std::vector<Half>& host, std::initializer_list<std::int64_t> shape) override {
    TensorView t = allocate(DType::F16, shape);
    if (!host.empty()) ok(cudaMemcpy(t.data, host.data(), host.size() * sizeof(Half), cudaMemcpyHostToDevice), "H2D");
    return t;
  }
  TensorView output(DType dtype, std::initializer_list<std::int64_t> shape) override {
    TensorView t = allocate(dtype, shape);
    ok(cudaMemset(t.data, 0x7f, std::max<std::size_t>(t.bytes(), 1)), "memset");  // NaN until written
    return t;
  }
  std::vector<float> read(const TensorView& t) override {
    ok(cudaDeviceSynchronize(), "sync");
    std::vector<std::byte> bytes(t.bytes());
    if (!bytes.empty()) ok(cudaMemcpy(bytes.data(), t.data, bytes.size(), cudaMemcpyDeviceToHost), "D2H");
    std::vector<float> r(static_cast<std::size_t>(t.numel()));
    for (std::size_t i = 0; i < r.size(); ++i) {
      if (t.dtype == DType::F16) {
        Half h;
        std::memcpy(&h, bytes.data() + 2 * i, 2);
        r[i] = half_to_float(h);
      } else {
        std::memcpy(&r[i], bytes.data() + 4 * i, 4);
      }
    }
    return r;
  }
  void release() override {
    cudaDeviceSynchronize();
    for (void* p : owned_) cudaFree(p);
    owned_.clear();
  }

 private:
  TensorView allocate(DType dtype, std::initializer_list<std::int64_t> shape) {
    TensorView t = test::HostMemory::view(nullptr, dtype, shape);
    t.device = DeviceKind::CUDA;
    void* p = nullptr;
    ok(cudaMalloc(&p, std::max<std::size_t>(t.bytes(), 16)), "cudaMalloc");
    owned_.push_back(p);
    t.data = p;
    return t;
  }
  std::vector<void*> owned_;
};

EngineConfig config(BackendKind kind, bool demote) {
  EngineConfig c;
  c.cache.shape = CacheShape{2, 2, 64, 32};  // a built decode instance (head_dim 64, block 32)
  c.cache.slab_bytes = 64 << 10;
  c.cache.arena_bytes = 6 * c.cache.slab_bytes;
  c.cache.swap_blocks = {96, 96, 96};
  c.cache.fp16_windows_first = true;
  c.scheduler.max_num_seqs = 8;
  c.scheduler.max_num_batched_tokens = 96;
  c.scheduler.watermark = 0.0;
  c.scheduler.preemption = PreemptionMode::Swap;
  c.scheduler.demote_under_pressure = demote;
  c.scheduler.build_metadata = false;
  c.scheduler.per_layer_slots = false;
  c.num_q_heads = 4;
  c.backend = kind;
  return c;
}

class CudaLoop : public ::testing::TestWithParam<bool> {};

TEST_P(CudaLoop, MatchesTheCpuBackend) {
  MIXKV_REQUIRE_CUDA();
  const bool mixed = GetParam();
  for (const std::uint32_t seed : {1u, 2u}) {
    test::WorkloadOptions o;
    o.seed = seed;
    o.requests = 18;
    o.max_new_tokens = 40;
    o.mixed_plans = mixed;
    const test::Workload workload(CacheShape{2, 2, 64, 32}, o);
    Engine cpu(config(BackendKind::CPU, mixed));
    Engine gpu(config(BackendKind::CUDA, mixed));
    test::HostMemory host;
    DeviceMemory device;
    test::Outputs want, got;
    const test::RunStats sc = test::run_engine(cpu, workload, host, want);
    const test::RunStats sg = test::run_engine(gpu, workload, device, got);
    EXPECT_NO_THROW(gpu.backend().synchronize());  // no id out of range on the device
    EXPECT_EQ(sg.steps, sc.steps);
    EXPECT_EQ(sg.demotions, sc.demotions);
    EXPECT_EQ(sg.swaps_out, sc.swaps_out);
    EXPECT_GT(sg.swaps_out, 0);
    if (mixed) {
      EXPECT_GT(sg.demotions, 0);
    }
    const test::Diff d = test::compare(got, want);
    std::printf("seed %u %s: %lld decode tokens, max |out| difference %.2e, max |lse| difference %.2e\n", seed,
                mixed ? "mixed" : "fp16", static_cast<long long>(sg.decode_tokens), d.out, d.lse);
    // FP16: rounding of the output only; mixed: the tests/cuda bound.
    EXPECT_LE(d.out, mixed ? 5e-3 : 2e-3) << "seed " << seed;
    EXPECT_LE(d.lse, 1e-3) << "seed " << seed;
    test::expect_empty(gpu.cache());
  }
}

// Prefill through the cache (extend attention over the prefix pages) and
// speculative decoding (3 drafts a decode, verified by extend attention):
// the same decisions and outputs as the CPU backend.
TEST_P(CudaLoop, PrefillAndDraftsMatchTheCpuBackend) {
  MIXKV_REQUIRE_CUDA();
  const bool mixed = GetParam();
  for (const std::uint32_t seed : {1u, 2u}) {
    test::WorkloadOptions o;
    o.seed = seed;
    o.requests = 18;
    o.max_new_tokens = 40;
    o.mixed_plans = mixed;
    const test::Workload workload(CacheShape{2, 2, 64, 32}, o);
    EngineConfig cc = config(BackendKind::CPU, mixed), gc = config(BackendKind::CUDA, mixed);
    cc.scheduler.num_speculative_tokens = gc.scheduler.num_speculative_tokens = 3;
    Engine cpu(cc);
    Engine gpu(gc);
    test::HostMemory host;
    DeviceMemory device;
    test::Outputs want, got;
    const test::RunStats sc = test::run_engine(cpu, workload, host, want, /*through_cache=*/true);
    const test::RunStats sg = test::run_engine(gpu, workload, device, got, /*through_cache=*/true);
    EXPECT_NO_THROW(gpu.backend().synchronize());
    EXPECT_EQ(sg.steps, sc.steps);
    EXPECT_EQ(sg.drafts, sc.drafts);
    EXPECT_GT(sg.drafts, 0);
    const test::Diff d = test::compare(got, want);
    const test::Diff p = test::compare(got.prefill, want.prefill);
    std::printf("seed %u %s: %lld drafts, decode |out| %.2e |lse| %.2e, prefill |out| %.2e |lse| %.2e\n", seed,
                mixed ? "mixed" : "fp16", static_cast<long long>(sg.drafts), d.out, d.lse, p.out, p.lse);
    EXPECT_LE(d.out, mixed ? 5e-3 : 2e-3) << "seed " << seed;
    EXPECT_LE(d.lse, 1e-3) << "seed " << seed;
    EXPECT_LE(p.out, mixed ? 5e-3 : 2e-3) << "seed " << seed;
    EXPECT_LE(p.lse, 1e-3) << "seed " << seed;
    test::expect_empty(gpu.cache());
  }
}

// Age tiers (text, prompt tails and generated tokens demoted as they age,
// INT4 in layer 0 and INT2 in layer 1): the stream blocks' demotions, the
// page tables they change and the decodes over them match the CPU backend.
TEST_P(CudaLoop, AgeTiersMatchTheCpuBackend) {
  MIXKV_REQUIRE_CUDA();
  const bool mixed = GetParam();
  test::WorkloadOptions o;
  o.seed = 3;
  o.requests = 18;
  o.max_new_tokens = 40;
  o.mixed_plans = mixed;
  const test::Workload workload(CacheShape{2, 2, 64, 32}, o);
  EngineConfig cc = config(BackendKind::CPU, mixed), gc = config(BackendKind::CUDA, mixed);
  for (EngineConfig* c : {&cc, &gc}) {
    c->scheduler.age_tiers.enabled = true;
    c->scheduler.age_tiers.recent_windows = 1;
    c->scheduler.age_tiers.layer_floor = {Precision::INT4, Precision::INT2};
  }
  Engine cpu(cc);
  Engine gpu(gc);
  test::HostMemory host;
  DeviceMemory device;
  test::Outputs want, got;
  const test::RunStats sc = test::run_engine(cpu, workload, host, want);
  const test::RunStats sg = test::run_engine(gpu, workload, device, got);
  EXPECT_NO_THROW(gpu.backend().synchronize());
  EXPECT_EQ(sg.steps, sc.steps);
  EXPECT_EQ(sg.demotions, sc.demotions);
  EXPECT_GT(gpu.scheduler().stats().age_demotions, 0);
  EXPECT_EQ(gpu.scheduler().stats().age_demotions, cpu.scheduler().stats().age_demotions);
  const test::Diff d = test::compare(got, want);
  std::printf("age tiers %s: %lld age demotions, max |out| difference %.2e, max |lse| difference %.2e\n",
              mixed ? "mixed" : "fp16", static_cast<long long>(gpu.scheduler().stats().age_demotions), d.out, d.lse);
  EXPECT_LE(d.out, 5e-3);
  EXPECT_LE(d.lse, 1e-3);
  test::expect_empty(gpu.cache());
}

// Prefix caching by content (Exact prefill): questions on two videos share
// their FP16 copies, demote them to their own plans off shared blocks and
// prefill their questions through the cache, as on the CPU backend.
TEST_P(CudaLoop, PrefixCachingByContentMatchesTheCpuBackend) {
  MIXKV_REQUIRE_CUDA();
  const bool mixed = GetParam();
  test::WorkloadOptions o;
  o.seed = 4;
  o.requests = 18;
  o.max_new_tokens = 40;
  o.mixed_plans = mixed;
  o.shared_videos = true;
  const test::Workload workload(CacheShape{2, 2, 64, 32}, o);
  EngineConfig cc = config(BackendKind::CPU, mixed), gc = config(BackendKind::CUDA, mixed);
  for (EngineConfig* c : {&cc, &gc}) {
    c->cache.arena_bytes = 12 * c->cache.slab_bytes;
    c->cache.prefix_cache.enabled = true;
    c->cache.prefix_cache.identity = PrefixIdentity::Content;
    c->scheduler.prefill_mode = PrefillMode::Exact;
  }
  Engine cpu(cc);
  Engine gpu(gc);
  test::HostMemory host;
  DeviceMemory device;
  test::Outputs want, got;
  const test::RunStats sc = test::run_engine(cpu, workload, host, want, /*through_cache=*/true);
  const test::RunStats sg = test::run_engine(gpu, workload, device, got, /*through_cache=*/true);
  EXPECT_NO_THROW(gpu.backend().synchronize());
  EXPECT_EQ(sg.steps, sc.steps);
  const SchedulerStats st = gpu.scheduler().stats();
  EXPECT_EQ(st.prefix_hits, cpu.scheduler().stats().prefix_hits);
  EXPECT_GT(st.prefix_hits, 0);
  const test::Diff d = test::compare(got, want);
  const test::Diff p = test::compare(got.prefill, want.prefill);
  std::printf(
      "prefix by content %s: %lld hits, %lld rows from the cache, decode |out| %.2e |lse| %.2e, prefill "
      "|out| %.2e\n",
      mixed ? "mixed" : "fp16", static_cast<long long>(st.prefix_hits), static_cast<long long>(st.cached_prompt_tokens),
      d.out, d.lse, p.out);
  EXPECT_LE(d.out, mixed ? 5e-3 : 2e-3);
  EXPECT_LE(d.lse, 1e-3);
  EXPECT_LE(p.out, mixed ? 5e-3 : 2e-3);
  const_cast<KVCacheManager&>(gpu.cache()).evict_prefix_cache();
  test::expect_empty(gpu.cache());
}

INSTANTIATE_TEST_SUITE_P(Plans, CudaLoop, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? std::string("Mixed") : std::string("Fp16"); });

// Batch-invariant decode (EngineConfig::batch_invariant_blocks): a request
// whose 25-block lists are cut into 7 chunks of 4 blocks gives bitwise the
// same outputs and LSEs alone, after or before eleven others (1-28 blocks
// each, so the batch outgrows the plan's first item capacity and the plan
// is rebuilt), and among others arriving while it decodes. They match the
// CPU backend within the mixed plans' tolerance. Without the option the
// automatic split follows the batch; how many rows then differ is printed,
// not asserted.
TEST(EngineCuda, BatchInvariantDecodeIgnoresTheBatch) {
  MIXKV_REQUIRE_CUDA();
  const auto runs = test::invariance_runs();
  test::TargetRows cpu;
  {
    Engine engine(test::invariance_config(BackendKind::CPU, 0));
    test::HostMemory host;
    cpu = test::run_for_target(engine, runs[0].second, host);
  }
  for (const std::int32_t blocks : {4, kBatchInvariantBlocks, 0}) {
    std::vector<test::TargetRows> got;
    for (const auto& [name, arrivals] : runs) {
      Engine engine(test::invariance_config(BackendKind::CUDA, blocks));
      DeviceMemory device;
      got.push_back(test::run_for_target(engine, arrivals, device));
      EXPECT_NO_THROW(engine.backend().synchronize()) << name;
    }
    ASSERT_GE(got[0].size(), 40u);  // 23 decodes x 2 layers
    test::Outputs want, alone;
    for (const auto& [key, rows] : cpu) want.rows[{test::kTargetId, key.first, key.second}] = rows;
    for (const auto& [key, rows] : got[0]) alone.rows[{test::kTargetId, key.first, key.second}] = rows;
    const test::Diff d = test::compare(alone, want);
    EXPECT_LE(d.out, 5e-3) << "blocks " << blocks;
    EXPECT_LE(d.lse, 1e-3) << "blocks " << blocks;
    for (std::size_t i = 1; i < runs.size(); ++i) {
      if (blocks > 0) {
        test::expect_same_bits(got[0], got[i], runs[i].first);
        continue;
      }
      int differing = 0;
      for (const auto& [key, rows] : got[0]) differing += got[i].count(key) && got[i].at(key) != rows ? 1 : 0;
      std::printf("automatic split, %s: %d of %zu rows differ from alone\n", runs[i].first, differing, got[0].size());
    }
  }
}

// The invariant plan's item capacity grows with the batch: a batch whose
// chunks need many times the first capacity (16 sequences of 1 block chunks
// over ~30 blocks) plans and decodes, and later steps reuse the grown plan.
TEST(EngineCuda, BatchInvariantPlanGrowsWithTheBatch) {
  MIXKV_REQUIRE_CUDA();
  Engine engine(test::invariance_config(BackendKind::CUDA, 1));
  std::vector<std::pair<std::int64_t, Request>> arrivals;
  for (std::int32_t i = 0; i < 15; ++i) arrivals.emplace_back(0, test::invariance_request(200 + i, 28, 3, i));
  arrivals.emplace_back(0, test::invariance_target());
  DeviceMemory device;
  const test::TargetRows rows = test::run_for_target(engine, arrivals, device);
  EXPECT_NO_THROW(engine.backend().synchronize());
  EXPECT_GE(rows.size(), 40u);
  for (const auto& [key, r] : rows) {
    for (const float x : r.first) ASSERT_TRUE(std::isfinite(x)) << "position " << key.first;
  }
}

// A decode plan configured as the CUDA backend configures a batch-invariant
// one (batch_invariant_blocks, max_items_per_layer) and captured in a CUDA
// graph with fixed grids replays after re-planning other batches: each
// sequence's rows are bitwise its rows of the eager run, in another order,
// in a smaller batch, and again over poisoned outputs (the merge's arrival
// counters were reset by the replay before).
TEST(EngineCuda, BatchInvariantPlanReplaysInACapturedGraph) {
  MIXKV_REQUIRE_CUDA();
  using namespace test;
  const int kvh = 4, qh = 28, dim = 128, block = 32;
  Rng rng(31);
  const std::vector<int> contexts = {700, 300, 1250};
  TestArena arena(kvh, dim, block, blocks_needed(contexts, block), 4);
  const PlacedBatch placed = place_batch(arena, mixed_sequences<Half>(contexts, kvh, dim, block, Mix{0.1, 0.3}, rng));
  const auto n = static_cast<std::int32_t>(contexts.size());
  const auto q = random_halves(rng, contexts.size() * qh * dim);
  const std::size_t row = static_cast<std::size_t>(qh) * dim;
  DeviceArenaCopy device(arena);
  gpu::DevicePageTables tables({1, n, longest_list(placed)}, layout_of(arena));
  fill_tables(tables, placed, 0);  // sequence i in slot i
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream), "stream");
  tables.upload(stream);
  gpu::DecodePlanConfig plan_config;
  plan_config.num_layers = 1;
  plan_config.num_q_heads = qh;
  plan_config.num_kv_heads = kvh;
  plan_config.head_dim = dim;
  plan_config.block_size = block;
  plan_config.max_batch = n;
  plan_config.batch_invariant_blocks = 4;
  plan_config.max_items_per_layer = 128;  // 3 sequences x 4 KV heads x <= 10 chunks
  gpu::DecodePlan plan(plan_config, tables);
  DeviceVector<Half> dq(q), dout(q.size());
  DeviceVector<float> dlse(contexts.size() * qh);
  gpu::DecodeRunArgs run;
  run.q = dq.get();
  run.out = dout.get();
  run.lse = dlse.get();
  run.sm_scale = 1.0f / std::sqrt(static_cast<float>(dim));
  run.pools = device.pools;
  run.stream = stream;
  // Eager, the batch in slot order: sequence i's rows at entry i.
  const std::vector<std::int32_t> in_order = {0, 1, 2};
  plan.plan(in_order, stream);
  plan.run(run);
  const std::vector<Half> want_out = dout.to_host();
  const std::vector<float> want_lse = dlse.to_host();
  for (const Half h : want_out) ASSERT_NE(h.bits & 0x7c00, 0x7c00) << "non-finite eager output";

  run.fixed_grid = true;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
  plan.run(run);
  cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  const std::vector<std::vector<std::int32_t>> batches = {{2, 0, 1}, {1}, {1, 2}, {2, 0, 1}};
  for (const auto& slots : batches) {
    std::vector<Half> permuted;
    for (const std::int32_t s : slots) {
      permuted.insert(permuted.end(), q.begin() + static_cast<std::ptrdiff_t>(s * row),
                      q.begin() + static_cast<std::ptrdiff_t>((s + 1) * row));
    }
    cuda_ok(cudaMemcpy(dq.get(), permuted.data(), permuted.size() * sizeof(Half), cudaMemcpyHostToDevice), "H2D q");
    dout.fill_bytes(0x7e);
    dlse.fill_bytes(0x7f);
    plan.plan(slots, stream);
    cuda_ok(cudaGraphLaunch(exec, stream), "replay");
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    const std::vector<Half> got_out = dout.to_host();
    const std::vector<float> got_lse = dlse.to_host();
    for (std::size_t b = 0; b < slots.size(); ++b) {
      const auto s = static_cast<std::size_t>(slots[b]);
      EXPECT_EQ(std::memcmp(got_out.data() + b * row, want_out.data() + s * row, row * sizeof(Half)), 0)
          << "sequence " << s << " at entry " << b << " of a batch of " << slots.size();
      EXPECT_EQ(std::memcmp(got_lse.data() + b * qh, want_lse.data() + s * qh, qh * sizeof(float)), 0)
          << "sequence " << s << " LSE at entry " << b << " of a batch of " << slots.size();
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(EngineCuda, HostArraysAreRefusedByName) {
  MIXKV_REQUIRE_CUDA();
  Engine engine(config(BackendKind::CUDA, true));
  Request r;
  r.id = 1;
  r.layout = TokenLayout({{TokenKind::Text, 20}});
  r.max_new_tokens = 2;
  engine.add_request(r);
  engine.step();
  test::HostMemory host;
  const std::vector<Half> rows(20 * 2 * 64);
  const TensorView k = host.input(rows, {20, 2, 64});
  try {
    engine.store(0, k, k);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("Engine::store: k: expected dtype float16 on cuda:0"), std::string::npos)
        << e.what();
  }
  DeviceMemory device;
  TensorView dk = device.input(rows, {20, 2, 64});
  TensorView misaligned = dk;
  misaligned.data = static_cast<std::byte*>(dk.data) + 2;
  try {
    engine.store(0, misaligned, dk);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("16-byte aligned"), std::string::npos) << e.what();
  }
  engine.store(0, dk, dk);
  engine.store(1, dk, dk);
  engine.backend().synchronize();
}

TEST(EngineCuda, BadDeviceIsNamed) {
  MIXKV_REQUIRE_CUDA();
  EngineConfig c = config(BackendKind::CUDA, true);
  c.cuda_device = 64;
  try {
    Engine e(c);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("cuda_device = 64"), std::string::npos) << e.what();
  }
}

// A BF16 cache runs on the CUDA backend; float16 arrays for it are refused
// naming the argument before anything is enqueued, and bfloat16 ones are
// stored (tests/cuda/bf16_*_test.cpp check the kernels against the CPU).
TEST(EngineCuda, Bf16CacheTakesBf16ArraysOnly) {
  MIXKV_REQUIRE_CUDA();
  EngineConfig c = config(BackendKind::CUDA, true);
  c.cache.shape.dtype = DType::BF16;
  Engine engine(c);
  Request r;
  r.id = 1;
  r.layout = TokenLayout({{TokenKind::Text, 20}});
  r.max_new_tokens = 2;
  engine.add_request(r);
  engine.step();
  DeviceMemory device;
  const std::vector<Half> rows(20 * 2 * 64);
  const TensorView f16 = device.input(rows, {20, 2, 64});
  try {
    engine.store(0, f16, f16);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("Engine::store: k: expected dtype bfloat16"), std::string::npos) << e.what();
  }
  TensorView bf16 = f16;  // zeros: the same bytes in either type
  bf16.dtype = DType::BF16;
  engine.store(0, bf16, bf16);
  engine.store(1, bf16, bf16);
  engine.backend().synchronize();
}

}  // namespace
}  // namespace mixkv
