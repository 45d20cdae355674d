// The manager's additions for the scheduler: the host swap pool, demotion,
// windows-first FP16 packing and sequence handles. Exact ids on tiny
// caches, bytes through the CPU backend, and no change on a failed call.
#include <gtest/gtest.h>

#include <random>

#include "cache_test_util.h"
#include "mixkv/cpu/demote.h"
#include "mixkv/cpu/quantize.h"
#include "mixkv/cpu/swap.h"

namespace mixkv {
namespace {

using test::expect_rejected;
using test::tiny_config;

TEST(Swap, MovesExactlyThePageTablesBlocksAndBringsTheBytesBack) {
  CacheConfig c = tiny_config(2, 6);
  c.swap_blocks = {8, 4, 4};
  KVCacheManager cache(c);
  PrecisionPlan plan(2, 2, Precision::INT4);
  cache.add_sequence(1, TokenLayout({{TokenKind::Text, 5}, {TokenKind::Visual, 32}}), plan);
  std::vector<std::byte> arena(c.arena_bytes), host(cache.swap_bytes());
  PoolViews dev{}, hst{};
  for (const Precision p : kAllPrecisions) {
    dev[pool_index(p)] = cache.pool_view(p, arena.data());
    hst[pool_index(p)] = cache.swap_view(p, host.data());
  }
  std::mt19937 rng(1);
  for (auto& b : arena) b = static_cast<std::byte>(rng());
  const BlockCounts held = cache.blocks_held(1);
  std::vector<std::vector<std::byte>> before;
  const std::vector<SwapCopy> out = cache.swap_out(1);
  ASSERT_EQ(out.size(), static_cast<std::size_t>(held[0] + held[1] + held[2]));
  for (const SwapCopy& s : out) {
    const std::byte* b = dev[pool_index(s.pool)].block(s.device_block);
    before.emplace_back(b, b + dev[pool_index(s.pool)].format.block_bytes());
  }
  cpu::swap_blocks(out, SwapDirection::DeviceToHost, dev, hst);
  EXPECT_TRUE(cache.is_swapped(1));
  for (const Precision p : kAllPrecisions) EXPECT_EQ(cache.pool_stats(p).used_blocks, 0);
  EXPECT_NO_THROW(cache.check_invariants());
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.blocks(1, 0, Precision::FP16); }, {"swapped out"});
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.swap_out(1); }, {"swapped out"});
  std::fill(arena.begin(), arena.end(), std::byte{0});
  const std::vector<SwapCopy> in = cache.swap_in(1);
  cpu::swap_blocks(in, SwapDirection::HostToDevice, dev, hst);
  ASSERT_EQ(in.size(), out.size());
  for (std::size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(in[i].pool, out[i].pool);
    const std::byte* b = dev[pool_index(in[i].pool)].block(in[i].device_block);
    EXPECT_TRUE(std::equal(before[i].begin(), before[i].end(), b)) << "block " << i;
  }
  EXPECT_EQ(cache.blocks_held(1), held);
  EXPECT_EQ(cache.free_swap_slots(), c.swap_blocks);
  EXPECT_NO_THROW(cache.check_invariants());
}

TEST(Swap, FullHostPoolRefusesAndChangesNothing) {
  CacheConfig c = tiny_config(1, 4);
  c.swap_blocks = {1, 0, 0};
  KVCacheManager cache(c);
  cache.add_sequence(1, test::text(40), PrecisionPlan(1, 0));  // 3 FP16 blocks
  expect_rejected<OutOfMemory>(cache, [&] { (void)cache.swap_out(1); }, {"FP16 swap pool has 1 free slots"});
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.swap_in(1); }, {"not swapped out"});
}

TEST(Demote, MovesTheWindowAndItsPlanAndRefusesWhatItMust) {
  CacheConfig c = tiny_config(1, 8);
  c.fp16_windows_first = true;
  KVCacheManager cache(c);
  PrecisionPlan plan(1, 3);  // three FP16 windows
  cache.add_sequence(1, TokenLayout({{TokenKind::Text, 3}, {TokenKind::Visual, 48}}), plan);
  const std::vector<std::int32_t> fp16 = test::to_vector(cache.blocks(1, 0, Precision::FP16));
  ASSERT_EQ(fp16.size(), 4u);  // windows first: w0, w1, w2, then the 3 text tokens
  const Demotion d{1, 0, 2, Precision::INT4};
  const std::vector<DemoteOp> ops = cache.demote(std::span<const Demotion>(&d, 1));
  ASSERT_EQ(ops.size(), 1u);
  EXPECT_EQ(ops[0].src_precision, Precision::FP16);
  EXPECT_EQ(ops[0].src_block, fp16[2]);
  EXPECT_EQ(cache.plan(1).at(0, 2), Precision::INT4);
  EXPECT_EQ(test::to_vector(cache.blocks(1, 0, Precision::INT4)), std::vector<std::int32_t>{ops[0].dst_block});
  EXPECT_EQ(test::to_vector(cache.blocks(1, 0, Precision::FP16)),
            (std::vector<std::int32_t>{fp16[0], fp16[1], fp16[3]}));
  EXPECT_EQ(cache.fp16_tail_fill(1, 0), 3);
  EXPECT_EQ(cache.demand(cache.layout(1), cache.plan(1)), (BlockCounts{3, 1, 0}));
  EXPECT_NO_THROW(cache.check_invariants());
  const Demotion zero{1, 0, 0, Precision::INT4};
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.demote(std::span<const Demotion>(&zero, 1)); },
                                   {"demotions[0].window = 0"});
  const Demotion up{1, 0, 2, Precision::INT4};
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.demote(std::span<const Demotion>(&up, 1)); },
                                   {"is not below"});
  const Demotion twice[2] = {{1, 0, 1, Precision::INT2}, {1, 0, 1, Precision::INT4}};
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.demote(twice); }, {"demotions[1] repeats demotions[0]"});
  cache.fork(1, 2);
  const Demotion shared{1, 0, 1, Precision::INT2};
  expect_rejected<InvalidArgument>(cache, [&] { (void)cache.demote(std::span<const Demotion>(&shared, 1)); },
                                   {"shared by 2 sequences"});
}

TEST(Demote, PromptOrderRefusesAWindowThatStraddlesBlocks) {
  KVCacheManager cache(tiny_config(1, 8));
  cache.add_sequence(1, TokenLayout({{TokenKind::Text, 3}, {TokenKind::Visual, 32}}), PrecisionPlan(1, 2));
  ASSERT_TRUE(cache.why_not_demotable(1, 0, 1, Precision::INT4).has_value());
  EXPECT_NE(cache.why_not_demotable(1, 0, 1, Precision::INT4)->find("FP16 rank 19"), std::string::npos);
}

// What the scheduler's INT4 -> INT2 step reads: the block of each window
// and how many used blocks keep its slab from being given back.
TEST(Demote, WindowBlocksAndSlabUsage) {
  CacheConfig c = tiny_config(1, 8);
  c.fp16_windows_first = true;
  KVCacheManager cache(c);
  PrecisionPlan plan(1, 4);
  plan.set(0, 1, Precision::INT4);
  plan.set(0, 2, Precision::INT2);
  plan.set(0, 3, Precision::INT4);
  cache.add_sequence(1, TokenLayout({{TokenKind::Text, 3}, {TokenKind::Visual, 64}}), plan);
  EXPECT_EQ(cache.window_block(1, 0, 0), cache.blocks(1, 0, Precision::FP16)[0]);  // windows first
  EXPECT_EQ(cache.window_block(1, 0, 1), cache.blocks(1, 0, Precision::INT4)[0]);
  EXPECT_EQ(cache.window_block(1, 0, 2), cache.blocks(1, 0, Precision::INT2)[0]);
  EXPECT_EQ(cache.window_block(1, 0, 3), cache.blocks(1, 0, Precision::INT4)[1]);
  const std::int32_t per_slab = cache.pool_stats(Precision::INT4).blocks_per_slab;
  const std::int32_t slab = cache.window_block(1, 0, 3) / per_slab;
  EXPECT_EQ(cache.used_in_slab(Precision::INT4, slab), 2);
  EXPECT_EQ(cache.used_in_slab(Precision::INT2, slab), 0);  // another pool's slab
  EXPECT_EQ(cache.pool_stats(Precision::INT4).empty_slabs, 0);
  cache.demote(std::vector<Demotion>{{1, 0, 1, Precision::INT2}, {1, 0, 3, Precision::INT2}});
  EXPECT_EQ(cache.used_in_slab(Precision::INT4, slab), 0);
  EXPECT_EQ(cache.pool_stats(Precision::INT4).empty_slabs, 1);
  EXPECT_EQ(cache.window_block(1, 0, 3), cache.blocks(1, 0, Precision::INT2)[2]);
  expect_rejected<IndexOutOfRange>(cache, [&] { (void)cache.window_block(1, 0, 4); }, {"window = 4"});
  expect_rejected<IndexOutOfRange>(cache, [&] { (void)cache.window_block(1, 1, 0); }, {"layer = 1"});
  expect_rejected<UnknownId>(cache, [&] { (void)cache.window_block(2, 0, 0); }, {"id = 2"});
  expect_rejected<IndexOutOfRange>(cache, [&] { (void)cache.used_in_slab(Precision::INT4, 8); }, {"slab = 8"});
  // In prompt order an FP16 window after 3 text tokens shares blocks: -1.
  KVCacheManager prompt_order(tiny_config(1, 8));
  prompt_order.add_sequence(1, TokenLayout({{TokenKind::Text, 3}, {TokenKind::Visual, 32}}), PrecisionPlan(1, 2));
  EXPECT_EQ(prompt_order.window_block(1, 0, 1), -1);
  EXPECT_NO_THROW(cache.check_invariants());
}

TEST(Demote, CpuRequantizesExactlyAsWriteHead) {
  const BlockFormat fp16{Precision::FP16, 1, 16, 16};
  const BlockFormat int4{Precision::INT4, 1, 16, 16};
  const BlockFormat int2{Precision::INT2, 1, 16, 16};
  std::mt19937 rng(5);
  std::normal_distribution<float> g(0.0f, 2.0f);
  std::vector<Half> k(256), v(256);
  for (auto& h : k) h = float_to_half(g(rng));
  for (auto& h : v) h = float_to_half(g(rng));
  // One slab per pool in a 3-slab arena: FP16 block 0 (slab 0), INT4 block
  // in slab 1, INT2 block in slab 2.
  std::vector<std::byte> arena(3 * 4096);
  PoolViews pools{PoolView{arena.data(), 4096, 4, fp16, 3 * 4}, PoolView{arena.data(), 4096, 10, int4, 3 * 10},
                  PoolView{arena.data(), 4096, 16, int2, 3 * 16}};
  cpu::write_head(fp16, k.data(), v.data(), 16, pools[0].block(0));
  const DemoteOp to4{1, 0, 1, Precision::FP16, 0, Precision::INT4, 10};
  cpu::demote(std::span<const DemoteOp>(&to4, 1), pools);
  std::vector<std::byte> expect(int4.block_bytes());
  cpu::write_head(int4, k.data(), v.data(), 16, expect.data());
  EXPECT_TRUE(std::equal(expect.begin(), expect.end(), pools[1].block(10)));
  // INT4 -> INT2 quantizes the INT4-dequantized values.
  const DemoteOp to2{1, 0, 1, Precision::INT4, 10, Precision::INT2, 32};
  cpu::demote(std::span<const DemoteOp>(&to2, 1), pools);
  std::vector<float> kf(256), vf(256), k2(256), v2(256);
  cpu::read_head(int4, pools[1].block(10), kf.data(), vf.data());
  cpu::read_head(int2, pools[2].block(32), k2.data(), v2.data());
  for (int c = 0; c < 16; ++c) {  // every K channel within half an INT2 step of its INT4 value
    float lo = 1e30f, hi = -1e30f;
    for (int t = 0; t < 16; ++t) lo = std::min(lo, kf[t * 16 + c]), hi = std::max(hi, kf[t * 16 + c]);
    for (int t = 0; t < 16; ++t) EXPECT_NEAR(k2[t * 16 + c], kf[t * 16 + c], (hi - lo) / 3 / 2 * 1.01 + 1e-2);
  }
  const DemoteOp bad{1, 0, 1, Precision::INT2, 0, Precision::INT4, 0};
  EXPECT_THROW(cpu::demote(std::span<const DemoteOp>(&bad, 1), pools), InvalidArgument);
}

TEST(Handles, StaleHandlesAreUnknown) {
  KVCacheManager cache(tiny_config(1, 4));
  cache.add_sequence(1, test::text(5), PrecisionPlan(1, 0));
  const SequenceHandle h = cache.handle(1);
  EXPECT_EQ(cache.append_tokens(std::span<const SequenceHandle>(&h, 1)).slots[0].size(), 1u);
  cache.free_sequence(1);
  cache.add_sequence(2, test::text(5), PrecisionPlan(1, 0));
  expect_rejected<UnknownId>(cache, [&] { (void)cache.append_tokens(std::span<const SequenceHandle>(&h, 1)); },
                             {"handles[0]", "stale"});
}

}  // namespace
}  // namespace mixkv
