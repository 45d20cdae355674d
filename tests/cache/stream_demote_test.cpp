// Demotion of the FP16 stream's full blocks (Demotion::stream, what age
// tiers use): page lists, plans and token counts stay consistent; bad input
// is named and changes nothing; shared blocks, prompt order beside FP16
// windows, prefill mappings, publishing and truncation of demoted tokens are
// refused; swap and fork keep the demoted blocks.
#include <gtest/gtest.h>

#include <vector>

#include "cache_test_util.h"

namespace mixkv {
namespace {

using test::expect_rejected;
using test::tiny_config;

CacheConfig windows_first(std::int32_t layers, std::int32_t slabs) {
  CacheConfig c = tiny_config(layers, slabs);
  c.fp16_windows_first = true;
  return c;
}

Demotion stream(SequenceId id, std::int32_t layer, std::int32_t block, Precision target) {
  return {id, layer, block, target, true};
}

void append(KVCacheManager& cache, SequenceId id, int n) {
  for (int i = 0; i < n; ++i) cache.append_tokens(std::vector<SequenceId>{id});
}

TEST(StreamDemote, MovesOneBlockAndKeepsTheRestPacked) {
  KVCacheManager cache(windows_first(2, 16));
  cache.add_sequence(1, test::text(50), PrecisionPlan(2, 0));  // blocks 0..2 full, 3 holds 2
  EXPECT_EQ(cache.stream_blocks(1), 3);
  const auto fp16 = test::to_vector(cache.blocks(1, 0, Precision::FP16));
  const auto ops = cache.demote(std::vector<Demotion>{
      stream(1, 0, 1, Precision::INT4), stream(1, 1, 1, Precision::INT2), stream(1, 0, 2, Precision::INT4)});
  ASSERT_EQ(ops.size(), 3u);
  EXPECT_EQ(ops[0].window, 1);  // plan.num_windows() (0) + block
  EXPECT_EQ(ops[0].src_block, fp16[1]);
  EXPECT_EQ(ops[2].src_block, fp16[2]);
  EXPECT_EQ(test::to_vector(cache.blocks(1, 0, Precision::FP16)), (std::vector<std::int32_t>{fp16[0], fp16[3]}));
  EXPECT_EQ(test::to_vector(cache.blocks(1, 0, Precision::INT4)),
            (std::vector<std::int32_t>{ops[0].dst_block, ops[2].dst_block}));
  EXPECT_EQ(cache.blocks(1, 1, Precision::INT2).size(), 1u);
  EXPECT_EQ(cache.stream_precision(1, 0, 1), Precision::INT4);
  EXPECT_EQ(cache.stream_precision(1, 1, 1), Precision::INT2);
  EXPECT_EQ(cache.stream_precision(1, 1, 2), Precision::FP16);
  EXPECT_EQ(cache.aged_blocks(1, 0, Precision::INT4), 2);
  EXPECT_EQ(cache.fp16_tail_fill(1, 0), 2);
  EXPECT_NO_THROW(cache.check_invariants());
  // INT4 -> INT2 of a demoted block; then decode tokens keep appending.
  cache.demote(std::vector<Demotion>{stream(1, 0, 1, Precision::INT2)});
  EXPECT_EQ(cache.stream_precision(1, 0, 1), Precision::INT2);
  append(cache, 1, 20);
  EXPECT_EQ(cache.stream_blocks(1), 4);
  EXPECT_EQ(cache.num_tokens(1), 70);
  EXPECT_NO_THROW(cache.check_invariants());
  cache.free_sequence(1);
  for (const Precision p : kAllPrecisions) EXPECT_EQ(cache.pool_stats(p).used_blocks, 0);
}

// With windows first, the stream follows the FP16 windows: a stream block
// and a window of one layer in one call, each to its own list position.
TEST(StreamDemote, BesideVisualWindows) {
  KVCacheManager cache(windows_first(1, 16));
  PrecisionPlan plan(1, 3);
  plan.set(0, 2, Precision::INT4);
  // Stream: text 20 + visual tail 4 + text 40 = 64 tokens, 4 blocks.
  cache.add_sequence(1, TokenLayout({{TokenKind::Text, 20}, {TokenKind::Visual, 52}, {TokenKind::Text, 40}}), plan);
  EXPECT_EQ(cache.stream_blocks(1), 4);
  const auto fp16 = test::to_vector(cache.blocks(1, 0, Precision::FP16));  // windows 0, 1, then stream 0..3
  ASSERT_EQ(fp16.size(), 6u);
  const auto ops = cache.demote(std::vector<Demotion>{stream(1, 0, 2, Precision::INT4), {1, 0, 1, Precision::INT4}});
  EXPECT_EQ(ops[0].src_block, fp16[4]);
  EXPECT_EQ(ops[0].window, 3 + 2);
  EXPECT_EQ(ops[1].src_block, fp16[1]);
  // INT4 list: windows in order (1, 2), then the stream block.
  EXPECT_EQ(test::to_vector(cache.blocks(1, 0, Precision::INT4)),
            (std::vector<std::int32_t>{ops[1].dst_block, cache.window_block(1, 0, 2), ops[0].dst_block}));
  EXPECT_EQ(cache.window_block(1, 0, 1), ops[1].dst_block);
  EXPECT_NO_THROW(cache.check_invariants());
}

TEST(StreamDemote, BadInputIsNamedAndChangesNothing) {
  CacheConfig c = windows_first(1, 3);
  c.prefix_cache.enabled = true;
  KVCacheManager cache(c);
  cache.add_sequence(1, test::text(40), PrecisionPlan(1, 0));
  expect_rejected<IndexOutOfRange>(cache,
                                   [&] { cache.demote(std::vector<Demotion>{stream(1, 0, 2, Precision::INT4)}); },
                                   {"demotions[0].window = 2"});
  expect_rejected<IndexOutOfRange>(cache,
                                   [&] { cache.demote(std::vector<Demotion>{stream(1, 1, 0, Precision::INT4)}); },
                                   {"demotions[0].layer = 1"});
  expect_rejected<InvalidArgument>(cache,
                                   [&] { cache.demote(std::vector<Demotion>{stream(1, 0, 0, Precision::FP16)}); },
                                   {"demotions[0]", "stream block 0", "not below"});
  expect_rejected<InvalidArgument>(
      cache,
      [&] {
        cache.demote(std::vector<Demotion>{stream(1, 0, 0, Precision::INT4), stream(1, 0, 0, Precision::INT2)});
      },
      {"demotions[1] repeats demotions[0]"});
  expect_rejected<IndexOutOfRange>(cache, [&] { (void)cache.stream_precision(1, 0, 2); }, {"block = 2"});
  // 3 slabs: FP16 takes 1 for 3 blocks; two INT4 blocks need a slab, then
  // an INT2 one needs the last: a third target cannot be had.
  cache.add_sequence(2, test::text(64), PrecisionPlan(1, 0));  // 4 more FP16 blocks: slab 2
  expect_rejected<OutOfMemory>(
      cache,
      [&] {
        cache.demote(std::vector<Demotion>{stream(1, 0, 0, Precision::INT4), stream(2, 0, 0, Precision::INT2)});
      },
      {});
  // Shared with a fork: never demoted under the other holder.
  cache.fork(1, 3);
  expect_rejected<InvalidArgument>(
      cache, [&] { cache.demote(std::vector<Demotion>{stream(1, 0, 0, Precision::INT4)}); }, {"shared by 2 sequences"});
  EXPECT_TRUE(cache.why_not_stream_demotable(3, 0, 1, Precision::INT2).has_value());
}

TEST(StreamDemote, PromptOrderOnlyWithoutFp16Windows) {
  KVCacheManager cache(tiny_config(1, 16));
  cache.add_sequence(1, TokenLayout({{TokenKind::Text, 20}, {TokenKind::Visual, 32}, {TokenKind::Text, 30}}),
                     PrecisionPlan(1, 2));
  ASSERT_TRUE(cache.why_not_stream_demotable(1, 0, 0, Precision::INT4).has_value());
  EXPECT_NE(cache.why_not_stream_demotable(1, 0, 0, Precision::INT4)->find("fp16_windows_first"), std::string::npos);
  cache.add_sequence(2, test::text(40), PrecisionPlan(1, 0));
  EXPECT_FALSE(cache.why_not_stream_demotable(2, 0, 1, Precision::INT4).has_value());
  cache.demote(std::vector<Demotion>{stream(2, 0, 1, Precision::INT4)});
  EXPECT_NO_THROW(cache.check_invariants());
}

// A demoted stream block means the prompt is stored: its mapping and
// publishing are refused, and truncation stops above the demoted tokens.
TEST(StreamDemote, StoredPromptCallsAndTruncation) {
  CacheConfig c = windows_first(1, 16);
  c.prefix_cache.enabled = true;
  KVCacheManager cache(c);
  cache.add_sequence(1, test::text(20), PrecisionPlan(1, 0));
  append(cache, 1, 30);  // 50 tokens
  EXPECT_NO_THROW((void)cache.prefill_mapping(1, 0));
  cache.demote(std::vector<Demotion>{stream(1, 0, 1, Precision::INT4)});
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.prefill_mapping(1, 0); }, {"id = 1", "demoted stream"});
  const std::vector<TokenKey> keys(20, 7);
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.publish_prefix(1, keys); }, {"id = 1", "demoted stream"});
  expect_rejected<InvalidArgument>(cache, [&] { cache.truncate(1, 31); }, {"num_tokens = 31", "expected >= 32"});
  cache.truncate(1, 32);
  EXPECT_EQ(cache.num_tokens(1), 32);
  EXPECT_NO_THROW(cache.check_invariants());
}

TEST(StreamDemote, SwapAndForkKeepDemotedBlocks) {
  CacheConfig c = windows_first(2, 16);
  c.swap_blocks = {16, 16, 16};
  KVCacheManager cache(c);
  cache.add_sequence(1, test::text(70), PrecisionPlan(2, 0));
  cache.demote(std::vector<Demotion>{stream(1, 0, 1, Precision::INT4), stream(1, 1, 2, Precision::INT2)});
  cache.swap_out(1);
  EXPECT_EQ(cache.stream_precision(1, 0, 1), Precision::INT4);
  EXPECT_NO_THROW(cache.check_invariants());
  cache.swap_in(1);
  EXPECT_EQ(cache.blocks(1, 0, Precision::INT4).size(), 1u);
  EXPECT_EQ(cache.blocks(1, 1, Precision::INT2).size(), 1u);
  cache.fork(1, 2);
  EXPECT_EQ(cache.stream_precision(2, 1, 2), Precision::INT2);
  append(cache, 2, 3);
  EXPECT_NO_THROW(cache.check_invariants());
  cache.free_sequence(1);
  // Alone again, the child's blocks are its own: demotable.
  EXPECT_FALSE(cache.why_not_stream_demotable(2, 0, 3, Precision::INT4).has_value());
  cache.free_sequence(2);
  for (const Precision p : kAllPrecisions) EXPECT_EQ(cache.pool_stats(p).used_blocks, 0);
}

}  // namespace
}  // namespace mixkv
