// Fault injection on the scheduler with the CPU backend (docs/reliability.md):
// a request cancelled in each state (waiting, prefilling, running, swapped)
// and the host swap pool too small for swap preemption. The engine
// (tests/scheduler/engine_sim.h) applies every step on real bytes and
// records every decode attention output; K/V values are a pure function of
// (request, position), and demotion is off, so a request's outputs do not
// depend on how it was scheduled. Hence "no other request's data changed"
// is checked as: every other request's every output equals, bit for bit,
// the output of a run without the fault. "Nothing leaks": the cancelled
// request's blocks or host slots come back at once, and at the end every
// pool and the host pool are whole.
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "../scheduler/engine_sim.h"
#include "mixkv/scheduler/scheduler.h"

namespace mixkv {
namespace {

using Outputs = std::map<std::tuple<RequestId, std::int64_t, std::int32_t>, std::vector<float>>;

CacheConfig cache_config(std::int32_t slabs, BlockCounts swap) {
  CacheConfig c;
  c.shape = CacheShape{2, 1, 16, 16};  // FP16 block 1 KiB, INT4 384 B, INT2 256 B
  c.slab_bytes = 4096;                 // 4 FP16, 10 INT4 or 16 INT2 blocks a slab
  c.arena_bytes = 4096 * static_cast<std::size_t>(slabs);
  c.swap_blocks = swap;
  return c;
}

SchedulerConfig scheduler_config(PreemptionMode mode) {
  SchedulerConfig c;
  c.max_num_seqs = 6;
  c.max_num_batched_tokens = 48;  // long prompts take several chunks
  c.watermark = 0.0;
  c.preemption = mode;
  c.demote_under_pressure = false;  // plans stay fixed: outputs do not depend on the schedule
  c.build_metadata = true;
  return c;
}

// 24 requests of mixed sizes and plans, arriving over the first 40 steps.
std::vector<std::pair<std::int64_t, Request>> workload() {
  std::mt19937_64 rng(7);
  auto pick = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<std::pair<std::int64_t, Request>> out;
  for (RequestId id = 0; id < 24; ++id) {
    std::vector<Segment> segments{{TokenKind::Text, pick(1, 12)}};
    const std::int32_t visual = pick(0, 3) == 0 ? pick(64, 120) : pick(0, 50);
    if (visual > 0) segments.push_back({TokenKind::Visual, visual});
    segments.push_back({TokenKind::Text, pick(1, 8)});
    Request r;
    r.id = id;
    r.layout = TokenLayout(segments);
    PrecisionPlan plan(2, r.layout.num_windows(16));
    for (std::int32_t w = 0; w < plan.num_windows(); ++w) {
      for (std::int32_t l = 0; l < 2; ++l) {
        const int p = pick(0, 9);
        plan.set(l, w, w == 0 || p < 5 ? Precision::FP16 : (p < 8 ? Precision::INT4 : Precision::INT2));
      }
    }
    r.plan = std::move(plan);
    r.max_new_tokens = pick(4, 40);
    r.arrival_time = static_cast<double>(id);
    out.emplace_back(static_cast<std::int64_t>(id) * 40 / 24, std::move(r));
  }
  return out;
}

struct Cancel {
  RequestState state;
  std::int64_t not_before = 3;  // steps, so that other requests are under way
};

struct RunResult {
  Outputs outputs;
  SchedulerStats stats;
  std::optional<RequestId> cancelled;
  std::map<RequestId, FinishReason> reasons;
};

// Runs the workload to the end; with `cancel`, cancels the first request
// found in that state and checks that what it held came back at once.
RunResult run(const CacheConfig& cc, const SchedulerConfig& sc, std::optional<Cancel> cancel) {
  test::EngineSim engine(cc, sc);
  KVCacheManager& cache = engine.cache();
  Scheduler& sched = engine.scheduler();
  const auto requests = workload();
  RunResult result;
  std::size_t next = 0;
  for (std::int64_t step = 0; next < requests.size() || sched.has_unfinished(); ++step) {
    while (next < requests.size() && requests[next].first <= step) sched.add_request(requests[next++].second);
    if (cancel && !result.cancelled && step >= cancel->not_before) {
      for (RequestId id = 0; id < static_cast<RequestId>(requests.size()); ++id) {
        if (!sched.contains(id) || sched.status(id).state != cancel->state) continue;
        // What the request holds, and what the pools hold, before the cancel.
        const bool holds = cache.contains(id);
        const BlockCounts held = holds ? cache.blocks_held(id) : BlockCounts{};
        const bool swapped = holds && cache.is_swapped(id);
        BlockCounts used{};
        for (const Precision p : kAllPrecisions) used[pool_index(p)] = cache.pool_stats(p).used_blocks;
        const BlockCounts host_free = cache.free_swap_slots();

        EXPECT_TRUE(sched.cancel(id));
        engine.forget(id);
        result.cancelled = id;
        EXPECT_FALSE(sched.cancel(id)) << "cancel is idempotent";
        EXPECT_FALSE(sched.finish(id));
        EXPECT_FALSE(cache.contains(id)) << "the cancelled request still holds memory";
        for (const Precision p : kAllPrecisions) {
          const int i = pool_index(p);
          EXPECT_EQ(cache.pool_stats(p).used_blocks, used[i] - (holds && !swapped ? held[i] : 0)) << to_string(p);
          EXPECT_EQ(cache.free_swap_slots()[i], host_free[i] + (swapped ? held[i] : 0)) << to_string(p);
        }
        EXPECT_NO_THROW(sched.check_invariants());
        break;
      }
    }
    const StepOutput out = sched.step();
    engine.apply(out, /*attention=*/true);
    if (testing::Test::HasFatalFailure()) return result;
    for (const FinishedRequest& f : out.finished) {
      EXPECT_TRUE(result.reasons.emplace(f.id, f.reason).second) << "request " << f.id << " reported twice";
    }
    EXPECT_TRUE(out.rejected.empty()) << "every request of the workload fits the cache";
    EXPECT_NO_THROW(sched.check_invariants()) << "after step " << step;
    if (step > 100000) {
      ADD_FAILURE() << "the workload does not drain";
      break;
    }
  }
  // Nothing leaked: every pool and the host pool are whole.
  for (const Precision p : kAllPrecisions) EXPECT_EQ(cache.pool_stats(p).used_blocks, 0) << to_string(p);
  EXPECT_EQ(cache.free_swap_slots(), cc.swap_blocks);
  EXPECT_TRUE(cache.sequence_ids().empty());
  result.outputs = engine.outputs();
  result.stats = sched.stats();
  return result;
}

// Every output of every request but `except` that both runs computed is the
// same, bit for bit. A run may lack a few: after a preemption by recompute
// the request's last generated token is prefilled again, and its attention
// output comes out of that prefill, not out of a decode step (one position
// per recompute, in every layer). `recomputes` bounds how many may be missing.
// Returns how many outputs were compared.
std::size_t expect_same_outputs(const Outputs& baseline, const Outputs& got, std::optional<RequestId> except,
                                std::int64_t recomputes) {
  std::size_t compared = 0;
  std::int64_t missing = 0;
  for (const auto& [key, values] : baseline) {
    if (except && std::get<0>(key) == *except) continue;
    const auto it = got.find(key);
    if (it == got.end()) {
      ++missing;
      continue;
    }
    if (it->second != values) {
      ADD_FAILURE() << "request " << std::get<0>(key) << " position " << std::get<1>(key) << " layer "
                    << std::get<2>(key) << ": the fault changed another request's data";
      return compared;
    }
    ++compared;
  }
  for (const auto& [key, values] : got) {
    if (!(except && std::get<0>(key) == *except) && !baseline.contains(key)) ++missing;
  }
  EXPECT_LE(missing, recomputes * 2) << "outputs missing beyond one position per recompute and layer";
  EXPECT_GT(compared, 500u);
  return compared;
}

// A cache small enough for preemption (swap, with a host pool of room).
const CacheConfig kSmall = cache_config(10, {24, 12, 12});

class CancelInState : public ::testing::TestWithParam<RequestState> {};

TEST_P(CancelInState, FreesEverythingAndChangesNoOtherRequest) {
  const SchedulerConfig sc = scheduler_config(PreemptionMode::Swap);
  const RunResult baseline = run(kSmall, sc, std::nullopt);
  ASSERT_GT(baseline.stats.preempted_swap, 0) << "the workload must reach the swapped state";
  const RunResult cancelled = run(kSmall, sc, Cancel{GetParam()});
  ASSERT_TRUE(cancelled.cancelled.has_value()) << "no request was ever " << to_string(GetParam());
  EXPECT_EQ(cancelled.reasons.at(*cancelled.cancelled), FinishReason::Cancelled);
  EXPECT_EQ(cancelled.stats.cancelled, 1);
  const std::size_t compared =
      expect_same_outputs(baseline.outputs, cancelled.outputs, cancelled.cancelled,
                          baseline.stats.preempted_recompute + cancelled.stats.preempted_recompute);
  std::printf("cancelled request %lld while %s; %zu outputs of the other requests compared with the baseline\n",
              static_cast<long long>(*cancelled.cancelled), std::string(to_string(GetParam())).c_str(), compared);
}

INSTANTIATE_TEST_SUITE_P(States, CancelInState,
                         ::testing::Values(RequestState::Waiting, RequestState::Prefilling, RequestState::Running,
                                           RequestState::Swapped),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// Swap preemption with a host pool too small for most victims: the scheduler
// falls back to recompute; every output equals a run whose cache never
// preempts at all, and nothing leaks.
TEST(SwapPoolFull, FallsBackToRecomputeAndChangesNoOutput) {
  const RunResult roomy = run(cache_config(64, {}), scheduler_config(PreemptionMode::Recompute), std::nullopt);
  EXPECT_EQ(roomy.stats.preempted_recompute + roomy.stats.preempted_swap, 0);
  const RunResult tight = run(cache_config(10, {3, 1, 1}), scheduler_config(PreemptionMode::Swap), std::nullopt);
  EXPECT_GT(tight.stats.preempted_recompute, 0) << "the host pool never ran full";
  const std::size_t compared =
      expect_same_outputs(roomy.outputs, tight.outputs, std::nullopt, tight.stats.preempted_recompute);
  std::printf("host pool of 3/1/1 slots: %lld swap preemptions, %lld recompute fallbacks, %zu outputs compared\n",
              static_cast<long long>(tight.stats.preempted_swap),
              static_cast<long long>(tight.stats.preempted_recompute), compared);
}

// --- Liveness under memory pressure (a scheduler_fuzz finding, reduced by
// hand; docs/reliability.md, "Findings"). One request alone in a 4-slab
// cache: its plan (layer 0: FP16, INT2; layer 1: INT2, FP16) and its 39
// decode tokens fit exactly as planned, 3 FP16 slabs and 1 INT2 slab.

CacheConfig four_slabs() { return cache_config(4, {13, 16, 15}); }

Request lone_request() {
  Request r;
  r.id = 3;
  r.layout = TokenLayout({{TokenKind::Visual, 46}, {TokenKind::Text, 12}});
  PrecisionPlan plan(2, 2);
  plan.set(0, 1, Precision::INT2);
  plan.set(1, 0, Precision::INT2);
  r.plan = plan;
  r.max_new_tokens = 39;
  return r;
}

// Steps until nothing is left (at most `limit` steps); the steps taken.
std::int64_t drain(Scheduler& sched, std::int64_t limit, std::vector<FinishedRequest>& finished,
                   std::vector<RejectedRequest>& rejected) {
  std::int64_t steps = 0;
  for (; sched.has_unfinished() && steps < limit; ++steps) {
    const StepOutput out = sched.step();
    finished.insert(finished.end(), out.finished.begin(), out.finished.end());
    rejected.insert(rejected.end(), out.rejected.begin(), out.rejected.end());
  }
  return steps;
}

SchedulerConfig lone_config(bool demote, PreemptionMode mode) {
  SchedulerConfig c = scheduler_config(mode);
  c.max_num_seqs = 3;
  c.max_num_batched_tokens = 77;
  c.chunked_prefill = false;
  c.demote_under_pressure = demote;
  c.max_demotions_per_step = 5;
  return c;
}

TEST(SchedulerLiveness, LoneRequestFinishesWithoutDemotion) {
  KVCacheManager cache(four_slabs());
  Scheduler sched(cache, lone_config(false, PreemptionMode::Swap));
  sched.add_request(lone_request());
  std::vector<FinishedRequest> finished;
  std::vector<RejectedRequest> rejected;
  drain(sched, 1000, finished, rejected);
  ASSERT_EQ(finished.size(), 1u);
  EXPECT_EQ(finished[0].generated, 39);
}

// The scheduler_fuzz finding (fixed): with demotion on, at 80 tokens the
// scheduler used to demote layer 1's FP16 window 1 to INT4, which took the
// last free slab for the INT4 pool and freed one FP16 block in a slab that
// stayed in use: the FP16 pool could no longer grow, and the request swapped
// itself out and back in every second step, forever. Demotion now counts
// slabs (a demotion that leaves less FP16 room than there was is not made),
// so the request grows into the last slab and finishes as planned.
TEST(SchedulerLiveness, LoneRequestThatCannotGrowDoesNotThrash) {
  KVCacheManager cache(four_slabs());
  Scheduler sched(cache, lone_config(true, PreemptionMode::Swap));
  sched.add_request(lone_request());
  std::vector<FinishedRequest> finished;
  std::vector<RejectedRequest> rejected;
  const std::int64_t steps = drain(sched, 1000, finished, rejected);
  EXPECT_FALSE(sched.has_unfinished()) << "still unfinished after " << steps << " steps, "
                                       << sched.stats().preempted_swap << " swap preemptions";
  ASSERT_EQ(finished.size(), 1u);
  EXPECT_TRUE(rejected.empty());
  EXPECT_EQ(finished[0].reason, FinishReason::Length);
  EXPECT_EQ(finished[0].generated, 39);
  EXPECT_EQ(sched.stats().demotions, 0) << "a demotion that costs the FP16 pool its last slab was made";
  EXPECT_EQ(sched.stats().preempted_swap, 0);
}

// Under recompute the same request finishes too (before the fix it was
// preempted and then rejected once its prompt with the generated tokens
// exceeded the token budget).
TEST(SchedulerLiveness, LoneRequestEndsUnderRecompute) {
  KVCacheManager cache(four_slabs());
  Scheduler sched(cache, lone_config(true, PreemptionMode::Recompute));
  sched.add_request(lone_request());
  std::vector<FinishedRequest> finished;
  std::vector<RejectedRequest> rejected;
  drain(sched, 1000, finished, rejected);
  EXPECT_FALSE(sched.has_unfinished());
  ASSERT_EQ(finished.size(), 1u);
  EXPECT_TRUE(rejected.empty());
  EXPECT_EQ(finished[0].generated, 39);
  EXPECT_EQ(sched.stats().preempted_recompute, 0);
}

// Neighbours: the lone request plus a second one that takes the cache's
// last slab (its 4 INT4 windows) and the FP16 room of the first one's
// tails, in both preemption modes, with demotion on and off. Each fits the
// cache alone, so both finish, within a bounded number of steps and
// preemptions: no request is preempted and resumed without progress. With
// demotion on, demoting the first request's FP16 window into the second
// one's INT4 slab would gain FP16 room at 64 tokens but leave the first
// request 5 slabs to complete in a 4-slab cache once alone (it was then
// rejected when preempted): demotion never raises a request's footprint
// above the cache, so no demotion is made.
Request int4_request(RequestId id, std::int32_t max_new_tokens) {
  Request r;
  r.id = id;
  r.layout = TokenLayout({{TokenKind::Visual, 32}, {TokenKind::Text, 1}});
  PrecisionPlan plan(2, 2);
  for (std::int32_t l = 0; l < 2; ++l) {
    for (std::int32_t w = 0; w < 2; ++w) plan.set(l, w, Precision::INT4);
  }
  r.plan = plan;
  r.max_new_tokens = max_new_tokens;
  r.arrival_time = 1.0;
  return r;
}

struct Pair {
  bool demote;
  PreemptionMode mode;
  std::int32_t second_tokens;  // max_new_tokens of the second request
};

class TwoRequestsUnderPressure : public ::testing::TestWithParam<Pair> {};

TEST_P(TwoRequestsUnderPressure, BothEndWithoutThrash) {
  const Pair p = GetParam();
  KVCacheManager cache(four_slabs());
  Scheduler sched(cache, lone_config(p.demote, p.mode));
  sched.add_request(lone_request());
  sched.add_request(int4_request(4, p.second_tokens));
  std::vector<FinishedRequest> finished;
  std::vector<RejectedRequest> rejected;
  std::int64_t steps = 0;
  for (; sched.has_unfinished() && steps < 1000; ++steps) {
    const StepOutput out = sched.step();
    finished.insert(finished.end(), out.finished.begin(), out.finished.end());
    rejected.insert(rejected.end(), out.rejected.begin(), out.rejected.end());
    ASSERT_NO_THROW(sched.check_invariants()) << "after step " << steps;
  }
  const SchedulerStats st = sched.stats();
  EXPECT_FALSE(sched.has_unfinished()) << "still unfinished after " << steps << " steps, " << st.preempted_swap
                                       << " swap and " << st.preempted_recompute << " recompute preemptions";
  EXPECT_EQ(finished.size(), 2u);
  for (const RejectedRequest& r : rejected) ADD_FAILURE() << r.reason;
  EXPECT_EQ(st.demotions, 0);
  // Each request at most a few preemptions: every one of them is followed
  // by progress (the other request grows or ends).
  EXPECT_LE(st.preempted_swap + st.preempted_recompute, 4);
  for (const Precision q : kAllPrecisions) EXPECT_EQ(cache.pool_stats(q).used_blocks, 0) << to_string(q);
  std::printf(
      "demotion %d, %s, second request %d tokens: %lld steps, %zu finished, %zu rejected, %lld demotions, "
      "%lld swaps, %lld recomputes\n",
      p.demote ? 1 : 0, p.mode == PreemptionMode::Swap ? "swap" : "recompute", p.second_tokens,
      static_cast<long long>(steps), finished.size(), rejected.size(), static_cast<long long>(st.demotions),
      static_cast<long long>(st.preempted_swap), static_cast<long long>(st.preempted_recompute));
}

INSTANTIATE_TEST_SUITE_P(
    Modes, TwoRequestsUnderPressure,
    ::testing::Values(Pair{true, PreemptionMode::Swap, 40}, Pair{true, PreemptionMode::Recompute, 40},
                      Pair{false, PreemptionMode::Swap, 40}, Pair{false, PreemptionMode::Recompute, 40},
                      Pair{true, PreemptionMode::Swap, 5}, Pair{true, PreemptionMode::Recompute, 5}),
    [](const auto& info) {
      return std::string(info.param.demote ? "Demote" : "NoDemote") +
             (info.param.mode == PreemptionMode::Swap ? "Swap" : "Recompute") +
             std::to_string(info.param.second_tokens);
    });

}  // namespace
}  // namespace mixkv
