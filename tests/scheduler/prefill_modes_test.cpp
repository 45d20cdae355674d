// Prefill modes (SchedulerConfig::prefill_mode). Under Exact a prompt
// prefilled in several chunks is admitted with every window FP16 (its
// all-FP16 demand), and the step after its last chunk demotes it to its
// plan, after which the manager's plan and the memory held equal compact
// mode's. Demotions that cannot get their target blocks wait for a later
// step while the request decodes at FP16; swap, recompute, fork, cancel, a
// vanished sequence and drafts each meet a pending plan; decode outputs
// after the demotions equal compact mode's bit for bit; a bad config and
// corrupted books are named.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "../cache/cache_test_util.h"
#include "engine_sim.h"
#include "mixkv/core/errors.h"
#include "scheduler_access.h"
#include "scheduler_test_util.h"

namespace mixkv {
namespace {

using test::base_config;
using test::expect_error;
using test::request;
using test::tiny;

// Window 0 FP16; the others INT4, except layer 1's odd windows at INT2
// (FP16 -> INT4 and FP16 -> INT2 demotions both).
Request video(RequestId id, std::int32_t windows, std::int32_t max_new, std::int32_t text_after = 3) {
  std::vector<Segment> segments{{TokenKind::Text, 4}, {TokenKind::Visual, 16 * windows}};
  if (text_after > 0) segments.push_back({TokenKind::Text, text_after});
  Request r = request(id, segments, max_new, Precision::INT4);
  for (std::int32_t w = 1; w < r.plan->num_windows(); w += 2) r.plan->set(1, w, Precision::INT2);
  return r;
}

// The plan with every window but window 0 FP16: what an exact prefill holds.
PrecisionPlan held_fp16(const PrecisionPlan& plan) {
  PrecisionPlan p = plan;
  for (std::int32_t l = 0; l < p.num_layers(); ++l) {
    for (std::int32_t w = 1; w < p.num_windows(); ++w) p.set(l, w, Precision::FP16);
  }
  return p;
}

std::int32_t quantized(const PrecisionPlan& plan) {
  std::int32_t n = 0;
  for (std::int32_t l = 0; l < plan.num_layers(); ++l) n += plan.window_counts(l)[1] + plan.window_counts(l)[2];
  return n;
}

SchedulerConfig exact_config() {
  SchedulerConfig c = base_config();
  c.prefill_mode = PrefillMode::Exact;
  return c;
}

TEST(PrefillModes, ExactNeedsWindowsFirstAndAKnownMode) {
  CacheConfig cc = tiny(8);
  cc.fp16_windows_first = false;
  KVCacheManager prompt_order(cc);
  expect_error<InvalidArgument>([&] { Scheduler s(prompt_order, exact_config()); },
                                "config.prefill_mode = Exact needs the cache's fp16_windows_first = true");
  EXPECT_NO_THROW(Scheduler(prompt_order, base_config()));  // Compact stores at the plan: any packing
  KVCacheManager cache(tiny(8));
  SchedulerConfig bad = base_config();
  bad.prefill_mode = static_cast<PrefillMode>(2);
  expect_error<InvalidArgument>([&] { Scheduler s(cache, bad); }, "config.prefill_mode = 2");
}

// The same request under both modes, step by step: exact holds the
// all-FP16 demand until the step after its last chunk, which demotes every
// quantized window of the plan (and nothing earlier); from then on the
// manager's plan is the request's and every pool holds what compact holds.
TEST(PrefillModes, ExactHoldsFp16UntilTheStepAfterTheLastChunk) {
  KVCacheManager compact_cache(tiny(40));
  KVCacheManager exact_cache(tiny(40));
  Scheduler compact(compact_cache, base_config());
  Scheduler exact(exact_cache, exact_config());
  const Request r = video(1, 8, 6);  // 135 tokens in chunks of at most 64
  const PrecisionPlan& plan = *r.plan;
  compact.add_request(r);
  exact.add_request(r);
  std::int64_t last_chunk = -1;
  std::int64_t demoted = -1;
  for (int i = 0; i < 30 && exact.has_unfinished(); ++i) {
    const StepOutput a = compact.step();
    const StepOutput b = exact.step();
    ASSERT_NO_THROW(exact.check_invariants());
    ASSERT_EQ(a.prefills.size(), b.prefills.size()) << "the chunks differ";
    EXPECT_TRUE(a.demotions.empty());
    const bool done = !b.prefills.empty() && b.prefills[0].last;
    if (!exact.contains(1)) break;
    if (last_chunk < 0) {
      // Prefilling, and the step of the last chunk: all FP16.
      EXPECT_TRUE(b.demotions.empty()) << "step " << b.step;
      EXPECT_EQ(exact_cache.plan(1), held_fp16(plan));
      EXPECT_EQ(exact_cache.blocks_held(1), exact_cache.demand(r.layout, held_fp16(plan)));
      EXPECT_EQ(compact_cache.blocks_held(1), compact_cache.demand(r.layout, plan));
      EXPECT_TRUE(exact.status(1).plan_pending);
      if (done) last_chunk = b.step;
      continue;
    }
    if (demoted < 0) {
      demoted = b.step;
      EXPECT_EQ(b.step, last_chunk + 1);
      ASSERT_EQ(b.demotions.size(), static_cast<std::size_t>(quantized(plan)));
      EXPECT_EQ(b.plan_demotions, quantized(plan));
      for (const DemoteOp& op : b.demotions) {
        EXPECT_EQ(op.id, 1);
        EXPECT_EQ(op.src_precision, Precision::FP16);
        EXPECT_EQ(op.dst_precision, plan.at(op.layer, op.window));
      }
      EXPECT_NE(std::find(b.tables_changed.begin(), b.tables_changed.end(), 1), b.tables_changed.end());
      EXPECT_EQ(b.decodes, std::vector<RequestId>{1}) << "it decodes in the same step, after the demotions";
      EXPECT_FALSE(exact.status(1).plan_pending);
    } else {
      EXPECT_TRUE(b.demotions.empty());
    }
    EXPECT_EQ(exact_cache.plan(1), plan);
    EXPECT_EQ(exact_cache.blocks_held(1), compact_cache.blocks_held(1)) << "step " << b.step;
  }
  EXPECT_GT(last_chunk, 1) << "the prompt was prefilled in one chunk";
  EXPECT_GT(demoted, 0);
  EXPECT_EQ(exact.stats().plan_demotions, quantized(plan));
  EXPECT_EQ(exact.stats().plan_waits, 0);
  EXPECT_EQ(exact.stats().demotions, 0);
  while (exact.has_unfinished()) (void)exact.step();
  for (const Precision p : kAllPrecisions) EXPECT_EQ(exact_cache.pool_stats(p).used_blocks, 0);
}

// A prompt prefilled in one chunk reads no earlier chunk: it is stored at
// its plan at once, reserving the plan's demand.
TEST(PrefillModes, OneChunkPromptIsStoredAtItsPlan) {
  KVCacheManager cache(tiny(40));
  Scheduler sched(cache, exact_config());
  const Request r = video(1, 3, 4);  // 55 tokens
  sched.add_request(r);
  const StepOutput out = sched.step();
  ASSERT_EQ(out.prefills.size(), 1u);
  EXPECT_TRUE(out.prefills[0].last);
  EXPECT_FALSE(sched.status(1).plan_pending);
  EXPECT_EQ(cache.plan(1), *r.plan);
  EXPECT_EQ(cache.blocks_held(1), cache.demand(r.layout, *r.plan));
  EXPECT_TRUE(sched.step().demotions.empty());
}

// A prompt that must be chunked and whose FP16 prompt (plus one slab for
// the demotions' targets) exceeds the cache can never run exactly: it is
// rejected with the reason; compact mode runs it.
TEST(PrefillModes, ExactRejectsAChunkedPromptWhoseFp16FormCanNeverFit) {
  const Request r = video(1, 12, 2, 0);  // 196 tokens: FP16 13 blocks a layer (7 slabs), the plan 3 slabs
  KVCacheManager cache(tiny(7));
  Scheduler sched(cache, exact_config());
  sched.add_request(r);
  const StepOutput out = sched.step();
  ASSERT_EQ(out.rejected.size(), 1u);
  EXPECT_NE(out.rejected[0].reason.find("prefill_mode = Exact stores its prompt of 196 tokens all FP16"),
            std::string::npos)
      << out.rejected[0].reason;
  KVCacheManager cache2(tiny(7));
  Scheduler compact(cache2, base_config());
  compact.add_request(r);
  EXPECT_TRUE(compact.step().rejected.empty());
}

// Request 1 (text, 60 tokens) and request 2 (exact, 68 tokens in three
// chunks: [0, 4), [4, 52), [52, 68)) fill a 5-slab cache: 2 FP16 slabs and
// 10 FP16 blocks. When 2's prompt completes no INT4 block can be had, so
// its plan waits while it decodes at FP16.
struct Full {
  KVCacheManager cache;
  Scheduler sched;
  explicit Full(SchedulerConfig config, std::int32_t max_new = 40)
      : cache(tiny(5, {16, 16, 16})), sched(cache, config) {
    sched.add_request(request(1, {{TokenKind::Text, 60}}, max_new));
    sched.add_request(video(2, 4, max_new, 0));
    for (int i = 0; i < 3; ++i) {
      (void)sched.step();
      sched.check_invariants();
    }
  }
};

TEST(PrefillModes, DemotionsWaitForTargetBlocksThenApply) {
  Full f(exact_config());
  ASSERT_EQ(f.sched.status(2).state, RequestState::Running);
  ASSERT_EQ(f.cache.free_slabs(), 0);
  const StepOutput waiting = f.sched.step();
  EXPECT_TRUE(waiting.demotions.empty());
  EXPECT_EQ(f.sched.stats().plan_waits, 1);
  EXPECT_NE(std::find(waiting.decodes.begin(), waiting.decodes.end(), 2), waiting.decodes.end())
      << "it decodes with its FP16 windows meanwhile";
  EXPECT_TRUE(waiting.preempted.empty());
  EXPECT_TRUE(f.sched.status(2).plan_pending);
  EXPECT_NO_THROW(f.sched.check_invariants());
  // Fork waits for the plan: a shared window is never demoted.
  expect_error<InvalidArgument>([&] { f.sched.fork(2, 9); }, "parent's plan is pending");
  EXPECT_NO_THROW(f.sched.check_invariants());

  ASSERT_TRUE(f.sched.finish(1));
  const StepOutput applied = f.sched.step();
  EXPECT_EQ(applied.plan_demotions, 6);
  EXPECT_EQ(applied.demotions.size(), 6u);
  EXPECT_EQ(f.cache.plan(2), *video(2, 4, 1, 0).plan);
  EXPECT_FALSE(f.sched.status(2).plan_pending);
  EXPECT_EQ(f.sched.stats().plan_demotions, 6);
  EXPECT_EQ(f.sched.stats().plan_waits, 1);
  EXPECT_NO_THROW(f.sched.check_invariants());
  EXPECT_NO_THROW(f.sched.fork(2, 9));
  EXPECT_NO_THROW(f.sched.check_invariants());
}

// Swapped out with its plan pending, it demotes in the step after it is
// back (a swapped-out sequence is not in device memory to demote).
TEST(PrefillModes, SwappedOutPendingPlanAppliesOnceBack) {
  SchedulerConfig config = exact_config();
  config.preemption = PreemptionMode::Swap;
  Full f(config, 60);
  std::int64_t swapped_in = -1;
  bool out_pending = false;
  for (int i = 0; i < 200 && f.sched.contains(2); ++i) {
    if (f.sched.status(2).state == RequestState::Swapped && f.sched.contains(1)) {
      out_pending = f.sched.status(2).plan_pending;
      ASSERT_TRUE(f.sched.finish(1));
    }
    const StepOutput out = f.sched.step();
    ASSERT_NO_THROW(f.sched.check_invariants()) << "step " << out.step;
    if (std::find(out.swapped_in.begin(), out.swapped_in.end(), 2) != out.swapped_in.end()) swapped_in = out.step;
    if (out.plan_demotions > 0) {
      EXPECT_GT(swapped_in, 0) << "demoted before it came back";
      EXPECT_EQ(out.step, swapped_in + 1);
      EXPECT_EQ(f.cache.plan(2), *video(2, 4, 1, 0).plan);
      break;
    }
  }
  EXPECT_TRUE(out_pending) << "request 2 was not swapped out with its plan pending";
  EXPECT_EQ(f.sched.stats().plan_demotions, 6);
  EXPECT_GE(f.sched.stats().preempted_swap, 1);
}

// Recomputed with its plan pending: queued again, prefilled FP16 again
// (its prompt now the original plus its tokens), then demoted to the plan.
TEST(PrefillModes, RecomputedPendingPlanIsPrefilledFp16Again) {
  SchedulerConfig config = exact_config();
  config.preemption = PreemptionMode::Recompute;
  Full f(config, 60);
  bool preempted = false;
  bool again = false;
  for (int i = 0; i < 200 && f.sched.contains(2); ++i) {
    const bool pending = f.sched.status(2).plan_pending;
    const StepOutput out = f.sched.step();
    ASSERT_NO_THROW(f.sched.check_invariants()) << "step " << out.step;
    if (std::find(out.preempted.begin(), out.preempted.end(), 2) != out.preempted.end()) {
      EXPECT_TRUE(pending) << "preempted after its plan was applied";
      preempted = true;
      EXPECT_FALSE(f.sched.status(2).plan_pending);
      if (f.sched.contains(1)) {
        ASSERT_TRUE(f.sched.finish(1));
      }
      continue;
    }
    if (preempted && f.sched.status(2).state == RequestState::Prefilling) {
      again = true;
      EXPECT_TRUE(f.sched.status(2).plan_pending);
      EXPECT_EQ(f.cache.plan(2), held_fp16(*video(2, 4, 1, 0).plan));
    }
    if (preempted && out.plan_demotions > 0) {
      EXPECT_EQ(f.cache.plan(2), *video(2, 4, 1, 0).plan);
      break;
    }
  }
  EXPECT_TRUE(preempted);
  EXPECT_TRUE(again) << "the re-prefill was not chunked";
  EXPECT_EQ(f.sched.stats().plan_demotions, 6);
  EXPECT_FALSE(f.sched.status(2).plan_pending);
}

TEST(PrefillModes, CancelOrVanishWhilePending) {
  for (const bool vanish : {false, true}) {
    SCOPED_TRACE(vanish ? "vanished" : "cancelled");
    Full f(exact_config());
    (void)f.sched.step();
    ASSERT_TRUE(f.sched.status(2).plan_pending);
    if (vanish) {
      f.cache.free_sequence(2);
      EXPECT_THROW(f.sched.check_invariants(), InvariantViolation);
    } else {
      ASSERT_TRUE(f.sched.cancel(2));
      EXPECT_NO_THROW(f.sched.check_invariants());
    }
    const StepOutput out = f.sched.step();
    EXPECT_TRUE(out.demotions.empty());
    ASSERT_EQ(out.finished.size(), 1u);
    EXPECT_EQ(out.finished[0].id, 2);
    EXPECT_EQ(out.finished[0].reason, FinishReason::Cancelled);
    EXPECT_EQ(out.finished[0].note.empty(), !vanish);
    EXPECT_NO_THROW(f.sched.check_invariants());
    EXPECT_EQ(f.cache.blocks_held(1), f.cache.demand(TokenLayout({{TokenKind::Text, 60}}), PrecisionPlan(2, 0)));
    while (f.sched.has_unfinished()) (void)f.sched.step();
    for (const Precision p : kAllPrecisions) EXPECT_EQ(f.cache.pool_stats(p).used_blocks, 0);
  }
}

// Drafts in the step of the plan demotions: the drafts are appended after
// the demotions, the demotions come from the plan only, and accept() works
// as in any step.
TEST(PrefillModes, DraftsCoexistWithPlanDemotions) {
  KVCacheManager cache(tiny(40));
  SchedulerConfig config = exact_config();
  config.num_speculative_tokens = 2;
  Scheduler sched(cache, config);
  const Request r = video(1, 8, 20);
  sched.add_request(r);
  StepOutput out;
  for (int i = 0; i < 10 && out.plan_demotions == 0; ++i) out = sched.step();
  ASSERT_EQ(out.plan_demotions, quantized(*r.plan));
  EXPECT_EQ(out.demotions.size(), static_cast<std::size_t>(out.plan_demotions)) << "drafts never demote";
  ASSERT_EQ(out.decode_rows, (std::vector<std::int32_t>{0, 3}));
  EXPECT_EQ(sched.status(1).drafts, 2);
  EXPECT_NO_THROW(sched.check_invariants());
  sched.accept(1, 1);
  EXPECT_NO_THROW(sched.check_invariants());
  EXPECT_EQ(cache.plan(1), *r.plan);
  while (sched.has_unfinished()) {
    const StepOutput s = sched.step();
    EXPECT_TRUE(s.demotions.empty());
    ASSERT_NO_THROW(sched.check_invariants());
  }
  for (const Precision p : kAllPrecisions) EXPECT_EQ(cache.pool_stats(p).used_blocks, 0);
}

// On real bytes (EngineSim: stores, demotions, decode attention on the CPU
// backend), with no memory pressure: the decode outputs of exact mode equal
// compact mode's bit for bit. The demote kernel quantizes the FP16 window
// as the store would have, and the page lists end up in the same order.
TEST(PrefillModes, DecodesAfterTheDemotionsEqualCompactMode) {
  std::vector<Request> requests;
  for (RequestId id = 0; id < 6; ++id) requests.push_back(video(id, 3 + static_cast<std::int32_t>(id), 12, 1 + id));
  requests.push_back(request(6, {{TokenKind::Text, 100}}, 12));  // no plan: nothing to demote
  auto run = [&](PrefillMode mode, SchedulerStats& stats) {
    SchedulerConfig config = base_config();
    config.prefill_mode = mode;
    test::EngineSim engine(tiny(120), config);
    for (const Request& r : requests) engine.scheduler().add_request(r);
    while (engine.scheduler().has_unfinished()) {
      const StepOutput out = engine.scheduler().step();
      engine.apply(out, true);
      EXPECT_NO_THROW(engine.scheduler().check_invariants());
    }
    stats = engine.scheduler().stats();
    return engine.outputs();
  };
  SchedulerStats compact_stats, exact_stats;
  const auto compact = run(PrefillMode::Compact, compact_stats);
  const auto exact = run(PrefillMode::Exact, exact_stats);
  EXPECT_GT(exact_stats.plan_demotions, 0);
  EXPECT_EQ(exact_stats.steps, compact_stats.steps);
  EXPECT_EQ(exact_stats.preempted_recompute + exact_stats.preempted_swap + exact_stats.demotions, 0);
  ASSERT_EQ(exact.size(), compact.size());
  EXPECT_TRUE(exact == compact) << "a decode output differs";
}

// The plan books can fail: a compact request marked exact, an exact one
// dropped from the planning list, a manager plan above a compact request's.
TEST(PrefillModes, InvariantsCatchCorruptedPlans) {
  auto expect_violation = [](const Scheduler& sched, const std::string& needle) {
    try {
      sched.check_invariants();
      ADD_FAILURE() << "expected a violation naming " << needle;
    } catch (const InvariantViolation& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  {
    KVCacheManager cache(tiny(40));
    Scheduler sched(cache, base_config());
    sched.add_request(video(1, 8, 9));
    (void)sched.step();
    test::SchedulerAccess::entry(sched, 1).exact = true;
    expect_violation(sched, "is marked exact under PrefillMode::Compact");
    test::SchedulerAccess::entry(sched, 1).exact = false;
    test::SchedulerAccess::entry(sched, 1).plan.set(0, 2, Precision::INT2);
    expect_violation(sched, "is held at INT4 at layer 0 window 2, above its plan's INT2");
  }
  {
    KVCacheManager cache(tiny(40));
    Scheduler sched(cache, exact_config());
    sched.add_request(video(1, 8, 9));
    while (sched.status(1).state != RequestState::Running) (void)sched.step();
    ASSERT_TRUE(sched.status(1).plan_pending);
    ASSERT_NO_THROW(sched.check_invariants());
    test::SchedulerAccess::impl(sched).planning.clear();
    expect_violation(sched, "is not listed as awaiting its plan's demotions");
  }
  {
    KVCacheManager cache(tiny(40));
    Scheduler sched(cache, exact_config());
    sched.add_request(video(1, 8, 9));
    (void)sched.step();
    ASSERT_EQ(sched.status(1).state, RequestState::Prefilling);
    cache.demote(std::vector<Demotion>{{1, 0, 1, Precision::INT4}});
    expect_violation(sched, "prefills exact but the manager holds INT4 at layer 0 window 1");
  }
}

}  // namespace
}  // namespace mixkv
