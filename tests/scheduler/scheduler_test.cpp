// The scheduler's promises, one at a time, on tiny caches: forced
// preemption changes no FP16 result, cancel frees everything in every state,
// requests that can never fit are rejected with a reason, a large request
// blocks the others only for a bounded number of steps, chunks end on
// window boundaries, demotion takes the least similar windows first, and
// bad input is refused by name without changing anything.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <random>

#include "../cache/cache_test_util.h"
#include "engine_sim.h"
#include "mixkv/scheduler/scheduler.h"
#include "scheduler_test_util.h"

namespace mixkv {
namespace {

using test::expect_error;

using test::base_config;
using test::request;
using test::tiny;

// Runs to completion; returns every attention output.
std::map<std::tuple<RequestId, std::int64_t, std::int32_t>, std::vector<float>> serve(
    const CacheConfig& cache_config, const SchedulerConfig& config, const std::vector<Request>& requests,
    SchedulerStats* stats) {
  test::EngineSim engine(cache_config, config);
  Scheduler& sched = engine.scheduler();
  for (const Request& r : requests) sched.add_request(r);
  for (int step = 0; sched.has_unfinished() && step < 100000; ++step) {
    const StepOutput out = sched.step();
    engine.apply(out, true);
    EXPECT_NO_THROW(sched.check_invariants());
    EXPECT_TRUE(out.rejected.empty()) << out.rejected.front().reason;
  }
  EXPECT_FALSE(sched.has_unfinished());
  if (stats) *stats = sched.stats();
  return engine.outputs();
}

// Every decode output of the run under pressure equals the unpressured
// one. A request recomputed after generating g tokens prefills its g-th
// token instead of decoding it, so that decode output is absent, and only
// those: at most one per recompute.
void expect_same_outputs(const std::map<std::tuple<RequestId, std::int64_t, std::int32_t>, std::vector<float>>& big,
                         const std::map<std::tuple<RequestId, std::int64_t, std::int32_t>, std::vector<float>>& small,
                         std::int64_t recomputes, std::int32_t layers) {
  EXPECT_LE(big.size() - small.size(), static_cast<std::size_t>(recomputes * layers));
  double worst = 0.0;
  for (const auto& [key, out] : small) {
    const auto it = big.find(key);
    ASSERT_NE(it, big.end());
    for (std::size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::abs(double(out[i]) - it->second[i]));
  }
  // Only the order of the pools' blocks differs: the merge is in double.
  EXPECT_LE(worst, 1e-6);
}

std::vector<Request> fp16_workload(int n, std::uint64_t seed) {
  std::mt19937 rng(static_cast<std::uint32_t>(seed));
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<Request> rs;
  for (int i = 0; i < n; ++i) {
    rs.push_back(
        request(i, {{TokenKind::Text, pick(1, 9)}, {TokenKind::Visual, pick(0, 70)}, {TokenKind::Text, pick(1, 9)}},
                pick(1, 60)));
  }
  return rs;
}

TEST(Scheduler, ForcedPreemptionChangesNoFp16Result) {
  const std::vector<Request> work = fp16_workload(60, 3);
  SchedulerConfig config = base_config();
  config.demote_under_pressure = false;  // demotion would change FP16 results on purpose
  SchedulerStats big_stats;
  const auto big = serve(tiny(200), config, work, &big_stats);
  EXPECT_EQ(big_stats.preempted_recompute + big_stats.preempted_swap, 0);
  for (const PreemptionMode mode : {PreemptionMode::Recompute, PreemptionMode::Swap}) {
    config.preemption = mode;
    SchedulerStats small_stats;
    const auto small = serve(tiny(12, {20, 4, 4}), config, work, &small_stats);
    EXPECT_GT(small_stats.preempted_recompute + small_stats.preempted_swap, 0) << "the tiny cache forced nothing";
    if (mode == PreemptionMode::Swap) {
      EXPECT_GT(small_stats.preempted_swap, 0);
    }
    expect_same_outputs(big, small, small_stats.preempted_recompute, 2);
  }
}

// An engine with only the compact slots (offsets + changed tails) writes
// every decode token where the per-layer slots say: the same outputs, bit
// for bit, under demotion, swapping and recompute.
TEST(Scheduler, CompactSlotsGiveTheSameOutputs) {
  std::vector<Request> work = fp16_workload(40, 5);
  for (Request& r : work) {
    for (std::int32_t w = 1; w < r.plan->num_windows(); ++w)
      r.plan->set(w % 2, w, w % 3 == 0 ? Precision::INT2 : Precision::INT4);
  }
  SchedulerConfig config = base_config();
  config.preemption = PreemptionMode::Swap;
  SchedulerStats with_stats;
  const auto with_slots = serve(tiny(12, {20, 4, 4}), config, work, &with_stats);
  config.per_layer_slots = false;
  SchedulerStats compact_stats;
  const auto compact = serve(tiny(12, {20, 4, 4}), config, work, &compact_stats);
  EXPECT_GT(with_stats.demotions, 0);
  EXPECT_GT(with_stats.preempted_swap + with_stats.preempted_recompute, 0);
  EXPECT_EQ(compact_stats.decode_tokens, with_stats.decode_tokens);
  EXPECT_EQ(compact, with_slots);
}

// Steps until `id` is in `state` (or gives up).
void step_until(Scheduler& sched, test::EngineSim& engine, RequestId id, RequestState state) {
  for (int i = 0; i < 200 && sched.contains(id) && sched.status(id).state != state; ++i)
    engine.apply(sched.step(), false);
  ASSERT_TRUE(sched.contains(id));
  ASSERT_EQ(sched.status(id).state, state);
}

TEST(Scheduler, CancelFreesEverythingInEveryState) {
  for (const RequestState target :
       {RequestState::Waiting, RequestState::Prefilling, RequestState::Running, RequestState::Swapped}) {
    SchedulerConfig config = base_config();
    config.preemption = PreemptionMode::Swap;
    config.demote_under_pressure = false;
    config.max_num_batched_tokens = 32;  // long prompts prefill in chunks
    test::EngineSim engine(tiny(10, {40, 40, 40}), config);
    KVCacheManager& cache = engine.cache();
    Scheduler& sched = engine.scheduler();
    // Request 1 takes most of the cache and grows; 0 is older and is the
    // one to swap out (the victim is the newest... so 0 arrives later).
    if (target == RequestState::Swapped) {
      sched.add_request(request(1, {{TokenKind::Text, 20}}, 200));
      sched.add_request(request(2, {{TokenKind::Text, 20}}, 200));
      step_until(sched, engine, 2, RequestState::Swapped);
      ASSERT_TRUE(sched.cancel(2));
    } else {
      sched.add_request(request(1, {{TokenKind::Text, 5}, {TokenKind::Visual, 64}, {TokenKind::Text, 5}}, 10));
      if (target == RequestState::Waiting) {
        ASSERT_EQ(sched.status(1).state, RequestState::Waiting);
      } else {
        step_until(sched, engine, 1, target);
      }
      ASSERT_TRUE(sched.cancel(1));
      for (const Precision p : kAllPrecisions) EXPECT_EQ(cache.pool_stats(p).used_blocks, 0) << to_string(p);
    }
    EXPECT_NO_THROW(sched.check_invariants());
    // Idempotent: a second cancel (or finish) does nothing.
    const std::string before = sched.describe_state();
    EXPECT_FALSE(sched.cancel(target == RequestState::Swapped ? 2 : 1));
    EXPECT_FALSE(sched.finish(target == RequestState::Swapped ? 2 : 1));
    EXPECT_EQ(sched.describe_state(), before);
    // Until the next step reports it, status() gives its last counts as Finished.
    const RequestId ended = target == RequestState::Swapped ? 2 : 1;
    EXPECT_FALSE(sched.contains(ended));
    const RequestStatus last = sched.status(ended);
    EXPECT_EQ(last.state, RequestState::Finished);
    EXPECT_EQ(last.slot, -1);
    const StepOutput out = sched.step();
    ASSERT_EQ(out.finished.size(), 1u);
    EXPECT_EQ(out.finished[0].reason, FinishReason::Cancelled);
    EXPECT_EQ(last.generated, out.finished[0].generated);
    expect_error<UnknownId>([&] { (void)sched.status(ended); }, "not a live request");
    sched.cancel(1);
    EXPECT_EQ(cache.free_swap_slots(), cache.config().swap_blocks);
    for (const Precision p : kAllPrecisions) EXPECT_EQ(cache.pool_stats(p).used_blocks, 0) << to_string(p);
    EXPECT_TRUE(cache.sequence_ids().empty());
  }
}

TEST(Scheduler, RequestThatCanNeverFitIsRejectedWithAReason) {
  KVCacheManager cache(tiny(4));
  Scheduler sched(cache, base_config());
  sched.add_request(request(1, {{TokenKind::Text, 20}, {TokenKind::Visual, 400}}, 4));  // 4 slabs hold 16 FP16 blocks
  sched.add_request(request(2, {{TokenKind::Text, 20}}, 10));
  sched.add_request(request(3, {{TokenKind::Text, 10}}, 400));  // the prompt fits, its growth never will
  const StepOutput out = sched.step();
  ASSERT_EQ(out.rejected.size(), 2u);
  EXPECT_EQ(out.rejected[0].id, 1);
  EXPECT_NE(out.rejected[0].reason.find("the whole cache holds 4 slabs"), std::string::npos) << out.rejected[0].reason;
  EXPECT_EQ(out.rejected[1].id, 3);
  EXPECT_NE(out.rejected[1].reason.find("400 new tokens"), std::string::npos) << out.rejected[1].reason;
  EXPECT_FALSE(sched.contains(1));
  EXPECT_EQ(out.prefills.size(), 1u);  // request 2 was not held up
  EXPECT_FALSE(sched.cancel(1));       // rejected requests have left
}

TEST(Scheduler, OneLargeRequestBlocksOthersOnlyForBoundedSteps) {
  SchedulerConfig config = base_config();
  config.lookahead = 2;
  config.max_head_bypass = 5;
  test::EngineSim engine(tiny(8), config);
  Scheduler& sched = engine.scheduler();
  sched.add_request(request(0, {{TokenKind::Text, 60}}, 40));  // holds half the cache for a while
  engine.apply(sched.step(), false);
  sched.add_request(request(1, {{TokenKind::Text, 200}}, 2));  // needs most of it: waits
  for (RequestId id = 2; id < 6; ++id) sched.add_request(request(id, {{TokenKind::Text, 8}}, 2));
  std::int64_t step = 1;
  std::map<RequestId, std::int64_t> admitted;
  while (sched.has_unfinished() && step < 500) {
    const StepOutput out = sched.step();
    ++step;
    for (const PrefillChunk& c : out.prefills) admitted.emplace(c.id, step);
    engine.apply(out, false);
    ASSERT_NO_THROW(sched.check_invariants());
  }
  ASSERT_EQ(admitted.count(1), 1u) << "the large request starved";
  // The small requests behind it within look-ahead got in first...
  EXPECT_LT(admitted.at(2), admitted.at(1));
  EXPECT_LT(admitted.at(3), admitted.at(1));
  // ...and the large one was not bypassed forever (request 0 finishes at step ~41).
  EXPECT_LT(admitted.at(1), 60);
}

TEST(Scheduler, ChunksEndOnWindowBoundariesAndThePromptIsAllocatedAtAdmission) {
  KVCacheManager cache(tiny(40));
  SchedulerConfig config = base_config();
  config.max_num_batched_tokens = 40;  // 7 text + 2 windows = 39; 40 would cut window 2
  Scheduler sched(cache, config);
  Request r = request(1, {{TokenKind::Text, 7}, {TokenKind::Visual, 100}, {TokenKind::Text, 3}}, 3, Precision::INT4);
  const BlockCounts demand = cache.demand(r.layout, *r.plan);
  sched.add_request(r);
  std::vector<std::pair<std::int32_t, std::int32_t>> chunks;
  for (int i = 0; i < 6 && sched.contains(1); ++i) {
    const StepOutput out = sched.step();
    if (i == 0) {
      for (const Precision p : kAllPrecisions) EXPECT_EQ(cache.pool_stats(p).used_blocks, demand[pool_index(p)]);
    }
    for (const PrefillChunk& c : out.prefills) chunks.emplace_back(c.start, c.end);
  }
  // Windows start at 7, 23, 39, 55, 71, 87 (visual tail 103..106).
  const std::vector<std::pair<std::int32_t, std::int32_t>> expected = {{0, 39}, {39, 71}, {71, 110}};
  EXPECT_EQ(chunks, expected);
}

TEST(Scheduler, DemotionTakesTheLeastSimilarWindowsFirstAndNeverWindowZero) {
  SchedulerConfig config = base_config();
  // Windows 3, 2 and 1 (both layers) in one step: fewer would take an INT4
  // slab for less than a slab of FP16 room, which the scheduler never does.
  config.max_demotions_per_step = 6;
  test::EngineSim engine(tiny(9), config);
  Scheduler& sched = engine.scheduler();
  // 4 FP16 windows, scores 1.0, 0.9, 0.8, 0.7: window 3 is the least similar.
  sched.add_request(request(1, {{TokenKind::Visual, 64}, {TokenKind::Text, 16}}, 200));
  std::vector<std::int32_t> order;
  for (int i = 0; i < 300 && sched.contains(1); ++i) {
    const StepOutput out = sched.step();
    for (const DemoteOp& op : out.demotions) {
      EXPECT_NE(op.window, 0);
      EXPECT_EQ(op.src_precision, Precision::FP16);
      EXPECT_EQ(op.dst_precision, Precision::INT4);
      if (order.empty() || order.back() != op.window) order.push_back(op.window);
    }
    engine.apply(out, true);
    ASSERT_NO_THROW(sched.check_invariants());
  }
  ASSERT_GE(order.size(), 2u) << "the cache never ran short";
  EXPECT_EQ(order[0], 3);
  EXPECT_EQ(order[1], 2);
  EXPECT_EQ(sched.stats().preempted_recompute, 0);
}

// Runs `requests` to the end on a cache of `cache`; returns every demotion in order.
std::vector<DemoteOp> demotions_of(const CacheConfig& cache, const std::vector<Request>& requests,
                                   SchedulerStats& stats, const SchedulerConfig& config = base_config(),
                                   std::shared_ptr<PlanSource> source = nullptr) {
  test::EngineSim engine(cache, config, std::move(source));
  Scheduler& sched = engine.scheduler();
  for (const Request& r : requests) sched.add_request(r);
  std::vector<DemoteOp> ops;
  for (int i = 0; i < 1000 && sched.has_unfinished(); ++i) {
    const StepOutput out = sched.step();
    EXPECT_TRUE(out.rejected.empty()) << out.rejected.front().reason;
    ops.insert(ops.end(), out.demotions.begin(), out.demotions.end());
    engine.apply(out, true);
    EXPECT_NO_THROW(sched.check_invariants());
  }
  EXPECT_FALSE(sched.has_unfinished());
  stats = sched.stats();
  return ops;
}

// Windows 1..15 (scores 0.9 .. -0.5, so window 15 is the least similar),
// `int2_from` and later INT2, the others below `int4_from` FP16, the rest
// INT4; 16 text tokens.
Request windowed(RequestId id, std::int32_t int4_from, std::int32_t int2_from, std::int32_t max_new) {
  Request r = request(id, {{TokenKind::Visual, 256}, {TokenKind::Text, 16}}, max_new, Precision::INT4);
  for (std::int32_t w = 1; w < 16; ++w) {
    const Precision p = w < int4_from ? Precision::FP16 : (w >= int2_from ? Precision::INT2 : Precision::INT4);
    for (std::int32_t layer = 0; layer < 2; ++layer) r.plan->set(layer, w, p);
  }
  return r;
}

// With no FP16 window left to demote, INT4 windows go to INT2, lowest score
// first, as far as they give the FP16 growth room: INT4 blocks are 10 a
// slab, INT2 blocks 16, and INT4 -> INT2 frees FP16 room only by emptying
// INT4 slabs, its INT2 blocks taken first.
TEST(Scheduler, DemotionGoesFromInt4ToInt2WhenThatMakesRoom) {
  {
    // Windows 1..11 INT4 (slabs: layer 0's 1..10 | layer 0's 11, layer 1's
    // 1..9 | layer 1's 10, 11), 12..15 INT2 (8 of 16 blocks of a slab).
    // The headroom runs short once; windows 11 and 10 empty the third INT4
    // slab into the INT2 slab's free blocks.
    SchedulerStats stats;
    const std::vector<DemoteOp> ops = demotions_of(tiny(10), {windowed(1, 1, 12, 150)}, stats);
    std::vector<std::pair<std::int32_t, std::int32_t>> demoted;  // (window, layer)
    for (const DemoteOp& op : ops) {
      EXPECT_EQ(op.src_precision, Precision::INT4);
      EXPECT_EQ(op.dst_precision, Precision::INT2);
      demoted.emplace_back(op.window, op.layer);
    }
    EXPECT_EQ(demoted, (std::vector<std::pair<std::int32_t, std::int32_t>>{{11, 0}, {11, 1}, {10, 0}, {10, 1}}));
    EXPECT_EQ(stats.finished, 1);
    EXPECT_EQ(stats.preempted_recompute + stats.preempted_swap, 0);
  }
  {
    // Windows 1..15 INT4, three full INT4 slabs, no INT2 slab: with one
    // obtainable slab, no prefix of INT4 -> INT2 demotions empties more
    // INT4 slabs than its INT2 blocks take, so none is made.
    SchedulerStats stats;
    EXPECT_TRUE(demotions_of(tiny(9), {windowed(1, 1, 16, 150)}, stats).empty());
    EXPECT_EQ(stats.finished, 1);
    EXPECT_EQ(stats.preempted_recompute + stats.preempted_swap, 0);
  }
}

// Every FP16 window (but window 0) goes to INT4 before any window goes to
// INT2; INT4 -> INT2 follows ascending scores. Windows 1..3 FP16, 4..9
// INT4, 10..15 INT2; request 2 (text only, nothing to demote) competes for
// the FP16 room.
TEST(Scheduler, DemotionDemotesEveryFp16WindowBeforeAnyInt4Window) {
  SchedulerStats stats;
  const std::vector<DemoteOp> ops =
      demotions_of(tiny(11), {windowed(1, 4, 10, 160), request(2, {{TokenKind::Text, 64}}, 120)}, stats);
  std::int64_t to_int4 = 0;
  std::vector<std::int32_t> int2_order;
  for (const DemoteOp& op : ops) {
    EXPECT_EQ(op.id, 1);
    EXPECT_NE(op.window, 0);
    if (op.dst_precision == Precision::INT4) {
      EXPECT_EQ(op.src_precision, Precision::FP16);
      EXPECT_TRUE(int2_order.empty()) << "window " << op.window << " went to INT4 after INT4 -> INT2 began";
      ++to_int4;
      continue;
    }
    EXPECT_EQ(op.src_precision, Precision::INT4);
    if (int2_order.empty() || int2_order.back() != op.window) int2_order.push_back(op.window);
  }
  EXPECT_EQ(to_int4, 6);  // windows 1..3, both layers
  ASSERT_FALSE(int2_order.empty()) << "no INT4 -> INT2 demotion";
  // Windows 9..4 planned INT4 and 3..1 demoted to INT4, in ascending score.
  EXPECT_EQ(int2_order, (std::vector<std::int32_t>{9, 8, 7, 6, 5, 4, 3, 2, 1}));
  EXPECT_EQ(stats.finished, 2);
}

// The planner's per-layer floors (PlannerConfig::min_precision) bind
// demotion under pressure too, also for plans that came with the request:
// the workload above with layer 0 held at INT4 (it may leave FP16, never go
// to INT2), then at FP16 (never demoted). Without floors the run above
// demotes both layers to INT2; here layer 1's INT4 -> INT2 alone empties no
// INT4 slab, so it is not made, and a preemption makes the room.
TEST(Scheduler, DemotionNeverGoesBelowThePlannersLayerFloor) {
  for (const Precision floor : {Precision::INT4, Precision::FP16}) {
    SCOPED_TRACE(std::string("layer 0 floor ") + std::string(to_string(floor)));
    SchedulerConfig config = base_config();
    PlannerConfig planner;
    planner.window_size = 16;
    planner.sensitivities = {0.5, 0.5};
    planner.min_precision = {floor, Precision::INT2};
    config.planner = planner;
    SchedulerStats stats;
    const std::vector<DemoteOp> ops =
        demotions_of(tiny(11), {windowed(1, 4, 10, 160), request(2, {{TokenKind::Text, 64}}, 120)}, stats, config);
    std::int64_t layer0 = 0, layer1 = 0;
    for (const DemoteOp& op : ops) {
      ++(op.layer == 0 ? layer0 : layer1);
      if (op.layer == 0) {
        EXPECT_EQ(op.src_precision, Precision::FP16) << "window " << op.window;
        EXPECT_EQ(op.dst_precision, Precision::INT4) << "window " << op.window;
      }
    }
    EXPECT_EQ(layer0, floor == Precision::INT4 ? 3 : 0);  // windows 1..3, to INT4 at most
    EXPECT_EQ(layer1, 3);                                 // windows 1..3 to INT4
    EXPECT_GT(stats.preempted_recompute, 0);
    EXPECT_EQ(stats.finished, 2);
  }
}

// The floors of a plan source given to the constructor bind demotion the
// same way: layer 0 held at FP16 is never demoted.
TEST(Scheduler, DemotionNeverGoesBelowAnInjectedSourcesLayerFloor) {
  PlannerConfig planner;
  planner.window_size = 16;
  planner.sensitivities = {0.5, 0.5};
  planner.min_precision = {Precision::FP16, Precision::INT2};
  SchedulerStats stats;
  const std::vector<DemoteOp> ops =
      demotions_of(tiny(11), {windowed(1, 4, 10, 160), request(2, {{TokenKind::Text, 64}}, 120)}, stats, base_config(),
                   make_cpu_plan_source(planner));
  for (const DemoteOp& op : ops) EXPECT_EQ(op.layer, 1) << "window " << op.window;
  EXPECT_EQ(ops.size(), 3u);  // layer 1's windows 1..3 to INT4
  EXPECT_EQ(stats.finished, 2);
}

TEST(Scheduler, PriorityPolicyAdmitsTheMostUrgentFirst) {
  KVCacheManager cache(tiny(40));
  SchedulerConfig config = base_config();
  config.policy = SchedulingPolicy::Priority;
  config.max_num_seqs = 1;
  config.max_num_batched_tokens = 16;
  Scheduler sched(cache, config);
  for (RequestId id = 0; id < 3; ++id) {
    Request r = request(id, {{TokenKind::Text, 4}}, 1);
    r.priority = static_cast<std::int32_t>(id);
    sched.add_request(r);
  }
  std::vector<RequestId> order;
  while (sched.has_unfinished()) {
    const StepOutput out = sched.step();
    for (const PrefillChunk& c : out.prefills) order.push_back(c.id);
  }
  EXPECT_EQ(order, (std::vector<RequestId>{2, 1, 0}));
}

TEST(Scheduler, BadInputIsRefusedByNameAndChangesNothing) {
  KVCacheManager cache(tiny(8));
  auto bad_config = [&](auto change, const std::string& needle) {
    SchedulerConfig c = base_config();
    change(c);
    expect_error<InvalidArgument>([&] { Scheduler s(cache, c); }, needle);
  };
  bad_config([](SchedulerConfig& c) { c.max_num_seqs = 0; }, "config.max_num_seqs = 0");
  bad_config([](SchedulerConfig& c) { c.max_num_batched_tokens = 4; }, "config.max_num_batched_tokens = 4");
  bad_config([](SchedulerConfig& c) { c.watermark = 1.5; }, "config.watermark");
  bad_config([](SchedulerConfig& c) { c.lookahead = -1; }, "config.lookahead = -1");

  Scheduler sched(cache, base_config());
  sched.add_request(request(1, {{TokenKind::Text, 4}}, 3));
  const std::string before = sched.describe_state();
  auto refused = [&](const Request& r, const std::string& needle) {
    expect_error<InvalidArgument>([&] { sched.add_request(r); }, needle);
    EXPECT_EQ(sched.describe_state(), before);
  };
  refused(request(1, {{TokenKind::Text, 4}}, 3), "request.id = 1 is a live request");
  Request r = request(2, {{TokenKind::Text, 4}}, 0);
  refused(r, "request.max_new_tokens = 0");
  r = request(2, {{TokenKind::Visual, 40}}, 3);
  r.plan = PrecisionPlan(2, 5);
  refused(r, "request.plan.num_windows() = 5");
  r = request(2, {{TokenKind::Text, 4}}, 3);
  r.embeddings = EmbeddingsView{};
  refused(r, "both a plan and embeddings");
  r.plan.reset();
  refused(r, "config.planner is not set");
  expect_error<UnknownId>([&] { sched.cancel(99); }, "id = 99 was never added");
  expect_error<UnknownId>([&] { (void)sched.status(99); }, "id = 99");
  expect_error<IndexOutOfRange>([&] { (void)sched.layer_metadata(2); }, "layer = 2");
  EXPECT_EQ(sched.describe_state(), before);
  (void)sched.step();
  expect_error<InvalidArgument>([&] { Scheduler other(cache, base_config()); }, "cache holds 1 sequences");
}

TEST(Scheduler, LayerMetadataMatchesTheFullMetadata) {
  KVCacheManager cache(tiny(40));
  Scheduler sched(cache, base_config());
  for (RequestId id = 0; id < 3; ++id) {
    sched.add_request(request(id, {{TokenKind::Text, 3 + static_cast<std::int32_t>(id)}, {TokenKind::Visual, 40}}, 20,
                              Precision::INT2));
  }
  for (int i = 0; i < 5; ++i) {
    const StepOutput out = sched.step();
    const DecodeMetadata full = cache.decode_metadata(out.decodes);
    for (std::int32_t layer = 0; layer < 2; ++layer) {
      const auto lazy = sched.layer_metadata(layer);
      for (const Precision p : kAllPrecisions) {
        const PagedPoolTable& a = out.metadata.layers[layer][pool_index(p)];
        const PagedPoolTable& b = full.layers[layer][pool_index(p)];
        EXPECT_EQ(a.indptr, b.indptr);
        EXPECT_EQ(a.indices, b.indices);
        EXPECT_EQ(a.last_block_len, b.last_block_len);
        EXPECT_EQ(lazy[pool_index(p)].indices, b.indices);
        EXPECT_EQ(lazy[pool_index(p)].last_block_len, b.last_block_len);
      }
    }
  }
}

}  // namespace
}  // namespace mixkv
