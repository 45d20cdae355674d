// Engine::prefill: chunked prefill with attention through the cache. Each
// chunk's rows attend to what earlier chunks stored (quantized windows read
// quantized) and causally to each other; the engine keeps no prompt copy.
// Held to a float64 attention over the cache's own bytes, in an engine loop
// with forks, cancels, swaps, recomputes and demotions; the decode outputs
// equal those of store() bit for bit (prefill() stores the same bytes).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine_loop.h"
#include "mixkv/core/errors.h"

namespace mixkv {
namespace {

using test::HostMemory;
using test::Outputs;
using test::RunStats;
using test::Workload;
using test::WorkloadOptions;

// 2 layers, 2 KV heads, 6 query heads (GQA 3), head_dim 64, block 32, chunks
// of at most 72 rows (not a multiple of 16): prompts span several chunks.
EngineConfig config(bool windows_first, std::int32_t slabs) {
  EngineConfig c;
  c.cache.shape = CacheShape{2, 2, 64, 32};
  c.cache.slab_bytes = 64 << 10;
  c.cache.arena_bytes = static_cast<std::size_t>(slabs) * c.cache.slab_bytes;
  c.cache.swap_blocks = {96, 96, 96};
  c.cache.fp16_windows_first = windows_first;
  c.scheduler.max_num_seqs = 8;
  c.scheduler.max_num_batched_tokens = 72;
  c.scheduler.watermark = 0.0;
  c.scheduler.preemption = PreemptionMode::Swap;
  c.scheduler.demote_under_pressure = true;
  c.num_q_heads = 6;
  return c;
}

class PrefillLoop : public ::testing::TestWithParam<bool> {};

TEST_P(PrefillLoop, AttendsThroughTheCache) {
  for (const std::uint32_t seed : {1u, 2u}) {
    const EngineConfig c = config(GetParam(), seed == 1 ? 6 : 40);
    WorkloadOptions o;
    o.seed = seed;
    o.requests = 15;
    o.max_new_tokens = 30;
    const Workload workload(c.cache.shape, o);
    Engine engine(c);
    HostMemory mem;
    Outputs got, want, stored;
    const RunStats stats = test::run_engine(engine, workload, mem, got, /*through_cache=*/true);
    test::run_reference(c, workload, want, /*prefill_outputs=*/true);
    EXPECT_FALSE(engine.has_unfinished());
    test::expect_empty(engine.cache());
    // The decode outputs: the same bytes in the cache as store() leaves.
    const test::Diff decode = test::compare(got, want);
    EXPECT_EQ(decode.out, 0.0) << "seed " << seed;
    EXPECT_EQ(decode.lse, 0.0) << "seed " << seed;
    // The prefill rows against float64: one FP16 rounding of out apart.
    ASSERT_GT(got.prefill.size(), 0u);
    const test::Diff prefill = test::compare(got.prefill, want.prefill);
    EXPECT_LE(prefill.out, 1e-3) << "seed " << seed;
    EXPECT_LE(prefill.lse, 1e-4) << "seed " << seed;
    EXPECT_GT(stats.prefill_rows, 0);
    std::printf("seed %u: %zu prefill rows x layers, max |out| diff %.2e, |lse| diff %.2e\n", seed, got.prefill.size(),
                prefill.out, prefill.lse);
  }
}

INSTANTIATE_TEST_SUITE_P(Packing, PrefillLoop, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "WindowsFirst" : "PromptOrder"; });

// Speculative decoding: each decode verifies up to 3 drafts in one attend()
// and a pseudo-random number is accepted. Every row equals the plain
// decode of the same position (one FP16 rounding apart: extend and decode
// arithmetic differ), in both packings, with and without memory pressure.
TEST_P(PrefillLoop, DraftRowsEqualPlainDecodes) {
  for (const std::uint32_t seed : {3u, 4u}) {
    EngineConfig c = config(GetParam(), seed == 3 ? 8 : 40);
    // Demotion picks windows by the schedule, which drafts change: without
    // it a position holds the same bytes in both runs (swaps and
    // recomputes store them again exactly).
    c.scheduler.demote_under_pressure = false;
    WorkloadOptions o;
    o.seed = seed;
    o.requests = 12;
    o.max_new_tokens = 30;
    o.forks = false;  // fork points and cancels depend on the schedule, which drafts change
    o.cancels = false;
    const Workload workload(c.cache.shape, o);
    HostMemory mem;
    Outputs plain, drafted;
    {
      Engine engine(c);
      test::run_engine(engine, workload, mem, plain, /*through_cache=*/true);
    }
    c.scheduler.num_speculative_tokens = 3;
    Engine engine(c);
    const RunStats stats = test::run_engine(engine, workload, mem, drafted, /*through_cache=*/true);
    EXPECT_FALSE(engine.has_unfinished());
    test::expect_empty(engine.cache());
    EXPECT_GT(stats.drafts, 0);
    EXPECT_GT(stats.accepted, 0);
    EXPECT_LT(stats.accepted, stats.drafts);
    const test::Diff d = test::compare(drafted.rows, plain.rows, /*a_may_lack=*/true);
    EXPECT_LE(d.out, 1e-3) << "seed " << seed;
    EXPECT_LE(d.lse, 1e-4) << "seed " << seed;
    std::printf("seed %u: %lld drafts, %lld accepted, %zu decode rows, max |out| diff %.2e, |lse| diff %.2e\n", seed,
                static_cast<long long>(stats.drafts), static_cast<long long>(stats.accepted), drafted.rows.size(),
                d.out, d.lse);
  }
}

// Arrays of the wrong shape, overlapping outputs and a bad layer are named
// and leave the scheduler as it was.
TEST(EnginePrefill, BadArraysAreNamed) {
  EngineConfig c = config(true, 40);
  Engine engine(c);
  Request r;
  r.id = 1;
  r.layout = TokenLayout({{TokenKind::Text, 20}});
  r.max_new_tokens = 2;
  engine.add_request(r);
  const StepOutput& s = engine.step();
  ASSERT_EQ(s.prefills.size(), 1u);
  const std::int64_t rows = 20;
  std::vector<Half> q(static_cast<std::size_t>(rows * 6 * 64)), kv(static_cast<std::size_t>(rows * 2 * 64));
  std::vector<Half> out(q.size());
  const auto view = [](void* p, DType t, std::initializer_list<std::int64_t> shape) {
    return HostMemory::view(p, t, shape);
  };
  const std::string before = engine.scheduler().describe_state();
  auto expect_named = [&](auto&& call, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << "expected an error naming " << needle;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_named(
      [&] {
        engine.prefill(0, view(q.data(), DType::F16, {rows - 1, 6, 64}), view(kv.data(), DType::F16, {rows, 2, 64}),
                       view(kv.data(), DType::F16, {rows, 2, 64}), view(out.data(), DType::F16, {rows, 6, 64}));
      },
      "q");
  expect_named(
      [&] {
        engine.prefill(0, view(q.data(), DType::F16, {rows, 6, 64}), view(kv.data(), DType::F16, {rows, 2, 64}),
                       view(kv.data(), DType::F16, {rows, 2, 64}), view(q.data(), DType::F16, {rows, 6, 64}));
      },
      "out overlaps q");
  EXPECT_THROW(engine.prefill(2, view(q.data(), DType::F16, {rows, 6, 64}), view(kv.data(), DType::F16, {rows, 2, 64}),
                              view(kv.data(), DType::F16, {rows, 2, 64}), view(out.data(), DType::F16, {rows, 6, 64})),
               IndexOutOfRange);
  EXPECT_EQ(engine.scheduler().describe_state(), before);
}

}  // namespace
}  // namespace mixkv
