// Speculative decoding in the manager: append_tokens with counts (several
// tokens per sequence, all or nothing) and truncate(). Appending and
// truncating back restores describe_state() exactly when the append took
// no slab and copied no shared tail, across block boundaries, layers of
// different FP16 counts and batches; after a fork, truncation only drops
// this holder and copy-on-write stays correct. Tiny configurations
// (cache_test_util.h): block_size 16, 4 FP16 blocks a slab.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cache_test_util.h"
#include "mixkv/cache/kv_cache_manager.h"

namespace mixkv {
namespace {

using test::expect_error;
using test::expect_rejected;
using test::text;
using test::tiny_config;
using test::to_vector;
using V = std::vector<std::int32_t>;

constexpr Precision F = Precision::FP16;
constexpr std::int32_t kBs = test::kTinyBlock;

// Makes the FP16 pool own `blocks` free blocks (a sequence added and
// freed), so that later appends take no slab and can be undone exactly.
void warm(KVCacheManager& cache, std::int32_t blocks_per_layer) {
  const std::int32_t layers = cache.config().shape.num_layers;
  cache.add_sequence(999, text(blocks_per_layer * kBs), PrecisionPlan(layers, 0));
  cache.free_sequence(999);
}

// Rows [row, row + count) of `r` are the last `count` FP16 tokens of `id`
// in every layer, and offsets[i] the first one's offset.
void expect_rows(const KVCacheManager& cache, SequenceId id, const AppendResult& r, std::size_t i, std::size_t row,
                 std::int32_t count) {
  const PageTable& t = cache.page_table(id);
  EXPECT_EQ(r.offsets[i], (cache.num_tokens(id) - count) % kBs) << "sequence " << id;
  for (std::int32_t l = 0; l < t.num_layers(); ++l) {
    for (std::int32_t j = 0; j < count; ++j) {
      EXPECT_EQ(r.slots[static_cast<std::size_t>(l)][row + static_cast<std::size_t>(j)],
                t.fp16_slot(l, t.fp16_tokens(l) - count + j))
          << "sequence " << id << " layer " << l << " token " << j;
    }
  }
}

AppendResult append(KVCacheManager& cache, const std::vector<SequenceId>& ids, const std::vector<std::int32_t>& counts,
                    AppendSlots form = AppendSlots::PerLayer) {
  return cache.append_tokens(std::span<const SequenceId>(ids), std::span<const std::int32_t>(counts), form);
}

TEST(Speculative, DraftsInsideTheTailAndBack) {
  KVCacheManager cache(tiny_config(2, 8));
  warm(cache, 4);
  cache.add_sequence(1, text(20), PrecisionPlan(2, 0));
  const std::string before = cache.describe_state();
  const AppendResult r = append(cache, {1}, {4});
  EXPECT_EQ(cache.num_tokens(1), 24);
  ASSERT_EQ(r.slots.size(), 2u);
  ASSERT_EQ(r.slots[0].size(), 4u);
  expect_rows(cache, 1, r, 0, 0, 4);
  EXPECT_TRUE(r.tails_changed.empty());
  EXPECT_TRUE(r.copies.empty());
  cache.truncate(1, 20);
  EXPECT_EQ(cache.describe_state(), before);
  EXPECT_NO_THROW(cache.check_invariants());
  cache.truncate(1, 20);  // nothing to drop: a no-op
  EXPECT_EQ(cache.describe_state(), before);
}

TEST(Speculative, AcrossBlockBoundariesReleasesInReverse) {
  KVCacheManager cache(tiny_config(2, 8));
  warm(cache, 6);
  cache.add_sequence(1, text(20), PrecisionPlan(2, 0));
  const std::string before = cache.describe_state();
  const PageTable table = cache.page_table(1);
  // 4 + 16 + 10: the rest of the tail, a full block, a partly filled one.
  const AppendResult r = append(cache, {1}, {30});
  EXPECT_EQ(cache.num_tokens(1), 50);
  EXPECT_EQ(cache.blocks(1, 0, F).size(), 4u);
  EXPECT_EQ(cache.fp16_tail_fill(1, 1), 2);
  expect_rows(cache, 1, r, 0, 0, 30);
  EXPECT_EQ(r.tails_changed, V{0});
  EXPECT_EQ(r.tail_blocks, (V{cache.blocks(1, 0, F).back(), cache.blocks(1, 1, F).back()}));
  EXPECT_NO_THROW(cache.check_invariants());
  cache.truncate(1, 20);
  EXPECT_EQ(cache.page_table(1), table);
  EXPECT_EQ(cache.describe_state(), before);
  // The same append again takes the same blocks.
  const AppendResult again = append(cache, {1}, {30});
  EXPECT_EQ(again.slots, r.slots);
  // Part way back: the block boundary at 32 tokens.
  cache.truncate(1, 32);
  EXPECT_EQ(cache.blocks(1, 0, F).size(), 2u);
  EXPECT_EQ(cache.fp16_tail_fill(1, 0), kBs);
  EXPECT_NO_THROW(cache.check_invariants());
  expect_rejected<InvalidArgument>(cache, [&] { cache.truncate(1, 33); }, {"num_tokens = 33", "<= 32"});
}

TEST(Speculative, LayersWithDifferentFp16CountsShareTheOffset) {
  KVCacheManager cache(tiny_config(3, 12));
  warm(cache, 6);
  const TokenLayout layout({{TokenKind::Text, 5}, {TokenKind::Visual, 32}, {TokenKind::Text, 3}});
  PrecisionPlan plan(3, layout.num_windows(kBs));
  plan.set(1, 1, Precision::INT4);
  plan.set(2, 1, Precision::INT2);
  cache.add_sequence(1, layout, plan);
  const std::string before = cache.describe_state();
  for (const std::int32_t count : {1, 7, 8, 9, 25, 40}) {
    const AppendResult r = append(cache, {1}, {count});
    expect_rows(cache, 1, r, 0, 0, count);
    EXPECT_EQ(r.offsets, V{8});  // 40 % 16 == 24 % 16
    EXPECT_NO_THROW(cache.check_invariants());
    cache.truncate(1, 40);
    EXPECT_EQ(cache.describe_state(), before) << count;
  }
  EXPECT_EQ(cache.blocks(1, 1, Precision::INT4).size(), 1u);
  expect_rejected<InvalidArgument>(cache, [&] { cache.truncate(1, 39); }, {"num_tokens = 39", "40 <= num_tokens"});
}

TEST(Speculative, BatchAppendAndBatchTruncateRestoreTheFreeLists) {
  KVCacheManager cache(tiny_config(2, 12));
  warm(cache, 12);
  cache.add_sequence(1, text(16), PrecisionPlan(2, 0));
  cache.add_sequence(2, text(3), PrecisionPlan(2, 0));
  cache.add_sequence(3, text(30), PrecisionPlan(2, 0));
  const std::string before = cache.describe_state();
  const AppendResult r = append(cache, {2, 1, 3}, {1, 5, 17});
  ASSERT_EQ(r.slots[0].size(), 23u);
  expect_rows(cache, 2, r, 0, 0, 1);
  expect_rows(cache, 1, r, 1, 1, 5);
  expect_rows(cache, 3, r, 2, 6, 17);
  EXPECT_EQ(r.tails_changed, (V{1, 2}));  // 2's token fits its tail
  const std::vector<SequenceId> ids{2, 1, 3};
  const std::vector<std::int32_t> back{3, 16, 30};
  cache.truncate(std::span<const SequenceId>(ids), std::span<const std::int32_t>(back));
  EXPECT_EQ(cache.describe_state(), before);
  EXPECT_NO_THROW(cache.check_invariants());
}

TEST(Speculative, CountsOfOneEqualTheOneTokenCall) {
  for (const AppendSlots form : {AppendSlots::PerLayer, AppendSlots::Compact}) {
    KVCacheManager a(tiny_config(2, 8));
    KVCacheManager b(tiny_config(2, 8));
    for (KVCacheManager* c : {&a, &b}) {
      c->add_sequence(1, text(16), PrecisionPlan(2, 0));
      c->add_sequence(2, text(7), PrecisionPlan(2, 0));
      c->fork(2, 3);
    }
    const std::vector<SequenceId> ids{1, 2, 3};
    for (int step = 0; step < 20; ++step) {
      const AppendResult x = a.append_tokens(std::span<const SequenceId>(ids), form);
      const AppendResult y = append(b, ids, {1, 1, 1}, form);
      EXPECT_EQ(x.slots, y.slots);
      EXPECT_EQ(x.offsets, y.offsets);
      EXPECT_EQ(x.tails_changed, y.tails_changed);
      EXPECT_EQ(x.tail_blocks, y.tail_blocks);
      EXPECT_EQ(x.copies.size(), y.copies.size());
    }
    EXPECT_EQ(a.describe_state(), b.describe_state());
  }
}

TEST(Speculative, CompactFormAndHandles) {
  KVCacheManager cache(tiny_config(2, 8));
  warm(cache, 4);
  cache.add_sequence(1, text(14), PrecisionPlan(2, 0));
  cache.add_sequence(2, text(5), PrecisionPlan(2, 0));
  const std::vector<SequenceHandle> handles{cache.handle(1), cache.handle(2)};
  const std::vector<std::int32_t> counts{3, 6};
  const AppendResult r = cache.append_tokens(std::span<const SequenceHandle>(handles),
                                             std::span<const std::int32_t>(counts), AppendSlots::Compact);
  EXPECT_TRUE(r.slots.empty());
  EXPECT_EQ(r.offsets, (V{14, 5}));
  // 1 crosses into a new block in every layer; 2 stays in its tails.
  EXPECT_EQ(r.tails_changed, V{0});
  EXPECT_EQ(r.tail_blocks, (V{cache.page_table(1).fp16_tails()[0], cache.page_table(1).fp16_tails()[1]}));
  EXPECT_EQ(cache.fp16_tail_fill(1, 0), 14 + 3 - kBs);
  EXPECT_EQ(cache.num_tokens(2), 11);
  EXPECT_NO_THROW(cache.check_invariants());
  const std::vector<SequenceHandle> stale{cache.handle(1), {5, 0}};
  expect_rejected<UnknownId>(
      cache,
      [&] { cache.append_tokens(std::span<const SequenceHandle>(stale), std::span<const std::int32_t>(counts)); },
      {"handles[1]"});
}

TEST(Speculative, ForkedTailIsCopiedAndTruncationOnlyDropsThisHolder) {
  KVCacheManager cache(tiny_config(2, 8));
  warm(cache, 8);
  cache.add_sequence(1, text(10), PrecisionPlan(2, 0));
  for (int i = 0; i < 10; ++i) cache.append_tokens(std::vector<SequenceId>{1});
  cache.fork(1, 2);  // both hold 2 blocks a layer, the tail (fill 4) shared
  const PageTable parent = cache.page_table(1);
  const std::int32_t full0 = cache.blocks(1, 0, F)[0];
  const std::int32_t tail0 = cache.blocks(1, 0, F)[1];

  // Drafts into the shared tail: the child copies it, the parent keeps it.
  AppendResult r = append(cache, {2}, {3});
  ASSERT_EQ(r.copies.size(), 2u);
  EXPECT_EQ(r.copies[0].src, tail0);
  EXPECT_EQ(cache.blocks(2, 0, F)[1], r.copies[0].dst);
  EXPECT_EQ(cache.ref_count(F, tail0), 1);
  expect_rows(cache, 2, r, 0, 0, 3);
  cache.truncate(2, 20);
  // The private copy stays (the original is the parent's alone now).
  EXPECT_EQ(cache.blocks(2, 0, F)[1], r.copies[0].dst);
  EXPECT_EQ(cache.fp16_tail_fill(2, 0), 4);
  EXPECT_EQ(cache.page_table(1), parent);
  EXPECT_NO_THROW(cache.check_invariants());

  // Back into the block both hold in full: the child's tail is shared and
  // partly filled, its copy goes, the parent's blocks stay.
  cache.truncate(2, 14);
  EXPECT_EQ(to_vector(cache.blocks(2, 0, F)), V{full0});
  EXPECT_EQ(cache.fp16_tail_fill(2, 0), 14);
  EXPECT_EQ(cache.ref_count(F, full0), 2);
  EXPECT_EQ(cache.page_table(1), parent);
  EXPECT_NO_THROW(cache.check_invariants());
  // The next append copies it again (copy-on-write), across a boundary too.
  r = append(cache, {2}, {5});
  ASSERT_EQ(r.copies.size(), 2u);
  EXPECT_EQ(r.copies[0].src, full0);
  EXPECT_EQ(cache.ref_count(F, full0), 1);
  expect_rows(cache, 2, r, 0, 0, 5);
  EXPECT_EQ(cache.page_table(1), parent);
  EXPECT_NO_THROW(cache.check_invariants());
  // A batch where both holders of a shared tail append: the first copies.
  cache.truncate(2, 14);
  cache.fork(2, 3);
  r = append(cache, {3, 2}, {2, 4});
  EXPECT_EQ(r.copies.size(), 2u);  // 3 copies, 2 writes the original
  expect_rows(cache, 3, r, 0, 0, 2);
  expect_rows(cache, 2, r, 1, 2, 4);
  EXPECT_NO_THROW(cache.check_invariants());
  for (const SequenceId id : {1, 2, 3}) cache.free_sequence(id);
  EXPECT_EQ(cache.pool_stats(F).used_blocks, 0);
}

TEST(Speculative, AllOrNothingOutOfMemory) {
  KVCacheManager cache(tiny_config(2, 2));               // 8 FP16 blocks at most
  cache.add_sequence(1, text(20), PrecisionPlan(2, 0));  // 4 blocks
  cache.add_sequence(2, text(4), PrecisionPlan(2, 0));   // 2 blocks
  // 1 needs 2 blocks a layer for 30 tokens: 4 + 0 blocks > 2 free.
  EXPECT_FALSE(cache.can_allocate({4, 0, 0}));
  expect_rejected<OutOfMemory>(cache, [&] { append(cache, {2, 1}, {3, 30}); }, {"append_tokens", "out of memory"});
  // 13 tokens fit in what is left: one more block a layer.
  EXPECT_TRUE(cache.can_allocate({2, 0, 0}));
  const AppendResult r = append(cache, {2, 1}, {3, 13});
  expect_rows(cache, 1, r, 1, 3, 13);
  EXPECT_NO_THROW(cache.check_invariants());
  cache.truncate(1, 20);
  cache.truncate(2, 4);
  EXPECT_EQ(cache.pool_stats(F).used_blocks, 6);
  EXPECT_NO_THROW(cache.check_invariants());
}

TEST(Speculative, SlabTakenByTheAppendStaysWithThePool) {
  KVCacheManager cache(tiny_config(2, 8));
  cache.add_sequence(1, text(20), PrecisionPlan(2, 0));  // one full FP16 slab
  const PageTable table = cache.page_table(1);
  const std::int32_t free_slabs = cache.free_slabs();
  append(cache, {1}, {13});  // a new block in both layers: a second slab
  EXPECT_EQ(cache.free_slabs(), free_slabs - 1);
  cache.truncate(1, 20);
  // The sequence is as it was; the pool keeps the emptied slab until
  // another pool needs it.
  EXPECT_EQ(cache.page_table(1), table);
  EXPECT_EQ(cache.num_tokens(1), 20);
  EXPECT_EQ(cache.pool_stats(F).empty_slabs, 1);
  EXPECT_EQ(cache.pool_stats(F).used_blocks, 4);
  EXPECT_NO_THROW(cache.check_invariants());
}

TEST(Speculative, BadArgumentsChangeNothing) {
  CacheConfig c = tiny_config(2, 8);
  c.swap_blocks = {8, 0, 0};
  KVCacheManager cache(c);
  cache.add_sequence(1, text(20), PrecisionPlan(2, 0));
  cache.add_sequence(2, text(5), PrecisionPlan(2, 0));
  append(cache, {1}, {6});
  const std::vector<SequenceId> one{1};
  const std::vector<SequenceId> twice{1, 1};
  const std::vector<std::int32_t> none;
  expect_rejected<UnknownId>(cache, [&] { cache.truncate(7, 20); }, {"id = 7"});
  expect_rejected<InvalidArgument>(cache, [&] { cache.truncate(1, 19); }, {"num_tokens = 19", "prompt"});
  expect_rejected<InvalidArgument>(cache, [&] { cache.truncate(1, 27); }, {"num_tokens = 27", "<= 26"});
  expect_rejected<InvalidArgument>(
      cache, [&] { cache.truncate(std::span<const SequenceId>(one), std::span<const std::int32_t>(none)); },
      {"num_tokens has 0 entries"});
  expect_rejected<InvalidArgument>(
      cache,
      [&] {
        cache.truncate(std::span<const SequenceId>(twice), std::span<const std::int32_t>(std::vector{20, 20}));
      },
      {"ids[1]", "repeats"});
  expect_rejected<InvalidArgument>(cache,
                                   [&] {
                                     cache.truncate(std::span<const SequenceId>(std::vector<SequenceId>{2, 1}),
                                                    std::span<const std::int32_t>(std::vector{5, 30}));
                                   },
                                   {"num_tokens[1] = 30"});
  expect_rejected<InvalidArgument>(cache, [&] { append(cache, {1}, {}); }, {"counts has 0 entries"});
  expect_rejected<InvalidArgument>(cache, [&] { append(cache, {2, 1}, {1, 0}); }, {"counts[1] = 0"});
  expect_rejected<InvalidArgument>(cache, [&] { append(cache, {1}, {-3}); }, {"counts[0] = -3"});
  expect_rejected<InvalidArgument>(cache, [&] { append(cache, {1}, {2147483647}); }, {"counts[0]", "2^31 - 1"});
  expect_rejected<InvalidArgument>(cache, [&] { append(cache, {1, 1}, {1, 1}); }, {"ids[1]", "repeats"});
  expect_rejected<UnknownId>(cache, [&] { append(cache, {4}, {2}); }, {"ids[0] = 4"});
  cache.swap_out(2);
  expect_rejected<InvalidArgument>(cache, [&] { cache.truncate(2, 5); }, {"id = 2", "swapped out"});
  expect_rejected<InvalidArgument>(cache, [&] { append(cache, {2}, {2}); }, {"swapped out"});
  expect_error<InvalidArgument>(
      [&] {
        cache.append_tokens(std::span<const SequenceId>(one), std::span<const std::int32_t>(std::vector{2}),
                            static_cast<AppendSlots>(7));
      },
      "form = 7");
  // A swapped-in sequence truncates as before.
  cache.swap_in(2);
  append(cache, {2}, {3});
  cache.truncate(2, 5);
  EXPECT_EQ(cache.num_tokens(2), 5);
  EXPECT_NO_THROW(cache.check_invariants());
}

TEST(PageTableDrop, DropsTokensOfEveryLayer) {
  PageTable t(2, 4);
  for (std::int32_t l = 0; l < 2; ++l) {
    t.push_block(l, F, 10 + l, 4);
    t.push_block(l, F, 20 + l, 3);
  }
  t.fill_all_fp16_tails();  // 8 tokens a layer, through the fast path's count
  t.drop_fp16_tokens(5);
  for (std::int32_t l = 0; l < 2; ++l) {
    EXPECT_EQ(to_vector(t.blocks(l, F)), V{10 + l});
    EXPECT_EQ(t.fp16_tail_fill(l), 3);
  }
  EXPECT_EQ(t.fp16_room(), 1);
  EXPECT_EQ(to_vector(t.fp16_tails()), (V{10, 11}));
  expect_error<InvalidArgument>([&] { t.drop_fp16_tokens(4); }, "count = 4");
  expect_error<InvalidArgument>([&] { t.drop_fp16_tokens(-1); }, "count = -1");
  t.drop_fp16_tokens(3);
  EXPECT_TRUE(t.blocks(0, F).empty());
  EXPECT_EQ(t.fp16_tail_fill(1), 0);
  EXPECT_EQ(to_vector(t.fp16_tails()), (V{-1, -1}));
}

}  // namespace
}  // namespace mixkv
