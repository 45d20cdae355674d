// Speculative decoding through the scheduler: draft rows in decode steps
// (SchedulerConfig::num_speculative_tokens, Scheduler::speculate), their
// slots and row offsets in StepOutput, accept() and the implicit rejection
// of drafts nobody accepted, the caps (remaining tokens, token budget,
// memory: never a demotion or preemption for drafts), forks, and random
// serving loops under memory pressure that keep every invariant and free
// everything at the end. The scheduler drives a bare manager: these steps
// are checked against the page tables, not run on bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "../cache/cache_test_util.h"
#include "mixkv/core/errors.h"
#include "mixkv/scheduler/scheduler.h"
#include "scheduler_access.h"
#include "scheduler_test_util.h"

namespace mixkv {
namespace {

using test::base_config;
using test::expect_error;
using test::request;
using test::tiny;

constexpr std::int32_t kBs = 16;

// A scheduler over a bare manager, every step checked.
struct Spec {
  Spec(const CacheConfig& cc, const SchedulerConfig& sc) : cache(cc), sched(cache, sc) {}

  StepOutput step() {
    StepOutput out = sched.step();
    check(out);
    EXPECT_NO_THROW(sched.check_invariants()) << "after step " << out.step;
    for (const FinishedRequest& f : out.finished) finished[f.id] = f;
    for (const RejectedRequest& r : out.rejected) rejected[r.id] = r.reason;
    return out;
  }

  // decode_rows, the slots of every row and the first rows' offsets against
  // the page tables; no slot taken twice; nothing relieved memory in a step
  // with drafts; the token budget holds.
  void check(const StepOutput& out) {
    const std::size_t batch = out.decodes.size();
    EXPECT_LE(out.num_batched_tokens, sched.config().max_num_batched_tokens);
    if (out.decode_rows.empty()) {
      for (const RequestId id : out.decodes) EXPECT_EQ(sched.status(id).drafts, 0);
      if (sched.config().per_layer_slots) {
        for (const auto& row : out.append.slots) EXPECT_EQ(row.size(), batch);
      }
      return;
    }
    EXPECT_TRUE(out.preempted.empty() && out.swapped_out.empty() && out.demotions.empty())
        << "step " << out.step << " relieved memory pressure and gave drafts";
    ASSERT_EQ(out.decode_rows.size(), batch + 1);
    EXPECT_EQ(out.decode_rows[0], 0);
    ASSERT_EQ(out.append.offsets.size(), batch);
    const std::int32_t rows = out.decode_rows.back();
    std::int32_t prefill = 0;
    for (const PrefillChunk& c : out.prefills) prefill += c.end - c.start;
    EXPECT_EQ(out.num_batched_tokens, rows + prefill);
    const bool per_layer = sched.config().per_layer_slots;
    for (std::int32_t l = 0; l < 2; ++l) {
      std::set<std::int32_t> seen;
      if (per_layer) {
        ASSERT_EQ(out.append.slots[static_cast<std::size_t>(l)].size(), static_cast<std::size_t>(rows));
      }
      for (std::size_t i = 0; i < batch; ++i) {
        const std::int32_t n = out.decode_rows[i + 1] - out.decode_rows[i];
        ASSERT_GE(n, 1);
        EXPECT_EQ(sched.status(out.decodes[i]).drafts, n - 1);
        const PageTable& t = cache.page_table(out.decodes[i]);
        EXPECT_EQ(out.append.offsets[i], (cache.num_tokens(out.decodes[i]) - n) % kBs);
        // The metadata covers every row: the page tables after the append.
        const PagedPoolTable& meta = out.metadata.layers[static_cast<std::size_t>(l)][0];
        EXPECT_EQ(meta.indptr[i + 1] - meta.indptr[i], static_cast<std::int32_t>(t.blocks(l, Precision::FP16).size()));
        EXPECT_EQ(meta.last_block_len[i], t.fp16_tail_fill(l));
        for (std::int32_t j = 0; j < n; ++j) {
          const std::int32_t slot = t.fp16_slot(l, t.fp16_tokens(l) - n + j);
          EXPECT_TRUE(seen.insert(slot).second) << "slot " << slot << " taken twice";
          if (per_layer) {
            EXPECT_EQ(out.append.slots[static_cast<std::size_t>(l)][out.decode_rows[i] + j], slot);
          }
        }
      }
    }
  }

  void accept(RequestId id, std::int32_t n) {
    sched.accept(id, n);
    EXPECT_NO_THROW(sched.check_invariants()) << "after accept(" << id << ", " << n << ")";
  }

  void drain(std::mt19937& rng) {
    for (int i = 0; i < 100000 && sched.has_unfinished() && !testing::Test::HasFatalFailure(); ++i) {
      const StepOutput out = step();
      for (std::size_t d = 0; d < out.decodes.size(); ++d) {
        const std::int32_t drafts = sched.status(out.decodes[d]).drafts;
        if (drafts > 0 && rng() % 4 != 0) accept(out.decodes[d], static_cast<std::int32_t>(rng() % (drafts + 1)));
      }
    }
    EXPECT_FALSE(sched.has_unfinished());
  }

  void expect_empty() const {
    for (const Precision p : kAllPrecisions) EXPECT_EQ(cache.pool_stats(p).used_blocks, 0) << to_string(p);
    EXPECT_EQ(cache.free_swap_slots(), cache.config().swap_blocks);
    EXPECT_TRUE(cache.sequence_ids().empty());
  }

  KVCacheManager cache;
  Scheduler sched;
  std::map<RequestId, FinishedRequest> finished;
  std::map<RequestId, std::string> rejected;
};

SchedulerConfig drafting(std::int32_t drafts) {
  SchedulerConfig c = base_config();
  c.num_speculative_tokens = drafts;
  return c;
}

TEST(SchedulerSpeculative, AcceptedDraftsCountTowardMaxNewTokens) {
  Spec s(tiny(20), drafting(3));
  s.sched.add_request(request(1, {{TokenKind::Text, 20}}, 10));
  s.step();  // the prefill: its token is the first generated
  StepOutput out = s.step();
  EXPECT_EQ(out.decode_rows, (std::vector<std::int32_t>{0, 4}));
  EXPECT_EQ(out.num_batched_tokens, 4);
  EXPECT_EQ(s.cache.num_tokens(1), 24);
  EXPECT_EQ(s.sched.status(1).generated, 2);
  s.accept(1, 2);  // 2 drafts and the token after them
  EXPECT_EQ(s.cache.num_tokens(1), 23);
  EXPECT_EQ(s.sched.status(1).generated, 4);
  EXPECT_EQ(s.sched.status(1).drafts, 0);
  out = s.step();
  EXPECT_EQ(out.decode_rows, (std::vector<std::int32_t>{0, 4}));
  s.accept(1, 3);
  EXPECT_EQ(s.sched.status(1).generated, 8);
  out = s.step();  // 2 tokens left: one draft at most
  EXPECT_EQ(out.decode_rows, (std::vector<std::int32_t>{0, 2}));
  s.accept(1, 1);
  EXPECT_EQ(s.sched.status(1).generated, 10);
  out = s.step();
  EXPECT_TRUE(out.decodes.empty());
  ASSERT_EQ(out.finished.size(), 1u);
  EXPECT_EQ(out.finished[0].reason, FinishReason::Length);
  EXPECT_EQ(out.finished[0].generated, 10);
  const SchedulerStats st = s.sched.stats();
  EXPECT_EQ(st.draft_tokens, 7);
  EXPECT_EQ(st.accepted_tokens, 6);
  EXPECT_EQ(st.decode_tokens, 3);
  EXPECT_TRUE(s.rejected.empty());
  s.expect_empty();
}

TEST(SchedulerSpeculative, DraftsNobodyAcceptedAreRejectedByTheNextStep) {
  SchedulerConfig c = drafting(5);
  c.per_layer_slots = false;  // compact slots: the rows' offsets only
  Spec s(tiny(20), c);
  s.sched.add_request(request(1, {{TokenKind::Text, 14}}, 30));
  s.step();
  const std::string before = s.cache.describe_state();
  s.step();
  EXPECT_EQ(s.cache.num_tokens(1), 20);  // 14 + 1 + 5, across a block boundary
  const StepOutput out = s.step();       // rejects the 5, then 1 + 5 rows again
  EXPECT_EQ(s.sched.status(1).generated, 3);
  EXPECT_EQ(s.cache.num_tokens(1), 21);
  EXPECT_EQ(out.decode_rows, (std::vector<std::int32_t>{0, 6}));
  s.accept(1, 0);
  EXPECT_EQ(s.cache.num_tokens(1), 16);
  EXPECT_NE(s.cache.describe_state(), before);
  s.sched.cancel(1);
  s.step();
  s.expect_empty();
}

TEST(SchedulerSpeculative, SpeculateSetsOneDecodeStep) {
  Spec s(tiny(20), base_config());
  s.sched.add_request(request(1, {{TokenKind::Text, 20}}, 30));
  s.sched.add_request(request(2, {{TokenKind::Text, 20}}, 30));
  s.sched.speculate(2, 4);  // waiting: kept for its first decode
  s.step();
  StepOutput out = s.step();
  ASSERT_EQ(out.decodes.size(), 2u);
  const std::size_t two = out.decodes[0] == 2 ? 0 : 1;
  EXPECT_EQ(out.decode_rows[two + 1] - out.decode_rows[two], 5);
  EXPECT_EQ(out.decode_rows[1 - two + 1] - out.decode_rows[1 - two], 1);
  s.accept(2, 4);
  out = s.step();
  EXPECT_TRUE(out.decode_rows.empty());  // the default again: plain decoding
  s.sched.speculate(1, 2);
  s.sched.speculate(1, 0);  // the last call counts
  out = s.step();
  EXPECT_TRUE(out.decode_rows.empty());
  s.sched.cancel(1);
  s.sched.cancel(2);
  s.step();
  s.expect_empty();
}

TEST(SchedulerSpeculative, BadCallsChangeNothing) {
  SchedulerConfig bad = drafting(-1);
  KVCacheManager cache(tiny(20));
  expect_error<InvalidArgument>([&] { Scheduler sched(cache, bad); }, "config.num_speculative_tokens = -1");
  Spec s(tiny(20), drafting(2));
  s.sched.add_request(request(1, {{TokenKind::Text, 20}}, 30));
  s.sched.add_request(request(2, {{TokenKind::Text, 20}}, 30));
  s.step();
  const std::string idle = s.sched.describe_state();
  expect_error<InvalidArgument>([&] { s.sched.accept(1, 0); }, "no draft tokens awaiting accept()");
  s.step();
  const std::string before = s.sched.describe_state();
  EXPECT_NE(before.find("drafts 2"), std::string::npos);
  expect_error<UnknownId>([&] { s.sched.accept(7, 0); }, "id = 7");
  expect_error<UnknownId>([&] { s.sched.speculate(7, 1); }, "id = 7");
  expect_error<InvalidArgument>([&] { s.sched.speculate(1, -1); }, "num_drafts = -1");
  expect_error<InvalidArgument>([&] { s.sched.accept(1, 3); }, "num_accepted = 3");
  expect_error<InvalidArgument>([&] { s.sched.accept(1, -1); }, "num_accepted = -1");
  expect_error<InvalidArgument>([&] { s.sched.fork(1, 9); }, "draft tokens awaiting accept()");
  EXPECT_EQ(s.sched.describe_state(), before);
  s.accept(1, 1);
  expect_error<InvalidArgument>([&] { s.sched.accept(1, 1); }, "no draft tokens awaiting accept()");
  EXPECT_NE(idle, before);
}

TEST(SchedulerSpeculative, TheTokenBudgetCapsDrafts) {
  SchedulerConfig c = drafting(10);
  c.max_num_batched_tokens = 16;
  Spec s(tiny(40), c);
  for (RequestId id = 1; id <= 4; ++id) s.sched.add_request(request(id, {{TokenKind::Text, 4}}, 40));
  s.step();
  const StepOutput out = s.step();
  ASSERT_EQ(out.decodes.size(), 4u);
  std::vector<std::int32_t> drafts;
  for (std::size_t i = 0; i < 4; ++i) drafts.push_back(out.decode_rows[i + 1] - out.decode_rows[i] - 1);
  EXPECT_EQ(drafts, (std::vector<std::int32_t>{10, 2, 0, 0}));  // 16 - 4 rows left, in batch order
  EXPECT_EQ(out.num_batched_tokens, 16);
}

TEST(SchedulerSpeculative, MemoryCapsDraftsWithoutPreemption) {
  SchedulerConfig c = drafting(28);
  c.demote_under_pressure = false;
  Spec s(tiny(4), c);  // 16 FP16 blocks
  for (RequestId id = 1; id <= 3; ++id) s.sched.add_request(request(id, {{TokenKind::Text, 20}}, 30));
  s.step();  // 3 x 4 blocks: 4 left, the drafts of one request
  const StepOutput out = s.step();
  ASSERT_EQ(out.decodes.size(), 3u);
  // 28 drafts open 2 blocks a layer, the third's 5 (budget) none: the
  // second loses its drafts.
  EXPECT_EQ(out.decode_rows, (std::vector<std::int32_t>{0, 29, 30, 36}));
  EXPECT_TRUE(out.preempted.empty());
  EXPECT_EQ(s.cache.pool_stats(Precision::FP16).free_blocks, 0);
  s.accept(out.decodes[0], 0);
  EXPECT_EQ(s.cache.pool_stats(Precision::FP16).free_blocks, 4);
  std::mt19937 rng(3);
  s.drain(rng);  // preempting as the three grow, never for drafts (Spec::check)
  for (RequestId id = 1; id <= 3; ++id) EXPECT_EQ(s.finished.at(id).generated, 30);
  EXPECT_TRUE(s.rejected.empty());
  s.expect_empty();
}

TEST(SchedulerSpeculative, ForksDecodeWithDrafts) {
  Spec s(tiny(30), drafting(3));
  s.sched.add_request(request(1, {{TokenKind::Text, 20}}, 40));
  s.step();
  s.step();
  s.accept(1, 1);
  s.sched.fork(1, 2);
  s.sched.fork(1, 3, 12);
  const StepOutput out = s.step();  // all three copy the shared tail but the last holder
  EXPECT_EQ(out.append.copies.size(), 4u);
  EXPECT_EQ(out.decode_rows.back(), 12);
  EXPECT_TRUE(s.rejected.empty());
  std::mt19937 rng(5);
  s.drain(rng);
  EXPECT_EQ(s.finished.at(1).generated, 40);
  EXPECT_EQ(s.finished.at(2).generated, 40);
  EXPECT_EQ(s.finished.at(3).generated, 3 + 12);
  s.expect_empty();
}

// The checker sees drafts where none can be and a wrong speculate() count.
TEST(SchedulerSpeculative, InvariantsCatchCorruptedDrafts) {
  auto expect_violation = [](const Scheduler& sched, const std::string& needle) {
    try {
      sched.check_invariants();
      ADD_FAILURE() << "check_invariants() passed, expected a violation naming \"" << needle << "\"";
    } catch (const InvariantViolation& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  Spec s(tiny(20), drafting(2));
  s.sched.add_request(request(1, {{TokenKind::Text, 20}}, 4));
  s.sched.add_request(request(2, {{TokenKind::Text, 200}}, 4));  // prefills over several steps
  s.step();
  s.step();
  ASSERT_EQ(s.sched.status(1).drafts, 2);
  ASSERT_EQ(s.sched.status(2).state, RequestState::Prefilling);
  auto& one = test::SchedulerAccess::entry(s.sched, 1);
  auto& two = test::SchedulerAccess::entry(s.sched, 2);
  one.drafts = 3;  // generated 2 + 3 drafts > max_new_tokens 4
  expect_violation(s.sched, "holds 3 drafts awaiting accept()");
  one.drafts = 2;
  two.drafts = 1;  // Prefilling
  expect_violation(s.sched, "holds 1 drafts awaiting accept()");
  two.drafts = 0;
  test::SchedulerAccess::impl(s.sched).overrides = 1;
  expect_violation(s.sched, "requests with drafts set by speculate()");
  test::SchedulerAccess::impl(s.sched).overrides = 0;
  EXPECT_NO_THROW(s.sched.check_invariants());
}

// Requests of mixed sizes arrive over time at a cache small enough to
// preempt; drafts by default and by speculate(), accepted at random or left
// to the next step; some requests fork, finish early or are cancelled.
void random_loop(PreemptionMode mode, bool per_layer_slots, std::uint32_t seed) {
  constexpr RequestId kRequests = 300;
  SchedulerConfig c = drafting(static_cast<std::int32_t>(seed % 4));
  c.preemption = mode;
  c.per_layer_slots = per_layer_slots;
  c.max_demotions_per_step = 6;
  Spec s(tiny(10, {16, 12, 12}), c);
  std::mt19937 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  RequestId next = 1;
  std::map<RequestId, std::int32_t> wanted;  // max_new_tokens of every request (children: their total)
  for (int step = 0; step < 20000 && !testing::Test::HasFailure(); ++step) {
    if (next <= kRequests && pick(0, 2) == 0) {
      const Precision fill = pick(0, 1) == 0 ? Precision::FP16 : Precision::INT4;
      const Request r = request(
          next, {{TokenKind::Text, pick(1, 9)}, {TokenKind::Visual, pick(1, 40)}, {TokenKind::Text, pick(1, 5)}},
          pick(1, 50), fill);
      wanted[next++] = r.max_new_tokens;
      s.sched.add_request(r);
    }
    if (s.sched.contains(next - 1) && pick(0, 3) == 0) s.sched.speculate(next - 1, pick(0, 6));
    const StepOutput out = s.step();
    if (testing::Test::HasFailure()) break;
    for (const RequestId id : out.decodes) {
      const RequestStatus st = s.sched.status(id);
      if (st.drafts > 0 && pick(0, 4) != 0) s.accept(id, pick(0, st.drafts));
      if (pick(0, 60) == 0) s.sched.speculate(id, pick(0, 8));
    }
    if (!out.decodes.empty() && pick(0, 40) == 0) {
      const RequestId id = out.decodes[static_cast<std::size_t>(pick(0, static_cast<int>(out.decodes.size()) - 1))];
      const RequestStatus st = s.sched.status(id);
      if (st.drafts == 0 && st.state == RequestState::Running && st.generated < wanted[id] && next <= kRequests) {
        try {
          s.sched.fork(id, next, -1);
          wanted[next++] = wanted[id];
        } catch (const OutOfMemory&) {  // no free page-table slot
        } catch (const InvalidArgument&) {
          // A child that could not complete alone: refused, nothing changed.
        }
      }
    }
    if (!out.decodes.empty() && pick(0, 80) == 0) s.sched.finish(out.decodes.front());
    if (pick(0, 200) == 0 && next > 1) s.sched.cancel(static_cast<RequestId>(pick(1, static_cast<int>(next - 1))));
    if (next > kRequests && !s.sched.has_unfinished()) break;
  }
  s.drain(rng);
  EXPECT_EQ(s.finished.size() + s.rejected.size(), wanted.size());
  for (const auto& [id, f] : s.finished) {
    if (f.reason == FinishReason::Length) {
      EXPECT_EQ(f.generated, wanted.at(id)) << "request " << id;
    }
    EXPECT_LE(f.generated, wanted.at(id));
  }
  const SchedulerStats st = s.sched.stats();
  EXPECT_GT(st.draft_tokens, 0);
  EXPECT_LE(st.accepted_tokens, st.draft_tokens);
  EXPECT_GT(st.preempted_recompute + st.preempted_swap, 0) << "no memory pressure: the test means little";
  s.expect_empty();
}

TEST(SchedulerSpeculative, RandomLoopUnderPressureRecompute) {
  for (std::uint32_t seed = 1; seed <= 4; ++seed) random_loop(PreemptionMode::Recompute, true, seed);
}

TEST(SchedulerSpeculative, RandomLoopUnderPressureSwap) {
  for (std::uint32_t seed = 5; seed <= 8; ++seed) random_loop(PreemptionMode::Swap, seed % 2 == 0, seed);
}

}  // namespace
}  // namespace mixkv
