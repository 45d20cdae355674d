// A request whose sequence vanishes from the cache behind the scheduler's
// back (another caller frees it, or frees it and adds another sequence
// under its id): check_invariants() reports it, the next step() retires the
// request as Cancelled with a note, frees nothing of the cache, and every
// other request is served to the end as if nothing had happened.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>

#include "engine_sim.h"
#include "mixkv/core/errors.h"
#include "scheduler_test_util.h"

namespace mixkv {
namespace {

using test::request;
using test::tiny;

// Request 1 Running, 2 Prefilling (a 200-token prompt in 32-token steps), 3
// Waiting or about to be admitted.
struct Busy {
  test::EngineSim engine{tiny(40, {40, 40, 40}), config()};
  KVCacheManager& cache = engine.cache();
  Scheduler& sched = engine.scheduler();

  static SchedulerConfig config() {
    SchedulerConfig c = test::base_config();
    c.max_num_seqs = 4;
    c.max_num_batched_tokens = 32;
    return c;
  }
  Busy() {
    sched.add_request(request(1, {{TokenKind::Text, 8}}, 20));
    engine.apply(sched.step(), false);
    sched.add_request(request(2, {{TokenKind::Text, 200}}, 5));
    sched.add_request(request(3, {{TokenKind::Text, 4}}, 5));
    engine.apply(sched.step(), false);
  }
};

// Steps to the end; returns each request's finish reason (and checks the
// invariants after every step and that every pool is whole at the end).
std::map<RequestId, FinishReason> run_to_end(Scheduler& sched, test::EngineSim& engine, const KVCacheManager& cache,
                                             std::map<RequestId, FinishReason> reasons = {}) {
  for (int i = 0; i < 1000 && sched.has_unfinished(); ++i) {
    const StepOutput out = sched.step();
    engine.apply(out, false);
    for (const FinishedRequest& f : out.finished) EXPECT_TRUE(reasons.emplace(f.id, f.reason).second) << f.id;
    EXPECT_TRUE(out.rejected.empty());
    EXPECT_NO_THROW(sched.check_invariants());
  }
  EXPECT_FALSE(sched.has_unfinished());
  for (const Precision p : kAllPrecisions) EXPECT_EQ(cache.pool_stats(p).used_blocks, 0) << to_string(p);
  EXPECT_EQ(cache.free_swap_slots(), cache.config().swap_blocks);
  return reasons;
}

// The step after the free: the request is retired as Cancelled with a note
// (only it), the step serves the others, and the books agree again.
void expect_retired(Scheduler& sched, test::EngineSim& engine, RequestId id,
                    std::map<RequestId, FinishReason>& reasons) {
  EXPECT_THROW(sched.check_invariants(), InvariantViolation);
  StepOutput out;
  ASSERT_NO_THROW(out = sched.step());
  engine.apply(out, false);
  const auto it =
      std::find_if(out.finished.begin(), out.finished.end(), [&](const FinishedRequest& f) { return f.id == id; });
  ASSERT_NE(it, out.finished.end()) << "request " << id << " was not retired";
  EXPECT_EQ(it->reason, FinishReason::Cancelled);
  EXPECT_NE(it->note.find("left the cache outside the scheduler"), std::string::npos) << it->note;
  for (const FinishedRequest& f : out.finished) {
    if (f.id != id) {
      EXPECT_TRUE(f.note.empty());
    }
    reasons.emplace(f.id, f.reason);
  }
  EXPECT_FALSE(sched.contains(id));
  EXPECT_FALSE(sched.cancel(id)) << "a retired request has left";
  EXPECT_EQ(std::count(out.decodes.begin(), out.decodes.end(), id), 0);
  EXPECT_EQ(sched.stats().vanished, 1);
  EXPECT_NO_THROW(sched.check_invariants());
}

TEST(Vanished, RunningOrPrefillingRequestIsRetiredAndTheOthersFinish) {
  for (const RequestId victim : {RequestId{1}, RequestId{2}}) {
    SCOPED_TRACE("request " + std::to_string(victim));
    Busy b;
    ASSERT_EQ(b.sched.status(victim).state, victim == 1 ? RequestState::Running : RequestState::Prefilling);
    b.cache.free_sequence(victim);
    std::map<RequestId, FinishReason> reasons;
    expect_retired(b.sched, b.engine, victim, reasons);
    reasons = run_to_end(b.sched, b.engine, b.cache, reasons);
    for (const RequestId id : {1, 2, 3}) {
      EXPECT_EQ(reasons.at(id), id == victim ? FinishReason::Cancelled : FinishReason::Length) << "request " << id;
    }
  }
}

TEST(Vanished, SwappedRequestIsRetiredAndTheOtherFinishes) {
  SchedulerConfig config = test::base_config();
  config.preemption = PreemptionMode::Swap;
  config.demote_under_pressure = false;
  config.max_num_batched_tokens = 32;
  test::EngineSim engine(tiny(10, {40, 40, 40}), config);
  KVCacheManager& cache = engine.cache();
  Scheduler& sched = engine.scheduler();
  sched.add_request(request(1, {{TokenKind::Text, 20}}, 200));
  sched.add_request(request(2, {{TokenKind::Text, 20}}, 200));
  for (int i = 0; i < 200 && sched.status(2).state != RequestState::Swapped; ++i) engine.apply(sched.step(), false);
  ASSERT_EQ(sched.status(2).state, RequestState::Swapped);
  cache.free_sequence(2);
  engine.forget(2);
  std::map<RequestId, FinishReason> reasons;
  expect_retired(sched, engine, 2, reasons);
  reasons = run_to_end(sched, engine, cache, reasons);
  EXPECT_EQ(reasons.at(1), FinishReason::Length);
}

// Freed and added again under the same id by another caller: the scheduler
// retires its request but leaves that sequence alone; the books agree again
// once its owner frees it.
TEST(Vanished, SequenceReplacedUnderTheSameIdIsLeftToItsOwner) {
  Busy b;
  b.cache.free_sequence(1);
  b.cache.add_sequence(1, TokenLayout({{TokenKind::Text, 40}}), PrecisionPlan(2, 0));
  EXPECT_THROW(b.sched.check_invariants(), InvariantViolation);
  const StepOutput out = b.sched.step();
  b.engine.apply(out, false);
  ASSERT_EQ(out.finished.size(), 1u);
  EXPECT_EQ(out.finished[0].id, 1);
  EXPECT_EQ(out.finished[0].reason, FinishReason::Cancelled);
  EXPECT_FALSE(out.finished[0].note.empty());
  EXPECT_FALSE(b.sched.contains(1));
  ASSERT_TRUE(b.cache.contains(1));
  EXPECT_EQ(b.cache.num_tokens(1), 40) << "the other caller's sequence changed";
  EXPECT_THROW(b.sched.check_invariants(), InvariantViolation);  // the cache holds a sequence of no request
  b.cache.free_sequence(1);
  EXPECT_NO_THROW(b.sched.check_invariants());
  const auto reasons = run_to_end(b.sched, b.engine, b.cache);
  EXPECT_EQ(reasons.at(2), FinishReason::Length);
  EXPECT_EQ(reasons.at(3), FinishReason::Length);
}

// cancel() and finish() of a request whose sequence vanished succeed (the
// caller's reason, no note), and so does the retirement of a request that
// had already generated its last token (Length).
TEST(Vanished, CancelFinishAndLastTokenStillWork) {
  Busy b;
  b.sched.add_request(request(4, {{TokenKind::Text, 4}}, 1));
  for (int i = 0; i < 20 && b.sched.contains(4) && b.sched.status(4).state != RequestState::Running; ++i) {
    b.engine.apply(b.sched.step(), false);
  }
  ASSERT_EQ(b.sched.status(4).state, RequestState::Running);  // its one token came out: done
  ASSERT_TRUE(b.sched.contains(1) && b.sched.contains(2));
  for (const RequestId id : {1, 2, 4}) b.cache.free_sequence(id);
  EXPECT_TRUE(b.sched.cancel(1));
  EXPECT_TRUE(b.sched.finish(2));
  const StepOutput out = b.sched.step();
  std::map<RequestId, FinishedRequest> finished;
  for (const FinishedRequest& f : out.finished) finished.emplace(f.id, f);
  ASSERT_EQ(finished.count(1) + finished.count(2) + finished.count(4), 3u);
  EXPECT_EQ(finished.at(1).reason, FinishReason::Cancelled);
  EXPECT_EQ(finished.at(2).reason, FinishReason::Stopped);
  EXPECT_EQ(finished.at(4).reason, FinishReason::Length);
  for (const RequestId id : {1, 2, 4}) EXPECT_TRUE(finished.at(id).note.empty()) << id;
  EXPECT_EQ(b.sched.stats().vanished, 0);
  EXPECT_NO_THROW(b.sched.check_invariants());
}

// Under memory pressure the vanished request is retired before any room
// is made: its blocks are gone already, so no one is demoted or preempted
// (relief would otherwise pick it, the newest, as its first victim).
TEST(Vanished, UnderPressureItIsRetiredBeforeAnyoneIsPreempted) {
  SchedulerConfig config = test::base_config();
  config.max_num_batched_tokens = 128;
  config.demote_under_pressure = false;
  test::EngineSim engine(tiny(4), config);  // 16 FP16 blocks
  KVCacheManager& cache = engine.cache();
  Scheduler& sched = engine.scheduler();
  sched.add_request(request(1, {{TokenKind::Text, 48}}, 3));  // 3 blocks a layer
  sched.add_request(request(2, {{TokenKind::Text, 48}}, 3));
  sched.add_request(request(3, {{TokenKind::Text, 16}}, 3));  // 1 block a layer
  engine.apply(sched.step(), false);
  ASSERT_EQ(cache.pool_stats(Precision::FP16).used_blocks, 14);
  // All three are at a block boundary: 6 new blocks, 2 free. Without 3's
  // blocks 4 are needed and 4 are free.
  cache.free_sequence(3);
  const StepOutput out = sched.step();
  engine.apply(out, false);
  ASSERT_EQ(out.finished.size(), 1u);
  EXPECT_EQ(out.finished[0].id, 3);
  EXPECT_EQ(out.finished[0].reason, FinishReason::Cancelled);
  EXPECT_EQ(out.decodes, (std::vector<RequestId>{1, 2}));
  EXPECT_TRUE(out.preempted.empty());
  EXPECT_TRUE(out.swapped_out.empty());
  EXPECT_TRUE(out.demotions.empty());
  EXPECT_NO_THROW(sched.check_invariants());
  const auto reasons = run_to_end(sched, engine, cache);
  EXPECT_EQ(reasons.at(1), FinishReason::Length);
  EXPECT_EQ(reasons.at(2), FinishReason::Length);
  EXPECT_EQ(sched.stats().preempted_recompute + sched.stats().preempted_swap, 0);
}

}  // namespace
}  // namespace mixkv
