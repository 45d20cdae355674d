// Prefix caching in the manager (CacheConfig::prefix_cache): which blocks a
// prompt shares, at which precision, where the shared prefix ends, how
// cached blocks count as free and are evicted, and the verified match.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <vector>

#include "cache_test_util.h"
#include "manager_test_access.h"
#include "mixkv/cache/prefix_tables.h"

namespace mixkv::test {
namespace {

using Access = detail::ManagerTestAccess;

CacheConfig cached_config(std::int32_t layers, std::int32_t slabs, bool windows_first = true) {
  CacheConfig c = tiny_config(layers, slabs);
  c.fp16_windows_first = windows_first;
  c.prefix_cache.enabled = true;
  return c;
}

std::vector<TokenKey> keys_from(TokenKey first, std::int32_t n) {
  std::vector<TokenKey> keys(static_cast<std::size_t>(n));
  std::iota(keys.begin(), keys.end(), first);
  return keys;
}

// System text 32, a video of 4 windows (rows 32..96), a question of `q`.
TokenLayout video_layout(std::int32_t q) {
  return TokenLayout({{TokenKind::Text, 32}, {TokenKind::Visual, 4 * kTinyBlock}, {TokenKind::Text, q}});
}

// Windows 0..3: FP16, INT4, INT2, INT4 in every layer.
PrecisionPlan video_plan(std::int32_t layers) {
  PrecisionPlan plan(layers, 4);
  for (std::int32_t l = 0; l < layers; ++l) {
    plan.set(l, 1, Precision::INT4);
    plan.set(l, 2, Precision::INT2);
    plan.set(l, 3, Precision::INT4);
  }
  return plan;
}

// Keys of the video prompt: the same system text and video, question keys from `question`.
std::vector<TokenKey> video_keys(std::int32_t q, TokenKey question) {
  std::vector<TokenKey> keys = keys_from(1000, 96);
  const std::vector<TokenKey> tail = keys_from(question, q);
  keys.insert(keys.end(), tail.begin(), tail.end());
  return keys;
}

TEST(PrefixCache, OffByDefaultSharesNothing) {
  KVCacheManager cache(tiny_config(2, 8));
  const auto keys = keys_from(1, 40);
  const PrefixMatch m = cache.add_sequence(1, text(40), PrecisionPlan(2, 0), keys);
  EXPECT_EQ(m.rows, 0);
  EXPECT_EQ(cache.publish_prefix(1, keys), 0);
  cache.free_sequence(1);
  EXPECT_EQ(cache.pool_stats(Precision::FP16).used_blocks, 0);
  EXPECT_EQ(cache.add_sequence(2, text(40), PrecisionPlan(2, 0), keys).rows, 0);
  EXPECT_EQ(cache.prefix_stats().cached, (BlockCounts{0, 0, 0}));
}

TEST(PrefixCache, SameTextSharesEveryFullBlockBeforeTheLastRow) {
  KVCacheManager cache(cached_config(2, 8));
  const auto keys = keys_from(1, 70);
  cache.add_sequence(1, text(70), PrecisionPlan(2, 0), keys);
  const std::vector<std::int32_t> a0 = to_vector(cache.blocks(1, 0, Precision::FP16));
  // Blocks 0..3 are full; block 4 (rows 64..69) is the tail, never indexed.
  EXPECT_EQ(cache.publish_prefix(1, keys), 8);
  EXPECT_EQ(cache.publish_prefix(1, keys), 0) << "published twice";
  cache.check_invariants();
  cache.free_sequence(1);
  EXPECT_EQ(cache.prefix_stats().evictable, (BlockCounts{8, 0, 0}));
  EXPECT_EQ(cache.pool_stats(Precision::FP16).used_blocks, 8);
  cache.check_invariants();

  const PrefixMatch probe = cache.match_prefix(text(70), PrecisionPlan(2, 0), keys);
  const PrefixMatch m = cache.add_sequence(2, text(70), PrecisionPlan(2, 0), keys);
  EXPECT_EQ(m.rows, 64);
  EXPECT_EQ(m.shared, (BlockCounts{8, 0, 0}));
  EXPECT_EQ(m.revived, (BlockCounts{8, 0, 0}));
  EXPECT_EQ(m.demand, (BlockCounts{2, 0, 0}));
  EXPECT_EQ(probe.rows, m.rows);
  EXPECT_EQ(probe.revived_ids, m.revived_ids);
  const std::vector<std::int32_t> b0 = to_vector(cache.blocks(2, 0, Precision::FP16));
  EXPECT_TRUE(std::equal(a0.begin(), a0.begin() + 4, b0.begin()));
  EXPECT_EQ(cache.ref_count(Precision::FP16, b0[0]), 2);  // the sequence and the index
  EXPECT_EQ(cache.ref_count(Precision::FP16, b0[4]), 1);  // the fresh tail
  EXPECT_EQ(cache.prefix_stats().evictable, (BlockCounts{0, 0, 0}));
  cache.check_invariants();

  // A prompt that differs at row 40 shares the blocks before it: rows 0..31.
  auto other = keys;
  other[40] = 9999;
  EXPECT_EQ(cache.match_prefix(text(70), PrecisionPlan(2, 0), other).rows, 32);
  // Keys that stop at row 50 serve rows below it only.
  EXPECT_EQ(cache.match_prefix(text(70), PrecisionPlan(2, 0), std::span(keys).first(50)).rows, 48);
  // A prompt of 64 rows: its last row is computed, so 48.
  EXPECT_EQ(cache.match_prefix(text(64), PrecisionPlan(2, 0), std::span(keys).first(64)).rows, 48);
  // Visual tokens with the same keys are other content.
  const TokenLayout visual_tail({{TokenKind::Text, 20}, {TokenKind::Visual, 10}, {TokenKind::Text, 40}});
  EXPECT_EQ(cache.match_prefix(visual_tail, PrecisionPlan(2, 0), keys).rows, 16);
}

TEST(PrefixCache, AVideoAskedAgainSharesItsWindowsInBothPackings) {
  for (const bool windows_first : {true, false}) {
    KVCacheManager cache(cached_config(2, 16, windows_first));
    const PrecisionPlan plan = video_plan(2);
    const auto a = video_keys(7, 5000);
    cache.add_sequence(1, video_layout(7), plan, a);
    cache.publish_prefix(1, a);
    cache.check_invariants();
    const auto b = video_keys(11, 6000);
    const PrefixMatch m = cache.add_sequence(2, video_layout(11), plan, b);
    EXPECT_EQ(m.rows, 96) << windows_first;
    // Per layer: 2 text blocks + window 0 (FP16), windows 1 and 3 (INT4), window 2 (INT2).
    EXPECT_EQ(m.shared, (BlockCounts{6, 4, 2})) << windows_first;
    EXPECT_EQ(m.demand, (BlockCounts{2, 0, 0})) << windows_first;
    EXPECT_EQ(m.revived, (BlockCounts{0, 0, 0})) << "the first sequence still holds them";
    for (std::int32_t l = 0; l < 2; ++l) {
      for (const Precision p : {Precision::INT4, Precision::INT2}) {
        EXPECT_EQ(to_vector(cache.blocks(1, l, p)), to_vector(cache.blocks(2, l, p)));
      }
      for (std::int32_t w = 0; w < 4; ++w) EXPECT_EQ(cache.window_block(1, l, w), cache.window_block(2, l, w));
    }
    // The prefix's page lists are the shared blocks, all full.
    const DecodeMetadata meta = prefix_metadata(cache, std::vector<SequenceId>{2}, std::vector<std::int32_t>{96});
    for (std::int32_t l = 0; l < 2; ++l) {
      const auto& f = meta.layers[static_cast<std::size_t>(l)][0];
      ASSERT_EQ(f.indices.size(), 3u);
      EXPECT_EQ(f.last_block_len[0], kTinyBlock);
      for (const std::int32_t block : f.indices) EXPECT_EQ(cache.ref_count(Precision::FP16, block), 3);
    }
    // Their tails are private: appending writes no shared block.
    const AppendResult r = cache.append_tokens(std::vector<SequenceId>{1, 2});
    EXPECT_TRUE(r.copies.empty());
    for (const SequenceId id : {1, 2}) {
      for (std::int32_t l = 0; l < 2; ++l) {
        EXPECT_EQ(cache.ref_count(Precision::FP16, cache.page_table(id).fp16_tails()[static_cast<std::size_t>(l)]), 1);
      }
    }
    cache.check_invariants();
  }
}

TEST(PrefixCache, HigherCachedPrecisionIsSharedLowerIsRecomputed) {
  for (const bool share_higher : {true, false}) {
    CacheConfig c = cached_config(2, 16);
    c.prefix_cache.share_higher = share_higher;
    KVCacheManager cache(c);
    const auto keys = video_keys(7, 5000);
    cache.add_sequence(1, video_layout(7), video_plan(2), keys);
    cache.publish_prefix(1, keys);
    // Wants window 2 of layer 1 at INT2... which is cached at INT2: then
    // window 1 of layer 0 at INT2 (cached INT4: higher).
    PrecisionPlan lower = video_plan(2);
    lower.set(0, 1, Precision::INT2);
    const PrefixMatch m = cache.match_prefix(video_layout(9), lower, keys);
    if (share_higher) {
      EXPECT_EQ(m.rows, 96);
      EXPECT_EQ(m.plan.at(0, 1), Precision::INT4) << "taken at the cached precision";
      EXPECT_EQ(m.plan.at(1, 1), Precision::INT4);
      EXPECT_EQ(m.shared, (BlockCounts{6, 4, 2}));
    } else {
      EXPECT_EQ(m.rows, 48) << "the prefix ends before window 1";
      EXPECT_EQ(m.plan, lower);
    }
    // Wanting window 2 at INT4 where INT2 is cached: recomputed from window 2 on.
    PrecisionPlan higher = video_plan(2);
    higher.set(1, 2, Precision::INT4);
    const PrefixMatch h = cache.match_prefix(video_layout(9), higher, keys);
    EXPECT_EQ(h.rows, 64);
    EXPECT_EQ(h.plan, higher);
    const PrefixMatch added = cache.add_sequence(2, video_layout(9), lower, keys);
    EXPECT_EQ(cache.plan(2), added.plan);
    cache.check_invariants();
  }
}

TEST(PrefixCache, CachedBlocksCountAsFreeAndAreEvictedLeastRecentlyReleasedFirst) {
  KVCacheManager cache(cached_config(1, 4));  // 16 FP16 blocks
  const auto a = keys_from(1, 64);
  const auto b = keys_from(500, 64);
  cache.add_sequence(1, text(64), PrecisionPlan(1, 0), a);
  cache.add_sequence(2, text(64), PrecisionPlan(1, 0), b);
  cache.publish_prefix(1, a);
  cache.publish_prefix(2, b);
  cache.free_sequence(2);
  cache.free_sequence(1);  // released last: evicted last
  EXPECT_EQ(cache.free_slabs(), 2);
  EXPECT_EQ(cache.prefix_stats().evictable, (BlockCounts{8, 0, 0}));
  EXPECT_TRUE(cache.can_allocate({16, 0, 0}));
  EXPECT_FALSE(cache.can_allocate({17, 0, 0}));
  // 12 blocks: 8 free + 4 evicted, all of sequence 2's chain.
  cache.add_sequence(3, text(12 * kTinyBlock), PrecisionPlan(1, 0));
  EXPECT_EQ(cache.prefix_stats().evicted, (BlockCounts{4, 0, 0}));
  EXPECT_EQ(cache.match_prefix(text(64), PrecisionPlan(1, 0), a).rows, 48);
  EXPECT_EQ(cache.match_prefix(text(64), PrecisionPlan(1, 0), b).rows, 0);
  cache.check_invariants();
  // Too much even with every cached block evicted: nothing changes.
  expect_rejected<OutOfMemory>(cache, [&] { cache.add_sequence(4, text(5 * kTinyBlock), PrecisionPlan(1, 0)); },
                               {"FP16 pool", "evicting the 4 cached blocks"});
  // A hit on its own blocks cannot count them as free as well.
  const PrefixMatch m = cache.match_prefix(text(64), PrecisionPlan(1, 0), a);
  EXPECT_EQ(m.revived, (BlockCounts{3, 0, 0}));
  EXPECT_TRUE(cache.can_allocate(m.demand, m));
  EXPECT_FALSE(cache.can_allocate({2, 0, 0}, m));
  EXPECT_TRUE(cache.can_allocate({2, 0, 0}));
  cache.add_sequence(5, text(64), PrecisionPlan(1, 0), a);
  EXPECT_EQ(cache.pool_stats(Precision::FP16).free_blocks, 0);
  cache.check_invariants();
  EXPECT_EQ(cache.evict_prefix_cache(), 0);
  cache.free_sequence(3);
  cache.free_sequence(5);
  EXPECT_EQ(cache.evict_prefix_cache(), 3);
  EXPECT_EQ(cache.pool_stats(Precision::FP16).used_blocks, 0);
  cache.check_invariants();
}

// An INT4 slab whose blocks only the index holds is a slab another pool may
// take: the accounting counts it, and allocation evicts to get it.
TEST(PrefixCache, EvictionFreesSlabsForOtherPools) {
  KVCacheManager cache(cached_config(1, 3));
  const TokenLayout video({{TokenKind::Visual, 5 * kTinyBlock}, {TokenKind::Text, 1}});
  PrecisionPlan plan(1, 5, Precision::INT4);
  plan.set(0, 0, Precision::FP16);
  const auto keys = keys_from(1, 81);
  cache.add_sequence(1, video, plan, keys);  // FP16 window 0 + the text row, 4 INT4 windows: 2 slabs
  cache.publish_prefix(1, keys);
  cache.free_sequence(1);
  EXPECT_EQ(cache.prefix_stats().evictable, (BlockCounts{1, 4, 0}));
  // As the pools stand: 3 free FP16 blocks and the free slab; with every
  // cached block evicted, all 3 slabs.
  EXPECT_TRUE(cache.can_allocate({7, 0, 0}));
  EXPECT_TRUE(cache.can_allocate({12, 0, 0}));
  EXPECT_FALSE(cache.can_allocate({13, 0, 0}));
  cache.add_sequence(2, text(8 * kTinyBlock), PrecisionPlan(1, 0));
  EXPECT_EQ(cache.prefix_stats().evicted, (BlockCounts{0, 4, 0}));
  cache.check_invariants();
}

// can_allocate answers from the cached blocks' per-pool counts when those
// suffice as free blocks of their own pools (no walk over the cached
// blocks, whose number grows with the cache), and still walks them when
// only the slabs they would empty suffice; a match's revived blocks count
// in neither.
TEST(PrefixCache, CachedBlocksCountWithoutAWalkWhenTheirPoolsSuffice) {
  KVCacheManager cache(cached_config(1, 4));  // a slab: 4 FP16 blocks, 10 INT4, 16 INT2
  const TokenLayout video({{TokenKind::Visual, 5 * kTinyBlock}, {TokenKind::Text, 1}});
  PrecisionPlan plan(1, 5, Precision::INT4);
  plan.set(0, 0, Precision::FP16);
  const auto keys = keys_from(1, 81);
  cache.add_sequence(1, video, plan, keys);
  cache.publish_prefix(1, keys);
  cache.free_sequence(1);
  cache.add_sequence(2, text(7 * kTinyBlock), PrecisionPlan(1, 0));
  // FP16: no free block, 1 cached; INT4: 6 free, 4 cached (their slab
  // empties when they go); 1 free slab.
  ASSERT_EQ(cache.free_slabs(), 1);
  ASSERT_EQ(cache.pool_stats(Precision::FP16).free_blocks, 0);
  ASSERT_EQ(cache.prefix_stats().evictable, (BlockCounts{1, 4, 0}));
  EXPECT_TRUE(cache.can_allocate({0, 10, 0}));     // the INT4 pool's own blocks
  EXPECT_TRUE(cache.can_allocate({1 + 4, 0, 0}));  // the cached FP16 block and the free slab
  EXPECT_TRUE(cache.can_allocate({1 + 8, 0, 0}));  // and the INT4 slab eviction empties
  EXPECT_FALSE(cache.can_allocate({1 + 9, 0, 0}));
  // A hit on the cached video takes its blocks: they stop counting as free.
  const PrefixMatch m = cache.match_prefix(video, plan, keys);
  ASSERT_EQ(m.revived, (BlockCounts{1, 4, 0}));
  EXPECT_TRUE(cache.can_allocate({4, 0, 0}, m));
  EXPECT_FALSE(cache.can_allocate({5, 0, 0}, m));
  EXPECT_TRUE(cache.can_allocate({0, 6 + 10, 0}, m));
  EXPECT_FALSE(cache.can_allocate({0, 6 + 11, 0}, m));
  cache.add_sequence(3, text(9 * kTinyBlock), PrecisionPlan(1, 0));
  EXPECT_EQ(cache.prefix_stats().evicted, (BlockCounts{1, 4, 0}));
  cache.check_invariants();
}

TEST(PrefixCache, ADemotedWindowLeavesTheOriginalCached) {
  KVCacheManager cache(cached_config(1, 8));
  PrecisionPlan plan(1, 4);
  const TokenLayout layout = video_layout(5);
  const auto keys = video_keys(5, 7000);
  cache.add_sequence(1, layout, plan, keys);
  cache.publish_prefix(1, keys);
  const std::int32_t original = cache.window_block(1, 0, 2);
  EXPECT_EQ(cache.why_not_demotable(1, 0, 2, Precision::INT4), std::nullopt);
  cache.add_sequence(2, layout, plan, keys);
  EXPECT_NE(cache.why_not_demotable(1, 0, 2, Precision::INT4), std::nullopt) << "shared by two sequences";
  cache.free_sequence(2);
  const std::vector<DemoteOp> ops = cache.demote(std::vector<Demotion>{{1, 0, 2, Precision::INT4}});
  ASSERT_EQ(ops.size(), 1u);
  EXPECT_EQ(ops[0].src_block, original);
  EXPECT_EQ(cache.ref_count(Precision::FP16, original), 1);
  EXPECT_EQ(cache.prefix_stats().evictable[0], 1);
  cache.check_invariants();
  // The demoted sequence publishes its INT4 copy beside the FP16 original;
  // window 3's block is filed after the original already, which ends the
  // new chain there.
  EXPECT_EQ(cache.publish_prefix(1, keys), 1);
  cache.check_invariants();
  EXPECT_EQ(cache.match_prefix(layout, cache.plan(1), keys).rows, 80);
  EXPECT_EQ(cache.match_prefix(layout, plan, keys).rows, 96);
}

// A hash shared by other content never shares: the node found by the hash
// is checked key by key.
TEST(PrefixCache, AMatchIsVerifiedNotTrusted) {
  KVCacheManager cache(cached_config(1, 8));
  const auto keys = keys_from(1, 70);
  cache.add_sequence(1, text(70), PrecisionPlan(1, 0), keys);
  cache.publish_prefix(1, keys);
  EXPECT_EQ(cache.match_prefix(text(70), PrecisionPlan(1, 0), keys).rows, 64);
  // Block 1's node keeps its hash but holds other keys: as if other
  // content had collided with this prompt's.
  PrefixIndex& index = *Access::impl(cache).index;
  const PrefixNode* node = index.node_of(Precision::FP16, cache.blocks(1, 0, Precision::FP16)[1]);
  ASSERT_NE(node, nullptr);
  const_cast<PrefixNode*>(node)->keys[3] ^= 1;
  EXPECT_EQ(cache.match_prefix(text(70), PrecisionPlan(1, 0), keys).rows, 16);
  EXPECT_THROW(cache.check_invariants(), InvariantViolation);
  const_cast<PrefixNode*>(node)->keys[3] ^= 1;
  cache.check_invariants();
}

// check_invariants() covers the index: each corruption is named.
TEST(PrefixCache, EveryIndexCorruptionIsNamed) {
  const auto keys = keys_from(1, 70);
  auto fresh = [&](KVCacheManager& cache) {
    cache.add_sequence(1, text(70), PrecisionPlan(1, 0), keys);
    cache.publish_prefix(1, keys);
    cache.add_sequence(2, text(40), PrecisionPlan(1, 0), std::span(keys).first(40));  // shares blocks 0 and 1
    cache.free_sequence(1);  // blocks 2 and 3: the index's alone
    cache.check_invariants();
    return Access::index(cache).node_of(Precision::FP16, cache.blocks(2, 0, Precision::FP16)[0]);
  };
  auto expect_named = [](const KVCacheManager& cache, const std::string& needle) {
    try {
      cache.check_invariants();
      ADD_FAILURE() << "expected an InvariantViolation naming " << needle;
    } catch (const InvariantViolation& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  {
    KVCacheManager cache(cached_config(1, 4));
    const PrefixNode* shared = fresh(cache);
    Access::pool(cache, Precision::FP16).retain(shared->block(Precision::FP16));
    expect_named(cache, "page tables hold it and the prefix index");
  }
  {
    KVCacheManager cache(cached_config(1, 4));
    PrefixNode& node = *fresh(cache)->children.front()->children.front();  // block 2
    detail::PrefixCopy& copy = node.copies[0];
    Access::lru(Access::index(cache)).erase(Access::lru(Access::index(cache)).iterator_to(copy));
    expect_named(cache, "but is not on the LRU list");
    Access::lru(Access::index(cache)).push_back(copy);
  }
  {
    KVCacheManager cache(cached_config(1, 4));
    fresh(cache);
    ++Access::evictable(Access::index(cache))[0];
    expect_named(cache, "counts per pool");
  }
  {
    KVCacheManager cache(cached_config(1, 4));
    const PrefixNode* shared = fresh(cache);
    PrefixNode* child = shared->children.front();
    std::vector<PrefixNode*>& siblings = const_cast<PrefixNode*>(shared)->children;
    siblings.clear();
    expect_named(cache, "is not listed once among its parent's children");
    siblings.push_back(child);
  }
  {
    KVCacheManager cache(cached_config(1, 4));
    const PrefixNode* shared = fresh(cache);
    const std::int32_t cached_only = shared->children.front()->children.front()->block(Precision::FP16);
    Access::pool(cache, Precision::FP16).release(cached_only);  // freed under the index
    expect_named(cache, "is free in its pool");
  }
}

TEST(PrefixCache, BadArgumentsAreNamedAndChangeNothing) {
  KVCacheManager cache(cached_config(1, 1));  // 4 FP16 blocks
  const auto keys = keys_from(1, 40);
  cache.add_sequence(1, text(32), PrecisionPlan(1, 0), std::span(keys).first(32));
  expect_rejected<InvalidArgument>(cache, [&] { cache.publish_prefix(1, keys); }, {"keys has 40 entries"});
  expect_rejected<UnknownId>(cache, [&] { cache.publish_prefix(7, keys); }, {"id = 7"});
  expect_rejected<InvalidArgument>(cache, [&] { cache.add_sequence(2, text(30), PrecisionPlan(1, 0), keys); },
                                   {"keys"});
  expect_rejected<InvalidArgument>(cache, [&] { cache.add_sequence(1, text(30), PrecisionPlan(1, 0), keys); },
                                   {"id = 1"});
  cache.publish_prefix(1, std::span(keys).first(32));
  expect_rejected<OutOfMemory>(cache, [&] { cache.add_sequence(3, text(88), PrecisionPlan(1, 0), keys); },
                               {"add_sequence(id = 3)"});
  // A match from before a change is refused by name.
  const PrefixMatch m = cache.match_prefix(text(40), PrecisionPlan(1, 0), keys);
  cache.free_sequence(1);
  const PrefixMatch fresh = cache.match_prefix(text(40), PrecisionPlan(1, 0), keys);
  EXPECT_EQ(fresh.rows, 32);
  cache.add_sequence(4, text(8), PrecisionPlan(1, 0));
  EXPECT_NO_THROW((void)cache.can_allocate({0, 0, 0}, m));
  cache.free_sequence(4);
  cache.evict_prefix_cache();
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.can_allocate({0, 0, 0}, fresh); }, {"match"});
}

}  // namespace
}  // namespace mixkv::test
