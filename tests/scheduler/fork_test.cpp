// Text-only requests (no plan: all FP16) and forks through the scheduler
// (parallel sampling): parent and children decode to completion on real
// bytes with the outputs a request holding the same values would have, a
// child outlives its cancelled parent, forked requests are demoted around,
// swapped and recomputed under memory pressure, and every refused fork
// changes nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../cache/cache_test_util.h"
#include "engine_sim.h"
#include "mixkv/core/errors.h"
#include "scheduler_test_util.h"

namespace mixkv {
namespace {

using test::base_config;
using test::expect_error;
using test::request;
using test::tiny;

using Outputs = std::map<std::tuple<RequestId, std::int64_t, std::int32_t>, std::vector<float>>;

// A cache, its scheduler and the CPU engine, stepped with every check.
struct Served {
  Served(const CacheConfig& cc, const SchedulerConfig& sc)
      : engine(cc, sc), cache(engine.cache()), sched(engine.scheduler()) {}

  StepOutput step() {
    StepOutput out = sched.step();
    engine.apply(out, true);
    EXPECT_NO_THROW(sched.check_invariants()) << "after step " << out.step;
    EXPECT_TRUE(out.rejected.empty()) << out.rejected.front().reason;
    for (const FinishedRequest& f : out.finished) finished[f.id] = f;
    return out;
  }
  void drain() {
    for (int i = 0; i < 100000 && sched.has_unfinished() && !testing::Test::HasFatalFailure(); ++i) step();
    EXPECT_FALSE(sched.has_unfinished());
  }
  void fork(RequestId parent, RequestId child, std::int32_t max_new = -1) {
    sched.fork(parent, child, max_new);
    engine.inherit(child, parent);
  }
  void expect_empty() const {
    for (const Precision p : kAllPrecisions) EXPECT_EQ(cache.pool_stats(p).used_blocks, 0) << to_string(p);
    EXPECT_EQ(cache.free_swap_slots(), cache.config().swap_blocks);
    EXPECT_TRUE(cache.sequence_ids().empty());
  }

  test::EngineSim engine;
  KVCacheManager& cache;
  Scheduler& sched;
  std::map<RequestId, FinishedRequest> finished;
};

void expect_near(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(double(a[i]) - b[i]));
  EXPECT_LE(worst, 1e-6) << what;
}

// The outputs of `id` served alone, holding `parent`'s values below
// `tokens` (what a child forked at that point holds).
Outputs reference(const Request& r, std::optional<std::pair<RequestId, std::int64_t>> inherit) {
  Served run(tiny(60), base_config());
  if (inherit) run.engine.inherit(r.id, inherit->first, inherit->second);
  run.sched.add_request(r);
  run.drain();
  return run.engine.outputs();
}

// A child's outputs equal those of a request with its values served
// alone: the parent's outputs up to the fork point, its own after.
void expect_child(const Outputs& forked, RequestId parent, RequestId child, std::int64_t fork_tokens,
                  const Request& parent_request, std::int32_t child_total) {
  Request r = parent_request;
  r.id = child;
  r.max_new_tokens = child_total;
  const Outputs ref = reference(r, std::pair{parent, fork_tokens});
  std::int64_t own = 0;
  for (const auto& [key, out] : ref) {
    const auto [id, pos, layer] = key;
    const RequestId who = pos < fork_tokens ? parent : child;
    const auto it = forked.find({who, pos, layer});
    ASSERT_NE(it, forked.end()) << "request " << who << " has no output at position " << pos;
    expect_near(it->second, out, "request " + std::to_string(who) + " position " + std::to_string(pos));
    own += who == child ? 1 : 0;
  }
  // Every output of the child was compared.
  std::int64_t outputs = 0;
  for (const auto& [key, out] : forked) outputs += std::get<0>(key) == child ? 1 : 0;
  EXPECT_EQ(outputs, own);
  EXPECT_GT(own, 0);
}

TEST(SchedulerText, TextOnlyRequestsAreStoredFp16) {
  Served run(tiny(30), base_config());
  Request text;
  text.id = 1;
  text.layout = TokenLayout({{TokenKind::Text, 20}});
  text.max_new_tokens = 5;
  Request visual = text;
  visual.id = 2;
  visual.layout = TokenLayout({{TokenKind::Text, 5}, {TokenKind::Visual, 40}, {TokenKind::Text, 3}});
  run.sched.add_request(text);
  run.sched.add_request(visual);
  const StepOutput first = run.step();
  ASSERT_EQ(first.prefills.size(), 2u);
  for (const PrefillChunk& c : first.prefills) {
    for (const StoreMapping& m : c.mappings) {
      EXPECT_TRUE(m.int4_windows.empty());
      EXPECT_TRUE(m.int2_windows.empty());
    }
  }
  EXPECT_EQ(run.cache.plan(1).num_windows(), 0);
  const PrecisionPlan& plan = run.cache.plan(2);
  ASSERT_EQ(plan.num_layers(), 2);
  ASSERT_EQ(plan.num_windows(), visual.layout.num_windows(16));
  for (std::int32_t w = 0; w < plan.num_windows(); ++w) {
    EXPECT_EQ(plan.score(w), 0.0f);
    for (std::int32_t l = 0; l < 2; ++l) EXPECT_EQ(plan.at(l, w), Precision::FP16);
  }
  run.drain();
  EXPECT_EQ(run.finished.at(1).generated, 5);
  EXPECT_EQ(run.finished.at(2).generated, 5);
  run.expect_empty();

  // Both a plan and embeddings is still refused.
  Request both = request(3, {{TokenKind::Text, 4}}, 3);
  both.embeddings = EmbeddingsView{};
  const std::string before = run.sched.describe_state();
  expect_error<InvalidArgument>([&] { run.sched.add_request(both); }, "both a plan and embeddings");
  EXPECT_EQ(run.sched.describe_state(), before);
}

// Two children forked after four tokens (one with its own length, one with
// the parent's remaining tokens) decode to completion beside the parent:
// the parent's outputs are those of the parent alone, each child's those of
// a request holding the parent's values up to the fork point and its own
// after; the shared tail is copied once per extra holder; the pools end empty.
TEST(SchedulerFork, ParentAndChildrenDecodeToCompletion) {
  const Request parent = request(1, {{TokenKind::Text, 10}, {TokenKind::Visual, 40}, {TokenKind::Text, 5}}, 30);
  const Outputs alone = reference(parent, std::nullopt);

  Served run(tiny(60), base_config());
  run.sched.add_request(parent);
  while (!(run.sched.status(1).state == RequestState::Running && run.sched.status(1).generated == 4)) run.step();
  const std::int64_t fork_tokens = run.cache.num_tokens(1);
  ASSERT_NE(fork_tokens % 16, 0) << "the test needs a partly filled tail";
  run.fork(1, 2, 20);
  run.fork(1, 3);
  EXPECT_EQ(run.sched.status(2).state, RequestState::Running);
  EXPECT_EQ(run.sched.status(2).generated, 4);
  EXPECT_NE(run.sched.status(2).slot, run.sched.status(1).slot);
  EXPECT_EQ(run.cache.ref_count(Precision::FP16, run.cache.blocks(1, 0, Precision::FP16)[0]), 3);
  const StepOutput out = run.step();
  EXPECT_EQ(std::set<RequestId>(out.tables_changed.begin(), out.tables_changed.end()), (std::set<RequestId>{2, 3}));
  EXPECT_EQ(out.decodes.size(), 3u);
  EXPECT_EQ(out.append.copies.size(), 2u * 2u) << "3 holders of each layer's tail: 2 copies a layer";
  run.drain();
  EXPECT_EQ(run.sched.stats().forks, 2);
  EXPECT_EQ(run.finished.at(1).generated, 30);
  EXPECT_EQ(run.finished.at(2).generated, 24);
  EXPECT_EQ(run.finished.at(3).generated, 30);
  run.expect_empty();

  const Outputs& forked = run.engine.outputs();
  std::int64_t parent_outputs = 0;
  for (const auto& [key, o] : forked) {
    if (std::get<0>(key) != 1) continue;
    ++parent_outputs;
    const auto it = alone.find(key);
    ASSERT_NE(it, alone.end());
    expect_near(o, it->second, "parent position " + std::to_string(std::get<1>(key)));
  }
  EXPECT_EQ(parent_outputs, static_cast<std::int64_t>(alone.size()));
  expect_child(forked, 1, 2, fork_tokens, parent, 24);
  expect_child(forked, 1, 3, fork_tokens, parent, 30);
}

// A parent whose last token has come out can still be forked with a length
// of the child's own; the child outlives it.
TEST(SchedulerFork, ParentAtItsLastTokenForksWithAnExplicitLength) {
  const Request parent = request(1, {{TokenKind::Text, 21}}, 1);
  Served run(tiny(20), base_config());
  run.sched.add_request(parent);
  run.step();
  ASSERT_EQ(run.sched.status(1).state, RequestState::Running);
  const std::string before = run.sched.describe_state();
  expect_error<InvalidArgument>([&] { run.sched.fork(1, 2); }, "has generated all its 1");
  EXPECT_EQ(run.sched.describe_state(), before);
  const std::int64_t fork_tokens = run.cache.num_tokens(1);
  run.fork(1, 2, 6);
  run.drain();
  EXPECT_EQ(run.finished.at(1).generated, 1);
  EXPECT_EQ(run.finished.at(2).generated, 7);
  run.expect_empty();
  expect_child(run.engine.outputs(), 1, 2, fork_tokens, parent, 7);
}

// Cancelling the parent leaves the child every shared block: before the
// first step after the fork (the child then writes its tail in place, no
// copy) and two steps after it.
TEST(SchedulerFork, CancelTheParentWhileTheChildRuns) {
  for (const int steps_after : {0, 2}) {
    const Request parent = request(1, {{TokenKind::Text, 7}, {TokenKind::Visual, 33}}, 40);
    Served run(tiny(60), base_config());
    run.sched.add_request(parent);
    while (run.sched.status(1).generated < 3) run.step();
    const std::int64_t fork_tokens = run.cache.num_tokens(1);
    run.fork(1, 2, 25);
    for (int i = 0; i < steps_after; ++i) run.step();
    ASSERT_TRUE(run.sched.cancel(1));
    const StepOutput out = run.step();
    if (steps_after == 0) {
      EXPECT_TRUE(out.append.copies.empty()) << "the child is the tail's only holder";
    }
    for (std::int32_t layer = 0; layer < 2; ++layer) {
      for (const Precision p : kAllPrecisions) {
        for (const std::int32_t b : run.cache.blocks(2, layer, p)) EXPECT_EQ(run.cache.ref_count(p, b), 1);
      }
    }
    run.drain();
    EXPECT_EQ(run.finished.at(1).reason, FinishReason::Cancelled);
    EXPECT_EQ(run.finished.at(2).reason, FinishReason::Length);
    EXPECT_EQ(run.finished.at(2).generated, 3 + 25);
    run.expect_empty();
    // The parent's outputs before the cancel are the ones the reference compares.
    expect_child(run.engine.outputs(), 1, 2, fork_tokens, parent, 28);
  }
}

// Requests that fork children as soon as their prompt is done (n > 1
// samples), with unforked ones beside them, in a cache that forces
// demotion, swapping and recompute. Forked requests are preempted both
// ways and come back; with FP16 plans (no demotion) every output equals
// the one in a cache large enough for no pressure.
struct PressureResult {
  Outputs outputs;
  SchedulerStats stats;
  std::int64_t forked_swapped = 0;
  std::int64_t forked_recomputed = 0;
};

PressureResult serve_forking(const CacheConfig& cc, const SchedulerConfig& sc, bool mixed_plans) {
  Served run(cc, sc);
  std::map<RequestId, std::int32_t> children;  // parent -> children still to fork
  std::set<RequestId> family;
  RequestId next_child = 1000;
  for (RequestId id = 0; id < 12; ++id) {
    const auto k = static_cast<std::int32_t>(id);
    Request r = request(id, {{TokenKind::Text, 3 + k % 5}, {TokenKind::Visual, 48 + 7 * (k % 3)}}, 20 + 3 * (k % 4),
                        mixed_plans ? Precision::INT4 : Precision::FP16);
    if (mixed_plans && id % 2 == 1) r.plan->set(1, 1, Precision::FP16);
    r.arrival_time = static_cast<double>(id / 3);
    run.sched.add_request(r);
    if (id % 3 != 2) children[id] = 1 + static_cast<std::int32_t>(id % 2);
  }
  PressureResult result;
  for (int i = 0; i < 20000 && run.sched.has_unfinished(); ++i) {
    const StepOutput out = run.step();
    if (testing::Test::HasFatalFailure()) return result;
    for (const RequestId id : out.swapped_out) result.forked_swapped += family.contains(id) ? 1 : 0;
    for (const RequestId id : out.preempted) result.forked_recomputed += family.contains(id) ? 1 : 0;
    for (auto it = children.begin(); it != children.end();) {
      const RequestId p = it->first;
      if (!run.sched.contains(p) || run.sched.status(p).state != RequestState::Running) {
        ++it;
        continue;
      }
      // At its first sight Running: generated == 1 in every run.
      EXPECT_EQ(run.sched.status(p).generated, 1);
      for (std::int32_t k = 0; k < it->second; ++k) {
        const RequestId c = next_child + p * 10 + k;
        run.fork(p, c, 10 + 5 * k);
        family.insert(c);
      }
      family.insert(p);
      it = children.erase(it);
    }
  }
  EXPECT_FALSE(run.sched.has_unfinished());
  EXPECT_TRUE(children.empty());
  run.expect_empty();
  result.outputs = run.engine.outputs();
  result.stats = run.sched.stats();
  return result;
}

TEST(SchedulerFork, ForkedRequestsUnderMemoryPressure) {
  SchedulerConfig config = base_config();
  config.max_num_seqs = 32;  // room for every request and child at once
  config.max_num_batched_tokens = 64;
  // FP16 plans, no demotion: preemption only, outputs as without pressure.
  config.demote_under_pressure = false;
  const PressureResult big = serve_forking(tiny(200), config, false);
  EXPECT_EQ(big.stats.preempted_recompute + big.stats.preempted_swap, 0);
  EXPECT_EQ(big.stats.forks, 12);
  for (const PreemptionMode mode : {PreemptionMode::Recompute, PreemptionMode::Swap}) {
    config.preemption = mode;
    const PressureResult small = serve_forking(tiny(14, {24, 4, 4}), config, false);
    EXPECT_EQ(small.stats.forks, 12);
    if (mode == PreemptionMode::Swap) {
      EXPECT_GT(small.forked_swapped, 0);
    } else {
      EXPECT_GT(small.forked_recomputed, 0);
    }
    // A request recomputed after g tokens prefills its g-th token instead
    // of decoding it: that output (one per layer) is absent.
    EXPECT_LE(big.outputs.size() - small.outputs.size(), static_cast<std::size_t>(small.stats.preempted_recompute * 2));
    for (const auto& [key, o] : small.outputs) {
      const auto it = big.outputs.find(key);
      ASSERT_NE(it, big.outputs.end());
      expect_near(o, it->second, "request " + std::to_string(std::get<0>(key)));
    }
  }
  // Mixed plans with demotion: forked requests keep their shared windows
  // (never demoted) while the others are demoted; all complete.
  config.demote_under_pressure = true;
  config.max_demotions_per_step = 8;
  for (const PreemptionMode mode : {PreemptionMode::Recompute, PreemptionMode::Swap}) {
    config.preemption = mode;
    const PressureResult mixed = serve_forking(tiny(10, {24, 8, 8}), config, true);
    EXPECT_GT(mixed.stats.demotions, 0);
    EXPECT_GT(mixed.forked_swapped + mixed.forked_recomputed, 0);
  }
}

// Every refused fork names its argument and changes nothing.
TEST(SchedulerFork, RefusedForksChangeNothing) {
  KVCacheManager cache(tiny(40, {40, 40, 40}));
  SchedulerConfig config = base_config();
  config.max_num_seqs = 4;
  config.max_num_batched_tokens = 32;
  Scheduler sched(cache, config);
  sched.add_request(request(1, {{TokenKind::Text, 8}}, 50));
  (void)sched.step();
  sched.add_request(request(2, {{TokenKind::Text, 200}}, 5));
  sched.add_request(request(3, {{TokenKind::Text, 4}}, 5));
  (void)sched.step();
  ASSERT_EQ(sched.status(1).state, RequestState::Running);
  ASSERT_EQ(sched.status(2).state, RequestState::Prefilling);
  ASSERT_EQ(sched.status(3).state, RequestState::Waiting);
  std::string before = sched.describe_state();
  auto refused = [&](auto error, RequestId parent, RequestId child, std::int32_t max_new, const std::string& needle) {
    expect_error<typename decltype(error)::type>([&] { sched.fork(parent, child, max_new); }, needle);
    EXPECT_EQ(sched.describe_state(), before);
    EXPECT_NO_THROW(sched.check_invariants());
  };
  refused(std::type_identity<UnknownId>{}, 99, 10, -1, "parent = 99");
  refused(std::type_identity<InvalidArgument>{}, 2, 10, -1, "parent is Prefilling");
  refused(std::type_identity<InvalidArgument>{}, 3, 10, -1, "parent is Waiting");
  refused(std::type_identity<InvalidArgument>{}, 1, 2, -1, "child = 2 is a live request");
  refused(std::type_identity<InvalidArgument>{}, 1, 1, -1, "child = 1 is a live request");
  refused(std::type_identity<InvalidArgument>{}, 1, 10, 0, "max_new_tokens = 0");
  refused(std::type_identity<InvalidArgument>{}, 1, 10, -2, "max_new_tokens = -2");
  refused(std::type_identity<InvalidArgument>{}, 1, 10, 100000, "could never complete alone");
  refused(std::type_identity<InvalidArgument>{}, 1, 10, 2147483647, "2^31 - 1 tokens");
  EXPECT_EQ(sched.stats().forks, 0);
  // Two forks fill the four slots; a third has none.
  sched.fork(1, 10);
  sched.fork(1, 11, 3);
  before = sched.describe_state();
  refused(std::type_identity<OutOfMemory>{}, 1, 12, -1, "config.max_num_seqs = 4");
  EXPECT_NO_THROW(sched.check_invariants());

  // A swapped parent is not Running.
  KVCacheManager small(tiny(10, {40, 40, 40}));
  config.preemption = PreemptionMode::Swap;
  config.demote_under_pressure = false;
  Scheduler swapping(small, config);
  swapping.add_request(request(1, {{TokenKind::Text, 20}}, 200));
  swapping.add_request(request(2, {{TokenKind::Text, 20}}, 200));
  for (int i = 0; i < 200 && swapping.status(2).state != RequestState::Swapped; ++i) (void)swapping.step();
  ASSERT_EQ(swapping.status(2).state, RequestState::Swapped);
  before = swapping.describe_state();
  expect_error<InvalidArgument>([&] { swapping.fork(2, 10); }, "parent is Swapped");
  EXPECT_EQ(swapping.describe_state(), before);
}

}  // namespace
}  // namespace mixkv
