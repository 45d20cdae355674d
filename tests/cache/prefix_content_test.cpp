// Prefix caching by content (PrefixIdentity::Content): a window's node holds
// copies at several precisions, each plan takes the copy it wants or the
// FP16 one to demote from, a copy below the plan ends the match, demotions
// leave a shared FP16 copy to its other holders, and eviction drops copies
// before it drops a node and what continues it.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "cache_test_util.h"
#include "manager_test_access.h"

namespace mixkv::test {
namespace {

using Access = detail::ManagerTestAccess;

constexpr std::int32_t kLayers = 2;
constexpr std::int32_t kVideoRows = 96;  // system text 32, windows 0..3 at rows 32..96

CacheConfig content_config(std::int32_t slabs, PrefixHigher higher = PrefixHigher::Demote) {
  CacheConfig c = tiny_config(kLayers, slabs);
  c.fp16_windows_first = true;
  c.prefix_cache.enabled = true;
  c.prefix_cache.identity = PrefixIdentity::Content;
  c.prefix_cache.higher = higher;
  return c;
}

TokenLayout video(std::int32_t question) {
  return TokenLayout({{TokenKind::Text, 32}, {TokenKind::Visual, 4 * kTinyBlock}, {TokenKind::Text, question}});
}

// The same system text and video; question rows keyed from `question_key`.
std::vector<TokenKey> keys(std::int32_t question, TokenKey question_key) {
  std::vector<TokenKey> k(static_cast<std::size_t>(kVideoRows + question));
  std::iota(k.begin(), k.begin() + kVideoRows, TokenKey{1000});
  std::iota(k.begin() + kVideoRows, k.end(), question_key);
  return k;
}

// Windows 1..3 at `p1`, `p2`, `p3` in both layers; window 0 FP16.
PrecisionPlan plan(Precision p1, Precision p2, Precision p3) {
  PrecisionPlan out(kLayers, 4);
  for (std::int32_t l = 0; l < kLayers; ++l) {
    out.set(l, 1, p1);
    out.set(l, 2, p2);
    out.set(l, 3, p3);
  }
  return out;
}

const PrecisionPlan kFp16 = plan(Precision::FP16, Precision::FP16, Precision::FP16);

std::vector<Demotion> to_plan(SequenceId id, const PrecisionPlan& target, bool leave_shared) {
  std::vector<Demotion> out;
  for (std::int32_t l = 0; l < kLayers; ++l) {
    for (std::int32_t w = 1; w < 4; ++w) {
      if (target.at(l, w) != Precision::FP16) out.push_back({id, l, w, target.at(l, w), false, leave_shared});
    }
  }
  return out;
}

// One request stored FP16, published, demoted to its plan and published
// again: the index holds FP16 copies of everything and its plan's copies.
void cache_first_question(KVCacheManager& cache, const PrecisionPlan& first) {
  const auto k = keys(8, 50000);
  EXPECT_EQ(cache.add_sequence(1, video(8), kFp16, k, first).rows, 0);
  EXPECT_EQ(cache.publish_prefix(1, k), 2 * 6);  // per layer 2 text blocks and 4 windows
  EXPECT_EQ(cache.demote(to_plan(1, first, false)).size(), 6u);
  EXPECT_EQ(cache.publish_prefix(1, k), 6);  // the plan's copies join their nodes
  cache.check_invariants();
}

TEST(PrefixContent, NeedsWindowsFirst) {
  CacheConfig c = content_config(8);
  c.fp16_windows_first = false;
  try {
    KVCacheManager cache(c);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("prefix_cache.identity"), std::string::npos) << e.what();
  }
}

TEST(PrefixContent, BadPolicyValuesAreNamed) {
  for (const auto& [set, name] : std::vector<std::pair<void (*)(CacheConfig&), std::string>>{
           {[](CacheConfig& c) { c.prefix_cache.identity = static_cast<PrefixIdentity>(7); }, "prefix_cache.identity"},
           {[](CacheConfig& c) { c.prefix_cache.higher = static_cast<PrefixHigher>(9); }, "prefix_cache.higher"}}) {
    CacheConfig c = content_config(8);
    set(c);
    try {
      KVCacheManager cache(c);
      ADD_FAILURE() << "expected InvalidArgument naming " << name;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
}

TEST(PrefixContent, OneFp16CopyServesEveryPlan) {
  KVCacheManager cache(content_config(24));
  const PrecisionPlan first = plan(Precision::INT4, Precision::INT2, Precision::INT4);
  cache_first_question(cache, first);
  EXPECT_EQ(cache.prefix_stats().cached, (BlockCounts{12, 4, 2}));

  // Another question, another plan: every video row is shared, FP16, to be
  // demoted to its own plan.
  const PrecisionPlan second = plan(Precision::INT2, Precision::INT4, Precision::FP16);
  const auto k2 = keys(5, 60000);
  const PrefixMatch m = cache.add_sequence(2, video(5), kFp16, k2, second);
  EXPECT_EQ(m.rows, kVideoRows);
  EXPECT_EQ(m.shared, (BlockCounts{12, 0, 0}));
  EXPECT_EQ(m.plan.at(0, 1), Precision::FP16);
  // A third at the same time shares the same FP16 blocks: its demotions
  // must leave them to the second.
  const PrefixMatch m3 = cache.add_sequence(3, video(5), kFp16, keys(5, 70000), second);
  EXPECT_EQ(m3.rows, kVideoRows);
  const std::int32_t master = cache.window_block(2, 0, 1);
  EXPECT_EQ(cache.window_block(3, 0, 1), master);
  EXPECT_THROW((void)cache.demote(to_plan(3, second, false)), InvalidArgument);
  const std::vector<DemoteOp> ops = cache.demote(to_plan(3, second, true));
  EXPECT_EQ(ops.size(), 4u);
  EXPECT_EQ(cache.window_block(2, 0, 1), master);
  EXPECT_NE(cache.window_block(3, 0, 1), master);
  EXPECT_EQ(cache.plan(3).at(1, 1), Precision::INT2);
  EXPECT_EQ(cache.plan(3).at(1, 3), Precision::FP16);
  cache.check_invariants();
  // The third's INT2 window 1 and INT4 window 2 join their nodes; its question's rows
  // (a partial block) are never published.
  EXPECT_EQ(cache.publish_prefix(3, keys(5, 70000)), 2 + 2);
  EXPECT_EQ(cache.prefix_stats().cached, (BlockCounts{12, 6, 4}));
  cache.check_invariants();
}

TEST(PrefixContent, KeepSharesTheWantedCopyElseFp16) {
  KVCacheManager cache(content_config(24, PrefixHigher::Keep));
  cache_first_question(cache, plan(Precision::INT4, Precision::INT2, Precision::INT4));
  const PrecisionPlan wanted = plan(Precision::INT4, Precision::INT4, Precision::INT2);
  const PrefixMatch m = cache.match_prefix(video(5), kFp16, keys(5, 60000), wanted);
  EXPECT_EQ(m.rows, kVideoRows);
  EXPECT_EQ(m.plan.at(0, 1), Precision::INT4);  // the copy it wants
  EXPECT_EQ(m.plan.at(0, 2), Precision::FP16);  // INT2 cached is below INT4: FP16, kept
  EXPECT_EQ(m.plan.at(1, 3), Precision::FP16);
  EXPECT_EQ(m.shared, (BlockCounts{10, 2, 0}));
}

TEST(PrefixContent, ACopyBelowThePlanEndsTheMatch) {
  for (const bool share_higher : {true, false}) {
    CacheConfig c = content_config(24);
    c.prefix_cache.share_higher = share_higher;
    KVCacheManager cache(c);
    // Stored at its plan at once: no FP16 copy of windows 1..3.
    const PrecisionPlan first = plan(Precision::INT4, Precision::INT2, Precision::INT4);
    const auto k = keys(16, 50000);
    cache.add_sequence(1, video(16), first, k);
    EXPECT_EQ(cache.publish_prefix(1, k), 2 * 7);
    // Window 1 wanted FP16, cached INT4 only: the prefix ends before it.
    EXPECT_EQ(cache.match_prefix(video(16), kFp16, k, kFp16).rows, 48);
    // Wanted INT2 where INT4 is cached: shared at INT4 with share_higher.
    const PrecisionPlan low = plan(Precision::INT2, Precision::INT2, Precision::INT2);
    const PrefixMatch m = cache.add_sequence(2, video(16), kFp16, keys(16, 60000), low);
    if (!share_higher) {
      EXPECT_EQ(m.rows, 48);
      continue;
    }
    EXPECT_EQ(m.rows, kVideoRows);
    EXPECT_EQ(m.plan.at(0, 1), Precision::INT4);
    EXPECT_EQ(m.plan.at(0, 2), Precision::INT2);
    // Its rows after the hit read quantized keys: not published.
    EXPECT_EQ(cache.publish_prefix(2, keys(16, 60000)), 0);
    cache.check_invariants();
  }
}

TEST(PrefixContent, EvictionDropsCopiesThenNodes) {
  KVCacheManager cache(content_config(24));
  cache_first_question(cache, plan(Precision::INT4, Precision::INT2, Precision::INT4));
  cache.free_sequence(1);
  detail::PrefixIndex& index = Access::index(cache);
  const auto k = keys(5, 60000);
  const PrecisionPlan wanted = plan(Precision::INT4, Precision::INT2, Precision::INT4);
  std::int32_t rows = cache.match_prefix(video(5), kFp16, k, wanted).rows;
  EXPECT_EQ(rows, kVideoRows);
  std::int64_t evicted = 0;
  while (index.evict_one()) {
    ++evicted;
    cache.check_invariants();
    const std::int32_t now = cache.match_prefix(video(5), kFp16, k, wanted).rows;
    EXPECT_LE(now, rows);
    rows = now;
  }
  // The FP16 window copies went first (released at the demotions); the
  // plan's copies kept the whole prefix until their nodes went.
  EXPECT_EQ(rows, 0);
  EXPECT_GE(evicted, 6);
  EXPECT_EQ(cache.prefix_stats().cached, (BlockCounts{0, 0, 0}));
  const PoolStats fp16 = cache.pool_stats(Precision::FP16);
  EXPECT_EQ(fp16.used_blocks, 0);
}

TEST(PrefixContent, WantedOfAnotherShapeIsRefusedByName) {
  KVCacheManager cache(content_config(8));
  const auto k = keys(5, 60000);
  try {
    (void)cache.match_prefix(video(5), kFp16, k, PrecisionPlan(kLayers, 3));
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("wanted"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)cache.add_sequence(1, video(5), kFp16, k, PrecisionPlan(1, 4)), InvalidArgument);
  EXPECT_FALSE(cache.contains(1));
}

}  // namespace
}  // namespace mixkv::test
