#include "mixkv/cache/block_pool.h"

#include <gtest/gtest.h>

#include <string>

#include "cache_test_util.h"

namespace mixkv {
namespace {

using test::expect_error;

// 256-byte INT2 blocks: a 1 KiB slab holds 4.
BlockFormat int2_format() { return BlockFormat{Precision::INT2, 1, 16, 16}; }

std::string describe(const BlockPool& pool) {
  std::string out;
  pool.describe(out);
  return out;
}

TEST(BlockPool, Geometry) {
  const BlockPool pool(int2_format(), 1024 + 255, 8);
  EXPECT_EQ(int2_format().block_bytes(), 256u);
  EXPECT_EQ(pool.blocks_per_slab(), 4);
  EXPECT_EQ(pool.id_limit(), 32);
  EXPECT_EQ(pool.num_slabs(), 0);
  EXPECT_EQ(pool.capacity(), 0);
  EXPECT_EQ(pool.free_blocks(), 0);
  expect_error<InvalidArgument>([] { BlockPool(int2_format(), 255, 8); }, "slab_bytes = 255");
  expect_error<InvalidArgument>(
      [] {
        BlockPool(BlockFormat{Precision::FP16, 1, 16, 16}, 1000, 8);
      },
      "slab_bytes = 1000");
}

TEST(BlockPool, BlockIdsFollowSlabIndex) {
  BlockPool pool(int2_format(), 1024, 8);
  pool.add_slab(5);
  EXPECT_EQ(pool.num_slabs(), 1);
  EXPECT_EQ(pool.free_blocks(), 4);
  EXPECT_EQ(pool.empty_slabs(), 1);
  // Slab 5 holds ids 20..23, handed out in address order.
  EXPECT_EQ(pool.allocate(), 20);
  EXPECT_EQ(pool.allocate(), 21);
  EXPECT_EQ(pool.empty_slabs(), 0);
  EXPECT_EQ(pool.used_blocks(), 2);
  EXPECT_EQ(pool.ref_count(20), 1);
  EXPECT_EQ(pool.ref_count(22), 0);
  EXPECT_EQ(pool.ref_count(3), 0);  // a slab the pool does not own
  EXPECT_NO_THROW(pool.check_invariants());
}

TEST(BlockPool, FreeIsLifoAndRefCounted) {
  BlockPool pool(int2_format(), 1024, 2);
  pool.add_slab(0);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(pool.allocate(), i);
  EXPECT_EQ(pool.free_blocks(), 0);
  expect_error<OutOfMemory>([&] { pool.allocate(); }, "INT2");

  pool.retain(2);
  EXPECT_EQ(pool.ref_count(2), 2);
  EXPECT_FALSE(pool.release(2));  // still held once
  EXPECT_EQ(pool.ref_count(2), 1);
  EXPECT_TRUE(pool.release(1));
  EXPECT_TRUE(pool.release(2));
  EXPECT_EQ(pool.free_blocks(), 2);
  // The last freed block comes back first.
  EXPECT_EQ(pool.allocate(), 2);
  EXPECT_EQ(pool.allocate(), 1);
  EXPECT_NO_THROW(pool.check_invariants());
}

TEST(BlockPool, DoubleFreeIsAnErrorNotASecondEntry) {
  BlockPool pool(int2_format(), 1024, 2);
  pool.add_slab(1);
  const std::int32_t a = pool.allocate();
  const std::int32_t b = pool.allocate();
  EXPECT_TRUE(pool.release(a));
  const std::string before = describe(pool);
  expect_error<InvalidArgument>([&] { pool.release(a); }, "double free");
  expect_error<InvalidArgument>([&] { pool.retain(a); }, "is free");
  EXPECT_EQ(describe(pool), before);
  EXPECT_EQ(pool.free_blocks(), 3);
  EXPECT_NO_THROW(pool.check_invariants());
  // The block is handed out once, then the pool moves on.
  EXPECT_EQ(pool.allocate(), a);
  EXPECT_NE(pool.allocate(), a);
  EXPECT_TRUE(pool.release(b));
  EXPECT_NO_THROW(pool.check_invariants());
}

TEST(BlockPool, RejectsIdsOutsideItsSlabs) {
  BlockPool pool(int2_format(), 1024, 2);
  pool.add_slab(0);
  expect_error<IndexOutOfRange>([&] { (void)pool.ref_count(8); }, "block_id = 8");
  expect_error<IndexOutOfRange>([&] { pool.release(-1); }, "block_id = -1");
  expect_error<InvalidArgument>([&] { pool.release(5); }, "block_id = 5");
  expect_error<InvalidArgument>([&] { pool.retain(5); }, "slab 1");
  expect_error<InvalidArgument>([&] { pool.add_slab(0); }, "slab = 0");
  expect_error<IndexOutOfRange>([&] { pool.add_slab(2); }, "slab = 2");
  pool.allocate();
  expect_error<InvalidArgument>([&] { pool.release_empty_slab(); }, "no entirely free");
  EXPECT_NO_THROW(pool.check_invariants());
}

TEST(BlockPool, FillsPartlyUsedSlabsBeforeOpeningAnEmptyOne) {
  BlockPool pool(int2_format(), 1024, 4);
  pool.add_slab(0);
  pool.add_slab(1);
  pool.add_slab(2);
  // The newest slab (2) is opened first and filled before the next.
  std::vector<std::int32_t> ids;
  for (int i = 0; i < 6; ++i) ids.push_back(pool.allocate());
  EXPECT_EQ(ids, (std::vector<std::int32_t>{8, 9, 10, 11, 4, 5}));
  EXPECT_EQ(pool.empty_slabs(), 1);
  // Freeing one block of full slab 2 makes it partly used: it is reused
  // before slab 0 is touched.
  pool.release(9);
  EXPECT_EQ(pool.allocate(), 9);
  EXPECT_EQ(pool.allocate(), 6);
  EXPECT_EQ(pool.allocate(), 7);
  EXPECT_EQ(pool.empty_slabs(), 1);
  EXPECT_EQ(pool.allocate(), 0);
  EXPECT_EQ(pool.empty_slabs(), 0);
  EXPECT_NO_THROW(pool.check_invariants());
}

TEST(BlockPool, GivesBackTheSlabEmptiedLongestAgo) {
  BlockPool pool(int2_format(), 1024, 4);
  pool.add_slab(0);
  pool.add_slab(3);
  std::vector<std::int32_t> ids;
  for (int i = 0; i < 8; ++i) ids.push_back(pool.allocate());  // slab 3 first, then 0
  EXPECT_EQ(pool.empty_slabs(), 0);
  for (std::int32_t id : {12, 13, 14, 15}) pool.release(id);  // slab 3 empties first
  for (std::int32_t id : {0, 1, 2, 3}) pool.release(id);
  EXPECT_EQ(pool.empty_slabs(), 2);
  EXPECT_EQ(pool.release_empty_slab(), 3);
  EXPECT_EQ(pool.num_slabs(), 1);
  EXPECT_EQ(pool.free_blocks(), 4);
  EXPECT_FALSE(pool.owns_slab(3));
  EXPECT_EQ(pool.ref_count(12), 0);
  EXPECT_NO_THROW(pool.check_invariants());
  EXPECT_EQ(pool.release_empty_slab(), 0);
  EXPECT_EQ(pool.capacity(), 0);
  EXPECT_NO_THROW(pool.check_invariants());
}

TEST(BlockPool, SpareSlabsAfterFollowsTheAllocationOrder) {
  BlockPool pool(int2_format(), 1024, 8);
  for (std::int32_t s : {0, 1, 2, 3}) pool.add_slab(s);
  // Slab 3 partly used (1 of 4), slabs 0-2 empty: 3 + 12 free.
  pool.allocate();
  EXPECT_EQ(pool.free_blocks(), 15);
  EXPECT_EQ(pool.spare_slabs_after(0), 3);
  EXPECT_EQ(pool.spare_slabs_after(3), 3);  // the partly used slab absorbs them
  EXPECT_EQ(pool.spare_slabs_after(4), 2);
  EXPECT_EQ(pool.spare_slabs_after(7), 2);
  EXPECT_EQ(pool.spare_slabs_after(8), 1);
  EXPECT_EQ(pool.spare_slabs_after(15), 0);
  EXPECT_EQ(pool.spare_slabs_after(16), 0);  // more than it has
  // Check against what allocation really leaves.
  for (int n = 0; n <= 15; ++n) {
    BlockPool copy(int2_format(), 1024, 8);
    for (std::int32_t s : {0, 1, 2, 3}) copy.add_slab(s);
    copy.allocate();
    const std::int32_t predicted = copy.spare_slabs_after(n);
    for (int i = 0; i < n; ++i) copy.allocate();
    EXPECT_EQ(copy.empty_slabs(), predicted) << n;
  }
}

TEST(BlockPool, DescribeIsCanonical) {
  BlockPool pool(int2_format(), 1024, 2);
  pool.add_slab(1);
  pool.allocate();
  pool.retain(4);
  EXPECT_EQ(describe(pool),
            "pool INT2: slabs 1, free 3\n  partial: 1\n  empty:\n  slab 1 used 1 free: 5 6 7 refs: 4x2\n");
}

}  // namespace
}  // namespace mixkv
