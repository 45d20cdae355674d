// Age tiers (SchedulerConfig::age_tiers): old windows demoted between steps,
// step by step against the rule, on real bytes (EngineSim applies every
// step with the CPU backend), with plans, floors, forks, never-fit checks
// and preemption.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "engine_sim.h"
#include "mixkv/core/errors.h"
#include "mixkv/scheduler/scheduler.h"
#include "scheduler_test_util.h"

namespace mixkv {
namespace {

constexpr std::int32_t kBs = 16;  // test::tiny's block_size

SchedulerConfig tiered(std::int32_t recent, std::vector<Precision> floor = {}, std::int32_t sink = 1) {
  SchedulerConfig c = test::base_config();
  c.age_tiers.enabled = true;
  c.age_tiers.recent_windows = recent;
  c.age_tiers.sink_windows = sink;
  c.age_tiers.layer_floor = std::move(floor);
  return c;
}

Request text_request(RequestId id, std::int32_t prompt, std::int32_t max_new) {
  Request r;
  r.id = id;
  r.layout = TokenLayout({{TokenKind::Text, prompt}});
  r.max_new_tokens = max_new;
  r.arrival_time = static_cast<double>(id);
  return r;
}

// The rule for a text-only sequence with n tokens at the step's start:
// stream block k is old once recent * bs tokens follow it, a sink when it
// holds a position below sink * bs.
Precision expected(std::int64_t n, std::int32_t k, std::int32_t recent, std::int32_t sink, Precision tier) {
  const bool old = n - 1 - (std::int64_t{k} * kBs + kBs - 1) >= std::int64_t{recent} * kBs;
  return old && k >= sink ? tier : Precision::FP16;
}

// Runs steps until `id` leaves, checking after each one that every stream
// block of a text-only request holds what the rule says for the tokens it
// had when the step started, that age demotions are listed with their
// request in tables_changed, and the invariants.
void run_text(test::EngineSim& sim, RequestId id, std::int32_t recent, std::int32_t sink,
              const std::vector<Precision>& tiers, std::int64_t& aged) {
  Scheduler& sched = sim.scheduler();
  const KVCacheManager& cache = sim.cache();
  for (int guard = 0; guard < 10000 && sched.has_unfinished(); ++guard) {
    const bool decoding = cache.contains(id) && sched.status(id).state == RequestState::Running;
    const std::int64_t n = decoding ? cache.num_tokens(id) : 0;
    const StepOutput out = sched.step();
    sim.apply(out, false);
    ASSERT_FALSE(testing::Test::HasFatalFailure());
    ASSERT_NO_THROW(sched.check_invariants());
    ASSERT_NO_THROW(cache.check_invariants());
    aged += out.age_demotions;
    for (std::int32_t i = out.plan_demotions; i < out.plan_demotions + out.age_demotions; ++i) {
      const DemoteOp& op = out.demotions[static_cast<std::size_t>(i)];
      EXPECT_EQ(op.src_precision, Precision::FP16);
      EXPECT_EQ(op.dst_precision, tiers[static_cast<std::size_t>(op.layer)]);
      EXPECT_NE(std::find(out.tables_changed.begin(), out.tables_changed.end(), op.id), out.tables_changed.end());
    }
    if (!cache.contains(id) || sched.status(id).state != RequestState::Running || n == 0) continue;
    for (std::int32_t layer = 0; layer < 2; ++layer) {
      for (std::int32_t k = 0; k < cache.stream_blocks(id); ++k) {
        EXPECT_EQ(cache.stream_precision(id, layer, k),
                  expected(n, k, recent, sink, tiers[static_cast<std::size_t>(layer)]))
            << "step " << out.step << " tokens " << n << " layer " << layer << " block " << k;
      }
    }
  }
}

TEST(AgeTiers, BadKnobsAreNamedAndGoodOnesAccepted) {
  KVCacheManager cache(test::tiny(8));
  auto rejects = [&](SchedulerConfig c, const std::string& what) {
    try {
      Scheduler s(cache, c);
      ADD_FAILURE() << "accepted a config with " << what;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  rejects(tiered(2, {}, -1), "config.age_tiers.sink_windows = -1");
  rejects(tiered(0), "config.age_tiers.recent_windows = 0");
  rejects(tiered(2, {Precision::INT4, Precision::INT4, Precision::INT2}), "config.age_tiers.layer_floor has 3 layers");
  rejects(tiered(2, {Precision::INT4, static_cast<Precision>(7)}), "config.age_tiers.layer_floor[1] = 7");
  SchedulerConfig off = tiered(0);
  off.age_tiers.enabled = false;
  rejects(off, "config.age_tiers.recent_windows = 0");  // checked even when off
  CacheConfig prompt_order = test::tiny(8);
  prompt_order.fp16_windows_first = false;
  KVCacheManager other(prompt_order);
  try {
    Scheduler s(other, tiered(2));
    ADD_FAILURE() << "accepted age tiers without fp16_windows_first";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("config.age_tiers.enabled = true needs the cache's fp16_windows_first"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(Scheduler(cache, tiered(1, {Precision::FP16, Precision::INT2}, 0)));
}

// W = 2, sink 1, INT4 in layer 0 and INT2 in layer 1: each block moves in
// the step that starts with 32 tokens after it, and block 0 never.
TEST(AgeTiers, TextWindowsDemoteExactlyWhenTheyAge) {
  const std::vector<Precision> tiers{Precision::INT4, Precision::INT2};
  test::EngineSim sim(test::tiny(24), tiered(2, tiers));
  sim.scheduler().add_request(text_request(1, 40, 120));
  std::int64_t aged = 0;
  run_text(sim, 1, 2, 1, tiers, aged);
  // 158 tokens at the last decode step's start: blocks 1..6 old (block 0 a sink).
  EXPECT_EQ(aged, 6 * 2);
  EXPECT_EQ(sim.scheduler().stats().age_demotions, 12);
  EXPECT_EQ(sim.scheduler().stats().demotions, 0);  // nothing under pressure
}

TEST(AgeTiers, SinksAndLayerFloorsAreKept) {
  const std::vector<Precision> tiers{Precision::FP16, Precision::INT4};  // layer 0 kept FP16
  test::EngineSim sim(test::tiny(24), tiered(1, tiers, /*sink=*/3));
  sim.scheduler().add_request(text_request(1, 70, 100));
  std::int64_t aged = 0;
  run_text(sim, 1, 1, 3, tiers, aged);
  // 168 tokens at the last decode step's start: blocks 0..8 old, 0..2 sinks, layer 1 only.
  EXPECT_EQ(aged, 6);
}

// The plan's precisions stay; tiers take only what it left FP16, never
// window 0; the sink text before the video stays FP16.
TEST(AgeTiers, PlanWindowsAreLeftAndFp16WindowsAge) {
  test::EngineSim sim(test::tiny(24), tiered(1));
  Request r = test::request(1, {{TokenKind::Text, 8}, {TokenKind::Visual, 80}, {TokenKind::Text, 8}}, 60);
  PrecisionPlan& plan = *r.plan;  // windows 0..4 at positions 8..87
  for (std::int32_t l = 0; l < 2; ++l) {
    plan.set(l, 1, Precision::INT2);
    plan.set(l, 3, Precision::INT4);
  }
  sim.scheduler().add_request(r);
  const KVCacheManager& cache = sim.cache();
  bool checked = false;
  while (sim.scheduler().has_unfinished()) {
    // Tiers apply from the first step that starts with the prompt done.
    const bool decoding = cache.contains(1) && sim.scheduler().status(1).state == RequestState::Running;
    const std::int64_t n = decoding ? cache.num_tokens(1) : 0;
    const StepOutput out = sim.scheduler().step();
    sim.apply(out, false);
    ASSERT_NO_THROW(sim.scheduler().check_invariants());
    if (!cache.contains(1) || !decoding) continue;
    checked = true;
    for (std::int32_t l = 0; l < 2; ++l) {
      EXPECT_EQ(cache.plan(1).at(l, 0), Precision::FP16);
      EXPECT_EQ(cache.plan(1).at(l, 1), Precision::INT2);
      EXPECT_EQ(cache.plan(1).at(l, 2), Precision::INT4);
      EXPECT_EQ(cache.plan(1).at(l, 3), Precision::INT4);
      // Window 4 ends at position 87: old once 16 tokens follow it.
      EXPECT_EQ(cache.plan(1).at(l, 4), n - 1 - 87 >= kBs ? Precision::INT4 : Precision::FP16) << n;
      // Stream: text 0..7 and 88..95 (block 0, a sink), then generated.
      EXPECT_EQ(cache.stream_precision(1, l, 0), Precision::FP16);
      for (std::int32_t k = 1; k < cache.stream_blocks(1); ++k) {
        const std::int64_t last = 96 + std::int64_t{k - 1} * kBs + kBs - 1;
        EXPECT_EQ(cache.stream_precision(1, l, k), n - 1 - last >= kBs ? Precision::INT4 : Precision::FP16);
      }
    }
  }
  EXPECT_TRUE(checked);
}

// The never-fit check counts the demotions to come: 315 tokens all FP16
// need 10 slabs of an 8-slab cache; with tiers the end holds 3 FP16 and 17
// INT4 blocks a layer (6 slabs), and the request runs to its end.
TEST(AgeTiers, FootprintCountsTheDemotionsToCome) {
  {
    test::EngineSim sim(test::tiny(8), test::base_config());
    sim.scheduler().add_request(text_request(1, 16, 300));
    const StepOutput out = sim.scheduler().step();
    ASSERT_EQ(out.rejected.size(), 1u);
    EXPECT_NE(out.rejected[0].reason.find("10 slabs"), std::string::npos) << out.rejected[0].reason;
  }
  const std::vector<Precision> tiers{Precision::INT4, Precision::INT4};
  test::EngineSim sim(test::tiny(8), tiered(1, tiers));
  sim.scheduler().add_request(text_request(1, 16, 300));
  std::int64_t aged = 0;
  run_text(sim, 1, 1, 1, tiers, aged);
  const SchedulerStats st = sim.scheduler().stats();
  EXPECT_EQ(st.finished, 1);
  EXPECT_EQ(st.rejected, 0);
  EXPECT_EQ(st.preempted_recompute + st.preempted_swap, 0);
  EXPECT_EQ(aged, 2 * 17);
}

// Shared blocks are never demoted under another holder: a fork shares the
// prompt's blocks, which stay FP16 while both live; each sibling's own
// generated blocks age.
TEST(AgeTiers, SharedBlocksOfAForkStayFp16) {
  test::EngineSim sim(test::tiny(32), tiered(1));
  Scheduler& sched = sim.scheduler();
  const KVCacheManager& cache = sim.cache();
  sched.add_request(text_request(1, 64, 80));
  StepOutput out = sched.step();  // the whole prompt: 4 full blocks
  sim.apply(out, false);
  ASSERT_EQ(sched.status(1).state, RequestState::Running);
  sched.fork(1, 2);
  sim.inherit(2, 1);
  for (int i = 0; i < 60; ++i) {
    out = sched.step();
    sim.apply(out, false);
    ASSERT_NO_THROW(sched.check_invariants());
    ASSERT_NO_THROW(cache.check_invariants());
  }
  for (const RequestId id : {1, 2}) {
    ASSERT_TRUE(cache.contains(id));
    for (std::int32_t l = 0; l < 2; ++l) {
      for (std::int32_t k = 0; k < 4; ++k) {
        EXPECT_EQ(cache.stream_precision(id, l, k), Precision::FP16) << id << " " << l << " " << k;
        const std::int32_t block = cache.blocks(id, l, Precision::FP16)[static_cast<std::size_t>(k)];
        EXPECT_EQ(cache.ref_count(Precision::FP16, block), 2);
      }
      // 124 tokens: generated blocks 4 and 5 (positions 64..95) are old.
      EXPECT_EQ(cache.stream_precision(id, l, 4), Precision::INT4);
      EXPECT_EQ(cache.stream_precision(id, l, 5), Precision::INT4);
      EXPECT_EQ(cache.stream_precision(id, l, 6), Precision::FP16);
    }
  }
  EXPECT_EQ(sched.stats().age_demotions, 2 * 2 * 2);
}

// Preemption: a request recomputed comes back as a longer FP16 prompt and
// ages again from its start; one swapped keeps its demoted blocks.
TEST(AgeTiers, PreemptedRequestsAgeAgain) {
  for (const PreemptionMode mode : {PreemptionMode::Recompute, PreemptionMode::Swap}) {
    SchedulerConfig c = tiered(1, {Precision::INT4, Precision::INT2});
    c.preemption = mode;
    c.demote_under_pressure = false;
    test::EngineSim sim(test::tiny(6, {64, 64, 64}), c);
    Scheduler& sched = sim.scheduler();
    for (RequestId id = 1; id <= 3; ++id) sched.add_request(text_request(id, 20 + 5 * static_cast<int>(id), 150));
    for (int guard = 0; guard < 20000 && sched.has_unfinished(); ++guard) {
      const StepOutput out = sched.step();
      sim.apply(out, false);
      ASSERT_FALSE(testing::Test::HasFatalFailure());
      ASSERT_NO_THROW(sched.check_invariants());
      ASSERT_NO_THROW(sim.cache().check_invariants());
    }
    const SchedulerStats st = sched.stats();
    EXPECT_EQ(st.finished, 3) << "mode " << static_cast<int>(mode);
    EXPECT_GT(mode == PreemptionMode::Swap ? st.preempted_swap : st.preempted_recompute, 0);
    EXPECT_GT(st.age_demotions, 0);
    for (const Precision p : kAllPrecisions) EXPECT_EQ(sim.cache().pool_stats(p).used_blocks, 0);
  }
}

}  // namespace
}  // namespace mixkv
