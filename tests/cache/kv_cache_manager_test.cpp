// Exact block ids, ref counts and slab moves on tiny configurations (in the
// spirit of vLLM's tests/v1/core): 1 KV head, head_dim 16, block_size 16, 4 KiB
// slabs of 4 FP16, 10 INT4 or 16 INT2 blocks (cache_test_util.h).
#include "mixkv/cache/kv_cache_manager.h"

#include <gtest/gtest.h>

#include "cache_test_util.h"

namespace mixkv {
namespace {

using test::expect_rejected;
using test::text;
using test::tiny_config;
using test::to_vector;
using V = std::vector<std::int32_t>;

constexpr Precision F = Precision::FP16;
constexpr Precision I4 = Precision::INT4;
constexpr Precision I2 = Precision::INT2;

std::vector<std::int32_t> iota(std::int32_t begin, std::int32_t end) {
  std::vector<std::int32_t> v;
  for (std::int32_t i = begin; i < end; ++i) v.push_back(i);
  return v;
}

TEST(KVCacheManager, FreshCache) {
  const KVCacheManager cache(tiny_config(2, 8));
  EXPECT_EQ(cache.total_slabs(), 8);
  EXPECT_EQ(cache.free_slabs(), 8);
  const PoolStats fp16 = cache.pool_stats(F);
  EXPECT_EQ(fp16.block_bytes, 1024u);
  EXPECT_EQ(fp16.blocks_per_slab, 4);
  EXPECT_EQ(fp16.slabs, 0);
  EXPECT_EQ(cache.pool_stats(I4).block_bytes, 384u);
  EXPECT_EQ(cache.pool_stats(I4).blocks_per_slab, 10);
  EXPECT_EQ(cache.pool_stats(I2).block_bytes, 256u);
  EXPECT_EQ(cache.pool_stats(I2).blocks_per_slab, 16);
  const BlockFormat int4 = cache.format(I4);
  EXPECT_EQ(int4.precision, I4);
  EXPECT_EQ(int4.block_bytes(), 384u);
  EXPECT_TRUE(cache.sequence_ids().empty());
  EXPECT_NO_THROW(cache.check_invariants());
}

TEST(KVCacheManager, PoolViewAddressesBlocksBySlab) {
  const KVCacheManager cache(tiny_config(2, 8));
  std::byte* base = reinterpret_cast<std::byte*>(std::uintptr_t{0x10000});
  const PoolView view = cache.pool_view(I4, base);
  EXPECT_EQ(view.slab_bytes, test::kTinySlab);
  EXPECT_EQ(view.blocks_per_slab, 10);
  EXPECT_EQ(view.format.precision, I4);
  EXPECT_EQ(view.block(21), base + 2 * 4096 + 384);
}

TEST(KVCacheManager, TextPromptTakesConsecutiveIds) {
  KVCacheManager cache(tiny_config(2, 8));
  cache.add_sequence(1, text(20), PrecisionPlan(2, 0));
  EXPECT_EQ(to_vector(cache.blocks(1, 0, F)), (V{0, 1}));
  EXPECT_EQ(to_vector(cache.blocks(1, 1, F)), (V{2, 3}));
  EXPECT_EQ(cache.fp16_tail_fill(1, 0), 4);
  EXPECT_EQ(cache.num_tokens(1), 20);
  EXPECT_EQ(cache.free_slabs(), 7);
  EXPECT_EQ(cache.pool_stats(F).slabs, 1);
  EXPECT_EQ(cache.pool_stats(F).used_blocks, 4);
  EXPECT_EQ(cache.pool_stats(F).free_blocks, 0);
  for (std::int32_t b = 0; b < 4; ++b) EXPECT_EQ(cache.ref_count(F, b), 1);

  const StoreMapping m0 = cache.prefill_mapping(1, 0);
  EXPECT_EQ(m0.fp16_slots, iota(0, 20));
  EXPECT_TRUE(m0.int4_windows.empty());
  EXPECT_EQ(cache.prefill_mapping(1, 1).fp16_slots, iota(32, 52));

  // The FP16 pool is full: the next prompt takes a new slab.
  cache.add_sequence(2, text(5), PrecisionPlan(2, 0));
  EXPECT_EQ(to_vector(cache.blocks(2, 0, F)), (V{4}));
  EXPECT_EQ(to_vector(cache.blocks(2, 1, F)), (V{5}));
  EXPECT_EQ(cache.fp16_tail_fill(2, 1), 5);
  EXPECT_EQ(cache.sequence_ids(), (std::vector<SequenceId>{1, 2}));
  EXPECT_NO_THROW(cache.check_invariants());
}

// T3 V40 T5: two windows and an 8-token visual tail. Layer 0 keeps window 0
// in FP16 and puts window 1 in INT2; layer 1 puts them in INT4 and INT2.
PrecisionPlan mixed_plan() {
  PrecisionPlan plan(2, 2);
  plan.set(0, 1, I2);
  plan.set(1, 0, I4);
  plan.set(1, 1, I2);
  return plan;
}
TokenLayout mixed_layout() {
  return TokenLayout({{TokenKind::Text, 3}, {TokenKind::Visual, 40}, {TokenKind::Text, 5}});
}

TEST(KVCacheManager, MixedPromptDemandAndMapping) {
  KVCacheManager cache(tiny_config(2, 8));
  EXPECT_EQ(cache.demand(mixed_layout(), mixed_plan()), (BlockCounts{3, 1, 2}));
  cache.add_sequence(1, mixed_layout(), mixed_plan());
  // One slab per pool, in pool order: FP16 slab 0, INT4 slab 1, INT2 slab 2.
  EXPECT_EQ(to_vector(cache.blocks(1, 0, F)), (V{0, 1}));
  EXPECT_EQ(to_vector(cache.blocks(1, 1, F)), (V{2}));
  EXPECT_EQ(to_vector(cache.blocks(1, 0, I4)), (V{}));
  EXPECT_EQ(to_vector(cache.blocks(1, 1, I4)), (V{10}));
  EXPECT_EQ(to_vector(cache.blocks(1, 0, I2)), (V{32}));
  EXPECT_EQ(to_vector(cache.blocks(1, 1, I2)), (V{33}));
  EXPECT_EQ(cache.fp16_tail_fill(1, 0), 16);
  EXPECT_EQ(cache.fp16_tail_fill(1, 1), 16);
  EXPECT_EQ(cache.free_slabs(), 5);

  // Layer 0: text, FP16 window, INT2 window (rows 19..34), tail, text.
  const StoreMapping m0 = cache.prefill_mapping(1, 0);
  V expected0 = iota(0, 19);
  expected0.insert(expected0.end(), 16, -1);
  for (std::int32_t s : iota(19, 32)) expected0.push_back(s);
  EXPECT_EQ(m0.fp16_slots, expected0);
  EXPECT_TRUE(m0.int4_windows.empty());
  ASSERT_EQ(m0.int2_windows.size(), 1u);
  EXPECT_EQ(m0.int2_windows[0].block_id, 32);
  EXPECT_EQ(m0.int2_windows[0].first_row, 19);

  // Layer 1: both windows quantized; the 16 FP16 tokens fill block 2.
  const StoreMapping m1 = cache.prefill_mapping(1, 1);
  V expected1 = iota(32, 35);
  expected1.insert(expected1.end(), 32, -1);
  for (std::int32_t s : iota(35, 48)) expected1.push_back(s);
  EXPECT_EQ(m1.fp16_slots, expected1);
  ASSERT_EQ(m1.int4_windows.size(), 1u);
  EXPECT_EQ(m1.int4_windows[0].block_id, 10);
  EXPECT_EQ(m1.int4_windows[0].first_row, 3);
  ASSERT_EQ(m1.int2_windows.size(), 1u);
  EXPECT_EQ(m1.int2_windows[0].block_id, 33);
  EXPECT_EQ(m1.int2_windows[0].first_row, 19);
  EXPECT_NO_THROW(cache.check_invariants());
}

TEST(KVCacheManager, StoreMappingAppendShiftsRows) {
  StoreMapping a{{5, -1, -1}, {{7, 1}}, {}};
  const StoreMapping b{{-1, -1, 9}, {}, {{4, 0}}};
  a.append(b);
  EXPECT_EQ(a.fp16_slots, (V{5, -1, -1, -1, -1, 9}));
  ASSERT_EQ(a.int4_windows.size(), 1u);
  EXPECT_EQ(a.int4_windows[0].first_row, 1);
  ASSERT_EQ(a.int2_windows.size(), 1u);
  EXPECT_EQ(a.int2_windows[0].block_id, 4);
  EXPECT_EQ(a.int2_windows[0].first_row, 3);
}

TEST(KVCacheManager, DecodeMetadataIsCsrPerLayerAndPool) {
  KVCacheManager cache(tiny_config(2, 8));
  cache.add_sequence(1, mixed_layout(), mixed_plan());
  // FP16 slab 0 has one block left (3); the rest comes from slab 3.
  cache.add_sequence(2, text(17), PrecisionPlan(2, 0));
  EXPECT_EQ(to_vector(cache.blocks(2, 0, F)), (V{3, 12}));
  EXPECT_EQ(to_vector(cache.blocks(2, 1, F)), (V{13, 14}));

  const std::vector<SequenceId> batch{2, 1};
  const DecodeMetadata meta = cache.decode_metadata(batch);
  EXPECT_EQ(meta.batch_size, 2);
  ASSERT_EQ(meta.layers.size(), 2u);
  const auto& l0 = meta.layers[0];
  EXPECT_EQ(l0[0].indptr, (V{0, 2, 4}));
  EXPECT_EQ(l0[0].indices, (V{3, 12, 0, 1}));
  EXPECT_EQ(l0[0].last_block_len, (V{1, 16}));
  EXPECT_EQ(l0[1].indptr, (V{0, 0, 0}));
  EXPECT_TRUE(l0[1].indices.empty());
  EXPECT_EQ(l0[1].last_block_len, (V{0, 0}));
  EXPECT_EQ(l0[2].indptr, (V{0, 0, 1}));
  EXPECT_EQ(l0[2].indices, (V{32}));
  EXPECT_EQ(l0[2].last_block_len, (V{0, 16}));
  const auto& l1 = meta.layers[1];
  EXPECT_EQ(l1[0].indptr, (V{0, 2, 3}));
  EXPECT_EQ(l1[0].indices, (V{13, 14, 2}));
  EXPECT_EQ(l1[0].last_block_len, (V{1, 16}));
  EXPECT_EQ(l1[1].indices, (V{10}));
  EXPECT_EQ(l1[1].last_block_len, (V{0, 16}));
  EXPECT_EQ(l1[2].indices, (V{33}));

  const DecodeMetadata empty = cache.decode_metadata({});
  EXPECT_EQ(empty.batch_size, 0);
  EXPECT_EQ(empty.layers[1][2].indptr, (V{0}));
}

TEST(KVCacheManager, AllQuantizedPromptHasNoFp16UntilItDecodes) {
  KVCacheManager cache(tiny_config(1, 4));
  cache.add_sequence(1, TokenLayout({{TokenKind::Visual, 32}}), PrecisionPlan(1, 2, I2));
  EXPECT_TRUE(cache.blocks(1, 0, F).empty());
  EXPECT_EQ(cache.fp16_tail_fill(1, 0), 0);
  EXPECT_EQ(cache.prefill_mapping(1, 0).fp16_slots, V(32, -1));
  const std::vector<SequenceId> ids{1};
  EXPECT_EQ(cache.decode_metadata(ids).layers[0][0].last_block_len, (V{0}));
  const AppendResult r = cache.append_tokens(ids);
  // INT2 took slab 0, so the first FP16 block is slab 1's first.
  EXPECT_EQ(r.slots, (std::vector<V>{{4 * 16}}));
  EXPECT_EQ(cache.fp16_tail_fill(1, 0), 1);
  EXPECT_EQ(cache.decode_metadata(ids).layers[0][0].last_block_len, (V{1}));
  EXPECT_NO_THROW(cache.check_invariants());
}

TEST(KVCacheManager, AppendFillsTheTailThenTakesANewBlock) {
  KVCacheManager cache(tiny_config(2, 8));
  cache.add_sequence(1, text(16), PrecisionPlan(2, 0));
  const std::vector<SequenceId> ids{1};
  AppendResult r = cache.append_tokens(ids);
  EXPECT_EQ(r.slots, (std::vector<V>{{2 * 16}, {3 * 16}}));
  EXPECT_TRUE(r.copies.empty());
  EXPECT_EQ(to_vector(cache.blocks(1, 0, F)), (V{0, 2}));
  EXPECT_EQ(cache.fp16_tail_fill(1, 1), 1);
  for (std::int32_t k = 1; k < 16; ++k) {
    r = cache.append_tokens(ids);
    EXPECT_EQ(r.slots, (std::vector<V>{{2 * 16 + k}, {3 * 16 + k}}));
  }
  EXPECT_EQ(cache.fp16_tail_fill(1, 0), 16);
  r = cache.append_tokens(ids);  // slab 0 is full: slab 1 gives blocks 4, 5
  EXPECT_EQ(r.slots, (std::vector<V>{{4 * 16}, {5 * 16}}));
  EXPECT_EQ(cache.num_tokens(1), 33);
  EXPECT_NO_THROW(cache.check_invariants());
}

TEST(KVCacheManager, ForkSharesBlocksAndCopiesTheTailOnWrite) {
  KVCacheManager cache(tiny_config(2, 8));
  cache.add_sequence(1, text(20), PrecisionPlan(2, 0));
  cache.fork(1, 2);
  EXPECT_EQ(to_vector(cache.blocks(2, 0, F)), (V{0, 1}));
  EXPECT_EQ(to_vector(cache.blocks(2, 1, F)), (V{2, 3}));
  for (std::int32_t b = 0; b < 4; ++b) EXPECT_EQ(cache.ref_count(F, b), 2);
  EXPECT_EQ(cache.layout(2), cache.layout(1));
  EXPECT_EQ(cache.plan(2), cache.plan(1));
  EXPECT_EQ(cache.pool_stats(F).used_blocks, 4);

  // The child writes first: its shared, partly filled tails are copied.
  const std::vector<SequenceId> child{2};
  AppendResult r = cache.append_tokens(child);
  ASSERT_EQ(r.copies.size(), 2u);
  EXPECT_EQ(r.copies[0].src, 1);
  EXPECT_EQ(r.copies[0].dst, 4);
  EXPECT_EQ(r.copies[1].src, 3);
  EXPECT_EQ(r.copies[1].dst, 5);
  EXPECT_EQ(r.slots, (std::vector<V>{{4 * 16 + 4}, {5 * 16 + 4}}));
  EXPECT_EQ(to_vector(cache.blocks(2, 0, F)), (V{0, 4}));
  EXPECT_EQ(to_vector(cache.blocks(2, 1, F)), (V{2, 5}));
  EXPECT_EQ(cache.ref_count(F, 0), 2);  // full blocks stay shared
  EXPECT_EQ(cache.ref_count(F, 1), 1);
  EXPECT_EQ(cache.ref_count(F, 4), 1);
  EXPECT_EQ(cache.fp16_tail_fill(2, 0), 5);
  EXPECT_EQ(cache.fp16_tail_fill(1, 0), 4);

  // The parent is now the only holder of its tail: written in place.
  const std::vector<SequenceId> parent{1};
  r = cache.append_tokens(parent);
  EXPECT_TRUE(r.copies.empty());
  EXPECT_EQ(r.slots, (std::vector<V>{{1 * 16 + 4}, {3 * 16 + 4}}));
  EXPECT_NO_THROW(cache.check_invariants());

  // Freeing the parent keeps the child's shared blocks alive.
  cache.free_sequence(1);
  EXPECT_EQ(cache.ref_count(F, 0), 1);
  EXPECT_EQ(cache.ref_count(F, 1), 0);
  EXPECT_EQ(cache.pool_stats(F).used_blocks, 4);
  cache.free_sequence(2);
  EXPECT_EQ(cache.pool_stats(F).used_blocks, 0);
  EXPECT_NO_THROW(cache.check_invariants());
}

TEST(KVCacheManager, BatchAppendCountsCopyOnWriteExactly) {
  // One layer, two slabs: 8 FP16 blocks.
  KVCacheManager cache(tiny_config(1, 2));
  cache.add_sequence(1, text(20), PrecisionPlan(1, 0));  // blocks 0, 1
  cache.fork(1, 2);
  cache.add_sequence(3, text(64), PrecisionPlan(1, 0));  // blocks 2, 3, 4, 5
  cache.add_sequence(4, text(16), PrecisionPlan(1, 0));  // block 6
  EXPECT_EQ(cache.pool_stats(F).free_blocks, 1);
  // Parent and child in one batch need one block, not two: the parent
  // copies the shared tail, then the child is its only holder.
  const std::vector<SequenceId> both{1, 2};
  const AppendResult r = cache.append_tokens(both);
  ASSERT_EQ(r.copies.size(), 1u);
  EXPECT_EQ(r.copies[0].src, 1);
  EXPECT_EQ(r.copies[0].dst, 7);
  EXPECT_EQ(r.slots, (std::vector<V>{{7 * 16 + 4, 1 * 16 + 4}}));
  EXPECT_EQ(cache.append_tokens(both).slots, (std::vector<V>{{7 * 16 + 5, 1 * 16 + 5}}));
  EXPECT_NO_THROW(cache.check_invariants());

  // No block left: a full tail cannot grow, and nothing changes.
  const std::vector<SequenceId> full{3};
  EXPECT_FALSE(cache.can_allocate({1, 0, 0}));
  expect_rejected<OutOfMemory>(cache, [&] { cache.append_tokens(full); }, {"append_tokens", "FP16", "needs 1"});
  // All or nothing: 1 and 2 alone would fit in place, 3 cannot.
  const std::vector<SequenceId> mixed{1, 2, 3};
  expect_rejected<OutOfMemory>(cache, [&] { cache.append_tokens(mixed); }, {"FP16"});
  EXPECT_EQ(cache.num_tokens(1), 22);
}

TEST(KVCacheManager, MemoryMovesBetweenPoolsThroughSlabs) {
  KVCacheManager cache(tiny_config(1, 2));
  cache.add_sequence(1, text(128), PrecisionPlan(1, 0));  // 8 FP16 blocks: both slabs
  EXPECT_EQ(cache.free_slabs(), 0);
  EXPECT_EQ(cache.pool_stats(F).slabs, 2);
  cache.free_sequence(1);
  // Slabs are given back lazily: FP16 keeps them while no one asks.
  EXPECT_EQ(cache.free_slabs(), 0);
  EXPECT_EQ(cache.pool_stats(F).slabs, 2);
  EXPECT_EQ(cache.pool_stats(F).free_blocks, 8);
  EXPECT_TRUE(cache.can_allocate({0, 0, 32}));
  EXPECT_FALSE(cache.can_allocate({0, 0, 33}));
  EXPECT_TRUE(cache.can_allocate({4, 0, 16}));
  EXPECT_FALSE(cache.can_allocate({5, 0, 16}));
  EXPECT_TRUE(cache.can_allocate({0, 10, 16}));
  EXPECT_FALSE(cache.can_allocate({1, 10, 16}));

  // INT2 asks: FP16's slab emptied longest ago (slab 1) moves over.
  cache.add_sequence(2, TokenLayout({{TokenKind::Visual, 32}}), PrecisionPlan(1, 2, I2));
  EXPECT_EQ(to_vector(cache.blocks(2, 0, I2)), (V{16, 17}));
  EXPECT_EQ(cache.pool_stats(F).slabs, 1);
  EXPECT_EQ(cache.pool_stats(I2).slabs, 1);
  EXPECT_NO_THROW(cache.check_invariants());

  cache.add_sequence(3, text(64), PrecisionPlan(1, 0));
  EXPECT_EQ(to_vector(cache.blocks(3, 0, F)), (V{0, 1, 2, 3}));
  // INT2's slab is in use: nothing to reclaim.
  expect_rejected<OutOfMemory>(cache, [&] { cache.add_sequence(4, text(1), PrecisionPlan(1, 0)); },
                               {"add_sequence(id = 4)", "FP16 pool needs 1 blocks, 0 available"});
  cache.free_sequence(2);
  EXPECT_EQ(cache.pool_stats(I2).slabs, 1);  // lazily kept
  cache.add_sequence(4, text(1), PrecisionPlan(1, 0));
  EXPECT_EQ(to_vector(cache.blocks(4, 0, F)), (V{4}));
  EXPECT_EQ(cache.pool_stats(I2).slabs, 0);
  EXPECT_EQ(cache.pool_stats(F).slabs, 2);
  EXPECT_NO_THROW(cache.check_invariants());
}

TEST(KVCacheManager, ReclaimsOnlySlabsTheirPoolDoesNotNeed) {
  KVCacheManager cache(tiny_config(1, 3));
  cache.add_sequence(1, text(1), PrecisionPlan(1, 0));                                     // FP16: slab 0
  cache.add_sequence(2, TokenLayout({{TokenKind::Visual, 16}}), PrecisionPlan(1, 1, I4));  // INT4: slab 1
  cache.add_sequence(3, TokenLayout({{TokenKind::Visual, 16}}), PrecisionPlan(1, 1, I2));  // INT2: slab 2
  for (SequenceId id : {1, 2, 3}) cache.free_sequence(id);
  EXPECT_EQ(cache.free_slabs(), 0);
  // FP16 needs 5 blocks (one slab more), INT4 one block of its own empty
  // slab: the slab that moves is INT2's, which nobody needs, and only it.
  cache.add_sequence(4, TokenLayout({{TokenKind::Text, 80}, {TokenKind::Visual, 16}}), PrecisionPlan(1, 1, I4));
  EXPECT_EQ(to_vector(cache.blocks(4, 0, F)), (V{0, 1, 2, 3, 8}));
  EXPECT_EQ(to_vector(cache.blocks(4, 0, I4)), (V{10}));
  EXPECT_EQ(cache.pool_stats(F).slabs, 2);
  EXPECT_EQ(cache.pool_stats(I4).slabs, 1);
  EXPECT_EQ(cache.pool_stats(I2).slabs, 0);
  EXPECT_NO_THROW(cache.check_invariants());
}

TEST(KVCacheManager, OutOfMemoryNamesThePoolAndChangesNothing) {
  KVCacheManager cache(tiny_config(2, 3));
  cache.add_sequence(1, mixed_layout(), mixed_plan());  // one slab per pool
  // 20 INT2 windows per layer need 40 INT2 blocks: 16 + 14 free, 0 slabs.
  const TokenLayout big({{TokenKind::Visual, 320}});
  const PrecisionPlan plan(2, 20, I2);
  EXPECT_EQ(cache.demand(big, plan), (BlockCounts{0, 0, 40}));
  EXPECT_FALSE(cache.can_allocate(cache.demand(big, plan)));
  expect_rejected<OutOfMemory>(cache, [&] { cache.add_sequence(2, big, plan); },
                               {"INT2 pool needs 40 blocks, 14 available", "add_sequence(id = 2)"});
  EXPECT_FALSE(cache.contains(2));
  // 7 windows per layer fit exactly.
  const TokenLayout fits({{TokenKind::Visual, 112}});
  EXPECT_TRUE(cache.can_allocate(cache.demand(fits, PrecisionPlan(2, 7, I2))));
  cache.add_sequence(2, fits, PrecisionPlan(2, 7, I2));
  EXPECT_EQ(cache.pool_stats(I2).free_blocks, 0);
}

TEST(KVCacheManager, FreedBlocksComeBackInTheSameOrder) {
  KVCacheManager cache(tiny_config(2, 8));
  cache.add_sequence(1, mixed_layout(), mixed_plan());
  const std::string before = cache.describe_state();
  std::array<std::array<V, 3>, 2> ids;
  for (std::int32_t layer = 0; layer < 2; ++layer) {
    for (Precision p : kAllPrecisions) ids[layer][pool_index(p)] = to_vector(cache.blocks(1, layer, p));
  }
  cache.free_sequence(1);
  EXPECT_FALSE(cache.contains(1));
  EXPECT_NO_THROW(cache.check_invariants());
  for (Precision p : kAllPrecisions) EXPECT_EQ(cache.pool_stats(p).used_blocks, 0);
  cache.add_sequence(1, mixed_layout(), mixed_plan());
  for (std::int32_t layer = 0; layer < 2; ++layer) {
    for (Precision p : kAllPrecisions) EXPECT_EQ(to_vector(cache.blocks(1, layer, p)), ids[layer][pool_index(p)]);
  }
  EXPECT_EQ(cache.describe_state(), before);
}

TEST(KVCacheManager, DescribeStateIsCanonicalText) {
  KVCacheManager cache(tiny_config(1, 2));
  cache.add_sequence(7, TokenLayout({{TokenKind::Text, 2}, {TokenKind::Visual, 16}}), PrecisionPlan(1, 1, I4));
  cache.fork(7, 8);
  EXPECT_EQ(cache.describe_state(),
            "arena: slabs 2, owners FP16 INT4\n"
            "  free slabs:\n"
            "pool FP16: slabs 1, free 3\n  partial: 0\n  empty:\n  slab 0 used 1 free: 1 2 3 refs: 0x2\n"
            "pool INT4: slabs 1, free 9\n  partial: 1\n  empty:\n"
            "  slab 1 used 1 free: 11 12 13 14 15 16 17 18 19 refs: 10x2\n"
            "pool INT2: slabs 0, free 0\n  partial:\n  empty:\n"
            "sequence 7: tokens 18, prompt T2 V16\n  layer 0 plan 4 | FP16: 0 | INT4: 10 | INT2: | fill 2\n"
            "sequence 8: tokens 18, prompt T2 V16\n  layer 0 plan 4 | FP16: 0 | INT4: 10 | INT2: | fill 2\n");
}

}  // namespace
}  // namespace mixkv
