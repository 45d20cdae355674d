// Every invariant Scheduler::check_invariants() holds (scheduler.h,
// docs/scheduler.md) can fail: each test corrupts one piece of bookkeeping
// through the test-only access hook (or the cache behind the scheduler's
// back) and expects InvariantViolation naming what broke. A checker that
// checked nothing would pass every other test.
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "mixkv/core/errors.h"
#include "scheduler_access.h"
#include "scheduler_test_util.h"

namespace mixkv {
namespace {

using test::request;
using test::SchedulerAccess;
using test::tiny;

class Corrupted : public ::testing::Test {
 protected:
  // Request 1 Running, 2 Prefilling (a 200-token prompt in 32-token steps),
  // 3 Waiting (the step's token budget is spent); 4 slots.
  void busy() {
    cache_.emplace(tiny(40, {40, 40, 40}));
    SchedulerConfig config = test::base_config();
    config.max_num_seqs = 4;
    config.max_num_batched_tokens = 32;
    sched_.emplace(*cache_, config);
    sched_->add_request(request(1, {{TokenKind::Text, 8}}, 50));
    (void)sched_->step();
    sched_->add_request(request(2, {{TokenKind::Text, 200}}, 5));
    sched_->add_request(request(3, {{TokenKind::Text, 4}}, 5));
    (void)sched_->step();
    ASSERT_EQ(sched_->status(1).state, RequestState::Running);
    ASSERT_EQ(sched_->status(2).state, RequestState::Prefilling);
    ASSERT_EQ(sched_->status(3).state, RequestState::Waiting);
    ASSERT_NO_THROW(sched_->check_invariants());
  }

  // Request 1 Running, 2 swapped out to the host pool.
  void with_swapped() {
    cache_.emplace(tiny(10, {40, 40, 40}));
    SchedulerConfig config = test::base_config();
    config.preemption = PreemptionMode::Swap;
    config.demote_under_pressure = false;
    config.max_num_batched_tokens = 32;
    sched_.emplace(*cache_, config);
    sched_->add_request(request(1, {{TokenKind::Text, 20}}, 200));
    sched_->add_request(request(2, {{TokenKind::Text, 20}}, 200));
    for (int i = 0; i < 200 && sched_->status(2).state != RequestState::Swapped; ++i) (void)sched_->step();
    ASSERT_EQ(sched_->status(1).state, RequestState::Running);
    ASSERT_EQ(sched_->status(2).state, RequestState::Swapped);
    ASSERT_NO_THROW(sched_->check_invariants());
  }

  auto& impl() { return SchedulerAccess::impl(*sched_); }
  scheduler_detail::Entry& entry(RequestId id) { return SchedulerAccess::entry(*sched_, id); }
  KVCacheManager& cache() { return *cache_; }
  Scheduler& sched() { return *sched_; }

  void expect_violation(const std::string& needle) {
    try {
      sched_->check_invariants();
      ADD_FAILURE() << "check_invariants() passed, expected a violation naming \"" << needle << "\"";
    } catch (const InvariantViolation& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
          << "message \"" << e.what() << "\" lacks \"" << needle << "\"";
    }
  }

 private:
  std::optional<KVCacheManager> cache_;  // outlives the scheduler
  std::optional<Scheduler> sched_;
};

// Every request is on exactly one queue, the one of its state.
TEST_F(Corrupted, RequestOnTheQueueOfAnotherState) {
  busy();
  entry(3).state = RequestState::Swapped;
  expect_violation("request 3 (Swapped) is on the waiting queue");
}

TEST_F(Corrupted, QueuedRequestThatIsNotLive) {
  busy();
  entry(3).id = 99;
  expect_violation("request 99 (Waiting) is queued but not a live entry");
}

TEST_F(Corrupted, LiveRequestOnNoQueue) {
  busy();
  impl().waiting.erase(impl().waiting.iterator_to(entry(3)));
  expect_violation("3 live requests but 2 queued");
}

// Memory is held exactly by Prefilling and Running (device) and Swapped
// (host) requests.
TEST_F(Corrupted, RunningRequestWhoseSequenceWasFreed) {
  busy();
  cache().free_sequence(1);
  expect_violation("request 1 (Running): the cache disagrees on its memory");
}

// A shared partly filled FP16 tail only among requests marked as forked:
// the decode need counts copy-on-write copies for those alone.
TEST_F(Corrupted, SharedTailOfAnUnmarkedRequest) {
  busy();
  sched().fork(1, 9);
  ASSERT_NO_THROW(sched().check_invariants());
  entry(9).shares_tail = false;
  expect_violation("request 9 (Running) shares a partly filled FP16 tail but is not marked as forked");
}

TEST_F(Corrupted, WaitingRequestThatHoldsMemory) {
  busy();
  cache().add_sequence(3, TokenLayout({{TokenKind::Text, 4}}), PrecisionPlan(2, 0));
  expect_violation("request 3 (Waiting): the cache disagrees on its memory");
}

TEST_F(Corrupted, RunningRequestSwappedOutInTheCache) {
  busy();
  (void)cache().swap_out(1);
  expect_violation("request 1 (Running) is swapped out in the cache");
}

TEST_F(Corrupted, SwappedRequestBackInDeviceMemory) {
  with_swapped();
  ASSERT_TRUE(sched().cancel(1));
  (void)cache().swap_in(2);
  expect_violation("request 2 (Swapped) is not swapped out in the cache");
}

TEST_F(Corrupted, CacheHoldsASequenceOfNoRequest) {
  busy();
  cache().add_sequence(99, TokenLayout({{TokenKind::Text, 4}}), PrecisionPlan(2, 0));
  expect_violation("the cache holds 3 sequences, the scheduler 2");
}

// What a resident request records agrees with the cache.
TEST_F(Corrupted, StalePageTable) {
  busy();
  entry(1).table = nullptr;
  expect_violation("request 1 (Running) holds a stale page table");
}

TEST_F(Corrupted, TokenCount) {
  busy();
  ++entry(1).num_tokens;
  expect_violation("request 1 (Running) counts 10 tokens, the cache 9");
}

// Slots: unique, in range, held only with device memory, the rest free.
TEST_F(Corrupted, SharedSlot) {
  busy();
  entry(2).slot = entry(1).slot;
  expect_violation("request 2 (Prefilling) has slot " + std::to_string(entry(1).slot) + ", out of range or shared");
}

TEST_F(Corrupted, SlotOutOfRange) {
  busy();
  entry(1).slot = 4;
  expect_violation("request 1 (Running) has slot 4, out of range or shared");
}

TEST_F(Corrupted, SlotWithoutDeviceMemory) {
  busy();
  entry(3).slot = 3;
  expect_violation("request 3 (Waiting) holds slot 3 without device memory");
}

TEST_F(Corrupted, FreeSlotMissing) {
  busy();
  impl().free_slots.pop_back();
  expect_violation("1 free slots + 2 used != max_num_seqs");
}

TEST_F(Corrupted, FreeSlotInUse) {
  busy();
  impl().free_slots.front() = entry(1).slot;
  expect_violation("free slot " + std::to_string(entry(1).slot) + " is out of range, used or listed twice");
}

TEST_F(Corrupted, FreeSlotOutOfRange) {
  busy();
  impl().free_slots.front() = 7;
  expect_violation("free slot 7 is out of range, used or listed twice");
}

// Prefill progress and generation agree with the state.
TEST_F(Corrupted, ComputedPastThePrompt) {
  busy();
  entry(3).computed = 5;
  expect_violation("request 3 (Waiting) computed 5");
}

TEST_F(Corrupted, RunningBeforeItsPromptIsDone) {
  busy();
  --entry(1).computed;
  expect_violation("request 1 (Running) runs before its prompt is done");
}

TEST_F(Corrupted, PrefillingADonePrompt) {
  busy();
  entry(2).computed = 200;
  expect_violation("request 2 (Prefilling) prefills a done prompt");
}

TEST_F(Corrupted, GeneratedMoreThanMaxNewTokens) {
  busy();
  entry(1).generated = entry(1).max_new_tokens + 1;
  expect_violation("request 1 (Running) generated more than max_new_tokens");
}

// The decode list holds exactly the Running requests; the counters match.
TEST_F(Corrupted, RunningRequestMissingFromTheDecodeList) {
  busy();
  entry(1).decode_index = -1;
  expect_violation("request 1 (Running) is wrongly (un)listed for decoding");
}

TEST_F(Corrupted, DecodeListTooLong) {
  busy();
  impl().decoding.push_back(&entry(1));
  expect_violation("counts 1 prefilling and 2 decoding requests, the queues hold 1 and 1");
}

TEST_F(Corrupted, PrefillingCount) {
  busy();
  ++impl().prefilling;
  expect_violation("counts 2 prefilling and 1 decoding requests, the queues hold 1 and 1");
}

// Within max_num_seqs.
TEST_F(Corrupted, MoreResidentRequestsThanMaxNumSeqs) {
  busy();
  impl().config.max_num_seqs = 1;
  expect_violation("2 requests hold device memory, more than max_num_seqs = 1");
}

}  // namespace
}  // namespace mixkv
