// Prefix caching in the scheduler (CacheConfig::prefix_cache), on tiny
// caches: admission by the demand after hits, the first chunk from the
// first row not cached, rows published the step after they are computed,
// eviction of cached blocks before any demotion or preemption, cancels and
// forks of requests admitted with a hit, and malformed keys refused.
#include <gtest/gtest.h>

#include <vector>

#include "../cache/cache_test_util.h"
#include "mixkv/scheduler/scheduler.h"
#include "scheduler_test_util.h"

namespace mixkv {
namespace {

using test::base_config;
using test::tiny;

CacheConfig cached(std::int32_t slabs) {
  CacheConfig c = tiny(slabs);
  c.prefix_cache.enabled = true;
  return c;
}

// System text 32, a video of 4 windows (window 0 FP16, the others INT4), a
// question of `rows` rows from question `question`, with their keys.
Request video_question(RequestId id, std::int32_t question, std::int32_t rows, std::int32_t max_new) {
  Request r = test::request(id, {{TokenKind::Text, 32}, {TokenKind::Visual, 64}, {TokenKind::Text, rows}}, max_new,
                            Precision::INT4);
  for (std::int32_t i = 0; i < 96; ++i) r.token_keys.push_back(1000 + i);
  for (std::int32_t i = 0; i < rows; ++i) r.token_keys.push_back(9000 + 100 * question + i);
  return r;
}

// Steps until `id` is Running; returns the chunks' first rows.
std::vector<std::int32_t> prefill(Scheduler& sched, RequestId id) {
  std::vector<std::int32_t> starts;
  for (int i = 0; i < 20 && sched.status(id).state != RequestState::Running; ++i) {
    const StepOutput out = sched.step();
    for (const PrefillChunk& c : out.prefills) {
      if (c.id == id) starts.push_back(c.start);
    }
    EXPECT_NO_THROW(sched.check_invariants());
  }
  return starts;
}

void drain(Scheduler& sched) {
  for (int i = 0; i < 200 && sched.has_unfinished(); ++i) {
    sched.step();
    ASSERT_NO_THROW(sched.check_invariants());
  }
  EXPECT_FALSE(sched.has_unfinished());
}

// The first request holds 3 of the 5 slabs; the second, the same video
// with another question, would need 3 more without the cache and fits
// beside it by its demand after the hit.
TEST(PrefixHits, AdmitsByTheDemandAfterHits) {
  for (const bool caching : {false, true}) {
    KVCacheManager cache(caching ? cached(5) : tiny(5));
    Scheduler sched(cache, base_config());
    sched.add_request(video_question(1, 0, 7, 20));
    EXPECT_EQ(prefill(sched, 1), (std::vector<std::int32_t>{0, 64}));
    sched.add_request(video_question(2, 1, 11, 4));
    const StepOutput out = sched.step();  // publishes the first request's last chunk, then admits
    sched.check_invariants();
    if (!caching) {
      EXPECT_TRUE(out.prefills.empty()) << "admitted without the cache";
      EXPECT_EQ(sched.status(2).state, RequestState::Waiting);
      continue;
    }
    ASSERT_EQ(out.prefills.size(), 1u);
    EXPECT_EQ(out.prefills[0].start, 96);
    EXPECT_EQ(out.prefills[0].end, 107);
    EXPECT_EQ(out.prefills[0].mappings[0].fp16_slots.size(), 11u);
    EXPECT_EQ(sched.status(2).cached_tokens, 96);
    const SchedulerStats st = sched.stats();
    EXPECT_EQ(st.prefix_hits, 1);
    EXPECT_EQ(st.cached_prompt_tokens, 96);
    EXPECT_EQ(st.prefill_tokens, 103 + 11);
    EXPECT_EQ(st.shared_blocks, 2 * (3 + 3));  // per layer: 2 text blocks, window 0, 3 INT4 windows
    EXPECT_EQ(st.published_blocks, 2 * 6);
    for (std::int32_t l = 0; l < 2; ++l) {
      EXPECT_EQ(test::to_vector(cache.blocks(1, l, Precision::INT4)),
                test::to_vector(cache.blocks(2, l, Precision::INT4)));
    }
    drain(sched);
    EXPECT_EQ(sched.stats().demotions + sched.stats().preempted_recompute + sched.stats().preempted_swap, 0);
  }
}

// Cached blocks no request holds count as free: a request that needs them
// is admitted by evicting them, with no demotion and no preemption, while
// another request runs.
TEST(PrefixHits, EvictsCachedBlocksBeforeDemotingOrPreempting) {
  KVCacheManager cache(cached(5));
  Scheduler sched(cache, base_config());
  sched.add_request(video_question(1, 0, 7, 2));
  drain(sched);
  EXPECT_EQ(cache.prefix_stats().evictable, (BlockCounts{6, 6, 0}));
  Request running = test::request(2, {{TokenKind::Text, 8}, {TokenKind::Visual, 32}, {TokenKind::Text, 4}}, 30);
  sched.add_request(running);
  prefill(sched, 2);
  // 7 FP16 blocks a layer: with the running request's, more than the free slabs hold.
  sched.add_request(test::request(3, {{TokenKind::Text, 100}}, 3));
  const StepOutput out = sched.step();
  ASSERT_EQ(out.prefills.size(), 1u);
  EXPECT_EQ(out.prefills[0].id, 3);
  EXPECT_GT(cache.prefix_stats().evicted[1], 0) << "the INT4 slab went to the FP16 pool";
  drain(sched);
  const SchedulerStats st = sched.stats();
  EXPECT_EQ(st.demotions + st.preempted_recompute + st.preempted_swap, 0);
}

// Cancelled right after its admission with a hit (before its chunk ran),
// a request gives its shared blocks back to their other holders; the next
// one with the prompt hits the same blocks.
TEST(PrefixHits, CancelDuringAHit) {
  KVCacheManager cache(cached(8));
  Scheduler sched(cache, base_config());
  sched.add_request(video_question(1, 0, 7, 30));
  prefill(sched, 1);
  sched.step();  // publishes the rest of its prompt
  const std::int32_t window = cache.window_block(1, 1, 2);
  sched.add_request(video_question(2, 1, 5, 4));
  sched.step();
  EXPECT_EQ(sched.status(2).cached_tokens, 96);
  EXPECT_EQ(cache.ref_count(Precision::INT4, window), 3);
  EXPECT_TRUE(sched.cancel(2));
  EXPECT_EQ(cache.ref_count(Precision::INT4, window), 2);
  sched.check_invariants();
  sched.step();  // its chunk was never computed: nothing of it is published
  sched.check_invariants();
  sched.add_request(video_question(3, 1, 5, 4));
  sched.step();
  EXPECT_EQ(sched.status(3).cached_tokens, 96);
  EXPECT_EQ(cache.window_block(3, 1, 2), window);
  drain(sched);
  EXPECT_EQ(sched.stats().prefix_hits, 2);
  EXPECT_EQ(cache.evict_prefix_cache(), 2 * 6);  // the published prompt: 3 FP16 and 3 INT4 blocks a layer
  for (const Precision p : kAllPrecisions) EXPECT_EQ(cache.pool_stats(p).used_blocks, 0);
}

// A request admitted with a hit forks: the child shares the cached blocks
// too, and both finish; the cached prefix outlives them.
TEST(PrefixHits, ForkOfACachedPrefix) {
  KVCacheManager cache(cached(10));
  Scheduler sched(cache, base_config());
  sched.add_request(video_question(1, 0, 7, 3));
  drain(sched);
  sched.add_request(video_question(2, 0, 7, 12));
  EXPECT_EQ(prefill(sched, 2), (std::vector<std::int32_t>{96}));
  sched.fork(2, 3, 5);
  const std::int32_t window = cache.window_block(2, 0, 3);
  EXPECT_EQ(cache.window_block(3, 0, 3), window);
  EXPECT_EQ(cache.ref_count(Precision::INT4, window), 3);
  drain(sched);
  EXPECT_EQ(cache.ref_count(Precision::INT4, window), 1);
  sched.add_request(video_question(4, 0, 7, 2));
  EXPECT_EQ(prefill(sched, 4), (std::vector<std::int32_t>{96}));
  drain(sched);
}

TEST(PrefixHits, MalformedKeysAreRefusedByName) {
  KVCacheManager cache(cached(5));
  Scheduler sched(cache, base_config());
  Request r = video_question(1, 0, 7, 2);
  r.token_keys.pop_back();
  const std::string before = sched.describe_state();
  test::expect_error<InvalidArgument>([&] { sched.add_request(r); }, "request.token_keys has 102 keys");
  EXPECT_EQ(sched.describe_state(), before);
  EXPECT_FALSE(sched.contains(1));
}

}  // namespace
}  // namespace mixkv
