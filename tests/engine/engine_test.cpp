// The Engine on the CPU backend: an engine loop over text-only and video
// requests (chunked prefill, forks, cancels, swaps, recomputes, demotions)
// held to a reference that applies the same scheduler's steps by hand with
// the cpu ops, FP16 results that memory pressure does not change, and bad
// input that is named and changes nothing.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine_loop.h"
#include "invariance_loop.h"
#include "mixkv/core/errors.h"

namespace mixkv {
namespace {

using test::HostMemory;
using test::Outputs;
using test::RunStats;
using test::Workload;
using test::WorkloadOptions;

// 2 layers, 2 KV heads (4 query heads), head_dim 64, block_size 32: an FP16
// block is 16 KiB, a 64 KiB slab holds 4 FP16, 14 INT4 or 25 INT2 blocks.
EngineConfig config(std::int32_t slabs, PreemptionMode mode, bool demote, bool compact) {
  EngineConfig c;
  c.cache.shape = CacheShape{2, 2, 64, 32};
  c.cache.slab_bytes = 64 << 10;
  c.cache.arena_bytes = static_cast<std::size_t>(slabs) * c.cache.slab_bytes;
  c.cache.swap_blocks = {96, 96, 96};
  c.cache.fp16_windows_first = true;
  c.scheduler.max_num_seqs = 8;
  c.scheduler.max_num_batched_tokens = 96;  // prompts arrive in chunks
  c.scheduler.watermark = 0.0;
  c.scheduler.preemption = mode;
  c.scheduler.demote_under_pressure = demote;
  // The engine builds what the step leaves out from the manager.
  c.scheduler.build_metadata = !compact;
  c.scheduler.per_layer_slots = !compact;
  c.scheduler.build_mappings = !compact;
  c.num_q_heads = 4;
  return c;
}

void print(const char* what, const RunStats& s) {
  std::printf(
      "%s: %lld steps, %lld prefill rows, %lld decode tokens, %lld demotions, %lld swaps out, %lld in, "
      "%lld recomputes, %lld forks, %lld cancels, %lld copies\n",
      what, static_cast<long long>(s.steps), static_cast<long long>(s.prefill_rows),
      static_cast<long long>(s.decode_tokens), static_cast<long long>(s.demotions), static_cast<long long>(s.swaps_out),
      static_cast<long long>(s.swaps_in), static_cast<long long>(s.recomputes), static_cast<long long>(s.forks),
      static_cast<long long>(s.cancels), static_cast<long long>(s.copies));
}

// 6 slabs: 24 FP16 blocks for up to 8 requests of up to 160 tokens in 2
// layers, each generating up to 40 tokens: demotions, swaps and recomputes.
constexpr std::int32_t kTightSlabs = 6;
constexpr int kMaxNew = 40;

class MixedLoop : public ::testing::TestWithParam<bool> {};

// Mixed plans under pressure (demotions to INT4 and INT2, swaps), with and
// without what the step can carry (metadata, mappings, per-layer slots):
// every output equals the reference's, bit for bit at FP16.
TEST_P(MixedLoop, EqualsTheCpuOpsAppliedByHand) {
  const bool compact = GetParam();
  for (const std::uint32_t seed : {1u, 2u, 3u}) {
    const EngineConfig c = config(kTightSlabs, PreemptionMode::Swap, true, compact);
    WorkloadOptions o;
    o.seed = seed;
    o.requests = 18;
    o.max_new_tokens = kMaxNew;
    const Workload workload(c.cache.shape, o);
    Engine engine(c);
    HostMemory mem;
    Outputs got, want;
    const RunStats stats = test::run_engine(engine, workload, mem, got);
    print(compact ? "compact" : "full", stats);
    test::run_reference(c, workload, want);
    EXPECT_FALSE(engine.has_unfinished());
    test::expect_empty(engine.cache());
    const test::Diff d = test::compare(got, want);
    EXPECT_EQ(d.out, 0.0) << "seed " << seed;
    EXPECT_EQ(d.lse, 0.0) << "seed " << seed;
    EXPECT_GT(stats.decode_tokens, 0);
    EXPECT_GT(stats.forks, 0);
    EXPECT_GT(stats.cancels, 0);
  }
}

// Prefix caching by content (Exact prefill) under the same pressure, forks
// and cancels: questions on two videos share FP16 copies and demote them to
// their own plans; every output equals the reference's, bit for bit.
TEST_P(MixedLoop, PrefixByContentEqualsTheCpuOpsAppliedByHand) {
  const bool compact = GetParam();
  for (const std::uint32_t seed : {1u, 2u}) {
    EngineConfig c = config(2 * kTightSlabs, PreemptionMode::Swap, true, compact);
    c.cache.prefix_cache.enabled = true;
    c.cache.prefix_cache.identity = PrefixIdentity::Content;
    c.scheduler.prefill_mode = PrefillMode::Exact;
    WorkloadOptions o;
    o.seed = seed;
    o.requests = 18;
    o.max_new_tokens = kMaxNew;
    o.shared_videos = true;
    const Workload workload(c.cache.shape, o);
    Engine engine(c);
    HostMemory mem;
    Outputs got, want;
    const RunStats stats = test::run_engine(engine, workload, mem, got);
    print(compact ? "content, compact" : "content, full", stats);
    test::run_reference(c, workload, want);
    EXPECT_FALSE(engine.has_unfinished());
    EXPECT_GT(engine.scheduler().stats().prefix_hits, 0) << "seed " << seed;
    const_cast<KVCacheManager&>(engine.cache()).evict_prefix_cache();
    test::expect_empty(engine.cache());
    const test::Diff d = test::compare(got, want);
    EXPECT_EQ(d.out, 0.0) << "seed " << seed;
    EXPECT_EQ(d.lse, 0.0) << "seed " << seed;
  }
}

INSTANTIATE_TEST_SUITE_P(StepForms, MixedLoop, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? std::string("Compact") : std::string("Full"); });

// The pressure paths ran somewhere in the mixed runs.
TEST(EngineCpu, PressureDemotesAndSwaps) {
  RunStats total;
  for (const std::uint32_t seed : {1u, 2u, 3u, 4u}) {
    const EngineConfig c = config(kTightSlabs, PreemptionMode::Swap, true, false);
    WorkloadOptions o;
    o.seed = seed;
    o.requests = 18;
    o.max_new_tokens = kMaxNew;
    Engine engine(c);
    HostMemory mem;
    Outputs got;
    const RunStats s = test::run_engine(engine, Workload(c.cache.shape, o), mem, got);
    total.demotions += s.demotions;
    total.swaps_out += s.swaps_out;
    total.swaps_in += s.swaps_in;
    total.copies += s.copies;
    test::expect_empty(engine.cache());
  }
  print("pressure", total);
  EXPECT_GT(total.demotions, 0);
  EXPECT_GT(total.swaps_out, 0);
  EXPECT_GT(total.swaps_in, 0);
  EXPECT_GT(total.copies, 0);
}

// FP16 plans without demotion: a tight cache (swaps or recomputes) gives the
// outputs of a roomy one.
TEST(EngineCpu, Fp16OutputsDoNotDependOnMemoryPressure) {
  for (const PreemptionMode mode : {PreemptionMode::Swap, PreemptionMode::Recompute}) {
    WorkloadOptions o;
    o.mixed_plans = false;
    o.requests = 15;
    o.max_new_tokens = kMaxNew;
    // Forks and cancels follow the scheduler's state, which pressure changes.
    o.forks = o.cancels = false;
    const EngineConfig roomy = config(64, mode, false, false);
    const EngineConfig tight = config(kTightSlabs, mode, false, true);
    const Workload workload(roomy.cache.shape, o);
    Engine a(roomy), b(tight);
    HostMemory mem;
    Outputs oa, ob;
    test::run_engine(a, workload, mem, oa);
    const RunStats sb = test::run_engine(b, workload, mem, ob);
    print("tight", sb);
    EXPECT_GT(sb.swaps_out + sb.recomputes, 0);
    const test::Diff d = test::compare(ob, oa, mode == PreemptionMode::Recompute);
    EXPECT_LE(d.out, 1e-3);
    EXPECT_LE(d.lse, 1e-5);
    test::expect_empty(a.cache());
    test::expect_empty(b.cache());
  }
}

// --- Bad input: named, typed, and nothing changes

template <class E, class F>
void expect_error(F&& call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "expected an error naming " << needle;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(EngineCpu, BadConfigIsNamed) {
  EngineConfig c = config(8, PreemptionMode::Swap, true, false);
  c.num_q_heads = 3;
  expect_error<InvalidArgument>([&] { Engine e(c); }, "num_q_heads = 3");
  c.num_q_heads = 4;
  c.sm_scale = -1.0f;
  expect_error<InvalidArgument>([&] { Engine e(c); }, "sm_scale");
#if !defined(MIXKV_ENGINE_TEST_CUDA)
  c.sm_scale = 0.0f;
  c.backend = BackendKind::CUDA;
  expect_error<InvalidArgument>([&] { Engine e(c); }, "built without CUDA");
#endif
}

// batch_invariant_blocks outside [0, 2^20] is refused naming it, on either
// backend kind (the config is checked before a device is looked for); a
// valid one reaches the backend's config.
TEST(EngineCpu, BatchInvariantBlocksIsCheckedAndPassedOn) {
  for (const BackendKind kind : {BackendKind::CPU, BackendKind::CUDA}) {
#if !defined(MIXKV_ENGINE_TEST_CUDA)
    if (kind == BackendKind::CUDA) continue;  // "built without CUDA" comes first
#endif
    EngineConfig c = config(8, PreemptionMode::Swap, true, false);
    c.backend = kind;
    c.batch_invariant_blocks = -1;
    expect_error<InvalidArgument>([&] { Engine e(c); }, "batch_invariant_blocks = -1: expected 0 (off)");
    c.batch_invariant_blocks = (1 << 20) + 1;
    expect_error<InvalidArgument>([&] { Engine e(c); }, "batch_invariant_blocks = 1048577");
  }
  EngineConfig c = config(8, PreemptionMode::Swap, true, false);
  c.batch_invariant_blocks = kBatchInvariantBlocks;
  Engine e(c);
  EXPECT_EQ(e.config().batch_invariant_blocks, kBatchInvariantBlocks);
  EXPECT_EQ(e.backend().config().batch_invariant_blocks, kBatchInvariantBlocks);
  c.batch_invariant_blocks = 1 << 20;
  EXPECT_NO_THROW(Engine{c});
}

// The CPU backend's decode is batch-invariant with or without the option:
// a request's outputs are bitwise the same alone, after or before eleven
// others, and among others arriving while it decodes.
TEST(EngineCpu, DecodeIsBatchInvariant) {
  for (const std::int32_t blocks : {0, 4}) {
    std::vector<test::TargetRows> got;
    const auto runs = test::invariance_runs();
    for (const auto& [name, arrivals] : runs) {
      Engine engine(test::invariance_config(BackendKind::CPU, blocks));
      HostMemory host;
      got.push_back(test::run_for_target(engine, arrivals, host));
    }
    ASSERT_GE(got[0].size(), 40u);  // 23 decodes x 2 layers
    for (std::size_t i = 1; i < runs.size(); ++i) {
      test::expect_same_bits(got[0], got[i], runs[i].first);
    }
  }
}

TEST(EngineCpu, BadArraysAreNamedAndChangeNothing) {
  const EngineConfig c = config(16, PreemptionMode::Swap, true, false);
  Engine engine(c);
  HostMemory mem;
  std::vector<Half> rows(20 * 2 * 64, float_to_half(0.5f));
  expect_error<InvalidArgument>(
      [&] {
        engine.store(0, mem.input(rows, {20, 2, 64}), mem.input(rows, {20, 2, 64}));
      },
      "no step yet");
  Request r;
  r.id = 1;
  r.layout = TokenLayout({{TokenKind::Text, 20}});
  r.max_new_tokens = 3;
  engine.add_request(r);
  const StepOutput& s1 = engine.step();
  ASSERT_EQ(s1.prefills.size(), 1u);
  const std::string state = engine.scheduler().describe_state();
  const TensorView k = mem.input(rows, {20, 2, 64});
  expect_error<InvalidArgument>([&] { engine.store(0, mem.input(rows, {19, 2, 64}), k); }, "Engine::store: k");
  expect_error<InvalidArgument>([&] { engine.store(0, k, mem.input(rows, {20, 1, 128})); }, "Engine::store: v");
  TensorView f32 = k;
  f32.dtype = DType::F32;
  expect_error<InvalidArgument>([&] { engine.store(0, f32, k); }, "expected dtype float16");
  TensorView on_gpu = k;
  on_gpu.device = DeviceKind::CUDA;
  expect_error<InvalidArgument>([&] { engine.store(0, k, on_gpu); }, "on cuda:0");
  TensorView null = k;
  null.data = nullptr;
  expect_error<InvalidArgument>([&] { engine.store(0, null, k); }, "data is null");
  expect_error<IndexOutOfRange>([&] { engine.store(2, k, k); }, "layer = 2");
  // Decode arrays of a step without decodes: batch 0.
  const std::vector<Half> q(4 * 64, float_to_half(0.25f));
  const TensorView out1 = mem.output(DType::F16, {1, 4, 64});
  expect_error<InvalidArgument>([&] { engine.attend(0, mem.input(q, {1, 4, 64}), k, k, out1); }, "Engine::attend: q");
  EXPECT_EQ(engine.scheduler().describe_state(), state);
  for (std::int32_t l = 0; l < 2; ++l) engine.store(l, k, k);

  const StepOutput& s2 = engine.step();  // the first decode
  ASSERT_EQ(s2.decodes.size(), 1u);
  const std::string state2 = engine.scheduler().describe_state();
  const std::vector<Half> kv(2 * 64, float_to_half(0.125f));
  const TensorView dq = mem.input(q, {1, 4, 64});
  const TensorView dk = mem.input(kv, {1, 2, 64});
  const TensorView out = mem.output(DType::F16, {1, 4, 64});
  const TensorView lse = mem.output(DType::F32, {1, 4});
  expect_error<InvalidArgument>([&] { engine.attend(0, dq, dk, dk, lse); }, "Engine::attend: out");
  expect_error<InvalidArgument>([&] { engine.attend(0, dq, dk, dk, out, &out); }, "Engine::attend: lse");
  // Outputs that overlap inputs are refused by the backend.
  TensorView aliased = out;
  aliased.data = dq.data;
  expect_error<InvalidArgument>([&] { engine.attend(0, dq, dk, dk, aliased); }, "out overlaps q");
  expect_error<IndexOutOfRange>([&] { engine.attend(-1, dq, dk, dk, out); }, "layer = -1");
  EXPECT_EQ(engine.scheduler().describe_state(), state2);
  for (std::int32_t l = 0; l < 2; ++l) engine.attend(l, dq, dk, dk, out, &lse);
  for (const float x : mem.read(lse)) EXPECT_TRUE(std::isfinite(x));
  while (engine.has_unfinished()) engine.step();  // stores/attends may be skipped: nothing is read then
  test::expect_empty(engine.cache());
}

// A step the backend cannot serve is refused before it changes anything.
TEST(EngineCpu, BackendRefusesABadStepWhole) {
  BackendConfig bc;
  bc.cache = config(16, PreemptionMode::Swap, true, false).cache;
  bc.num_q_heads = 4;
  bc.max_num_seqs = 2;
  std::unique_ptr<Backend> backend = make_cpu_backend(bc);
  KVCacheManager& cache = backend->manager();
  cache.add_sequence(5, TokenLayout({{TokenKind::Text, 40}}), PrecisionPlan(2, 0));
  StepOutput step;
  step.decodes = {5, 5, 5};
  step.decode_slots = {0, 1, 2};
  expect_error<InvalidArgument>([&] { backend->apply(step); }, "max_num_seqs = 2");
  step.decodes = {7};
  step.decode_slots = {0};
  expect_error<UnknownId>([&] { backend->apply(step); }, "step.decodes[0] = 7");
  step.decodes = {5};
  step.decode_slots = {3};
  expect_error<InvalidArgument>([&] { backend->apply(step); }, "step.decode_slots[0] = 3");
  step.decode_slots = {0};
  expect_error<InvalidArgument>([&] { backend->apply(step); }, "step.append.offsets");
  StepOutput prefill;
  prefill.prefills.push_back({5, 0, 0, 41, true, {}});
  expect_error<InvalidArgument>([&] { backend->apply(prefill); }, "step.prefills[0]: rows [0, 41)");
  HostMemory mem;
  const std::vector<Half> rows(40 * 2 * 64);
  expect_error<InvalidArgument>(
      [&] {
        backend->store(0, mem.input(rows, {40, 2, 64}), mem.input(rows, {40, 2, 64}));
      },
      "no step applied");
  prefill.prefills[0].end = 40;
  backend->apply(prefill);
  backend->store(0, mem.input(rows, {40, 2, 64}), mem.input(rows, {40, 2, 64}));
  cache.free_sequence(5);
  test::expect_empty(cache);
}

}  // namespace
}  // namespace mixkv
