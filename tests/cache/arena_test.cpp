#include "mixkv/cache/arena.h"

#include <gtest/gtest.h>

#include "cache_test_util.h"

namespace mixkv {
namespace {

using test::expect_error;

TEST(Arena, CutsIntoEqualSlabsAndDropsTheRemainder) {
  const Arena arena(10'000, 4096);
  EXPECT_EQ(arena.total_slabs(), 2);
  EXPECT_EQ(arena.free_slabs(), 2);
  EXPECT_EQ(arena.slab_bytes(), 4096u);
  EXPECT_EQ(arena.owner(0), std::nullopt);
  EXPECT_EQ(arena.free_list(), (std::vector<std::int32_t>{0, 1}));
  EXPECT_NO_THROW(arena.check_invariants());
}

TEST(Arena, TakesInAddressOrderAndReusesTheLastGivenBack) {
  Arena arena(4 * 4096, 4096);
  EXPECT_EQ(arena.take(Precision::FP16), 0);
  EXPECT_EQ(arena.take(Precision::INT2), 1);
  EXPECT_EQ(arena.take(Precision::FP16), 2);
  EXPECT_EQ(arena.owner(0), Precision::FP16);
  EXPECT_EQ(arena.owner(1), Precision::INT2);
  EXPECT_EQ(arena.owned_slabs(Precision::FP16), 2);
  EXPECT_EQ(arena.owned_slabs(Precision::INT2), 1);
  EXPECT_EQ(arena.owned_slabs(Precision::INT4), 0);
  EXPECT_EQ(arena.free_slabs(), 1);

  // A slab given back by one pool goes straight to the next pool that asks.
  arena.give_back(0, Precision::FP16);
  EXPECT_EQ(arena.free_list(), (std::vector<std::int32_t>{0, 3}));
  EXPECT_EQ(arena.take(Precision::INT4), 0);
  EXPECT_EQ(arena.owner(0), Precision::INT4);
  EXPECT_EQ(arena.take(Precision::INT4), 3);
  EXPECT_EQ(arena.free_slabs(), 0);
  EXPECT_NO_THROW(arena.check_invariants());
}

TEST(Arena, RejectsBadUse) {
  expect_error<InvalidArgument>([] { Arena(4096, 0); }, "slab_bytes = 0");
  expect_error<InvalidArgument>([] { Arena(4095, 4096); }, "arena_bytes = 4095");
  Arena arena(2 * 4096, 4096);
  arena.take(Precision::INT2);
  arena.take(Precision::INT2);
  expect_error<OutOfMemory>([&] { arena.take(Precision::FP16); }, "FP16");
  expect_error<InvalidArgument>([&] { arena.give_back(0, Precision::FP16); }, "slab = 0");
  expect_error<InvalidArgument>([&] { arena.give_back(0, static_cast<Precision>(5)); }, "p = 5");
  expect_error<IndexOutOfRange>([&] { arena.give_back(2, Precision::INT2); }, "slab = 2");
  expect_error<IndexOutOfRange>([&] { (void)arena.owner(-1); }, "slab = -1");
  arena.give_back(1, Precision::INT2);
  expect_error<InvalidArgument>([&] { arena.give_back(1, Precision::INT2); }, "slab = 1 is free");
  EXPECT_EQ(arena.owned_slabs(Precision::INT2), 1);
  EXPECT_EQ(arena.free_slabs(), 1);
  EXPECT_NO_THROW(arena.check_invariants());
}

}  // namespace
}  // namespace mixkv
